"""Carrying the caller's thread-local autocast state into the device workers.

Autocast state is thread-local, so what the caller set around ``forward``/``forward_backward`` is
invisible on a worker: :func:`capture_autocast` reads it at the call (as
``torch/utils/checkpoint.py``'s ``_get_autocast_kwargs`` does) and :func:`autocast_context`
applies it on the worker, in every stage forward, recompute and ``loss_fn``, never in backward.
RNG state is carried by :mod:`roundpipe.runtime.rng`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

__all__ = ["AutocastState", "capture_autocast", "resolve_autocast", "autocast_context"]


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """What ``torch.autocast`` is set to on one thread for one device type."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


def capture_autocast(device_type: str) -> AutocastState:
    """The calling thread's autocast state for ``device_type``. Never blocks."""
    return AutocastState(
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


def resolve_autocast(setting: Any, device_type: str) -> AutocastState:
    """``"caller"`` (or None): the caller's state; ``"off"`` (or False): disabled; a dtype:
    enabled with that dtype. Call it on the thread that called ``forward``/``forward_backward``."""
    caller = capture_autocast(device_type)
    if setting is None or setting == "caller":
        return caller
    if setting is False or setting == "off":
        return dataclasses.replace(caller, enabled=False)
    if isinstance(setting, torch.dtype):
        return dataclasses.replace(caller, enabled=True, dtype=setting)
    raise ValueError(
        f"autocast must be None (the caller's state), False or a torch.dtype, got {setting!r}"
    )


def autocast_context(state: AutocastState) -> contextlib.AbstractContextManager:
    """Apply ``state`` on the current (worker) thread."""
    if not state.enabled:
        # A worker thread starts with autocast off; enter a context only if a layer left it on.
        if not torch.is_autocast_enabled(state.device_type):
            return contextlib.nullcontext()
        return torch.autocast(state.device_type, enabled=False)
    return torch.autocast(
        state.device_type, dtype=state.dtype, enabled=True, cache_enabled=state.cache_enabled
    )
