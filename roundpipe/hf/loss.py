"""The causal LM loss in chunks of tokens, so the (tokens x vocabulary) fp32 logits never exist
at once: each chunk's logits are computed, reduced to a loss sum and freed in the forward, and
recomputed in the backward (152k vocabulary x 16k tokens would be 9.7 GB of fp32 logits)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "chunked_causal_lm_loss"]

# The label of a token no loss is taken for (transformers' and torch's cross-entropy default).
IGNORE_INDEX = -100


Transform = Callable[[torch.Tensor], torch.Tensor]


def _loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, transform: Transform | None = None
) -> torch.Tensor:
    if transform is not None:  # in the logits' dtype, as the model applies it
        logits = transform(logits)
    # fp32, as transformers upcasts the logits before its loss
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _linear_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: Transform | None,
) -> torch.Tensor:
    return _loss_sum(F.linear(hidden, weight, bias), labels, transform)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    shift_labels: torch.Tensor,
    num_items: int | torch.Tensor | None,
    chunk_tokens: int,
    transform: Transform | None = None,
) -> torch.Tensor:
    """``sum(cross_entropy(transform(head(hidden)), shift_labels)) / num_items`` over the tokens
    whose label is not -100, computed ``chunk_tokens`` tokens at a time; ``num_items`` None
    divides by this call's own count (the mean, as transformers without
    ``num_items_in_batch``). ``transform``: what the model does to its logits before the loss
    (soft-capping, scaling), or None."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    if num_items is None:
        num_items = (labels != IGNORE_INDEX).sum()
    if flat.shape[0] <= chunk_tokens:
        return _loss_sum(head(flat), labels, transform) / num_items
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    linear = type(head) is nn.Linear
    # The weight as the head sees it now: on an accelerator, the stage's device copy (the
    # recompute in backward runs after the call that substituted it has returned).
    weight, bias = (head.weight, head.bias) if linear else (None, None)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        if linear:
            total = total + checkpoint(
                _linear_loss_sum,
                flat[start:stop],
                weight,
                bias,
                labels[start:stop],
                transform,
                use_reentrant=False,
                preserve_rng_state=False,  # the loss draws no random numbers
            )
        else:  # a head of another kind (an adapter on it): chunked, but its logits are kept
            total = total + _loss_sum(head(flat[start:stop]), labels[start:stop], transform)
    return total / num_items
