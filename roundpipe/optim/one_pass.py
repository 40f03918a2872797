"""The one-pass step of :mod:`roundpipe.optim`'s Adam: exact moments with the master->model copy
written in the same pass (:func:`exact_one_pass`), and the lean moments' step
(:func:`lean_step`), each through the compiled kernels (:mod:`roundpipe.optim.native`) or,
for the lean moments without them, torch's reference (:mod:`roundpipe.optim.lean`).

Optimizer thread (the thread that runs the optimizer's step).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from roundpipe.optim.kernel import hyper_float
from roundpipe.optim.lean import StateKind, lean_reference_step, maps
from roundpipe.optim.native import PIECE

__all__ = ["Item", "exact_one_pass", "lean_step"]


@dataclasses.dataclass
class Item:
    """One parameter of a one-pass or lean step: the master, its gradient, its state, and
    where the step writes its low-precision copy (None: nowhere)."""

    param: Tensor
    grad: Tensor
    state: dict[str, Tensor]
    low: Tensor | None


def _bump(tensors: list[Tensor]) -> None:
    # The kernels write through pointers, below autograd's version counting: say so, so that
    # what compares versions (the step's copy, a gradient's finite check) sees the change.
    for t in tensors:
        torch.autograd.graph.increment_version(t)


#: the gradient dtypes the compiled kernels read for an fp32 master besides its own
LOW_GRAD_DTYPES = (torch.bfloat16, torch.float16)


def exact_one_pass(ops: Any, group: dict, items: list[Item], grad_scale: Tensor | None) -> None:
    """torch's fused Adam/AdamW over ``items`` (every one with a ``low``), each piece's cast
    written while it is in cache: bitwise torch's step followed by ``low.copy_(param)``. The
    caller has checked found_inf (a skipped step never gets here)."""
    steps = [it.state["step"] for it in items]
    torch._foreach_add_(steps, 1)
    amsgrad = group["amsgrad"]
    scale = None if grad_scale is None else grad_scale.to(device="cpu", dtype=torch.float32)
    with torch.no_grad():
        ops.exact_step(
            [it.param.detach() for it in items],
            [it.grad.detach() for it in items],
            [it.state["exp_avg"] for it in items],
            [it.state["exp_avg_sq"] for it in items],
            [it.state["max_exp_avg_sq"] for it in items] if amsgrad else [],
            steps,
            [it.low for it in items],
            hyper_float(group["lr"]),
            hyper_float(group["betas"][0]),
            hyper_float(group["betas"][1]),
            group["weight_decay"],
            group["eps"],
            amsgrad,
            group["maximize"],
            bool(group.get("decoupled_weight_decay")),
            scale,
            PIECE,
        )
    written = [it.param for it in items] + [it.low for it in items if it.low is not None]
    written += [it.state["exp_avg"] for it in items] + [it.state["exp_avg_sq"] for it in items]
    if grad_scale is not None:
        written += [it.grad for it in items]  # unscaled in place, as torch's kernel does
    _bump(written)


def lean_step(
    ops: Any, group: dict, kind: StateKind, items: list[Item], grad_scale: Tensor | None
) -> None:
    """One step of lean moments over ``items`` (see [Note: lean moments] in lean.py); with
    ``ops`` the compiled kernel, else torch's reference (the same bits). The caller has
    checked found_inf."""
    steps = [it.state["step"] for it in items]
    torch._foreach_add_(steps, 1)
    lr = hyper_float(group["lr"])
    beta1, beta2 = (hyper_float(b) for b in group["betas"])
    step_sizes, bc2_sqrts = [], []
    for s in steps:
        count = float(s)
        step_sizes.append(lr / (1 - beta1**count))
        bc2_sqrts.append(math.sqrt(1 - beta2**count))
    scale = None if grad_scale is None else float(grad_scale)
    adamw = bool(group.get("decoupled_weight_decay"))
    grads = [_plain_grad(it) for it in items]
    if ops is None:
        for it, g, size, bc2 in zip(items, grads, step_sizes, bc2_sqrts):
            lean_reference_step(
                kind,
                it.param,
                g,
                it.state,
                it.low,
                step_size=size,
                bias_correction2_sqrt=bc2,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                adamw=adamw,
                grad_scale=scale,
            )
    else:
        m = maps()
        eight = kind is StateKind.EIGHT_BIT
        with torch.no_grad():
            ops.lean_step(
                1 if kind is StateKind.BF16 else 2,
                [it.param.detach() for it in items],
                grads,
                [it.state["exp_avg"] for it in items],
                [it.state["exp_avg_sq"] for it in items],
                [it.state["exp_avg_absmax"] for it in items] if eight else [],
                [it.state["exp_avg_sq_absmax"] for it in items] if eight else [],
                [it.low if it.low is not None else _NO_COPY for it in items],
                step_sizes,
                bc2_sqrts,
                lr,
                beta1,
                beta2,
                group["weight_decay"],
                group["eps"],
                group["maximize"],
                adamw,
                scale,
                m.signed_table,
                m.unsigned_table,
                PIECE,
            )
    written = [it.param for it in items] + [it.low for it in items if it.low is not None]
    for it in items:
        written += [t for k, t in it.state.items() if k != "step"]
    _bump(written)


_NO_COPY = torch.empty(0)


def _plain_grad(item: Item) -> Tensor:
    """The gradient as the lean kernels read it: contiguous, detached, fp32 or as the bf16 or
    fp16 it is (see [Note: low-precision gradients] in _step_kernels.cpp)."""
    g = item.grad.detach()
    if g.dtype not in LOW_GRAD_DTYPES + (torch.float32,):
        g = g.to(torch.float32)
    return g.contiguous()
