"""The executor: one dispatch loop per device that performs exactly the plan's program, action by
action (see [Note: the program] in :mod:`roundpipe.plan.actions`): the compute actions through
:mod:`roundpipe.runtime.stage_ops`, the moves and waits through the device's backend.

Threads: :func:`execute` runs on the main thread, which, on a CPU pool, also runs device 0's
program (see [Note: the calling thread runs CPU device 0]); every other device's program runs
on its worker, and an action touches only its own slot, the slots of the actions it depends on
(after their futures are done), and its stage's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from roundpipe.devices import Backend, Future, StreamingBackend, caller_as_worker
from roundpipe.plan import Action, ActionKind
from roundpipe.runtime.call import CallSpec, CallState, Cancelled
from roundpipe.runtime.params import ParamsCopyFailed, raise_copy_failure
from roundpipe.runtime.stage_ops import ComputeFn, compute_action, wait_ahead
from roundpipe.threads.workers import add_note

__all__ = ["execute"]


def execute(spec: CallSpec, state: CallState) -> None:
    """Run every device's program and wait for all; re-raise the first real error (the earliest
    in plan time). A failure stops the call: its device runs nothing more, and every other
    device skips every action later in plan time (an earlier one still runs, so which error is
    reported does not depend on timing).

    Interrupted (Ctrl-C) while running or waiting, it cancels what has not started, waits until
    no worker touches the call any more, and then re-raises: the workers are never left waiting
    for work that will not come, and nothing of the call lands later."""
    pool = spec.pool
    assert spec.plan.program is not None
    for backend in pool.backends:
        backend.begin_call()
    handlers = _handlers(spec)
    jobs: list[Future] = []
    started: set[int] = set()  # devices whose program runs (or ran)
    try:
        for d, program in enumerate(spec.plan.program):
            if d != pool.caller_device and program:
                jobs.append(pool.worker(d).submit(_run_program, spec, state, d, handlers))
                started.add(d)
        if pool.caller_device is not None:
            started.add(pool.caller_device)
            with caller_as_worker(pool.device_type):
                _run_program(spec, state, pool.caller_device, handlers)
        for job in jobs:
            job.result()  # never raises: a program records its failures
    except BaseException:
        state.cancelled.set()
        state.grads.abandon()
        # A program that never started settles nothing: its readers must not wait for it.
        for d, program in enumerate(spec.plan.program):
            if d not in started:
                _settle_cancelled(state, program)
        _wait_uninterrupted(jobs)
        _drain(spec, state)
        raise
    if not state.failures:
        return
    _drain(spec, state)
    exc = min(state.failures, key=lambda f: f[:3])[3]
    if isinstance(exc, ParamsCopyFailed):
        raise_copy_failure(exc.ready)
    raise exc


Handler = Callable[[CallSpec, CallState, Action, Backend], None]


def _run_program(
    spec: CallSpec, state: CallState, d: int, handlers: dict[ActionKind, Handler]
) -> None:
    """Device ``d``'s program, on its worker: each action once the actions it reads are done,
    unless the call failed; its future (if another action waits for it) settled after it."""
    assert spec.plan.program is not None
    backend = spec.pool.backends[d]
    program = spec.plan.program[d]
    futures = state.futures
    i = 0
    try:
        with backend.action_context():
            for i, a in enumerate(program):  # noqa: B007 -- i is read in finally
                fut = futures.get(a.key)
                try:
                    stop = state.stop_after
                    if state.cancelled.is_set() or (
                        stop is not None and (a.time, a.stage, a.mb_index) > stop
                    ):
                        raise Cancelled()
                    for dep in spec.plan.dependencies(a):
                        waited = futures.get(dep.key)
                        if waited is not None and waited.exception() is not None:
                            raise Cancelled()
                    if _profiling():  # a label per action, so a trace shows whose time it is
                        with torch.profiler.record_function(_label(a)):
                            handlers[a.kind](spec, state, a, backend)
                    else:
                        handlers[a.kind](spec, state, a, backend)
                except Cancelled as exc:
                    if fut is not None:
                        fut.set_exception(exc)
                    break
                except KeyboardInterrupt:
                    raise  # on the calling thread: the call is cancelled by execute()
                except BaseException as exc:  # noqa: B036 -- recorded, re-raised by execute()
                    if not a.kind.computes and not isinstance(exc, ParamsCopyFailed):
                        add_note(exc, _where(spec, a))
                    state.fail(a.time, a.stage, a.mb_index, exc)
                    if fut is not None:
                        fut.set_exception(exc)
                    break
                else:
                    if fut is not None:
                        fut.set_result(None)
    finally:
        wait_ahead(state, d)  # nothing it handed to its helper runs after it
        # Whatever stopped the program, nothing waits forever for what it did not run.
        _settle_cancelled(state, program[i:])


def _profiling() -> bool:
    """Whether torch.profiler records now (torch's module flag is process-wide; the C++ one,
    its fallback on a torch without the flag, is the calling thread's)."""
    flag = getattr(torch.autograd.profiler, "_is_profiler_enabled", None)
    return torch._C._autograd._profiler_enabled() if flag is None else flag


def _label(a: Action) -> str:
    """The action's name under torch.profiler: its kind and stage, so a profile's table adds up
    each stage's forwards, recomputes and moves over the microbatches."""
    at = f"stage {a.stage}" if a.stage >= 0 else f"device {a.device}"
    return f"roundpipe {a.kind.name.lower()} {at}"


def _settle_cancelled(state: CallState, actions: Sequence[Action]) -> None:
    for a in actions:
        fut = state.futures.get(a.key)
        if fut is not None and not fut.done():
            fut.set_exception(Cancelled())


_MOVES = {
    ActionKind.WAIT_PARAMS: "wait for its params",
    ActionKind.UPLOAD: "upload",
    ActionKind.PREFETCH: "prefetch",
    ActionKind.RELEASE: "release",
    ActionKind.DOWNLOAD: "gradient download",
    ActionKind.HANDOFF: "hand-off",
    ActionKind.OFFLOAD: "stage input offload",
    ActionKind.RELOAD: "stage input reload",
    ActionKind.SYNC: "wait for the device",
}


def _where(spec: CallSpec, a: Action) -> str:
    """Where a move failed, for its note (the compute actions name their own place)."""
    at = f"stage {a.stage}" if a.stage >= 0 else f"device {a.device}"
    if a.mb_index >= 0:
        at += f", microbatch {a.mb_index}"
    return f"[roundpipe{spec.tag} {at}, {_MOVES[a.kind]}]"


def _handlers(spec: CallSpec) -> dict[ActionKind, Handler]:
    table: dict[ActionKind, Handler] = {
        ActionKind.WAIT_PARAMS: _wait_params,
        ActionKind.UPLOAD: _upload,
        ActionKind.PREFETCH: _upload,
        ActionKind.RELEASE: _release,
        ActionKind.DOWNLOAD: _download,
        ActionKind.HANDOFF: _handoff,
        ActionKind.OFFLOAD: _offload,
        ActionKind.RELOAD: _reload,
        ActionKind.SYNC: _sync,
    }
    for kind in (ActionKind.FORWARD, ActionKind.LAST, ActionKind.BACKWARD, ActionKind.MICROBATCH):
        fn: ComputeFn = compute_action(spec, kind)
        table[kind] = fn
    return table


# -- the moves and waits (accelerator plans) --------------------------------------------------
def _streaming(backend: Backend) -> StreamingBackend:
    return backend  # type: ignore[return-value]  # only accelerator plans have moves


def _wait_params(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    for layer in spec.stages[a.stage].layers:
        spec.ready.wait(layer.index)


def _upload(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    s = a.stage
    trainable = [rec.param for rec in spec.stage_params[s]]
    # Training: device leaves, whose gradients stay on the device. A differentiable inference
    # call: a differentiable upload, so a later backward() reaches the host parameters and
    # their grad hooks.
    leaves = spec.training
    with torch.set_grad_enabled(not spec.training and spec.grad_enabled):
        state.uploads[s] = _streaming(backend).upload(
            spec.stages[s].modules, trainable, leaves=leaves, prefetch=a.kind is ActionKind.PREFETCH
        )


def _release(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    upload = state.uploads.pop(a.stage)
    # A recompute's updates of the buffers are dropped: the forward made them.
    state.released[(a.stage, a.of)] = _streaming(backend).release(upload, a.write_back)


def _download(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    stages = range(len(spec.stages)) if a.stage < 0 else [a.stage]
    state.grads.download(stages, _streaming(backend))


def _handoff(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    slot = state.slots[(a.stage, a.mb_index)]
    event = _streaming(backend).record_event()
    if a.of is ActionKind.FORWARD:
        slot.out_ready = event
    else:
        slot.grad_ready = event


def _offload(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    slot = state.slots[(a.stage, a.mb_index)]
    slot.saved_input, slot.saved_ready = _streaming(backend).offload(slot.saved_input)


def _reload(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    slot = state.slots[(a.stage, a.mb_index)]
    assert slot.saved_ready is not None
    slot.saved_input = _streaming(backend).reload(slot.saved_input, slot.saved_ready)
    slot.saved_ready = None


def _sync(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    if a.stage < 0:
        _streaming(backend).finish()
    else:
        _streaming(backend).wait_for(state.released[(a.stage, a.of)])


def _drain(spec: CallSpec, state: CallState) -> None:
    """A failed call: nothing it enqueued on a device still runs once it has returned (its
    programs' final S may not have run)."""
    state.uploads.clear()
    for backend in spec.pool.backends:
        backend.drain()


def _wait_uninterrupted(futures: list[Future]) -> None:
    """Wait for every future, through repeated Ctrl-C too: once a call is cancelled its running
    actions end soon, and the caller re-raises the first interrupt afterwards."""
    for fut in futures:
        while True:
            try:
                fut.exception()
                break
            except KeyboardInterrupt:
                continue
