"""Executing a plan: each device worker gets its actions (:func:`_execute`), each action is a
future that its dependents wait on, and the action bodies run stage forwards, recomputes,
backwards and ``loss_fn`` on the workers (:func:`_run_action`), under the call's autocast and
RNG chain state. The order comes from :mod:`roundpipe.schedule`; the gradients an action computes
go to :mod:`roundpipe.runtime.grads`.

Threads: :func:`_execute` runs on the main thread (which, on a CPU pool, also runs device 0's
actions, see [Note: the calling thread runs CPU device 0]); every action runs on its device's
worker and touches only its own slot, the slots of the actions it depends on, and the stage's
low-precision parameters (read only, after the stage's "params ready" event).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as _checkpoint_module
from torch.utils.checkpoint import checkpoint

from roundpipe.autocast import RNGState, autocast_context, rng_scope
from roundpipe.devices import Backend, Future, StreamingBackend, caller_as_worker
from roundpipe.optim_thread import add_note
from roundpipe.runtime.call import _Call, _Cancelled, _Slot, _start_first_uploads, _upload
from roundpipe.runtime.grads import _launch_moves, _storage_counts, _sum_into
from roundpipe.runtime.params import _ParamsCopyFailed, raise_copy_failure
from roundpipe.runtime.plan import _Layer, _Stage
from roundpipe.schedule import Action, ActionKind, Transfer

__all__: list = []  # private to roundpipe.runtime


# [Note: recompute]
# With recompute on (the default), a FORWARD action runs its stage under non-reentrant
# torch.utils.checkpoint: the graph it keeps holds the stage input and no activation. The
# BACKWARD action's autograd.grad re-runs the stage forward when it first unpacks a saved tensor,
# under the forward's autocast state (captured by checkpoint) and, for a stage in an RNG chain,
# under its start state (an rng_scope as checkpoint's recompute context, holding RNG_LOCK for the
# re-run only; checkpoint's own RNG handling is off, since it would set the global generator
# without the lock). checkpoint stops the re-run as soon as every saved tensor is back; saved
# tensors are packed before an op computes, so the last ops of a stage (a whole Linear stage)
# are not computed again. Re-running the forward in full instead costs up to a third more
# compute than plain PyTorch with checkpoint.


# [Note: fused stages]
# With one device there is nothing to overlap, and the per-stage actions only cost: each
# BACKWARD is its own autograd call, and each action its own future. A training plan on one
# device therefore has one MICROBATCH(m) action per microbatch: every stage forward (each under
# its RNG chain state, and under checkpoint with recompute on, so the memory is the same),
# loss_fn, then one backward through all stages, as plain PyTorch runs a microbatch. Its
# parameter gradients leave autograd through AccumulateGrad into the model params' .grad, where
# the grad hooks take them at once (still in cache) into the call's per-stage buffers (a
# _GradSink, found through the model's _SinkSlot); the sum per param is then what the per-stage actions
# compute, so final parameters stay bitwise the same for any number of devices. The one
# exception is a parameter in two stages (tied weights): one backward sums its two gradients of
# a microbatch before the buffer does, in another order than per-stage backwards, so such a
# model keeps the per-stage plan. Error notes of the fused backward name all stages, or the
# stage whose recompute failed.


# checkpoint ends a recompute early by raising this from inside the stage (see
# [Note: recompute]); like the runtime's own signals it passes through without a location note.
_STOP_RECOMPUTE = getattr(_checkpoint_module, "_StopRecomputationError", None)
_NOT_LAYER_ERRORS = ((_Cancelled, _ParamsCopyFailed)
                     + ((_STOP_RECOMPUTE,) if _STOP_RECOMPUTE is not None else ()))


def _execute(call: _Call) -> None:
    """Hand each worker its actions, run the calling thread's own (see [Note: the calling
    thread runs CPU device 0]), wait for all, re-raise the first real error.

    Interrupted (Ctrl-C) while submitting, running or waiting, it cancels the actions not
    started, waits until no worker touches the call any more, and then re-raises: the workers
    are never left waiting for work that will not come, and nothing of the call lands later."""
    own = call.pool.caller_device
    submitted: List[Action] = []  # handed to worker threads, in submission order
    for backend in call.pool.backends:
        backend.begin_call()
    try:
        _start_first_uploads(call)
        for d, actions in enumerate(call.plan.per_device):
            if d == own:
                continue
            worker = call.pool.worker(d)
            for a in actions:
                worker.submit(_run_action, call, a, future=call.futures[a.key])
                submitted.append(a)
        if own is not None:
            with caller_as_worker(call.pool.device_type):
                for a in call.plan.per_device[own]:
                    # Ctrl-C propagates, to cancel the call below.
                    call.futures[a.key].run(_run_action, call, a,
                                            reraise=(KeyboardInterrupt,))
        # A worker runs its actions in order, so its last one done means all of its actions
        # are: wait on those alone rather than waking the main thread (and taking the GIL
        # from the workers) once per action.
        for actions in call.plan.per_device:
            if actions:
                call.futures[actions[-1].key].exception()
    except BaseException:
        call.cancelled.set()
        started = set(submitted)
        for a in call.plan.actions():
            if a not in started and not call.futures[a.key].done():
                call.futures[a.key].set_exception(_Cancelled())
        _wait_uninterrupted(list(call.first_uploads.values())
                            + [call.futures[a.key] for a in submitted])
        _drain(call)
        raise
    failures = []
    for a in call.plan.actions():
        exc = call.futures[a.key].exception()
        if exc is not None and not isinstance(exc, _Cancelled):
            failures.append((a.time, a.stage, a.mb_index, exc))
    if not failures:
        return
    _drain(call)
    exc = min(failures, key=lambda f: f[:3])[3]
    if isinstance(exc, _ParamsCopyFailed):
        raise_copy_failure(exc.ready)
    raise exc


def _drain(call: _Call) -> None:
    """A failed call: nothing it enqueued on a device still runs once it has returned (its
    workers' last actions, which wait for their devices, may not have run)."""
    call.prefetched.clear()
    for backend in call.pool.backends:
        backend.drain()


def _run_action(call: _Call, action: Action) -> None:
    if call.cancelled.is_set():
        raise _Cancelled()
    for dep in call.plan.dependencies(action):
        if call.futures[dep.key].exception() is not None:
            raise _Cancelled()
    backend = call.pool.backends[action.device]
    with backend.action_context():
        streaming = call.plan.stage_major
        if streaming:
            _enter_run(call, action, cast(StreamingBackend, backend))
        if action.kind is ActionKind.BACKWARD:
            if streaming and call.recompute:
                _recompute_backward_action(call, action, backend)
            else:
                _backward_action(call, action, backend)
        elif action.kind is ActionKind.MICROBATCH:
            _microbatch_action(call, action, backend)
        elif streaming and call.training and call.recompute \
                and action.kind is ActionKind.FORWARD:
            _streamed_forward_action(call, action, backend)
        else:
            _forward_action(call, action, backend)
        if streaming and call.plan.ends_run(action):
            _leave_run(call, action, cast(StreamingBackend, backend))
        if streaming and call.plan.hands_off(action):
            call.slots[(action.stage, action.mb_index)].handoff = backend.record_event()
        if not streaming or call.plan.needs_sync(action):
            backend.finish()


# [Note: streaming] in schedule.py: a stage is uploaded at the first action of a run that
# needs it, unless it was prefetched (a device's first upload as the call started, see
# _start_first_uploads in call.py; any other while the run before it computed, or at its end),
# and dropped at the end of the run (kept from the forward to the backward run when recompute
# is off, since the backward then walks the forward's graph).
def _enter_run(call: _Call, a: Action, backend: StreamingBackend) -> None:
    s = a.stage
    if s in call.resident:
        return
    first = call.first_uploads.get(a.key)
    # Queued ahead of this action on this worker, so done; re-raises its error here.
    resident = first.result() if first is not None else call.prefetched.pop(a.key, None)
    if resident is None:
        for layer in call.stages[s].layers:
            call.ready.wait(layer.index)
        resident = _upload(call, s, backend, prefetch=False)
    backend.adopt(resident)
    call.resident[s] = resident
    # Copy the device's next upload in while this run computes, if its params are ready
    # (else it is uploaded when its run starts). Not the same stage's: this run may still
    # write its host buffers back (BatchNorm stats) while the copy would read them; that one
    # is copied in once the run has ended (_leave_run).
    nxt = call.plan.next_upload(a)
    if nxt is not None and nxt.stage != s:
        _prefetch(call, nxt, backend, call.saved_bytes[a.device] + call.stage_bytes[s])


def _leave_run(call: _Call, a: Action, backend: StreamingBackend) -> None:
    if a.kind is ActionKind.FORWARD and call.training and not call.recompute:
        return  # the backward run reads this upload (see _enter_run)
    resident = call.resident.pop(a.stage, None)
    if resident is not None:
        # A recompute's updates of the buffers are dropped: the forward made them.
        backend.release(resident, write_back=not (a.kind is ActionKind.BACKWARD
                                                 and call.recompute))
    # The next run's upload, if its start could not be overlapped with this run: this stage's
    # own (its buffers are home now), or one that did not fit beside this run's. It is copied
    # in while the device waits for the next run's inputs.
    nxt = call.plan.upload_after(a)
    if nxt is not None and nxt.action.key not in call.prefetched:
        _prefetch(call, nxt, backend, call.saved_bytes[a.device]
                  + sum(call.stage_bytes[r] for r in call.resident))


def _prefetch(call: _Call, nxt: Transfer, backend: StreamingBackend, held: int) -> None:
    """Copy upload ``nxt`` in on the copy stream, for the action that will adopt it, if it fits
    the budget beside the ``held`` bytes and its params are ready (else that action uploads it;
    a prefetch never waits for the optimizer thread)."""
    fits = call.budget is None or held + call.stage_bytes[nxt.stage] <= call.budget
    if fits and all(call.ready.is_set(l.index) for l in call.stages[nxt.stage].layers):
        call.prefetched[nxt.action.key] = _upload(call, nxt.stage, backend, prefetch=True)


def _stage_input(call: _Call, s: int, m: int, backend: Backend) -> Tuple[tuple, dict]:
    if s == 0:
        args, kwargs = call.chunks[m]
        if call.cast_dtype is not None:
            dtype = call.cast_dtype
            args, kwargs = pytree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                else x, (args, kwargs))
    else:
        prev = call.slots[(s - 1, m)]
        args, kwargs = (prev.out,), {}
        prev.out = None
        return backend.to_device((args, kwargs), after=prev.handoff)
    return backend.to_device((args, kwargs))


def _chain_in(call: _Call, s: int, m: int) -> Optional[RNGState]:
    if call.rng_starts is None:
        return None
    return call.rng_starts[m] if s == 0 else call.slots[(s - 1, m)].rng_end


def _run_stage(call: _Call, stage: _Stage, inp: Tuple[tuple, dict], m: int,
               phase: str, backend: Backend) -> Any:
    args, kwargs = inp
    x: Any = None
    resident = call.resident.get(stage.index)
    for i, layer in enumerate(stage.layers):
        try:
            if i == 0:
                x = backend.call_layer(layer.module, args, kwargs, resident)
            else:
                x = backend.call_layer(layer.module, (x,), {}, resident)
        except _NOT_LAYER_ERRORS:
            raise
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            add_note(exc, _where(call, stage.index, m, phase, layer))
            raise
    return x


def _stage_forward(call: _Call, s: int, m: int, inp: Tuple[tuple, dict], backend: Backend,
                   checkpointed: bool) -> Tuple[Any, Any]:
    """Stage ``s`` forward of microbatch ``m`` (after its params are ready) under the call's
    autocast and the stage's RNG chain state; in training, ``loss_fn`` after the last stage,
    in the same state. Returns (output, loss or None). Grad mode is the caller's."""
    stage, slot = call.stages[s], call.slots[(s, m)]
    for layer in stage.layers:
        call.ready.wait(layer.index)
    chain_in = _chain_in(call, s, m)
    start = chain_in if call.stage_rng[s] else None
    slot.rng_start = start
    loss = None
    with autocast_context(call.autocast), rng_scope(start, backend) as r:
        if checkpointed:
            out = _checkpointed_stage(call, stage, inp, m, slot, backend)
        else:
            out = _run_stage(call, stage, inp, m, "forward", backend)
        if call.training and s == len(call.stages) - 1:
            try:
                loss = call.loss_fn(out, backend.to_device(call.labels[m]))
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                add_note(exc, _where(call, s, m, "loss_fn", None))
                raise
    slot.rng_end = r.end if start is not None else chain_in
    call.stage_drew[s] = call.stage_drew[s] or r.drew
    return out, loss


def _check_loss(call: _Call, m: int, loss: Any) -> torch.Tensor:
    s = len(call.stages) - 1
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        exc: Exception = ValueError(
            f"loss_fn must return a single-element tensor (a scalar loss), got {what}; "
            f"reduce it, e.g. with .mean() or .sum()")
        add_note(exc, _where(call, s, m, "loss_fn", None))
        raise exc
    if not loss.requires_grad:
        exc = RuntimeError("the loss does not require grad: no parameter is trainable "
                           "and no input requires grad, so there is nothing to train")
        add_note(exc, _where(call, s, m, "loss_fn", None))
        raise exc
    return loss


def _finish_microbatch(call: _Call, m: int, loss: torch.Tensor, out: Any) -> None:
    call.losses[m] = loss.detach().reshape(())
    if call.return_outputs:
        call.outputs[m] = _detach(out)


def _stage0_input(call: _Call, m: int, backend: Backend
                  ) -> Tuple[List[Any], Tuple[tuple, dict]]:
    """Microbatch ``m``'s input to stage 0 in training, the caller's inputs that require grad
    cut into leaves of the call's graph (their grads end in ``slots[(0, m)].grad_in``)."""
    inp = _stage_input(call, 0, m, backend)
    if not call.input_grad:
        return [], inp
    call.input_origins[m], in_leaves, inp = _cut_graph(inp, _requires_grad)
    return in_leaves, inp


def _forward_action(call: _Call, a: Action, backend: Backend) -> None:
    s, m = a.stage, a.mb_index
    if not call.training:
        inp = _stage_input(call, s, m, backend)
        with torch.inference_mode(call.inference_mode), \
                torch.set_grad_enabled(call.grad_enabled):
            out, _ = _stage_forward(call, s, m, inp, backend, checkpointed=False)
        if s == len(call.stages) - 1:
            call.outputs[m] = out
        else:
            call.slots[(s, m)].out = out
        return
    if s > 0:  # every floating input: the previous stage needs its gradient
        _, in_leaves, inp = _cut_graph(_stage_input(call, s, m, backend), _is_float)
    else:
        in_leaves, inp = _stage0_input(call, m, backend)
    with torch.enable_grad():
        out, loss = _stage_forward(
            call, s, m, inp, backend,
            checkpointed=a.kind is ActionKind.FORWARD and call.recompute)
        if a.kind is ActionKind.FORWARD:  # keep the (checkpointed) graph for BACKWARD
            slot = call.slots[(s, m)]
            slot.graph_in = in_leaves
            slot.graph_out = _leaves(out)
            slot.out = _detach(out)
            return
        loss = _check_loss(call, m, loss)
        _grad_and_move(call, s, m, [loss], [torch.ones_like(loss)], in_leaves, backend)
    _finish_microbatch(call, m, loss, out)


def _streamed_forward_action(call: _Call, a: Action, backend: Backend) -> None:
    """FORWARD of a stage-major plan with recompute (see [Note: streaming] in schedule.py):
    no graph is kept, only the stage input; the BACKWARD action re-runs the stage on its own
    upload and takes the gradients there."""
    s, m = a.stage, a.mb_index
    if s > 0:
        inp = _stage_input(call, s, m, backend)
    else:
        _, inp = _stage0_input(call, m, backend)
    with torch.no_grad():
        out, _ = _stage_forward(call, s, m, inp, backend, checkpointed=False)
    slot = call.slots[(s, m)]
    nbytes = _device_bytes(inp, backend) if call.budget is not None else 0
    if call.offload or (call.budget is not None and call.saved_bytes[a.device] + nbytes
                        + call.reserve[a.device] > call.budget):
        # The backward pass brings it back (see [Note: streaming]).
        slot.saved_input, slot.saved_ready = backend.offload(inp)
    else:
        slot.saved_input, slot.saved_bytes = inp, nbytes
        call.saved_bytes[a.device] += nbytes
    slot.out = out


def _device_bytes(tree: Any, backend: Backend) -> int:
    return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(tree)
               if isinstance(x, torch.Tensor) and x.device == backend.torch_device)


def _recompute_backward_action(call: _Call, a: Action, backend: Backend) -> None:
    """BACKWARD of a stage-major plan with recompute: re-run the stage from its saved input
    under the forward's autocast and RNG start state, on this run's upload, then take the
    gradients. It runs on the worker, not inside autograd."""
    s, m = a.stage, a.mb_index
    after, slot = call.slots[(s + 1, m)], call.slots[(s, m)]
    grads_out, after.grad_in = backend.to_device(after.grad_in, after=after.handoff), None
    inp, slot.saved_input = slot.saved_input, None
    call.saved_bytes[a.device] -= slot.saved_bytes
    slot.saved_bytes = 0
    if slot.saved_ready is not None:
        inp, slot.saved_ready = backend.reload(inp, slot.saved_ready), None
    _, in_leaves, inp = _cut_graph(inp, _requires_grad if s == 0 else _is_float)
    slot.phase = "recompute"
    with torch.enable_grad():
        with autocast_context(call.autocast), rng_scope(slot.rng_start, backend):
            out = _run_stage(call, call.stages[s], inp, m, "recompute", backend)
        _backward_from(call, s, m, _leaves(out), grads_out, in_leaves, backend)


def _microbatch_action(call: _Call, a: Action, backend: Backend) -> None:
    """A fused plan's MICROBATCH(m): see [Note: fused stages]."""
    m, last = a.mb_index, len(call.stages) - 1
    in_leaves, inp = _stage0_input(call, m, backend)
    with torch.enable_grad():
        for s in range(last + 1):
            out, loss = _stage_forward(call, s, m, inp, backend,
                                            checkpointed=call.recompute and s < last)
            inp = ((out,), {})
        loss = _check_loss(call, m, loss)
        for s in range(last):
            call.slots[(s, m)].phase = "recompute"
        sink = call.grad_sink
        wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        with _recompute_guard(call, call.stages), call.sink_slot.catching(sink):
            try:
                torch.autograd.backward([loss], [torch.ones_like(loss)],
                                        inputs=wrt + sink.params)
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                if not _has_location(exc):  # a recompute error already says where it was
                    add_note(exc, _where(call, None, m, "backward", None))
                raise
    if in_leaves:
        call.slots[(0, m)].grad_in = [sink.input_grad(x) for x in in_leaves]
    if m == call.plan.num_microbatch - 1:
        _launch_moves(call, range(last + 1), backend)
    _finish_microbatch(call, m, loss, out)


def _backward_action(call: _Call, a: Action, backend: Backend) -> None:
    s, m = a.stage, a.mb_index
    after = call.slots[(s + 1, m)]
    # Stage s+1 may have run on another device: its input grads come over to this one.
    grads_out, after.grad_in = backend.to_device(after.grad_in, after=after.handoff), None
    with _recompute_guard(call, [call.stages[s]]):
        _backward_body(call, a, backend, grads_out)


def _backward_body(call: _Call, a: Action, backend: Backend, grads_out: List[Any]) -> None:
    s, m = a.stage, a.mb_index
    slot = call.slots[(s, m)]
    in_leaves, out_leaves = slot.graph_in, slot.graph_out
    slot.graph_in = slot.graph_out = None
    slot.phase = "recompute"  # autograd may re-run the stage now (see [Note: recompute])
    with torch.enable_grad():
        _backward_from(call, s, m, out_leaves, grads_out, in_leaves, backend)


def _backward_from(call: _Call, s: int, m: int, out_leaves: List[Any], grads_out: List[Any],
                   in_leaves: List[Any], backend: Backend) -> None:
    """Stage ``s``'s backward of microbatch ``m`` from its output leaves and the input grads
    stage ``s + 1`` returned for them."""
    if len(out_leaves) != len(grads_out):
        raise AssertionError(f"stage {s} has {len(out_leaves)} outputs but stage {s + 1} "
                             f"returned {len(grads_out)} input grads; please report")
    pairs = [(o, g) for o, g in zip(out_leaves, grads_out)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    _grad_and_move(call, s, m, [o for o, _ in pairs], [g for _, g in pairs], in_leaves, backend)


def _checkpointed_stage(call: _Call, stage: _Stage, inp: Tuple[tuple, dict], m: int,
                        slot: _Slot, backend: Backend) -> Any:
    """The stage forward under non-reentrant ``torch.utils.checkpoint`` (see
    [Note: recompute]); ``slot.phase`` names the pass in error notes."""
    args, kwargs = inp
    values = tuple(args) + (kwargs,) if kwargs else tuple(args)

    def run(*flat: Any) -> Any:
        # Stage kwargs travel as one trailing positional dict: none meets checkpoint's own.
        a, kw = (flat[:-1], flat[-1]) if kwargs else (flat, {})
        return _run_stage(call, stage, (a, kw), m, slot.phase, backend)

    def contexts() -> Tuple[Any, Any]:
        # Forward: already inside the stage's RNG scope. Recompute: the same start state.
        return contextlib.nullcontext(), rng_scope(slot.rng_start, backend)

    return checkpoint(run, *values, use_reentrant=False, preserve_rng_state=False,
                      context_fn=contexts)


def _grad_and_move(call: _Call, s: int, m: int, outputs: List[torch.Tensor],
                   grad_outputs: List[torch.Tensor], in_leaves: List[Any],
                   backend: Backend) -> None:
    """autograd.grad of ``outputs`` w.r.t. the stage input leaves and trainable params;
    stores the input grads for stage s-1 and sums the param grads into the stage's buffers
    (see [Note: gradient accumulation] in grads.py)."""
    params = call.stage_params[s]
    wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    resident = call.resident.get(s)
    # On an accelerator the gradients are taken w.r.t. the stage's device copies and summed
    # on the device (see [Note: streaming] in schedule.py).
    targets = resident.leaves if resident is not None else [rec.param for rec in params]
    inputs = wrt + targets
    if outputs and inputs:
        try:
            grads = list(torch.autograd.grad(outputs, inputs, grad_outputs,
                                             allow_unused=True))
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            if not _has_location(exc):  # a recompute error already says where it was
                add_note(exc, _where(call, s, m, "backward", None))
            raise
    else:
        grads = [None] * len(inputs)
    if in_leaves:
        by_id = {id(x): g for x, g in zip(wrt, grads[:len(wrt)])}
        call.slots[(s, m)].grad_in = [by_id.get(id(x)) if isinstance(x, torch.Tensor)
                                      else None for x in in_leaves]
    param_grads = grads[len(wrt):]
    # See [Note: gradient accumulation] in grads.py.
    buffers = call.grad_buffers[s]
    shared = _storage_counts(grads[:len(wrt)] + list(param_grads) + list(grad_outputs))
    for i, (rec, g) in enumerate(zip(params, param_grads)):
        if g is not None:
            # Adopted only if no other gradient or grad_output of this autograd call shares
            # its storage (autograd may pass a grad_output through unchanged).
            alone = shared[g.untyped_storage().data_ptr()] == 1
            _sum_into(buffers, i, g, rec.master, alone, call.grad_dtype)
    if m == call.plan.num_microbatch - 1:
        _launch_moves(call, [s], backend)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _detach(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):  # the common stage output; no tree walk
        return tree.detach()
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _leaves(tree: Any) -> List[Any]:
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


def _where(call: _Call, stage: Optional[int], mb_index: int, phase: str,
           layer: Optional[_Layer]) -> str:
    """Where an error happened, for its note; ``stage`` None: the fused backward of all."""
    at = f"stage {stage}" if stage is not None else "all stages"
    if layer is not None:
        at += f", {layer.describe()}"
    return f"[roundpipe{call.tag} {at}, microbatch {mb_index}, {phase}]"


def _has_location(exc: BaseException) -> bool:
    return any(str(n).startswith("[roundpipe") for n in getattr(exc, "__notes__", ()))


def _wait_uninterrupted(futures: List[Future]) -> None:
    """Wait for every future, through repeated Ctrl-C too: once a call is cancelled its running
    actions end soon, and the caller re-raises the first interrupt afterwards."""
    for fut in futures:
        while True:
            try:
                fut.exception()
                break
            except KeyboardInterrupt:
                continue


@contextlib.contextmanager
def _recompute_guard(call: _Call, stages: Sequence[_Stage]) -> Iterator[None]:
    """Around a backward that recomputes ``stages``: their forward already updated their
    buffers (BatchNorm running stats) and the recompute must not update them a second time.
    Restored after the backward, which may still read them."""
    buffers = ([b for stage in stages for layer in stage.layers for b in layer.module.buffers()]
               if call.recompute else [])
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


def _cut_graph(inp: Tuple[tuple, dict], wants_grad: Callable[[torch.Tensor], bool]
               ) -> Tuple[List[Any], List[Any], Tuple[tuple, dict]]:
    """Make each tensor of a stage input that ``wants_grad`` a fresh leaf that requires grad, so
    the stage's own graph ends there. Returns (each leaf as it was, None where not cut; the new
    leaves; the new input)."""
    args, kwargs = inp
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # no tree walk
        x = args[0]
        if not wants_grad(x):
            return [None], [x], inp
        leaf = x.detach().requires_grad_()
        return [x], [leaf], ((leaf,), {})
    leaves, spec = pytree.tree_flatten(inp)
    origins = [x if isinstance(x, torch.Tensor) and wants_grad(x) else None for x in leaves]
    leaves = [x.detach().requires_grad_() if o is not None else x
              for x, o in zip(leaves, origins)]
    return origins, leaves, pytree.tree_unflatten(leaves, spec)


def _requires_grad(x: torch.Tensor) -> bool:
    return x.requires_grad


def _backward_to_inputs(call: _Call) -> None:
    """Main thread, after the workers: hand the stage-0 input grads to autograd, which
    accumulates them into the inputs' ``.grad`` (and on into whatever graph produced them)."""
    tensors, grads = [], []
    for m, origins in enumerate(call.input_origins):
        grad_in = call.slots[(0, m)].grad_in or []
        for origin, g in zip(origins or [], grad_in):
            if origin is not None and g is not None:
                tensors.append(origin)
                grads.append(g)
    if tensors:
        torch.autograd.backward(tensors, grads)
