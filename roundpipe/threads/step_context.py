"""The step that runs on this thread: while a RoundPipe ``step_fn`` runs on the optimizer thread,
the model's parameter records are known here (:func:`running_step`), so that an optimizer built
on the model's own low-precision parameters instead of the fp32 masters is refused with an
error that says how to build it (:func:`check_optimizer_params`).

It sits below the runtime and the scaler, both of which use it. Thread-local.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "ParamLookup",
    "running_step",
    "in_step",
    "check_optimizer_params",
    "step_copies",
]


class ParamLookup(Protocol):
    """What :func:`running_step` needs of a model's parameters: the record of a model
    parameter (with its ``name``), None for any other tensor."""

    def record_of(self, param: Any) -> Any: ...


_STEP_TLS = threading.local()


@contextlib.contextmanager
def running_step(params: ParamLookup) -> Iterator[None]:
    """Mark the body as a RoundPipe step of the model whose parameters ``params`` looks up."""
    _STEP_TLS.params = params
    try:
        yield
    finally:
        _STEP_TLS.params = None


def in_step() -> bool:
    """Whether a RoundPipe step runs on this thread. Never blocks."""
    return getattr(_STEP_TLS, "params", None) is not None


def step_copies() -> Any:
    """The :class:`roundpipe.runtime.step_copy.StepCopies` of the model whose step runs on
    this thread (where an optimizer may write the master->model copy, see [Note: the copy in
    the step]), or None outside a RoundPipe step. Never blocks."""
    params = getattr(_STEP_TLS, "params", None)
    return None if params is None else getattr(params, "step_copies", None)


def check_optimizer_params(
    optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None
) -> None:
    """Raise ``RuntimeError`` if ``optimizer`` runs in a RoundPipe step on this thread and was
    built on the model's own parameters; a no-op elsewhere. Never blocks."""
    params: ParamLookup | None = getattr(_STEP_TLS, "params", None)
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
                    f"...)` or on `model.optim_parameters()`"
                )
