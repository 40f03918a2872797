"""Calls that are for the main thread only: they wait for the device workers and the optimizer
thread, so made on one of those threads they would wait for themselves."""

from __future__ import annotations

from roundpipe.devices import on_device_worker
from roundpipe.threads import optimizer_thread

__all__ = ["check_main_thread"]


def check_main_thread(method: str, owner: str = "RoundPipe") -> None:
    """Raise ``RuntimeError`` if the calling thread is the optimizer thread or a device worker,
    naming ``owner.method()`` and where to call it instead. Never blocks."""
    if optimizer_thread.on_optimizer_thread() or on_device_worker():
        where = (
            "the optimizer thread (inside a step function)"
            if optimizer_thread.on_optimizer_thread()
            else "a device worker (inside a stage or loss_fn)"
        )
        raise RuntimeError(
            f"{owner}.{method}() was called on {where}, where it would wait for itself; call "
            f"it on the main thread (inside a step function, model.master_state_dict() and "
            f"model.optim_parameters() are the masters' state)"
        )
