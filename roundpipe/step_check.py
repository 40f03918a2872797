"""What a step function shares with the main thread, checked where roundpipe can see it: when
``model.step(step_fn)`` or ``optim_thread.launch(fn)`` launches it (main thread,
:func:`check_step_fn`) and when it steps an optimizer (optimizer thread,
:func:`check_optimizer_step`, from the global optimizer step pre-hook). See
[Note: what a step shares].
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from roundpipe.scaler import grad_scaler
from roundpipe.threads import optimizer_thread
from roundpipe.threads.optimizer_thread import caller_must_wait

__all__ = ["check_step_fn", "check_optimizer_step", "guard_optimizer"]


# [Note: what a step shares]
# A step function runs on the optimizer thread while the main thread goes on, so whatever it
# shares with the main thread must either hand over through the optimizer thread's queue or be
# guarded:
#   * a torch.amp.GradScaler cannot work there: its update() on the main thread runs before the
#     launched step recorded its inf checks (torch's "No inf checks were recorded prior to
#     update") or while it runs (a silently wrong scale). It is refused: at launch, when the step
#     function refers to one (its closure, the globals it names, defaults, a bound method's
#     object, and one level of callables among those), else on the optimizer thread when it
#     steps an optimizer (then the launched step fails and the next roundpipe call reports it);
#   * a roundpipe.GradScaler found there is marked as used by steps, so that the main thread
#     may not touch its back side while a step may run (grad_scaler.note_step_launched);
#   * a torch optimizer found there (or stepping in a RoundPipe step) gets state_dict and
#     load_state_dict pre-hooks that wait for launched work first, as the masters' .grad does
#     ([Note: guarded master gradients] in runtime/grad_access.py). One registered on the optimizer
#     thread at its first step leaves that first step unguarded against a concurrent
#     state_dict(), which torch then may report as "dictionary changed size during iteration".

# What the search looks into (by type, never through an object's own __class__ or __getattr__:
# the search must never fail a launch that would work).
_CALLABLES = (types.FunctionType, types.MethodType, functools.partial)
# How many objects one step function's references may name before the search stops (a global
# dict or list of thousands of entries is not worth walking at every step).
_MAX_CHILDREN = 64


def _foreign_scaler(obj: Any) -> bool:
    """A torch.amp.GradScaler (or a subclass, e.g. torch.cuda.amp's) that scales."""
    return (
        issubclass(type(obj), torch.amp.GradScaler)
        and not issubclass(type(obj), grad_scaler.GradScaler)
        and obj.is_enabled()
    )


def _foreign_scaler_error(where: str) -> RuntimeError:
    return RuntimeError(
        f"a torch.amp.GradScaler ({where}) is used by a step launched on roundpipe's optimizer "
        "thread: its update() on the main thread runs before or while the step records its inf "
        "checks, so torch raises 'No inf checks were recorded prior to update' or the scale goes "
        "silently wrong. Use roundpipe.GradScaler, a drop-in with the same constructor and "
        "methods: scaler = roundpipe.GradScaler(...) (docs/scaler.md)"
    )


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:  # lambdas and comprehensions defined inside
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _references(obj: Any) -> Iterator[tuple[str, Any]]:
    """(where, object) for what a callable refers to; nothing for anything else."""
    if type(obj) is types.MethodType:
        yield "the object", obj.__self__
        self_dict = _attributes(obj.__self__)
        if type(self_dict) is dict:
            for name, value in list(self_dict.items())[:_MAX_CHILDREN]:
                yield f"attribute {name!r} of the object", value
        obj = obj.__func__
    if issubclass(type(obj), functools.partial):
        yield "the partial's function", obj.func
        for i, value in enumerate(obj.args[:_MAX_CHILDREN]):
            yield f"partial argument {i}", value
        for name, value in list(obj.keywords.items())[:_MAX_CHILDREN]:
            yield f"partial argument {name!r}", value
        return
    if type(obj) is not types.FunctionType:
        return
    code = obj.__code__
    for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    module_globals = obj.__globals__
    for name in dict.fromkeys(_code_names(code)):
        if name in module_globals:
            yield f"global {name!r}", module_globals[name]
    for value in obj.__defaults__ or ():
        yield "a default argument", value
    for name, value in (obj.__kwdefaults__ or {}).items():
        yield f"default argument {name!r}", value


def _referenced_objects(step_fn: Callable) -> list[tuple[str, Any]]:
    """What ``step_fn`` refers to, and what the callables among those refer to (one level);
    elements of lists, tuples and dicts found there count as referenced too."""
    found: list[tuple[str, Any]] = []
    seen = {id(step_fn)}

    def add(where: str, value: Any) -> None:
        if id(value) not in seen:
            seen.add(id(value))
            found.append((where, value))

    for where, value in _guarded(_references(step_fn)):
        add(where, value)
    for where, value in list(found):
        if issubclass(type(value), _CALLABLES):
            for inner, child in _guarded(_references(value)):
                add(f"{inner} of {where}", child)
        elif _user_object(value):  # e.g. a trainer object holding the scaler
            for name, child in list(_attributes(value).items())[:_MAX_CHILDREN]:
                add(f"attribute {name!r} of {where}", child)
    for where, value in list(found):
        if type(value) in (list, tuple):
            for i, child in enumerate(value[:_MAX_CHILDREN]):
                add(f"{where}[{i}]", child)
        elif type(value) is dict:
            for key, child in list(value.items())[:_MAX_CHILDREN]:
                add(f"{where}[{key!r}]" if type(key) in (str, int) else where, child)
    return found


def _guarded(references: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``references`` until one cannot be read (an attribute that raises, say): the search
    is a courtesy at launch and must never fail a launch that would work."""
    try:
        yield from references
    except Exception:  # noqa: BLE001 -- see the docstring
        return


def _user_object(value: Any) -> bool:
    """An instance of a class of the user's (not a module, class, function, torch's or
    roundpipe's object) with attributes to look through."""
    if issubclass(type(value), (type, types.ModuleType, types.FunctionType)):
        return False
    module = getattr(type(value), "__module__", None) or ""
    if module.partition(".")[0] in ("torch", "roundpipe", "builtins"):
        return False
    return type(_attributes(value)) is dict


def _attributes(value: Any) -> Any:
    """``value.__dict__`` without running a class's own ``__getattr__``; None if it has none."""
    try:
        return object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 -- no instance dict
        return None


def check_step_fn(step_fn: Callable) -> list[grad_scaler.GradScaler]:
    """When ``model.step(step_fn)`` or ``optim_thread.launch`` launches it (any thread but the
    optimizer thread, usually the main thread): raise ``RuntimeError`` if the
    step function refers to a ``torch.amp.GradScaler``; guard the optimizers it refers to (see
    [Note: what a step shares]). Returns the ``roundpipe.GradScaler`` objects it refers to, for
    the launcher to hand the launched item (:func:`roundpipe.scaler.grad_scaler.note_step_launched`;
    the step's failure is theirs too, see [Note: error reporting] in
    :mod:`roundpipe.threads.optimizer_thread`). Never blocks."""
    scalers: list[grad_scaler.GradScaler] = []
    for where, obj in _referenced_objects(step_fn):
        if _foreign_scaler(obj):
            raise _foreign_scaler_error(f"{where} of the step function")
        if issubclass(type(obj), grad_scaler.GradScaler):
            if not any(s is obj for s in scalers):
                scalers.append(obj)
        elif issubclass(type(obj), torch.optim.Optimizer):
            guard_optimizer(obj)
    return scalers


_TORCH_SCALER_STEP_CODES = frozenset(
    {torch.amp.GradScaler.step.__code__, torch.amp.GradScaler._maybe_opt_step.__code__}
)
# Frames between the step pre-hook and torch's GradScaler.step: torch's hook runner, the
# optimizer's step wrapper, _maybe_opt_step, a subclass's step or two.
_MAX_FRAMES = 12


def _calling_foreign_scaler() -> Any | None:
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code in _TORCH_SCALER_STEP_CODES:
            scaler = frame.f_locals.get("self")
            return scaler if _foreign_scaler(scaler) else None
        frame = frame.f_back
    return None


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer thread, while a RoundPipe step function steps ``optimizer`` (the global step
    pre-hook): raise ``RuntimeError`` if a ``torch.amp.GradScaler`` is stepping it, warn if none
    of its parameters has a gradient (the step changes nothing), and guard it (see
    [Note: what a step shares]). Never blocks."""
    scaler = _calling_foreign_scaler()
    if scaler is not None:
        raise _foreign_scaler_error(
            f"{type(scaler).__module__}.{type(scaler).__qualname__} "
            f"stepping {type(optimizer).__name__}"
        )
    if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        warnings.warn(
            f"{type(optimizer).__name__}.step() runs in a RoundPipe step with no gradient on any "
            "of its parameters, so it changes nothing: were the gradients cleared between "
            "forward_backward and model.step (opt.zero_grad() on the main thread there)? Clear "
            "them inside the step function, after opt.step()",
            UserWarning,
            stacklevel=2,
        )
    guard_optimizer(optimizer)


_GUARDED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_GUARD_LOCK = threading.Lock()


def _wait_before_state_dict(optimizer: torch.optim.Optimizer, *state_dict: Any) -> None:
    # Failures stay for the loop's next roundpipe call (see [Note: guarded master gradients]).
    if caller_must_wait():
        optimizer_thread.wait_all()


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` and ``load_state_dict()`` wait, on any thread but the
    optimizer thread, until launched work has run (a step may be changing the state). Any
    thread; idempotent; never blocks."""
    with _GUARD_LOCK:
        if optimizer in _GUARDED:
            return
        _GUARDED.add(optimizer)
    optimizer.register_state_dict_pre_hook(_wait_before_state_dict, prepend=True)
    optimizer.register_load_state_dict_pre_hook(_wait_before_state_dict, prepend=True)
