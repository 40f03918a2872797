"""The optimizer context: :class:`OptimizerCtx` (``model.parameters()`` gives the masters inside
it), the work item that runs a ``step_fn`` on the optimizer thread (:func:`wrap_step`), and the
global optimizer step pre-hook that rejects an optimizer built on the model's own low-precision
parameters (:func:`check_optimizer_params`).

Threads: ``OptimizerCtx`` is thread-local (any thread); the wrapped step and the hook run on the
optimizer thread; the hook is registered once per process (any thread, under a lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe.optim_thread import add_note
from roundpipe.runtime.grad_router import clear_grads
from roundpipe.runtime.params import Params

__all__ = ["OptimizerCtx", "in_optimizer_ctx", "check_optimizer_params", "ensure_optimizer_hook",
           "wrap_step"]


_OPTIM_TLS = threading.local()
_STEP_TLS = threading.local()


class OptimizerCtx:
    """Inside this context (thread-local), ``model.parameters()`` / ``named_parameters()`` of
    every :class:`RoundPipe` return the fp32 masters instead of the model's parameters::

        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    It is also active on the optimizer thread while a ``step_fn`` runs. Any thread; nestable.
    """

    def __enter__(self) -> OptimizerCtx:
        _OPTIM_TLS.depth = getattr(_OPTIM_TLS, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPTIM_TLS.depth -= 1


def in_optimizer_ctx() -> bool:
    """Whether the calling thread is inside :class:`OptimizerCtx`. Never blocks."""
    return bool(getattr(_OPTIM_TLS, "depth", 0) > 0)


_OPTIMIZER_HOOK: Any = None
_OPTIMIZER_HOOK_LOCK = threading.Lock()


def check_optimizer_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook; acts only while a RoundPipe step_fn runs on this thread:
    an optimizer built on the model's own parameters instead of its masters is refused."""
    params: Params | None = getattr(_STEP_TLS, "params", None)
    if params is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec = params.record_of(p)
            if rec is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} was built on the model's own (low-precision) "
                    f"parameters, e.g. {rec.name!r}, instead of the "
                    f"fp32 masters that RoundPipe accumulates gradients into; build it with "
                    f"`with OptimizerCtx(): opt = {type(optimizer).__name__}(model.parameters(), "
                    f"...)` or on `model.optim_parameters()`")


def ensure_optimizer_hook() -> None:
    """Register :func:`check_optimizer_params` once per process. Any thread."""
    global _OPTIMIZER_HOOK
    with _OPTIMIZER_HOOK_LOCK:
        if _OPTIMIZER_HOOK is None:
            _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(check_optimizer_params)


def wrap_step(params: Params, tag: str, step_fn: Callable[[], Any],
              pre_step: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """The work item of ``model.step(step_fn)``: on the optimizer thread, inside
    :class:`OptimizerCtx`, the model's pre-step hooks (``pre_step``, taken at launch on the
    main thread: e.g. the data-parallel gradient average), then ``step_fn``."""

    hooks = tuple(pre_step)

    def run() -> None:
        _STEP_TLS.params = params
        try:
            with OptimizerCtx():
                for hook in hooks:
                    hook()
                step_fn()
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            # A failed step did not consume this iteration's gradients: drop them here, in
            # FIFO order, whichever call later reports the failure, so the next step does
            # not apply them twice.
            clear_grads(list(params.masters.values()))
            add_note(exc, f"[roundpipe{tag} step_fn]")
            raise
        finally:
            _STEP_TLS.params = None

    run.__qualname__ = run.__name__ = (
        f"RoundPipe.step({getattr(step_fn, '__qualname__', type(step_fn).__name__)})")
    return run
