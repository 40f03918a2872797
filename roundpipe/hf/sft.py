"""``roundpipe.hf.SFTTrainer``: TRL's ``SFTTrainer`` whose training runs on roundpipe.

Needs trl (the ``trl`` extra: ``pip install -e ".[hf,trl]"``); imported only when
``roundpipe.hf.SFTTrainer`` is first used. See docs/hf.md, "The Trainer".
"""

from __future__ import annotations

from typing import Any

import transformers

try:
    import trl
except ImportError as exc:  # pragma: no cover - exercised without trl installed
    raise ImportError(
        'roundpipe.hf.SFTTrainer needs trl: pip install "trl>=1.16" (or pip install -e '
        '".[hf,trl]" in the roundpipe checkout)'
    ) from exc

from roundpipe.hf.trainer import RoundPipeTrainerMixin

__all__ = ["SFTTrainer"]


class SFTTrainer(RoundPipeTrainerMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` on roundpipe: TRL prepares the dataset (tokenizing, packing,
    completion-only labels), its collator and the peft model (``peft_config=``); the training
    is roundpipe's, as :class:`roundpipe.hf.Trainer`'s, with the same extra arguments
    (:class:`roundpipe.hf.trainer.RoundPipeTrainerMixin`).

    The evaluation loss is transformers' (the wrapped model's ``model(**batch).loss``);
    TRL's extra metrics (entropy, mean token accuracy) need its fused head and are not logged.
    ``padding_free`` is refused: the stages take one row of position ids for the batch."""

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
        training computes its loss in roundpipe's head)."""
        return transformers.Trainer.compute_loss(
            self,
            model,
            inputs,
            return_outputs=return_outputs,
            num_items_in_batch=num_items_in_batch,
        )

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        """transformers' ``prediction_step`` (the loss, and the logits unless
        ``prediction_loss_only``)."""
        return transformers.Trainer.prediction_step(
            self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
