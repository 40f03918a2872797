"""``roundpipe.hf.wrap``: a HuggingFace causal LM as a RoundPipe of stages."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from roundpipe.hf import compat
from roundpipe.hf.families import Family, family_of, layer_attention_types
from roundpipe.hf.stages import IGNORE_INDEX, Decoder, Embed, Head, shift_labels
from roundpipe.runtime import RoundPipe, RoundPipeRunConfig

__all__ = ["wrap", "HFRoundPipe", "default_loss_chunk_tokens"]

# The loss head's chunk, by default: as many tokens as make this many bytes of fp32 logits (the
# chunk's logits and their gradient exist at once), at least 128. A 152k vocabulary gets 1024
# tokens (0.6 GB of logits), where 16k tokens at once would take 9.7 GB.
LOSS_CHUNK_BYTES = 1 << 30


def default_loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the loss head for ``vocab_size``: a power of two whose fp32 logits
    take at most :data:`LOSS_CHUNK_BYTES`, at least 128."""
    tokens = max(LOSS_CHUNK_BYTES // (4 * max(vocab_size, 1)), 128)
    return 1 << (tokens.bit_length() - 1)


def _identity_loss(loss: torch.Tensor, label: Any) -> torch.Tensor:
    return loss


class HFRoundPipe(RoundPipe):
    """A RoundPipe over the stages of a HuggingFace causal LM (made by :func:`wrap`).

    ``forward_backward(input_kwargs=batch)`` takes the batch as HF's collators make it
    (``input_ids``, ``attention_mask``, ``labels`` with -100 where no loss is taken) and, without
    a ``loss_fn``, backpropagates and returns the loss transformers computes for the whole batch.
    A ``loss_fn(loss, label)`` receives each microbatch's share of it (the microbatches add up
    to the batch's loss), e.g. ``lambda loss, _: scaler.scale(loss)``. ``model(input_ids=...,
    attention_mask=...)`` returns the logits. ``hf_model`` is the model that was wrapped: after
    :meth:`synchronize` its parameters hold the trained weights.
    """

    # The head divides each microbatch's token losses by the batch's count of predicted tokens,
    # so uneven microbatches are weighted right: no UnevenMicrobatchWarning.
    warns_uneven_microbatches = False

    def __init__(self, hf_model: nn.Module, stages: nn.Sequential, **kwargs: Any) -> None:
        super().__init__(stages, **kwargs)
        self.hf_model = hf_model
        by_object = {id(p): name for name, p in hf_model.named_parameters()}
        # The stages' parameter names ("1.layer.self_attn.q_proj.weight") -> the HF model's.
        self._hf_names = {name: by_object.get(id(p), name) for name, p in stages.named_parameters()}

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The masters, under the HF model's parameter names (``model.layers.0.mlp...``)."""
        for name, master in super().optim_named_parameters():
            yield self._hf_names.get(name, name), master

    def _hf_kwargs(self, input_kwargs: dict[str, Any] | None, input_args: Sequence[Any]) -> dict:
        kwargs = dict(input_kwargs or {})
        labels = kwargs.get("labels")
        if labels is None:
            raise ValueError(
                "forward_backward of a wrapped HF model needs input_kwargs['labels'] (the "
                "input_ids, with -100 where no loss is taken, as HF's collators make them)"
            )
        if input_args:
            raise ValueError(
                "pass the batch as input_kwargs (input_ids=..., attention_mask=..., labels=...), "
                "not input_args"
            )
        # Counted over the whole batch before it is split: each microbatch's loss is its token
        # losses' sum over this, so the microbatches add up to transformers' batch loss.
        kwargs["num_items_in_batch"] = int((shift_labels(labels) != IGNORE_INDEX).sum())
        return kwargs

    def memory_plan(  # type: ignore[override]
        self,
        batch: dict[str, Any] | None = None,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """What ``forward_backward(input_kwargs=batch)`` would take, host and devices, without
        running it (see :meth:`RoundPipe.memory_plan`); ``batch`` as for
        :meth:`forward_backward` (None: the host terms and the weights only)."""
        if batch is None:
            return super().memory_plan(run_config=run_config)
        return super().memory_plan(
            input_kwargs=self._hf_kwargs(batch, ()),
            loss_fn=_identity_loss,
            run_config=run_config,
        )

    def forward_backward(
        self,
        input_args: Sequence[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        return super().forward_backward(
            input_kwargs=self._hf_kwargs(input_kwargs, input_args),
            label=label,
            loss_fn=loss_fn or _identity_loss,
            return_outputs=return_outputs,
            run_config=run_config,
        )


def _base_model(model: nn.Module) -> Any:
    """The ``*ForCausalLM`` inside ``model`` (itself, or the one a peft model wraps)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def wrap(
    model: nn.Module,
    *,
    family: Family | None = None,
    loss_chunk_tokens: int | None = None,
    **kwargs: Any,
) -> HFRoundPipe:
    """Wrap a HuggingFace causal LM (``AutoModelForCausalLM``, or a peft model around one) as a
    RoundPipe of stages: the embedding, each decoder layer, and the head with a chunked loss.

    Args:
        model: the model; it keeps its parameter objects, which hold the trained weights after
            ``synchronize()`` (``model.save_pretrained`` then saves them).
        family: where the model keeps its parts; default: the family registered for
            ``model.config.model_type`` (see :func:`roundpipe.hf.register_family`).
        loss_chunk_tokens: tokens per chunk of the loss head (the fp32 logits of this many
            tokens exist at once); default :func:`default_loss_chunk_tokens` of the vocabulary.
        **kwargs: RoundPipe's (``optim_dtype``, ``model_run_config``, ``devices``, ``name``).

    HF's own gradient checkpointing is turned off (roundpipe recomputes each stage itself) and
    so is the key/value cache (``config.use_cache = False``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"roundpipe.hf.wrap takes a transformers model, got {type(model)!r}")
    base: Any = _base_model(model)
    family = family or family_of(base)
    parts = family.parts(base)
    config = base.config
    if loss_chunk_tokens is None:
        loss_chunk_tokens = default_loss_chunk_tokens(int(getattr(config, "vocab_size", 0) or 0))
    if not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be a positive int, got {loss_chunk_tokens!r}")
    compat.disable_checkpointing(base)
    config.use_cache = False
    layers = list(parts["layers"])[: config.num_hidden_layers]
    kinds = layer_attention_types(config)
    known = compat.mask_builders()
    unknown = set(kinds) - set(known)
    if unknown or len(kinds) != len(layers):
        raise NotImplementedError(
            f"{type(base).__name__}: attention types {sorted(set(kinds))} for {len(layers)} "
            f"layers; roundpipe.hf builds the masks transformers has builders for "
            f"({', '.join(sorted(known))}), one type per layer (config.layer_types)"
        )
    stages = nn.Sequential(
        Embed(parts, config, kinds),
        *(Decoder(layer, family, config, kind) for layer, kind in zip(layers, kinds)),
        Head(parts, config, loss_chunk_tokens),
    )
    kwargs.setdefault("name", type(base).__name__)
    return HFRoundPipe(model, stages, **kwargs)
