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

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from roundpipe.memory.host import format_bytes
from roundpipe.memory.probe import host_memory_available

if TYPE_CHECKING:
    from roundpipe.optim.adam import Adam

__all__ = ["StatePlacement", "StateInRAM", "make_placement"]


class StatePlacement(Protocol):
    """What an optimizer asks of the place its state lives in."""

    def check_group(self, opt: Adam, group: dict) -> None:
        """Raise ``ValueError`` if this placement cannot hold ``group``'s state (any thread)."""

    def step(self, opt: Adam, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """One update of every parameter with a gradient, honouring the GradScaler's tensors."""

    def state_dict(self, opt: Adam, base: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """torch's state dict, ``base`` being torch's ``Optimizer.state_dict`` of ``opt``."""

    def after_load(self, opt: Adam) -> None:
        """Take over the state ``Optimizer.load_state_dict`` has just put in ``opt.state``."""

    def close(self) -> None:
        """Release files and threads (idempotent)."""


class StateInRAM:
    """The moments are tensors in ``optimizer.state``, as in torch.optim.Adam (the default)."""

    def check_group(self, opt: Adam, group: dict) -> None:
        _check_fits_in_ram(group)

    def step(self, opt: Adam, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        from roundpipe.optim.adam import _fused_step

        for group in opt.param_groups:
            fused, other = opt._split_group(group)
            if fused:
                _fused_step(group, fused, grad_scale, found_inf)
            if other:
                opt._torch_step(group, other, grad_scale, found_inf)

    def state_dict(self, opt: Adam, base: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return base()

    def after_load(self, opt: Adam) -> None:
        pass

    def close(self) -> None:
        pass


def _check_fits_in_ram(group: dict) -> None:
    """Refuse a group whose moments cannot fit the RAM that is free, naming ``state_dir``."""
    rows = 3 if group.get("amsgrad") else 2
    need = sum(
        rows * p.numel() * p.element_size() for p in group["params"] if p.device.type == "cpu"
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


def make_placement(
    state_dir: str | os.PathLike[str] | None, state_buffer_bytes: int | None
) -> StatePlacement:
    """The placement of ``Adam(state_dir=..., state_buffer_bytes=...)``."""
    if state_dir is None:
        if state_buffer_bytes is not None:
            raise ValueError(
                "Adam: state_buffer_bytes sizes the buffer that state on disk streams through; "
                "it needs state_dir (or leave it out to keep the state in RAM)"
            )
        return StateInRAM()
    from roundpipe.optim.spill import StateOnDisk

    return StateOnDisk(state_dir, state_buffer_bytes)


def fused_only_reason(group: dict, p: Tensor) -> str | None:
    """Why ``p`` of ``group`` cannot take the fused kernel on the host, or None."""
    from roundpipe.optim.adam import _group_allows_fused, _param_fits_fused

    if not _group_allows_fused(group):
        return "its group sets fused=False, foreach=True or differentiable=True"
    if group.get("capturable"):
        return "its group sets capturable=True"
    if not _param_fits_fused(p):
        return f"it is a {type(p).__name__} of {p.dtype} (not a dense float/complex Tensor)"
    if p.device.type != "cpu":
        return f"it lives on {p.device}, not in host memory"
    if not p.is_contiguous():
        return "it is not contiguous"
    return None
