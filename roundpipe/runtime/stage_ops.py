"""The stage bodies: what a compute action of a plan does on its worker (a stage forward, its
recompute and backward, ``loss_fn``, a fused microbatch), under the call's autocast and the
stage's RNG chain state (:func:`compute_action`). The gradients they take
go to :mod:`roundpipe.runtime.grad_router`.

Threads: every function here runs on the action's device worker and touches only its own slot,
the slots of the actions it depends on, and the stage's low-precision parameters (read only,
after the stage's "params ready" event).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as checkpoint_module
from torch.utils.checkpoint import checkpoint

from roundpipe.autocast import autocast_context
from roundpipe.devices import Backend, StreamingBackend, get_worker
from roundpipe.microbatch import MicrobatchInfo
from roundpipe.microbatch_context import WithContext
from roundpipe.plan import Action, ActionKind
from roundpipe.runtime.call import CallSpec, CallState, Cancelled, Slot
from roundpipe.runtime.params import ParamsCopyFailed
from roundpipe.runtime.rng import RNGState, rng_scope
from roundpipe.runtime.stages import Layer, Stage
from roundpipe.threads.workers import add_note

__all__ = ["ComputeFn", "backward_to_inputs", "compute_action", "where"]


# [Note: recompute]
# With recompute on (the default), a CPU pool's FORWARD action runs its stage under
# non-reentrant torch.utils.checkpoint: the graph it keeps holds the stage input and no
# activation. The BACKWARD action's autograd.grad re-runs the stage forward when it first
# unpacks a saved tensor, under the forward's autocast state (captured by checkpoint) and, for a
# stage in an RNG chain, under its start state (an rng_scope as checkpoint's recompute context,
# holding RNG_LOCK for the re-run only; checkpoint's own RNG handling is off, since it would set
# the global generator without the lock). checkpoint stops the re-run as soon as every saved
# tensor is back; saved tensors are packed before an op computes, so the last ops of a stage (a
# whole Linear stage) are not computed again. On an accelerator the FORWARD keeps no graph at
# all, only the stage input, and the BACKWARD action re-runs the stage itself, on its worker,
# from that input and on its run's upload, under the same autocast and RNG start state.


# [Note: fused stages]
# With one device there is nothing to overlap, and the per-stage actions only cost: each
# BACKWARD is its own autograd call, and each action its own future. A training plan on one CPU
# worker therefore has one MICROBATCH(m) action per microbatch: every stage forward (each under
# its RNG chain state, and under checkpoint with recompute on, so the memory is the same),
# loss_fn, then one backward through all stages, as plain PyTorch runs a microbatch. Its
# parameter gradients leave autograd through AccumulateGrad into the model params' .grad, where
# the grad hooks take them at once (still in cache) into the call's per-stage buffers (a
# GradSink, set on the model's GradHooks); the sum per param is then what the per-stage actions
# compute, so final parameters stay bitwise the same for any number of devices. The one
# exception is a parameter in two stages (tied weights): one backward sums its two gradients of
# a microbatch before the buffer does, in another order than per-stage backwards, so such a
# model keeps the per-stage plan. Error notes of the fused backward name all stages, or the
# stage whose recompute failed.


# checkpoint ends a recompute early by raising this from inside the stage (see
# [Note: recompute]); like the runtime's own signals it passes through without a location note.
_STOP_RECOMPUTE = getattr(checkpoint_module, "_StopRecomputationError", None)
_NOT_LAYER_ERRORS: tuple[type[BaseException], ...] = (Cancelled, ParamsCopyFailed) + (
    (_STOP_RECOMPUTE,) if _STOP_RECOMPUTE is not None else ()
)


def where(spec: CallSpec, stage: int | None, mb_index: int, phase: str, layer: Layer | None) -> str:
    """Where an error happened, for its note; ``stage`` None: the fused backward of all."""
    at = f"stage {stage}" if stage is not None else "all stages"
    if layer is not None:
        at += f", {layer.describe()}"
    return f"[roundpipe{spec.tag} {at}, microbatch {mb_index}, {phase}]"


def _has_location(exc: BaseException) -> bool:
    return any(str(n).startswith("[roundpipe") for n in getattr(exc, "__notes__", ()))


# -- inputs, context, one stage's layers ------------------------------------------------------
def _stage_input(
    spec: CallSpec, state: CallState, s: int, m: int, backend: Backend
) -> tuple[tuple, dict]:
    if s > 0:
        prev = state.slots[(s - 1, m)]
        args, prev.out = (prev.out,), None
        return backend.to_device((args, {}), after=prev.out_ready)
    args, kwargs = spec.chunks[m]
    if spec.cast_dtype is not None:
        dtype = spec.cast_dtype
        args, kwargs = pytree.tree_map(
            lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
            (args, kwargs),
        )
    return backend.to_device((args, kwargs))


def _context(spec: CallSpec, state: CallState, m: int, backend: Backend) -> Any:
    """Microbatch ``m``'s context on ``backend``'s device (moved there once per device, after
    the event of stage 0's forward hand-off; see :mod:`roundpipe.microbatch_context`)."""
    context = state.contexts[m]
    if context is None or not spec.pool.streaming:
        return context
    key = (spec.pool.backends.index(backend), m)
    copy = state.device_contexts.get(key)
    if copy is None:
        copy = state.device_contexts[key] = backend.to_device(
            context, after=state.slots[(0, m)].out_ready
        )
    return copy


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _run_stage(
    spec: CallSpec,
    state: CallState,
    stage: Stage,
    inp: tuple[tuple, dict],
    m: int,
    phase: str,
    backend: Backend,
) -> Any:
    args, kwargs = inp
    x: Any = None
    upload = state.uploads.get(stage.index)
    for i, layer in enumerate(stage.layers):
        try:
            if i == 0 and stage.index == 0:  # the model's first layer: the call's inputs
                x = backend.call_layer(layer.module, args, kwargs, upload, layer.compiled)
                if isinstance(x, WithContext):
                    if phase == "forward":
                        state.contexts[m] = _detached(x.context)
                    x = x.output  # a recompute's context is the forward's
                continue
            if i == 0:  # a later stage's input: the stage before's output
                x = args[0]
            if layer.takes_context:
                x = backend.call_layer(
                    layer.module,
                    (x, _context(spec, state, m, backend)),
                    {},
                    upload,
                    layer.compiled,
                )
            else:
                x = backend.call_layer(layer.module, (x,), {}, upload, layer.compiled)
        except _NOT_LAYER_ERRORS:
            raise
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            add_note(exc, where(spec, stage.index, m, phase, layer))
            raise
    return x


def _chain_in(spec: CallSpec, state: CallState, s: int, m: int) -> RNGState | None:
    starts = spec.rng.starts
    if starts is None:
        return None
    return starts[m] if s == 0 else state.slots[(s - 1, m)].rng_end


def _stage_forward(
    spec: CallSpec,
    state: CallState,
    s: int,
    m: int,
    inp: tuple[tuple, dict],
    backend: Backend,
    checkpointed: bool,
) -> tuple[Any, Any]:
    """Stage ``s`` forward of microbatch ``m`` under the call's autocast and the stage's RNG
    chain state; in training, ``loss_fn`` after the last stage, in the same state. Returns
    (output, loss or None). Grad mode is the caller's. On the CPU it first waits for the stage's
    params (an accelerator plan's W action does, before the upload)."""
    stage, slot = spec.stages[s], state.slots[(s, m)]
    if not spec.plan.stage_major:
        for layer in stage.layers:
            spec.ready.wait(layer.index)
    chain_in = _chain_in(spec, state, s, m)
    start = chain_in if spec.rng.stage_rng[s] else None
    slot.rng_start = start
    loss = None
    with autocast_context(spec.autocast), rng_scope(start, backend) as r:
        if checkpointed:
            out = _checkpointed_stage(spec, state, stage, inp, m, slot, backend)
        else:
            out = _run_stage(spec, state, stage, inp, m, "forward", backend)
        if spec.training and s == len(spec.stages) - 1:
            assert spec.loss_fn is not None
            try:
                label = backend.to_device(spec.labels[m])
                if spec.loss_takes_microbatch:
                    info = MicrobatchInfo(m, spec.sizes[m], sum(spec.sizes), len(spec.sizes))
                    loss = spec.loss_fn(out, label, info)
                else:
                    loss = spec.loss_fn(out, label)
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                add_note(exc, where(spec, s, m, "loss_fn", None))
                raise
    slot.rng_end = r.end if start is not None else chain_in
    state.stage_drew[s] = state.stage_drew[s] or r.drew
    return out, loss


def _checkpointed_stage(
    spec: CallSpec,
    state: CallState,
    stage: Stage,
    inp: tuple[tuple, dict],
    m: int,
    slot: Slot,
    backend: Backend,
) -> Any:
    """The stage forward under non-reentrant ``torch.utils.checkpoint`` (see
    [Note: recompute]); ``slot.phase`` names the pass in error notes."""
    args, kwargs = inp
    values = tuple(args) + (kwargs,) if kwargs else tuple(args)

    def run(*flat: Any) -> Any:
        # Stage kwargs travel as one trailing positional dict: none meets checkpoint's own.
        a, kw = (flat[:-1], flat[-1]) if kwargs else (flat, {})
        return _run_stage(spec, state, stage, (a, kw), m, slot.phase, backend)

    def contexts() -> tuple[Any, Any]:
        # Forward: already inside the stage's RNG scope. Recompute: the same start state.
        return contextlib.nullcontext(), rng_scope(slot.rng_start, backend)

    return checkpoint(
        run, *values, use_reentrant=False, preserve_rng_state=False, context_fn=contexts
    )


def _check_loss(spec: CallSpec, m: int, loss: Any) -> torch.Tensor:
    s = len(spec.stages) - 1
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        exc: Exception = ValueError(
            f"loss_fn must return a single-element tensor (a scalar loss), got {what}; "
            f"reduce it, e.g. with .mean() or .sum()"
        )
        add_note(exc, where(spec, s, m, "loss_fn", None))
        raise exc
    if not loss.requires_grad:
        exc = RuntimeError(
            "the loss does not require grad: no parameter is trainable "
            "and no input requires grad, so there is nothing to train"
        )
        add_note(exc, where(spec, s, m, "loss_fn", None))
        raise exc
    return loss


def _finish_microbatch(
    spec: CallSpec, state: CallState, m: int, loss: torch.Tensor, out: Any
) -> None:
    state.losses[m] = loss.detach().reshape(())
    if spec.return_outputs:
        state.outputs[m] = _detach(out)


def _stage0_input(
    spec: CallSpec, state: CallState, m: int, backend: Backend
) -> tuple[list[Any], tuple[tuple, dict]]:
    """Microbatch ``m``'s input to stage 0 in training, the caller's inputs that require grad
    cut into leaves of the call's graph (their grads end in ``slots[(0, m)].grad_in``)."""
    inp = _stage_input(spec, state, 0, m, backend)
    if not spec.input_grad:
        return [], inp
    state.input_origins[m], in_leaves, inp = _cut_graph(inp, _requires_grad)
    return in_leaves, inp


# -- the compute actions ----------------------------------------------------------------------
def _forward(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    """FORWARD (inference, a CPU pool's training, or training without recompute) and LAST."""
    s, m = a.stage, a.mb_index
    _adopt(spec, state, s, backend)
    if not spec.training:
        inp = _stage_input(spec, state, s, m, backend)
        with torch.inference_mode(spec.inference_mode), torch.set_grad_enabled(spec.grad_enabled):
            out, _ = _stage_forward(spec, state, s, m, inp, backend, checkpointed=False)
        if s == len(spec.stages) - 1:
            state.outputs[m] = out
        else:
            state.slots[(s, m)].out = out
        return
    if s > 0:  # every floating input: the previous stage needs its gradient
        _, in_leaves, inp = _cut_graph(_stage_input(spec, state, s, m, backend), _is_float)
    else:
        in_leaves, inp = _stage0_input(spec, state, m, backend)
    with torch.enable_grad():
        out, loss = _stage_forward(
            spec,
            state,
            s,
            m,
            inp,
            backend,
            checkpointed=a.kind is ActionKind.FORWARD and spec.recompute,
        )
        if a.kind is ActionKind.FORWARD:  # keep the (checkpointed) graph for BACKWARD
            slot = state.slots[(s, m)]
            slot.graph_in = in_leaves
            slot.graph_out = _leaves(out)
            slot.out = _detach(out)
            return
        loss = _check_loss(spec, m, loss)
        _grads(spec, state, s, m, [loss], [torch.ones_like(loss)], in_leaves, backend)
    _finish_microbatch(spec, state, m, loss, out)


def _streamed_forward(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    """FORWARD of an accelerator plan with recompute (see [Note: recompute]): no graph is kept,
    only the stage input, which the plan may offload (O) and reload (I) before the BACKWARD
    re-runs the stage on its own upload."""
    s, m = a.stage, a.mb_index
    _adopt(spec, state, s, backend)
    if s > 0:
        inp = _stage_input(spec, state, s, m, backend)
    else:
        _, inp = _stage0_input(spec, state, m, backend)
    with torch.no_grad():
        out, _ = _stage_forward(spec, state, s, m, inp, backend, checkpointed=False)
    slot = state.slots[(s, m)]
    slot.saved_input, slot.out = inp, out


# [Note: overlapped recompute]
# On an accelerator the backward of stage s for microbatch m is two halves that the host issues
# one after the other: the worker re-runs the stage (the forward's ops, with grad), then
# autograd's device thread issues the backward's ops while the worker waits. Where the host's
# issue path bounds the iteration (a fast GPU, small microbatches: benchmarks/results/gpu.md)
# the device idles through part of both. With RoundPipeRunConfig(overlap_recompute=True),
# BACKWARD(s, m) first hands the same stage's recompute of microbatch m+1 to the device's
# helper thread and then takes its own gradients, so the two threads issue at once;
# BACKWARD(s, m+1) takes the graph made ahead (and re-raises the helper's error as its own).
# Only where the device's next compute action is BACKWARD(s, m+1), with its input already on
# the device (Plan.overlapped_recomputes, which the memory plan counts: the graph made ahead is
# held until its backward), and only for a stage outside the RNG chain (a backward's own
# recomputes, checkpointed MLP tiles, may set the device's generator, which a stage that draws
# random numbers reads) with no module that runs again inside its backward
# (``_roundpipe_runs_in_backward``, as roundpipe.hf.tiling's tiled MLPs: the tile's recompute
# swaps the stage's tensors into the module, which the helper's recompute may be running).
# Both threads enqueue on the compute stream; what the two halves share is the stage's upload,
# which both only read. A program that stops (a failure, a cancel) first waits for what it
# handed to the helper, so nothing of the call runs after it ended.


def _recompute(
    spec: CallSpec, state: CallState, s: int, m: int, backend: Backend
) -> tuple[Any, list[Any]]:
    """Re-run stage ``s`` of microbatch ``m`` from its saved input under the forward's autocast
    and RNG start state, on this run's upload, with grad: (output, input leaves)."""
    slot = state.slots[(s, m)]
    inp, slot.saved_input = slot.saved_input, None
    _, in_leaves, inp = _cut_graph(inp, _requires_grad if s == 0 else _is_float)
    slot.phase = "recompute"
    with torch.enable_grad():
        with autocast_context(spec.autocast), rng_scope(slot.rng_start, backend):
            out = _run_stage(spec, state, spec.stages[s], inp, m, "recompute", backend)
    return out, in_leaves


def _recompute_ahead(
    spec: CallSpec, state: CallState, s: int, m: int, backend: Backend
) -> tuple[Any, list[Any]]:
    """The helper thread: :func:`_recompute` on the device and compute stream the worker uses."""
    with backend.action_context():
        return _recompute(spec, state, s, m, backend)


def _recompute_backward(
    spec: CallSpec,
    state: CallState,
    a: Action,
    backend: Backend,
    ahead: frozenset[tuple[int, int]] = frozenset(),
) -> None:
    """BACKWARD of an accelerator plan with recompute: re-run the stage (or take the recompute
    made ahead, see [Note: overlapped recompute]), then take the gradients. It runs on the
    worker, not inside autograd. ``ahead``: the (stage, microbatch) during whose backward the
    next microbatch's recompute runs on the helper thread."""
    s, m = a.stage, a.mb_index
    _adopt(spec, state, s, backend)
    after = state.slots[(s + 1, m)]
    grads_out, after.grad_in = backend.to_device(after.grad_in, after=after.grad_ready), None
    made_ahead = state.ahead.setdefault(a.device, {})  # this worker's own
    made = made_ahead.pop((s, m), None)
    out, in_leaves = made.result() if made is not None else _recompute(spec, state, s, m, backend)
    if (s, m) in ahead:
        helper = get_worker(backend.device, "recompute")  # type: ignore[attr-defined]
        made_ahead[(s, m + 1)] = helper.submit(_recompute_ahead, spec, state, s, m + 1, backend)
    with torch.enable_grad():
        _backward_from(spec, state, s, m, _leaves(out), grads_out, in_leaves, backend)


def wait_ahead(state: CallState, d: int) -> None:
    """Device ``d``'s worker, as its program stops: wait for the recomputes it handed to the
    helper thread and drop them (an error of theirs belongs to an action that will not run)."""
    made_ahead = state.ahead.get(d, {})
    while made_ahead:
        made_ahead.popitem()[1].exception()


def _backward(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    """BACKWARD through the graph the FORWARD kept (checkpointed on the CPU, see
    [Note: recompute]; whole without recompute)."""
    s, m = a.stage, a.mb_index
    _adopt(spec, state, s, backend)
    after = state.slots[(s + 1, m)]
    # Stage s+1 may have run on another device: its input grads come over to this one.
    grads_out, after.grad_in = backend.to_device(after.grad_in, after=after.grad_ready), None
    slot = state.slots[(s, m)]
    in_leaves, out_leaves = slot.graph_in, slot.graph_out
    slot.graph_in = slot.graph_out = None
    with _recompute_guard(spec, [spec.stages[s]]):
        slot.phase = "recompute"  # autograd may re-run the stage now (see [Note: recompute])
        with torch.enable_grad():
            _backward_from(spec, state, s, m, out_leaves, grads_out, in_leaves, backend)


def _microbatch(spec: CallSpec, state: CallState, a: Action, backend: Backend) -> None:
    """A fused plan's MICROBATCH(m): see [Note: fused stages]."""
    m, last = a.mb_index, len(spec.stages) - 1
    in_leaves, inp = _stage0_input(spec, state, m, backend)
    with torch.enable_grad():
        for s in range(last + 1):
            out, loss = _stage_forward(
                spec, state, s, m, inp, backend, checkpointed=spec.recompute and s < last
            )
            inp = ((out,), {})
        loss = _check_loss(spec, m, loss)
        for s in range(last):
            state.slots[(s, m)].phase = "recompute"
        sink = state.sink
        assert sink is not None
        wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        with _recompute_guard(spec, spec.stages), spec.hooks.catching(sink):
            try:
                torch.autograd.backward([loss], [torch.ones_like(loss)], inputs=wrt + sink.params)
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                if not _has_location(exc):  # a recompute error already says where it was
                    add_note(exc, where(spec, None, m, "backward", None))
                raise
    if in_leaves:
        state.slots[(0, m)].grad_in = [sink.input_grad(x) for x in in_leaves]
    if m == spec.plan.num_microbatch - 1:
        state.grads.move(range(last + 1))
    _finish_microbatch(spec, state, m, loss, out)


def _backward_from(
    spec: CallSpec,
    state: CallState,
    s: int,
    m: int,
    out_leaves: list[Any],
    grads_out: list[Any],
    in_leaves: list[Any],
    backend: Backend,
) -> None:
    """Stage ``s``'s backward of microbatch ``m`` from its output leaves and the input grads
    stage ``s + 1`` returned for them."""
    if len(out_leaves) != len(grads_out):
        raise AssertionError(
            f"stage {s} has {len(out_leaves)} outputs but stage {s + 1} "
            f"returned {len(grads_out)} input grads; please report"
        )
    pairs = [
        (o, g)
        for o, g in zip(out_leaves, grads_out)
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
    ]
    _grads(spec, state, s, m, [o for o, _ in pairs], [g for _, g in pairs], in_leaves, backend)


def _grads(
    spec: CallSpec,
    state: CallState,
    s: int,
    m: int,
    outputs: list[torch.Tensor],
    grad_outputs: list[torch.Tensor],
    in_leaves: list[Any],
    backend: Backend,
) -> None:
    """autograd.grad of ``outputs`` w.r.t. the stage input leaves and trainable params; stores
    the input grads for stage s-1 and sums the param grads into the stage's buffers (see
    [Note: gradient accumulation] in grad_router.py)."""
    params = spec.stage_params[s]
    wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    upload = state.uploads.get(s)
    # On an accelerator the gradients are taken w.r.t. the stage's device copies and summed on
    # the device (see [Note: streaming]).
    targets: list[torch.Tensor] = (
        upload.leaves
        if upload is not None and upload.leaves is not None
        else [rec.param for rec in params]
    )
    inputs = wrt + targets
    grads: list[torch.Tensor | None]
    if outputs and inputs:
        try:
            grads = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
            if not _has_location(exc):  # a recompute error already says where it was
                add_note(exc, where(spec, s, m, "backward", None))
            raise
    else:
        grads = [None] * len(inputs)
    if in_leaves:
        by_id = {id(x): g for x, g in zip(wrt, grads[: len(wrt)])}
        state.slots[(s, m)].grad_in = [
            by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in in_leaves
        ]
    state.grads.add(s, grads[len(wrt) :], grads[: len(wrt)] + list(grad_outputs))
    if not spec.plan.stage_major and m == spec.plan.num_microbatch - 1:
        state.grads.move([s])  # an accelerator plan's D action moves them


def _adopt(spec: CallSpec, state: CallState, s: int, backend: Backend) -> None:
    """An accelerator's compute stream orders itself after a prefetch of the stage's upload
    before first reading it (a no-op afterwards, and on the CPU)."""
    upload = state.uploads.get(s)
    if upload is not None:
        streaming: StreamingBackend = backend  # type: ignore[assignment]
        streaming.adopt(upload)


ComputeFn = Callable[[CallSpec, CallState, Action, Backend], None]


def compute_action(spec: CallSpec, kind: ActionKind) -> ComputeFn:
    """The body of a compute action of ``kind`` in ``spec``'s call: an accelerator pool's
    training with recompute keeps no graph and re-runs the stage itself (see
    [Note: recompute])."""
    streamed = spec.pool.streaming and spec.recompute and spec.training
    if kind is ActionKind.MICROBATCH:
        return _microbatch
    if kind is ActionKind.FORWARD:
        return _streamed_forward if streamed else _forward
    if kind is ActionKind.LAST:
        return _forward
    if not streamed:
        return _backward
    pairs = spec.plan.overlapped_recomputes()
    kept = {
        s
        for s in {s for s, _ in pairs}
        if not spec.rng.stage_rng[s] and not _runs_in_backward(spec.stages[s])
    }
    ahead = frozenset((s, m) for s, m in pairs if s in kept)
    if not ahead:
        return _recompute_backward
    return functools.partial(_recompute_backward, ahead=ahead)


# -- helpers ----------------------------------------------------------------------------------
def _runs_in_backward(stage: Stage) -> bool:
    """Whether a module of ``stage`` runs again inside the stage's backward (see
    [Note: overlapped recompute])."""
    return any(
        getattr(sub, "_roundpipe_runs_in_backward", False)
        for module in stage.modules
        for sub in module.modules()
    )


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _requires_grad(x: torch.Tensor) -> bool:
    return x.requires_grad


def _detach(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):  # the common stage output; no tree walk
        return tree.detach()
    return _detached(tree)


def _leaves(tree: Any) -> list[Any]:
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


@contextlib.contextmanager
def _recompute_guard(spec: CallSpec, stages: Sequence[Stage]) -> Iterator[None]:
    """Around a backward that recomputes ``stages``: their forward already updated their
    buffers (BatchNorm running stats) and the recompute must not update them a second time.
    Restored after the backward, which may still read them."""
    buffers = (
        [b for stage in stages for module in stage.modules for b in module.buffers()]
        if spec.recompute
        else []
    )
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


def _cut_graph(
    inp: tuple[tuple, dict], wants_grad: Callable[[torch.Tensor], bool]
) -> tuple[list[Any], list[Any], tuple[tuple, dict]]:
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
    leaves = [x.detach().requires_grad_() if o is not None else x for x, o in zip(leaves, origins)]
    return origins, leaves, pytree.tree_unflatten(leaves, spec)


def backward_to_inputs(state: CallState) -> None:
    """Main thread, after the workers: hand the stage-0 input grads to autograd, which
    accumulates them into the inputs' ``.grad`` (and on into whatever graph produced them)."""
    tensors, grads = [], []
    for m, origins in enumerate(state.input_origins):
        grad_in = state.slots[(0, m)].grad_in or []
        for origin, g in zip(origins or [], grad_in):
            if origin is not None and g is not None:
                tensors.append(origin)
                grads.append(g)
    if tensors:
        torch.autograd.backward(tensors, grads)
