"""The causal LM loss in chunks of tokens, so the (tokens x vocabulary) fp32 logits never exist
at once: each chunk's logits are computed, reduced to a loss sum and freed in the forward, and
recomputed in the backward (152k vocabulary x 16k tokens would be 9.7 GB of fp32 logits).

See [Note: the head's backward] for how the backward keeps a chunk's footprint to its fp32
logits and one copy of the weight's gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.autocast import autocast_context, capture_autocast
from roundpipe.memory.repeats import eliding, runs

__all__ = ["IGNORE_INDEX", "chunked_causal_lm_loss"]

# The label of a token no loss is taken for (transformers' and torch's cross-entropy default).
IGNORE_INDEX = -100


Transform = Callable[[torch.Tensor], torch.Tensor]


def _token_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per token of fp32 ``logits``: the entropy, whether the top-1 token is the label, and 1,
    where the label is not -100; zeros elsewhere (no gradient)."""
    with torch.no_grad():
        valid = labels != IGNORE_INDEX
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        top1 = (logits.argmax(dim=-1) == labels) & valid
        return torch.stack([entropy * valid, top1.float(), valid.float()], dim=-1)


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
    return loss, _token_stats(logits, labels)


# [Note: the head's backward]
# Through autograd, a chunk's backward holds its fp16 logits, their fp32 copy, the fp32
# log-softmax cross_entropy saved, that tensor's gradient and its fp16 cast, and the weight's
# gradient twice: the chunk's, and the sum of the chunks before it, which autograd adds them
# into. For Qwen3-1.7B's 152k vocabulary at 1,024 tokens a chunk, that was 2.4 GiB, the largest
# term of a fine-tuning's device peak. _LinearCrossEntropy (an nn.Linear head, no logits
# transform) does the same arithmetic by hand: the forward reduces each chunk's fp32 logits to
# their loss in place (their log-sum-exp less the label's logit), and the backward turns them
# into the cross-entropy's gradient in place (softmax minus the label's one-hot, times the loss's
# gradient, zero where the label is -100), cast once to the weights' dtype, and multiplied
# into the hidden state's gradient and into one weight gradient, accumulated in place
# (``addmm_``): one fp32 logits tensor, its cast, and one copy of the weight's gradient. The
# loss's gradient is known there (the backward runs after the loss), so the gradient is scaled
# before the cast, as autograd's would be. The backward recomputes each chunk's logits under
# the forward's autocast state. A head with an adapter, or a model that transforms its logits
# (soft-capping), takes the autograd path, one checkpointed chunk at a time.


class _LinearCrossEntropy(torch.autograd.Function):
    """``(sum of cross_entropy(linear(hidden, weight, bias)), token stats or None)`` over the
    tokens whose label is not -100, ``chunk`` tokens at a time (see [Note: the head's
    backward]). ``hidden`` is (tokens, hidden) and ``labels`` (tokens,)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        token_stats: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.autocast = capture_autocast(hidden.device.type)
        ctx.chunk = chunk
        # A memory trace runs four chunks (the backward too): see [Note: elided repeats].
        ctx.elide = eliding()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        stats: list[torch.Tensor] = []
        n = -(-hidden.shape[0] // chunk)
        for k, start in enumerate(range(0, hidden.shape[0], chunk)):
            if not runs(k, n, ctx.elide):
                if token_stats:  # what the chunk leaves: its statistics
                    stats.append(stats[1].new_empty(stats[1].shape))
                continue
            part = labels[start : start + chunk]
            logits = F.linear(hidden[start : start + chunk], weight, bias).float()
            if token_stats:
                stats.append(_token_stats(logits, part))
            # cross_entropy's sum, in place: logsumexp(logits) - logits[label]
            picked = logits.gather(1, part.clamp(min=0).unsqueeze(1)).squeeze(1)
            top = logits.amax(dim=-1)
            lse = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=-1).log_().add_(top)
            del logits
            total += ((lse - picked) * (part != IGNORE_INDEX)).sum()
        ctx.save_for_backward(hidden, weight, bias, labels)
        if not token_stats:
            return total, None
        out = torch.cat(stats)
        ctx.mark_non_differentiable(out)
        return total, out

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _: Any) -> tuple[Any, ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        # The dtype the forward's matmul computed in: autocast's, else the weights'.
        state = ctx.autocast
        compute_dtype = state.dtype if state.enabled else weight.dtype
        w = weight.to(compute_dtype) if need_hidden else None
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        n = -(-hidden.shape[0] // ctx.chunk)
        for k, start in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            if not runs(k, n, ctx.elide):  # it leaves nothing: its rows are written in place
                continue
            h = hidden[start : start + ctx.chunk]
            part = labels[start : start + ctx.chunk]
            with autocast_context(state):
                grad = F.linear(h, weight, bias).float()
            # softmax - one_hot(label), times the loss's gradient, 0 where the label is -100
            grad.sub_(grad.amax(dim=-1, keepdim=True)).exp_()
            grad.div_(grad.sum(dim=-1, keepdim=True))  # the softmax, in place
            valid = (part != IGNORE_INDEX).to(grad.dtype)
            grad[rows[: part.shape[0]], part.clamp(min=0)] -= valid
            grad.mul_((valid * grad_total).unsqueeze(-1))
            grad_logits = grad.to(compute_dtype)
            del grad
            if grad_hidden is not None and w is not None:
                grad_hidden[start : start + ctx.chunk] = grad_logits @ w
            if grad_weight is not None:
                h = h.to(compute_dtype)
                if grad_weight.dtype == compute_dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:  # autocast: the weight's gradient in its own dtype, as autograd's
                    grad_weight += grad_logits.t() @ h
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            del grad_logits  # before the next chunk's logits
        return grad_hidden, grad_weight, grad_bias, None, None, None


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
    if type(head) is nn.Linear and transform is None:
        # The weight as the head sees it now: on an accelerator, the stage's device copy.
        total, stats = _LinearCrossEntropy.apply(
            flat, head.weight, head.bias, labels, chunk_tokens, token_stats
        )
        if token_stats:
            return total / num_items, stats.reshape(stats_shape)
        return total / num_items
    if flat.shape[0] <= chunk_tokens:
        out = _loss_sum(head(flat), labels, transform, token_stats)
        if token_stats:
            return out[0] / num_items, out[1].reshape(stats_shape)
        return out / num_items
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    chunks: list[torch.Tensor] = []
    linear = type(head) is nn.Linear
    weight, bias = (head.weight, head.bias) if linear else (None, None)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        if linear:  # with a logits transform
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
            chunks.append(chunk_stats)
        total = total + out
    if token_stats:
        return total / num_items, torch.cat(chunks).reshape(stats_shape)
    return total / num_items
