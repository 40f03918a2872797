"""One call's state: :class:`_Call` (what a ``forward``/``forward_backward`` call shares between
the main thread and the device workers) and its per (stage, microbatch) :class:`_Slot`, how a call
is prepared from its inputs and run config (:func:`_prepare_call`), and the RNG chain bookkeeping
around it (which stages draw random numbers, the global RNG state left afterwards; see
[Note: RNG chains] in :mod:`roundpipe.autocast`), and, on an accelerator, each device's first
upload, queued ahead of the call's actions (:func:`_start_first_uploads`).

Threads: the main thread builds a call and reads it after the workers finish; in between each
slot is written by one action and read by its dependents after that action's future is done.
A first upload runs on its device's worker while the main thread submits the actions; it reads
only what the call was built with (stages, their params, the "params ready" events) and hands
its upload over through its future.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from roundpipe.autocast import (AutocastState, RNGState, chain_starts, resolve_autocast,
                                restore_global, uses_rng)
from roundpipe.devices import Backend, DevicePool, Future, Resident, StreamingBackend
from roundpipe.microbatch import split_inputs, split_label
from roundpipe.runtime.config import RoundPipeRunConfig
from roundpipe.runtime.grads import _GradSink, _SinkSlot, _stash_grads
from roundpipe.runtime.params import _ParamRecord, _ParamsReady
from roundpipe.runtime.plan import _Stage
from roundpipe.schedule import Plan, stage_device

if TYPE_CHECKING:
    from roundpipe.runtime.model import RoundPipe

__all__: list = []  # private to roundpipe.runtime


class _Cancelled(Exception):
    """An action skipped because a dependency failed; never reaches the user."""


class _Slot:
    """What one (stage, microbatch) hands to the actions that depend on it."""

    __slots__ = ("phase", "rng_start", "rng_end", "out", "graph_in", "graph_out", "grad_in",
                 "saved_input", "saved_ready", "saved_bytes", "handoff")

    def __init__(self) -> None:
        self.phase = "forward"          # pass of a checkpointed stage, for error notes
        self.rng_start: Optional[RNGState] = None   # chain state the forward started from
        self.rng_end: Optional[RNGState] = None     # chain state for the next stage
        self.out: Any = None            # stage output handed to the next stage
        self.graph_in: Any = None       # input leaves of the stage's graph
        self.graph_out: Any = None      # output leaves with their (checkpointed) graph
        self.grad_in: Any = None        # grads w.r.t. this stage's input leaves (aligned)
        self.saved_input: Any = None    # a streamed forward's stage input, for its recompute
        self.saved_ready: Any = None    # device event: an offloaded saved_input has arrived
        self.saved_bytes = 0            # device bytes of a saved_input kept on the device
        # Device event after the action that wrote ``out`` or ``grad_in`` for an action on
        # another device (see [Note: streaming] in schedule.py); None on the CPU.
        self.handoff: Any = None


@dataclasses.dataclass
class _Call:
    """State of one forward/forward_backward call, shared by main and the workers."""

    tag: str                                   # the model's name, for error notes
    pool: DevicePool
    sink_slot: _SinkSlot  # the model's (see [Note: fused stages] in execute.py)
    plan: Plan
    stages: List[_Stage]
    training: bool
    recompute: bool
    offload: bool                              # saved stage inputs go to the host (streaming)
    budget: Optional[int]                      # device_memory_budget, bytes per device
    grad_dtype: Optional[torch.dtype]          # device_grad_dtype on accelerators, else None
    stage_bytes: List[int]                     # per stage, its upload and gradient sums
    # Per device, the room kept for two stages (the running one and a prefetch) under a budget.
    reserve: Dict[int, int]
    grad_enabled: bool
    inference_mode: bool
    autocast: AutocastState
    chunks: List[Tuple[tuple, dict]]
    sizes: List[int]
    labels: List[Any]
    loss_fn: Optional[Callable]
    return_outputs: bool
    stage_params: List[List[_ParamRecord]]     # per stage, its trainable params
    stage_rng: List[bool]
    stage_drew: List[bool]                     # written by the stage's worker: a generator moved
    rng_probe_keys: List[Optional[Tuple]]      # stages run in the chain only to learn if they draw
    rng_starts: Optional[List[RNGState]]
    rng_after_draw: Optional[RNGState]
    # The generator states of the pool's other devices before the call, restored after it:
    # their stages set them to chain states (see [Note: RNG chains]). Empty on the CPU.
    rng_others: List[Tuple[Backend, Optional[torch.Tensor]]]
    ready: _ParamsReady
    cast_dtype: Optional[torch.dtype]
    input_grad: bool                           # some input requires grad (forward_backward)
    slots: Dict[Tuple[int, int], _Slot] = dataclasses.field(default_factory=dict)
    futures: Dict[Tuple, Future] = dataclasses.field(default_factory=dict)
    losses: List[Any] = dataclasses.field(default_factory=list)
    outputs: List[Any] = dataclasses.field(default_factory=list)
    move_items: List[Any] = dataclasses.field(default_factory=list)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    grad_buffers: List[List[Optional[torch.Tensor]]] = dataclasses.field(default_factory=list)
    # Per microbatch, the stage-0 input leaves as the caller's graph has them (None where no
    # grad is wanted); their grads are in slots[(0, m)].grad_in. Written by stage 0's worker.
    input_origins: List[Any] = dataclasses.field(default_factory=list)
    # A fused plan's (see [Note: fused stages] in execute.py).
    grad_sink: Optional[_GradSink] = None
    # A stage-major plan's uploads, by stage, and uploads prefetched for the action that will
    # use them: written and read by the stage's worker only.
    resident: Dict[int, Resident] = dataclasses.field(default_factory=dict)
    prefetched: Dict[Tuple, Resident] = dataclasses.field(default_factory=dict)
    # Each device's first upload, by the key of the action that adopts it: its future, whose
    # result is the upload (see _start_first_uploads). Written by the main thread before the
    # actions are submitted, then only read.
    first_uploads: Dict[Tuple, Future] = dataclasses.field(default_factory=dict)
    # Per device, the bytes of the saved stage inputs kept on it (device_memory_budget): each
    # entry written by that device's worker only.
    saved_bytes: Dict[int, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    # (param, .grad) a user left on a model param, set aside during a fused call; main thread.
    stashed_grads: List[Tuple[nn.Parameter, torch.Tensor]] = dataclasses.field(
        default_factory=list)


def _prepare_call(model: "RoundPipe", cfg: RoundPipeRunConfig, args: tuple, kwargs: dict,
                  label: Any, loss_fn: Optional[Callable], training: bool, return_outputs: bool,
                  grad_enabled: bool = True) -> _Call:
    """Main thread: split the inputs, pick the stages and plan, set up the RNG chains."""
    stages = model._planner.stages(cfg.execute_plan)
    M = cfg.num_microbatch
    chunks, sizes = split_inputs(args, kwargs, M, cfg.split_input)
    labels = split_label(label, M, sizes, cfg.split_label) if training else [None] * M
    stage_params: List[List[_ParamRecord]] = []
    for stage in stages:
        trainable = [rec for rec in stage.params if rec.param.requires_grad]
        if training or grad_enabled:
            for rec in trainable:
                if rec.master is None:
                    raise RuntimeError(
                        f"parameter {rec.name!r} (stage {stage.index}) requires grad but has no "
                        f"master: it was frozen when the model was wrapped; freeze it again "
                        f"(requires_grad_(False)) or wrap the module after changing "
                        f"requires_grad")
        stage_params.append(trainable)
    pool = model._pool
    backend0 = pool.backends[0]
    stage_rng, probe_keys = [], []
    for s in stages:
        known = uses_rng([l.module for l in s.layers], cfg.preserve_rng_state)
        key = None
        if known is None:  # see [Note: RNG chains]: probe the stage until it is known
            key = tuple((id(l.module), l.module.training) for l in s.layers)
            known = model._rng_use.get(key)
            if known is None:
                known = True
            else:
                key = None
        stage_rng.append(known)
        probe_keys.append(key)
    # Device-side gradient sums exist on accelerators only (the stage-major plans).
    grad_dtype = cfg.device_grad_dtype if pool.device_type != "cpu" else None
    stage_bytes = [s.device_bytes(grad_dtype) for s in stages]
    rng_starts = rng_after = None
    rng_others: List[Tuple[Backend, Optional[torch.Tensor]]] = []
    if any(stage_rng):
        rng_starts = chain_starts(M, backend0)
        rng_after = RNGState(torch.get_rng_state(), backend0.get_rng_state())
        rng_others = [(b, b.get_rng_state()) for b in pool.backends[1:]]
    call = _Call(
        tag=model._name_tag(), pool=pool, sink_slot=model._grad_sink,
        plan=model._planner.plan(stages, M, training, bool(cfg.recompute)), stages=stages,
        training=training,
        recompute=bool(cfg.recompute), grad_enabled=grad_enabled,
        offload=bool(cfg.offload_activations) and bool(cfg.recompute) and training,
        budget=_budget(cfg.device_memory_budget, pool),
        grad_dtype=grad_dtype,
        stage_bytes=stage_bytes,
        reserve=_two_stages_per_device(stage_bytes, len(pool)),
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=resolve_autocast(cfg.autocast, pool.device_type),
        chunks=chunks, sizes=sizes, labels=labels, loss_fn=loss_fn,
        return_outputs=return_outputs, stage_params=stage_params, stage_rng=stage_rng,
        stage_drew=[False] * len(stages), rng_probe_keys=probe_keys,
        rng_starts=rng_starts, rng_after_draw=rng_after, rng_others=rng_others,
        ready=model._params.ready,
        cast_dtype=model._params.cast_dtype,
        input_grad=training and any(isinstance(x, torch.Tensor) and x.requires_grad
                                    for x in pytree.tree_leaves((args, kwargs))))
    call.slots = {(s, m): _Slot() for s in range(len(stages)) for m in range(M)}
    call.futures = {a.key: Future() for a in call.plan.actions()}
    call.losses = [None] * M
    call.grad_buffers = [[None] * len(ps) for ps in stage_params]
    call.outputs = [None] * M
    call.input_origins = [None] * M
    if call.plan.fused:
        model._ensure_grad_hooks()
        call.grad_sink = _GradSink(call.grad_buffers, stage_params)
        call.stashed_grads = _stash_grads(stage_params)
    return call


# "auto" budgets leave this share of a device's free memory to the activations inside a stage
# (which the estimate does not count) and to the allocator's rounding.
AUTO_BUDGET_SHARE = 0.9


def _budget(setting: Optional[Union[int, str]], pool: DevicePool) -> Optional[int]:
    """device_memory_budget in bytes per device (None: no budget)."""
    if setting != "auto":
        return cast(Optional[int], setting)
    free = [b.memory_available() for b in pool.backends]
    if any(f is None for f in free):
        return None  # the host's memory: nothing to budget
    return max(int(min(cast(List[int], free)) * AUTO_BUDGET_SHARE), 1)


def _start_first_uploads(call: _Call) -> None:
    """Main thread, as the call starts (in :func:`_execute`, so that an interrupted call waits
    for them): queue each device's first upload of a stage-major plan on its worker, ahead of
    the call's actions, so that it is copied in on the copy stream while a device after the
    first waits for its first input (see [Note: streaming] in schedule.py). A stage that does not fit the
    ``device_memory_budget`` on its own is left to its action, as a prefetch would be."""
    if not call.plan.stage_major:
        return
    for d in range(len(call.pool)):
        first = call.plan.first_upload(d)
        if first is None or (call.budget is not None
                             and call.stage_bytes[first.stage] > call.budget):
            continue
        backend = cast(StreamingBackend, call.pool.backends[d])
        call.first_uploads[first.action.key] = call.pool.worker(d).submit(
            _first_upload, call, first.stage, backend)


def _first_upload(call: _Call, s: int, backend: StreamingBackend) -> Resident:
    """Device worker: stage ``s``'s upload on the copy stream, once the master->model copy of a
    step launched before the call has written its params (see [Note: staleness] in model.py);
    the device has nothing else to do until then."""
    if call.cancelled.is_set():
        raise _Cancelled()
    with backend.action_context():
        for layer in call.stages[s].layers:
            call.ready.wait(layer.index)
        return _upload(call, s, backend, prefetch=True)


def _upload(call: _Call, s: int, backend: StreamingBackend, prefetch: bool) -> Resident:
    """Device worker: stage ``s``'s parameters and buffers on the device, for one run."""
    trainable = [rec.param for rec in call.stage_params[s]]
    # Training: device leaves, whose gradients stay on the device. A differentiable
    # inference call: a differentiable upload, so a later backward() reaches the host
    # parameters and their grad hooks.
    with torch.set_grad_enabled(not call.training and call.grad_enabled):
        return backend.upload([l.module for l in call.stages[s].layers], trainable,
                              leaves=call.training, prefetch=prefetch)


def _learn_rng_use(rng_use: Dict[Tuple, bool], call: _Call) -> None:
    """Main thread, after a call succeeded: remember in ``rng_use`` (the model's) whether each
    probed stage drew."""
    for key, drew in zip(call.rng_probe_keys, call.stage_drew):
        if key is not None:
            rng_use[key] = drew


def _restore_rng(call: _Call, ok: bool) -> None:
    """Leave the global RNG deterministic (see [Note: RNG chains])."""
    if call.rng_starts is None:
        return
    # First the other devices (an emulated device's generator is the CPU's, which device
    # 0's restore below then sets).
    for backend, state in call.rng_others:
        backend.set_rng_state(state)
    backend0 = call.pool.backends[0]
    if ok and call.plan.num_microbatch == 1:
        end = call.slots[(len(call.stages) - 1, 0)].rng_end
        restore_global(end, backend0)
    else:
        restore_global(call.rng_after_draw, backend0)


def _two_stages_per_device(stage_bytes: List[int], num_devices: int) -> Dict[int, int]:
    """Twice the largest of ``stage_bytes`` (per stage) among the stages each device runs."""
    reserve: Dict[int, int] = defaultdict(int)
    for s, nbytes in enumerate(stage_bytes):
        d = stage_device(s, num_devices)
        reserve[d] = max(reserve[d], 2 * nbytes)
    return reserve
