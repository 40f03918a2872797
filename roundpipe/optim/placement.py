"""Where an optimizer's state lives: the placement an :class:`roundpipe.optim.Adam` is built with.

A placement owns the moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) of every parameter
and runs the step over them; the optimizer's update code never asks where they are. Two exist:

* :class:`StateInRAM` (``state_dir=None``, the default): the moments are tensors in
  ``optimizer.state``, as in torch.
* :class:`roundpipe.optim.spill.StateOnDisk` (``state_dir="/nvme/run1"``): the moments are in a
  file under that directory and stream through a bounded host buffer on every step; only the step
  counts stay in ``optimizer.state``.

Both give the same ``state_dict`` (torch's format) and bitwise the same update. Thread: a
placement is used by its optimizer's methods only, so it belongs to whichever thread the
"Threads" paragraph of :class:`roundpipe.optim.Adam` gives them (the optimizer thread while
launched work is pending).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from roundpipe.memory.host import format_bytes
from roundpipe.memory.probe import host_memory_available
from roundpipe.optim import native
from roundpipe.optim.kernel import (
    COMPLEX_FUSABLE,
    fused_step,
    group_allows_fused,
    param_fits_fused,
)
from roundpipe.optim.lean import (
    MIN_8BIT_NUMEL,
    StateKind,
    init_lean_state,
    state_kind_of_group,
)
from roundpipe.optim.master_file import file_of_master
from roundpipe.optim.one_pass import LOW_GRAD_DTYPES, Item, exact_one_pass, lean_step
from roundpipe.optim.spill import StateOnDisk
from roundpipe.threads.step_context import step_copies
from roundpipe.user_frame import user_stacklevel

__all__ = ["OptimizerStatePlacement", "StateInRAM", "make_placement"]


class OptimizerStatePlacement(Protocol):
    """What an optimizer asks of the place its state lives in."""

    def check_group(self, opt: torch.optim.Optimizer, group: dict) -> None:
        """Raise ``ValueError`` if this placement cannot hold ``group``'s state (any thread)."""

    def step(
        self, opt: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> None:
        """One update of every parameter with a gradient, honouring the GradScaler's tensors."""

    def state_dict(
        self, opt: torch.optim.Optimizer, base: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """torch's state dict, ``base`` being torch's ``Optimizer.state_dict`` of ``opt``."""

    def after_load(self, opt: torch.optim.Optimizer) -> None:
        """Take over the state ``Optimizer.load_state_dict`` has just put in ``opt.state``."""

    def close(self) -> None:
        """Release files and threads (idempotent)."""


class StateInRAM:
    """The moments are tensors in ``optimizer.state``, as in torch.optim.Adam (the default)."""

    def check_group(self, opt: torch.optim.Optimizer, group: dict) -> None:
        _check_fits_in_ram(group)
        if any(file_of_master(p) is not None for p in group["params"]):
            warnings.warn(
                "these masters are in files (roundpipe.MastersOnDisk) but this Adam keeps its "
                "state in RAM: its step updates the masters through the page cache, so they "
                "come back into this process's memory at every step. Pass state_dir=DIR to "
                "stream them with the state (roundpipe.optim.AdamW(..., state_dir=DIR))",
                stacklevel=user_stacklevel(),
            )

    def step(
        self, opt: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> None:
        ops = native.kernels()
        # The copy targets only with the compiled kernels: without them the model's own copy
        # runs, as before, and no second buffer is made ([Note: the copy in the step]).
        copies = step_copies() if ops is not None and getattr(opt, "write_copy", True) else None
        skipped: bool | None = None
        for group in opt.param_groups:
            split = self._split_group(opt, group, copies)
            if split.fused:
                fused_step(group, split.fused, grad_scale, found_inf)
            if split.one_pass or split.lean:
                if skipped is None:  # a GradScaler's overflow: everything stays untouched
                    skipped = found_inf is not None and bool(found_inf)
                if not skipped:
                    if split.one_pass:
                        exact_one_pass(ops, group, split.one_pass, grad_scale)
                        _tell_written(copies, split.one_pass)
                    if split.lean:
                        lean_step(ops, group, state_kind_of_group(group), split.lean, grad_scale)
                        _tell_written(copies, split.lean)
            if split.other:
                self._torch_step(opt, group, split.other, grad_scale, found_inf)

    def state_dict(
        self, opt: torch.optim.Optimizer, base: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        return base()

    def after_load(self, opt: torch.optim.Optimizer) -> None:
        pass

    def close(self) -> None:
        pass

    def _split_group(self, opt: torch.optim.Optimizer, group: dict, copies: Any) -> _Split:
        """Init lazy state and send each parameter with a grad to its path: the lean kernels
        (a group with lean moments), the one-pass exact step (``copies`` gives it a place for
        its low-precision copy), torch's fused kernel, or torch's own path."""
        split = _Split({}, [], [], [])
        buckets = split.fused
        other = split.other
        group_fusable = group_allows_fused(group)
        amsgrad = group["amsgrad"]
        kind = state_kind_of_group(group)
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    "Adam does not support sparse gradients; use "
                    "torch.optim.SparseAdam for sparse parameters"
                )
            takes_fused = group_fusable and param_fits_fused(p)
            state = opt.state[p]
            if kind is not StateKind.EXACT and lean_numel(kind, p):
                if not state:
                    state.update(init_lean_state(kind, p))
                low = copies.target(p) if copies is not None else None
                split.lean.append(Item(p, grad, state, low))
                continue
            if not state:
                _init_state(state, p, group, fused=takes_fused)
            elif amsgrad and "max_exp_avg_sq" not in state:
                # amsgrad switched on after the state was made (or loaded without it).
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not takes_fused:
                other.append(p)
                continue
            states = [state["exp_avg"], state["exp_avg_sq"]]
            if amsgrad:
                states.append(state["max_exp_avg_sq"])
            dtype, device = p.dtype, p.device
            if not _fusable_layout(p, grad, states, dtype, device):
                other.append(p)
                continue
            step = state["step"]
            if step.dtype != torch.float32 or step.device != device:
                # e.g. loaded from a foreach checkpoint: the kernel reads a float32 step on the
                # parameter's device.
                state["step"] = step = step.to(device=device, dtype=torch.float32)
            if copies is not None and _one_pass_fits(p, grad, states):
                low = copies.target(p)
                if low is not None:
                    split.one_pass.append(Item(p, grad, state, low))
                    continue
            if grad.dtype != dtype:  # torch's fused kernel reads one dtype: an fp32 copy
                grad = grad.to(dtype)
            if dtype in COMPLEX_FUSABLE:
                # Adam on a complex tensor is Adam on its real view ([Note: fused by default]).
                p, grad = torch.view_as_real(p), torch.view_as_real(grad)
                states = [torch.view_as_real(t) for t in states]
                dtype = p.dtype
            lists = buckets.get((device, dtype))
            if lists is None:
                lists = buckets[(device, dtype)] = [[], [], [], [], [], []]
            lists[0].append(p)
            lists[1].append(grad)
            lists[2].append(states[0])
            lists[3].append(states[1])
            if amsgrad:
                lists[4].append(states[2])
            lists[5].append(step)
        return split

    def _torch_step(
        self,
        opt: torch.optim.Optimizer,
        group: dict,
        params: list[Tensor],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """torch.optim.Adam's own non-fused path for ``params``, with GradScaler unscaling."""
        if found_inf is not None and bool(found_inf):
            return  # a skipped step leaves params, state and the step count untouched
        grads = [p.grad for p in params if p.grad is not None]
        assert len(grads) == len(params)  # the caller passes params that have a gradient
        # torch's kernels read one dtype: an fp32 copy of a bf16/fp16 gradient of an fp32 master
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
        if grad_scale is not None:
            for g in grads:
                g.div_(grad_scale.to(g.device))
        states = [opt.state[p] for p in params]
        amsgrad = group["amsgrad"]
        kwargs: dict[str, Any] = {}
        if group.get("decoupled_weight_decay"):
            kwargs["decoupled_weight_decay"] = True
        _torch_adam(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            [s["step"] for s in states],
            # fused=None lets torch pick foreach or the for-loop exactly as torch.optim.Adam does
            # for these params; fused=False keeps torch's fused=False choice (the for-loop).
            foreach=group["foreach"],
            fused=False if group["fused"] is False else None,
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            has_complex=any(p.is_complex() for p in params),
            amsgrad=amsgrad,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            **kwargs,
        )


@dataclasses.dataclass
class _Split:
    """A param group's parameters with a gradient, by path (see StateInRAM._split_group)."""

    #: torch's fused kernel: (device, dtype) -> the six tensor lists of one call
    fused: dict[tuple, list[list[Tensor]]]
    other: list[Tensor]  # torch's own foreach/for-loop path
    one_pass: list[Item]  # exact moments, the low-precision copy written in the same pass
    lean: list[Item]  # lean moments (bf16 or 8-bit)


def lean_numel(kind: StateKind, p: Tensor) -> bool:
    """Whether ``p`` keeps lean moments of ``kind`` (8-bit needs MIN_8BIT_NUMEL elements: the
    smaller keep exact moments, see [Note: lean moments])."""
    return kind is StateKind.BF16 or p.numel() >= MIN_8BIT_NUMEL


def _one_pass_fits(p: Tensor, grad: Tensor, states: list[Tensor]) -> bool:
    """A real float parameter whose gradient and moments are contiguous host tensors of its
    dtype: what the compiled exact step takes (the layout rule already checked the rest)."""
    return (
        p.is_cpu
        and p.dtype in (torch.float32, torch.float64)
        and p.is_contiguous()
        and grad.is_contiguous()
        and all(t.is_contiguous() for t in states)
    )


def _tell_written(copies: Any, items: list[Item]) -> None:
    for it in items:
        if it.low is not None:
            copies.wrote(it.param)


def _check_fits_in_ram(group: dict) -> None:
    """Refuse a group whose moments cannot fit the RAM that is free, naming ``state_dir``."""
    rows = 3 if group.get("amsgrad") else 2
    kind = state_kind_of_group(group)
    need = sum(
        int(kind.moment_bytes * p.numel())
        if kind is not StateKind.EXACT and lean_numel(kind, p)
        else rows * p.numel() * p.element_size()
        for p in group["params"]
        if p.device.type == "cpu"
    )
    if need == 0:
        return
    available = host_memory_available()
    if available is not None and need > available:
        raise MemoryError(
            f"Adam's state for these parameters takes {format_bytes(need)} of host RAM and "
            f"{format_bytes(available)} is free: pass state_dir='/path/on/a/fast/disk' to keep "
            f"it in files there (roundpipe.optim.Adam(..., state_dir=...), docs/memory.md), or "
            f"train fewer parameters (LoRA)"
        )


def _memory_order(t: Tensor) -> tuple | None:
    """The strides that decide where each element lives, or None if ``t`` is not dense.

    Dense: the elements fill exactly ``numel`` consecutive slots (no gaps, no overlap), in any
    dimension order. Dimensions of size 1 are left out: their stride never moves an element.
    """
    dims = [(stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1]
    if t.numel() == 0:
        return ()
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return None
        expected *= size
    return tuple(stride for stride, _ in dims)


def _fusable_layout(
    p: Tensor, grad: Tensor, states: list[Tensor], dtype: torch.dtype, device: torch.device
) -> bool:
    """[Note: fused layout rule]: grad and states share ``p``'s dtype and dense memory order (a
    grad may also be the bf16/fp16 of an fp32 ``p``, see [Note: low-precision gradients] in
    _step_kernels.cpp).

    Runs for every parameter on every step, so it checks only what can differ: the ``.grad``
    setter already enforces the grad's shape and device (not its dtype, with ``grad_dtype``);
    states may come from any checkpoint, and a state of another size would make the CPU
    kernel read or write out of bounds.
    """
    if grad.dtype != dtype and not (dtype == torch.float32 and grad.dtype in LOW_GRAD_DTYPES):
        return False  # a bf16/fp16 gradient of an fp32 master: [Note: low-precision gradients]
    shape = p.shape
    for t in states:
        if t.shape != shape or t.dtype != dtype or t.device != device:
            return False
    # Fast path: contiguous tensors of one shape share one layout.
    if p.is_contiguous() and grad.is_contiguous() and all(t.is_contiguous() for t in states):
        return True
    order = _memory_order(p)
    return (
        order is not None
        and _memory_order(grad) == order
        and all(_memory_order(t) == order for t in states)
    )


def _init_state(state: dict, p: Tensor, group: dict, fused: bool) -> None:
    # The step count lives where the path that reads it wants it, as torch keeps it: a float32
    # on the parameter's device for the fused kernel, on the device for capturable, else on the
    # host (float64 only under a float64 default dtype).
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    if fused:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    elif group["capturable"]:
        state["step"] = torch.zeros((), dtype=dtype, device=p.device)
    else:
        state["step"] = torch.zeros((), dtype=dtype)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def make_placement(
    state_dir: str | os.PathLike[str] | None, state_buffer_bytes: int | None
) -> OptimizerStatePlacement:
    """The placement of ``Adam(state_dir=..., state_buffer_bytes=...)``."""
    if state_dir is None:
        if state_buffer_bytes is not None:
            raise ValueError(
                "Adam: state_buffer_bytes sizes the buffer that state on disk streams through; "
                "it needs state_dir (or leave it out to keep the state in RAM)"
            )
        return StateInRAM()
    return StateOnDisk(state_dir, state_buffer_bytes)
