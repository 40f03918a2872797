"""The causal LM loss in chunks of tokens, so the (tokens x vocabulary) fp32 logits never exist
at once: each chunk's logits are computed, reduced to a loss sum and freed in the forward, and
recomputed in the backward (152k vocabulary x 16k tokens would be 9.7 GB of fp32 logits)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["IGNORE_INDEX", "chunked_causal_lm_loss"]

# The label of a token no loss is taken for (transformers' and torch's cross-entropy default).
IGNORE_INDEX = -100


Transform = Callable[[torch.Tensor], torch.Tensor]


def _loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    transform: Transform | None = None,
    token_stats: bool = False,
) -> Any:
    if transform is not None:  # in the logits' dtype, as the model applies it
        logits = transform(logits)
    # fp32, as transformers upcasts the logits before its loss
    logits = logits.float()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not token_stats:
        return loss
    with torch.no_grad():
        valid = labels != IGNORE_INDEX
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        top1 = (logits.argmax(dim=-1) == labels) & valid
        stats = torch.stack([entropy * valid, top1.float(), valid.float()], dim=-1)
    return loss, stats


def _linear_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: Transform | None,
    token_stats: bool,
) -> Any:
    return _loss_sum(F.linear(hidden, weight, bias), labels, transform, token_stats)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    shift_labels: torch.Tensor,
    num_items: int | torch.Tensor | None,
    chunk_tokens: int,
    transform: Transform | None = None,
    token_stats: bool = False,
) -> Any:
    """``sum(cross_entropy(transform(head(hidden)), shift_labels)) / num_items`` over the tokens
    whose label is not -100, computed ``chunk_tokens`` tokens at a time; ``num_items`` None
    divides by this call's own count (the mean, as transformers without
    ``num_items_in_batch``). ``transform``: what the model does to its logits before the loss
    (soft-capping, scaling), or None.

    ``token_stats=True`` returns ``(loss, stats)``: ``stats`` (fp32, no gradient) has the shape
    of ``shift_labels`` plus a last dimension of 3: for each token whose label is not -100, the
    entropy of the model's distribution there, whether its most likely token is the label
    (1 or 0), and 1; zeros elsewhere. It is computed from each chunk's logits while they
    exist (TRL's ``entropy`` and ``mean_token_accuracy`` are sums of it)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    if num_items is None:
        num_items = (labels != IGNORE_INDEX).sum()
    stats_shape = (*shift_labels.shape, 3)
    if flat.shape[0] <= chunk_tokens:
        out = _loss_sum(head(flat), labels, transform, token_stats)
        if token_stats:
            return out[0] / num_items, out[1].reshape(stats_shape)
        return out / num_items
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    stats: list[torch.Tensor] = []
    linear = type(head) is nn.Linear
    # The weight as the head sees it now: on an accelerator, the stage's device copy (the
    # recompute in backward runs after the call that substituted it has returned).
    weight, bias = (head.weight, head.bias) if linear else (None, None)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        if linear:
            # The statistics come out of the forward; the backward's recompute makes them
            # again and drops them.
            out = checkpoint(
                _linear_loss_sum,
                flat[start:stop],
                weight,
                bias,
                labels[start:stop],
                transform,
                token_stats,
                use_reentrant=False,
                preserve_rng_state=False,  # the loss draws no random numbers
            )
        else:  # a head of another kind (an adapter on it): chunked, but its logits are kept
            out = _loss_sum(head(flat[start:stop]), labels[start:stop], transform, token_stats)
        if token_stats:
            out, chunk_stats = out
            stats.append(chunk_stats)
        total = total + out
    if token_stats:
        return total / num_items, torch.cat(stats).reshape(stats_shape)
    return total / num_items
