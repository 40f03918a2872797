"""``roundpipe.hf.SFTTrainer``: TRL's ``SFTTrainer`` whose training runs on roundpipe.

Needs trl (the ``trl`` extra: ``pip install -e ".[hf,trl]"``); imported only when
``roundpipe.hf.SFTTrainer`` is first used. See docs/hf.md, "The Trainer".
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

try:
    import trl
except ImportError as exc:  # pragma: no cover - exercised without trl installed
    raise ImportError(
        'roundpipe.hf.SFTTrainer needs trl: pip install "trl>=1.16" (or pip install -e '
        '".[hf,trl]" in the roundpipe checkout)'
    ) from exc

from roundpipe.hf.loss import IGNORE_INDEX
from roundpipe.hf.trainer import RoundPipeTrainerMixin

__all__ = ["SFTTrainer"]


class SFTTrainer(RoundPipeTrainerMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` on roundpipe: TRL prepares the dataset (tokenizing, packing,
    completion-only labels), its collator and the peft model (``peft_config=``); the training
    is roundpipe's, as :class:`roundpipe.hf.Trainer`'s, with the same extra arguments
    (:class:`roundpipe.hf.trainer.RoundPipeTrainerMixin`).

    The training logs carry TRL's ``entropy``, ``mean_token_accuracy`` and ``num_tokens``,
    computed in roundpipe's chunked head (see [Note: TRL's token metrics]); the evaluation's
    loss is transformers' (the wrapped model's ``model(**batch).loss``, TRL's mean over the
    tokens) and its ``eval_entropy`` and ``eval_mean_token_accuracy`` are computed from that
    call's logits. ``padding_free`` is refused: the stages take one row of position ids for the
    batch."""

    _token_metrics = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        trainer: Any = self
        if getattr(trainer.args, "padding_free", False) or getattr(trainer, "padding_free", False):
            raise ValueError(
                "padding_free=True (or packing with the 'bfd' strategy, which turns it on): the "
                "stages of roundpipe.hf take padded batches; set padding_free=False (packing="
                "'wrapped' packs without it)"
            )

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """transformers' ``compute_loss``: ``model(**inputs)`` and its loss (the evaluation's;
        training computes its loss in roundpipe's head), and, for TRL's metrics, the entropy and
        top-1 accuracy over the batch's predicted tokens, from the call's logits. Main thread."""
        loss, outputs = transformers.Trainer.compute_loss(
            self,
            model,
            inputs,
            return_outputs=True,
            num_items_in_batch=num_items_in_batch,
        )
        trainer: Any = self
        labels = inputs.get("labels")
        if labels is not None and getattr(outputs, "logits", None) is not None:
            mode = "train" if model.training else "eval"
            logits = outputs.logits[:, :-1].detach().float()
            targets = labels[:, 1:].to(logits.device)
            valid = targets != IGNORE_INDEX
            log_probs = torch.log_softmax(logits, dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
            top1 = (logits.argmax(dim=-1) == targets) & valid
            gather = trainer.accelerator.gather_for_metrics
            num_valid = gather(valid.sum()).sum()
            entropy_sum = gather((entropy * valid).sum()).sum()
            num_correct = gather(top1.sum()).sum()
            found = num_valid > 0
            metrics = trainer._metrics[mode]
            metrics["entropy"].append((entropy_sum / num_valid).item() if found else 0.0)
            metrics["mean_token_accuracy"].append(
                (num_correct / num_valid).item() if found else 0.0
            )
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        """transformers' ``prediction_step`` (the loss, and the logits unless
        ``prediction_loss_only``)."""
        return transformers.Trainer.prediction_step(
            self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
