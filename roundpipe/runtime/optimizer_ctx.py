"""The optimizer context: :class:`OptimizerCtx` (``model.parameters()`` gives the masters inside
it), the ``step_fn`` wrapper that runs on the optimizer thread, and the global optimizer step
pre-hook that rejects an optimizer built on the model's own low-precision parameters.

Threads: ``OptimizerCtx`` is thread-local (any thread); the wrapped step and the hook run on the
optimizer thread; the hook is registered once per process (any thread, under a lock).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe.optim_thread import add_note
from roundpipe.runtime.grads import _clear_grads

if TYPE_CHECKING:
    from roundpipe.runtime.model import RoundPipe

__all__ = ["OptimizerCtx"]


_OPTIM_TLS = threading.local()
_STEP_TLS = threading.local()


class OptimizerCtx:
    """Inside this context (thread-local), ``model.parameters()`` / ``named_parameters()`` of
    every :class:`RoundPipe` return the fp32 masters instead of the model's parameters::

        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    It is also active on the optimizer thread while a ``step_fn`` runs. Any thread; nestable.
    """

    def __enter__(self) -> "OptimizerCtx":
        _OPTIM_TLS.depth = getattr(_OPTIM_TLS, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPTIM_TLS.depth -= 1


def _in_optimizer_ctx() -> bool:
    return getattr(_OPTIM_TLS, "depth", 0) > 0


_OPTIMIZER_HOOK: Any = None
_OPTIMIZER_HOOK_LOCK = threading.Lock()


def _check_optimizer_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook; acts only while a RoundPipe step_fn runs on this thread."""
    model = getattr(_STEP_TLS, "model", None)
    if model is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec = model._params.record_of(p)
            if rec is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} was built on the model's own (low-precision) "
                    f"parameters, e.g. {rec.name!r}, instead of the "
                    f"fp32 masters that RoundPipe accumulates gradients into; build it with "
                    f"`with OptimizerCtx(): opt = {type(optimizer).__name__}(model.parameters(), "
                    f"...)` or on `model.optim_parameters()`")


def _ensure_optimizer_hook() -> None:
    global _OPTIMIZER_HOOK
    with _OPTIMIZER_HOOK_LOCK:
        if _OPTIMIZER_HOOK is None:
            _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(
                _check_optimizer_params)


def _wrap_step(model: "RoundPipe", step_fn: Callable[[], Any]) -> Callable[[], None]:
    """The work item of ``model.step(step_fn)``: on the optimizer thread, inside
    :class:`OptimizerCtx`, the data-parallel gradient average (if any), then ``step_fn``."""

    # Read here, on the main thread at launch, not when the step runs: a DataParallel attached
    # or closed in between changes later steps only.
    reducer = model._grad_reducer

    def run() -> None:
        _STEP_TLS.model = model
        try:
            with OptimizerCtx():
                if reducer is not None:
                    reducer()
                step_fn()
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            # A failed step did not consume this iteration's gradients: drop them here, in
            # FIFO order, whichever call later reports the failure, so the next step does
            # not apply them twice.
            _clear_grads(list(model._params.masters.values()))
            add_note(exc, f"[roundpipe{model._name_tag()} step_fn]")
            raise
        finally:
            _STEP_TLS.model = None

    run.__qualname__ = run.__name__ = (
        f"RoundPipe.step({getattr(step_fn, '__qualname__', type(step_fn).__name__)})")
    return run
