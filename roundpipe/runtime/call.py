"""One call of one model: what it runs (:class:`CallSpec`, immutable, built by
:func:`prepare_call` on the main thread) and what it writes as it runs (:class:`CallState`, one
:class:`Slot` per stage and microbatch).

Threads: the main thread builds both and reads the state after the workers finish; in between
each slot is written by one action and read by the actions that depend on it, after that
action has run (see [Note: the program] in :mod:`roundpipe.plan.actions`).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from roundpipe.autocast import AutocastState, resolve_autocast
from roundpipe.devices import DevicePool, Future, Upload
from roundpipe.microbatch import split_inputs, split_label
from roundpipe.plan import Plan, PlanSizes
from roundpipe.runtime.config import ResolvedRunConfig
from roundpipe.runtime.grad_router import CallGrads, GradHooks, GradSink, stash_grads
from roundpipe.runtime.params import ParamRecord, ParamsReady
from roundpipe.runtime.rng import CallRng, RngMemo, RNGState, plan_call_rng
from roundpipe.runtime.stages import ModelStages, Stage, probe_input_bytes

__all__ = [
    "Cancelled",
    "CallSpec",
    "CallState",
    "ModelParts",
    "Slot",
    "device_grad_dtype",
    "plan_call",
    "plan_sizes",
    "prepare_call",
    "takes_microbatch",
]


class Cancelled(Exception):
    """An action skipped because the call failed or was interrupted; never reaches the user."""


class Slot:
    """What one (stage, microbatch) hands to the actions that depend on it."""

    __slots__ = (
        "phase",
        "rng_start",
        "rng_end",
        "out",
        "out_ready",
        "graph_in",
        "graph_out",
        "grad_in",
        "grad_ready",
        "saved_input",
        "saved_ready",
    )

    def __init__(self) -> None:
        self.phase = "forward"  # pass of a checkpointed stage, for error notes
        self.rng_start: RNGState | None = None  # chain state the forward started from
        self.rng_end: RNGState | None = None  # chain state for the next stage
        self.out: Any = None  # stage output handed to the next stage
        self.graph_in: Any = None  # input leaves of the stage's graph
        self.graph_out: Any = None  # output leaves with their (checkpointed) graph
        self.grad_in: Any = None  # grads w.r.t. this stage's input leaves (aligned)
        self.saved_input: Any = None  # a streamed forward's stage input, for its recompute
        self.saved_ready: torch.Event | None = None  # an offloaded saved_input has arrived
        # Device events of the plan's H actions (None on the CPU): after the action that wrote
        # ``out`` (forward) or ``grad_in`` (backward), for its reader on another device.
        self.out_ready: torch.Event | None = None
        self.grad_ready: torch.Event | None = None


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What a call reads of its model (the facade's parts): main thread."""

    tag: str  # the model's name, for error notes
    pool: DevicePool
    stages: ModelStages
    ready: ParamsReady
    cast_dtype: torch.dtype | None
    hooks: GradHooks
    rng_memo: RngMemo


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """What one ``forward``/``forward_backward`` call runs. Immutable once built; every thread
    reads it."""

    tag: str
    pool: DevicePool
    plan: Plan
    stages: list[Stage]
    training: bool
    recompute: bool
    grad_enabled: bool
    inference_mode: bool
    autocast: AutocastState
    chunks: list[tuple[tuple, dict]]
    sizes: list[int]
    labels: list[Any]
    loss_fn: Callable | None
    loss_takes_microbatch: bool  # loss_fn(output, label, MicrobatchInfo)
    return_outputs: bool
    stage_params: list[list[ParamRecord]]  # per stage, its trainable params
    rng: CallRng
    ready: ParamsReady
    cast_dtype: torch.dtype | None
    input_grad: bool  # some input requires grad (forward_backward)
    hooks: GradHooks
    grad_dtype: torch.dtype | None  # the gradient sums' dtype on an accelerator


class CallState:
    """What one call writes as it runs (see the module doc for which thread touches what).

    ``failures``: (time, stage, mb_index, exception) of each failed action, under ``lock``;
    ``cancelled``: set when the call is interrupted.
    ``uploads``: per stage, its upload while a run of it holds one (the stage's worker only).
    ``released``: per (stage, pass), the event after its run, for a later host wait.
    ``contexts``: per microbatch, the context its first layer returned; ``device_contexts``: a
    copy per (device, microbatch) on the other devices (see :mod:`roundpipe.microbatch_context`)."""

    def __init__(self, spec: CallSpec) -> None:
        S, M = len(spec.stages), spec.plan.num_microbatch
        self.slots = {(s, m): Slot() for s in range(S) for m in range(M)}
        waited = {dep.key for deps in (spec.plan.deps or {}).values() for dep in deps}
        assert spec.plan.program is not None
        waited.update(p[-1].key for p in spec.plan.program if p)
        self.futures: dict[tuple, Future] = {key: Future() for key in waited}
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.failures: list[tuple[int, int, int, BaseException]] = []
        # The plan time (time, stage, mb_index) of the earliest failure: actions after it are
        # skipped; read without the lock (a tuple is replaced, never mutated).
        self.stop_after: tuple[int, int, int] | None = None
        self.losses: list[Any] = [None] * M
        self.outputs: list[Any] = [None] * M
        # Per microbatch, the stage-0 input leaves as the caller's graph has them (None where no
        # grad is wanted); their grads are in slots[(0, m)].grad_in. Written by stage 0's worker.
        self.input_origins: list[Any] = [None] * M
        self.grads = CallGrads(
            spec.stage_params,
            spec.grad_dtype,
            spec.hooks.owner,
            reducer=spec.hooks.reducer if spec.training else None,
        )
        self.sink: GradSink | None = None  # a fused plan's (see [Note: fused stages])
        self.uploads: dict[int, Upload] = {}
        # Per device (its worker's alone), per (stage, microbatch): a recompute run ahead on the
        # device's helper thread (see [Note: overlapped recompute] in stage_ops), the future of
        # (output, input leaves).
        self.ahead: dict[int, dict[tuple[int, int], Future]] = {}
        self.released: dict[tuple, torch.Event] = {}
        self.stage_drew = [False] * S  # written by the stage's worker: a generator moved
        self.contexts: list[Any] = [None] * M
        self.device_contexts: dict[tuple[int, int], Any] = {}
        # (param, .grad) a user left on a model param, set aside during a fused call; main thread.
        self.stashed_grads: list[tuple[nn.Parameter, torch.Tensor]] = []

    def fail(self, time: int, stage: int, mb_index: int, exc: BaseException) -> None:
        """Record a failed action; every action after it in plan time is skipped from now on
        (see :func:`roundpipe.runtime.executor.execute`)."""
        with self.lock:
            self.failures.append((time, stage, mb_index, exc))
            key = (time, stage, mb_index)
            if self.stop_after is None or key < self.stop_after:
                self.stop_after = key
        self.grads.abandon()


def takes_microbatch(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` takes a third positional argument, a
    :class:`roundpipe.MicrobatchInfo`: a required one, or one named ``mb``."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # A third argument with a default is some other option (F.cross_entropy's weight) unless it
    # is named for the microbatch.
    return len(positional) >= 3 and (
        positional[2].default is inspect.Parameter.empty
        or positional[2].name in ("mb", "microbatch")
    )


# "auto" budgets leave this share of a device's free memory to the activations inside a stage
# (which the estimate does not count) and to the allocator's rounding.
AUTO_BUDGET_SHARE = 0.9


def _budget(setting: int | str, pool: DevicePool) -> int | None:
    """device_memory_budget in bytes per device (None: no budget)."""
    if isinstance(setting, int):
        return setting
    if setting == "none":
        return None
    free = [b.memory_available() for b in pool.backends]
    known = [f for f in free if f is not None]
    if len(known) < len(free):
        return None  # the host's memory: nothing to budget
    return max(int(min(known) * AUTO_BUDGET_SHARE), 1)


def plan_sizes(
    stages: list[Stage],
    pool: DevicePool,
    cfg: ResolvedRunConfig,
    training: bool,
    chunks: list[tuple[tuple, dict]] | None,
    cast_dtype: torch.dtype | None,
    autocast: AutocastState,
) -> PlanSizes | None:
    """What an accelerator pool's plan is lowered with (None on the CPU): the stages' device
    bytes, the budget, and, under a budget, the bytes of each saved stage input, probed from
    ``chunks`` (None: taken as 0). Where the probe cannot tell them, every stage input is
    offloaded. Main thread."""
    if not pool.streaming:
        return None
    grad_dtype = cfg.device_grad_dtype if isinstance(cfg.device_grad_dtype, torch.dtype) else None
    M = cfg.num_microbatch
    budget = _budget(cfg.device_memory_budget, pool)
    offload = cfg.offload_activations and cfg.recompute and training
    input_bytes = None
    if budget is not None and training and cfg.recompute and not offload and chunks is not None:
        input_bytes = probe_input_bytes(
            stages, chunks, cast_dtype, autocast.dtype if autocast.enabled else None
        )
        if input_bytes is None:  # unknown sizes: keep no stage input on the device
            offload = True
    return PlanSizes(
        tuple(s.device_bytes(grad_dtype) for s in stages),
        input_bytes or tuple((0,) * M for _ in stages),
        budget,
        offload,
    )


def plan_call(
    model: ModelParts,
    cfg: ResolvedRunConfig,
    training: bool,
    chunks: list[tuple[tuple, dict]] | None,
) -> tuple[list[Stage], AutocastState, Plan]:
    """The stages, the autocast state and the plan of a call with ``cfg`` whose microbatches
    are ``chunks`` (None: stage inputs count as 0 bytes): the one sequence stages ->
    :func:`plan_sizes` -> plan that a call, ``model.plan()`` and the memory plan share. Main
    thread."""
    stages = model.stages.stages(cfg.execute_plan)
    pool = model.pool
    autocast = resolve_autocast(cfg.autocast, pool.device_type)
    sizes = plan_sizes(stages, pool, cfg, training, chunks, model.cast_dtype, autocast)
    plan = model.stages.plan(
        stages,
        cfg.num_microbatch,
        len(pool),
        pool.streaming,
        training,
        cfg.recompute,
        sizes,
        overlap_recompute=cfg.overlap_recompute,
    )
    return stages, autocast, plan


def device_grad_dtype(pool: DevicePool, cfg: ResolvedRunConfig) -> torch.dtype | None:
    """The dtype of the gradient sums on the devices: accelerators only (the stage-major
    plans); None: the gradients' own."""
    if pool.streaming and isinstance(cfg.device_grad_dtype, torch.dtype):
        return cfg.device_grad_dtype
    return None


def _refuse_meta(tag: str, stage: Stage) -> None:
    """A model built on the meta device has shapes only: it can be planned, not run."""
    meta = next((rec.name for rec in stage.params if rec.param.is_meta), None)
    if meta is not None:
        raise RuntimeError(
            f"{tag}: parameter {meta!r} is on the meta device (shapes only, no values): a model "
            f"built on the meta device can be planned (memory_plan(), plan()) but not run. "
            f"Build it with real weights (from_pretrained, or to_empty(device='cpu') and "
            f"load_state_dict) and wrap that one"
        )


def prepare_call(
    model: ModelParts,
    cfg: ResolvedRunConfig,
    args: tuple,
    kwargs: dict,
    label: Any,
    loss_fn: Callable | None,
    training: bool,
    return_outputs: bool,
    grad_enabled: bool = True,
) -> tuple[CallSpec, CallState]:
    """Main thread: split the inputs, pick the stages and plan, set up the RNG chains."""
    M = cfg.num_microbatch
    chunks, sizes = split_inputs(args, kwargs, M, cfg.split_input)
    stages, autocast, plan = plan_call(model, cfg, training, chunks)
    labels = split_label(label, M, sizes, cfg.split_label) if training else [None] * M
    stage_params: list[list[ParamRecord]] = []
    for stage in stages:
        _refuse_meta(model.tag, stage)
        trainable = [rec for rec in stage.params if rec.param.requires_grad]
        if training or grad_enabled:
            for rec in trainable:
                if rec.master is None:
                    raise RuntimeError(
                        f"parameter {rec.name!r} (stage {stage.index}) requires grad but has no "
                        f"master: it was frozen when the model was wrapped; freeze it again "
                        f"(requires_grad_(False)) or wrap the module after changing "
                        f"requires_grad"
                    )
        stage_params.append(trainable)
    pool = model.pool
    grad_dtype = device_grad_dtype(pool, cfg)
    rng = plan_call_rng(
        [s.modules for s in stages], M, cfg.preserve_rng_state, model.rng_memo, pool.backends
    )
    spec = CallSpec(
        tag=model.tag,
        pool=pool,
        plan=plan,
        stages=stages,
        training=training,
        recompute=cfg.recompute,
        grad_enabled=grad_enabled,
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=autocast,
        chunks=chunks,
        sizes=sizes,
        labels=labels,
        loss_fn=loss_fn,
        loss_takes_microbatch=loss_fn is not None and takes_microbatch(loss_fn),
        return_outputs=return_outputs,
        stage_params=stage_params,
        rng=rng,
        ready=model.ready,
        cast_dtype=model.cast_dtype,
        input_grad=training
        and any(
            isinstance(x, torch.Tensor) and x.requires_grad
            for x in pytree.tree_leaves((args, kwargs))
        ),
        hooks=model.hooks,
        grad_dtype=grad_dtype,
    )
    state = CallState(spec)
    if plan.fused:
        model.hooks.ensure()
        state.sink = GradSink(state.grads)
        state.stashed_grads = stash_grads(stage_params)
    return spec, state
