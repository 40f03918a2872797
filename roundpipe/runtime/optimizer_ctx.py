"""The optimizer context: :class:`OptimizerCtx` (``model.parameters()`` gives the masters inside
it), the work item that runs a ``step_fn`` on the optimizer thread (:func:`wrap_step`), and the
optimizer step pre-hook that rejects an optimizer built on the model's own low-precision
parameters (:func:`check_optimizer_step_hook`).

Threads: ``OptimizerCtx`` is thread-local (any thread); the wrapped step and the hook run on the
optimizer thread. The hook is torch's global optimizer step pre-hook, registered only while a
``step_fn`` runs and removed after it: a process whose model does not step (or a plain torch
loop beside it) never has it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe.runtime.grad_router import clear_grads
from roundpipe.runtime.params import Params
from roundpipe.step_check import check_optimizer_step
from roundpipe.threads.step_context import check_optimizer_params, in_step, running_step
from roundpipe.threads.workers import add_note

__all__ = [
    "OptimizerCtx",
    "in_optimizer_ctx",
    "check_optimizer_step_hook",
    "wrap_step",
]


_OPTIM_TLS = threading.local()


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


def check_optimizer_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook (registered while a step_fn runs, see :func:`wrap_step`); acts
    only on the thread that runs the step_fn:
    an optimizer built on the model's own parameters instead of its masters is refused, and a
    torch.amp.GradScaler stepping it too (see :mod:`roundpipe.step_check`)."""
    if not in_step():
        return
    check_optimizer_params(optimizer, args, kwargs)
    check_optimizer_step(optimizer)


def wrap_step(
    params: Params,
    tag: str,
    step_fn: Callable[[], Any],
    pre_step: Sequence[Callable[[], None]],
    in_place_copy: bool = False,
) -> Callable[[], None]:
    """The work item of ``model.step(step_fn)``: on the optimizer thread, inside
    :class:`OptimizerCtx`, the model's pre-step hooks (``pre_step``, taken at launch on the
    main thread: e.g. the data-parallel gradient average), then ``step_fn``, during which a
    one-pass optimizer may write the master->model copy (see [Note: the copy in the step] in
    roundpipe.runtime.step_copy): into the parameters themselves with ``in_place_copy`` (a
    synchronous step), else into the next weights."""

    hooks = tuple(pre_step)

    def run() -> None:
        try:
            with (
                OptimizerCtx(),
                running_step(params),
                params.step_copies.armed(in_place_copy),
            ):
                for hook in hooks:
                    hook()
                # Only steps run on the optimizer thread, one at a time: the hook is there for
                # exactly this step_fn.
                handle = register_optimizer_step_pre_hook(check_optimizer_step_hook)
                try:
                    step_fn()
                finally:
                    handle.remove()
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            # A failed step did not consume this iteration's gradients: drop them here, in
            # FIFO order, whichever call later reports the failure, so the next step does
            # not apply them twice.
            clear_grads(params.grad_targets)
            add_note(exc, f"[roundpipe{tag} step_fn]")
            raise

    run.__qualname__ = run.__name__ = (
        f"RoundPipe.step({getattr(step_fn, '__qualname__', type(step_fn).__name__)})"
    )
    return run
