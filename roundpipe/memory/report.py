"""Memory plans: what a call of a wrapped model takes, host and devices, before it runs
(:class:`MemoryPlan`, made by ``RoundPipe.memory_plan``; ``str(plan)`` is the report), and each
device's planned peak (:func:`plan_devices`), which the check of the first ``forward_backward``
(:func:`roundpipe.memory.checks.check_device_memory`) reads.

* Host terms: :func:`roundpipe.memory.host.host_terms` (weights, masters, their gradients, an
  Adam-sized optimizer state, the pinned pool's slack), here with the gradients' pinned
  downloads and the stage inputs an accelerator offloads to the host, or, on a CPU pool, the
  activations.
* Device terms: the plan's program walked by :func:`roundpipe.plan.device_peaks`, with each
  stage's activations traced on fake tensors (:mod:`roundpipe.memory.trace`).

Main thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from roundpipe.autocast import AutocastState
from roundpipe.devices import DevicePool
from roundpipe.devices.pinned import pool_layout
from roundpipe.memory.host import HostTerms, format_bytes
from roundpipe.memory.trace import (
    StageNotTraceable,
    StageTraces,
    describe_module,
    described_modules,
    trace_stages,
    tree_signature,
)
from roundpipe.plan import Action, ActionBytes, ActionKind, Plan, StageBytes, device_peaks
from roundpipe.plan.memory import TERMS
from roundpipe.runtime.stages import Stage

__all__ = [
    "HOST_FREE_HERE",
    "DeviceMemory",
    "MemoryPlan",
    "PlannedCall",
    "StageMemory",
    "TraceMemo",
    "make_memory_plan",
    "reused_traces",
    "stage_label",
]


# What the report calls the host RAM it compares with, when measured here (a plan for another
# machine names where its figure came from instead: MemoryPlan.host_source).
HOST_FREE_HERE = "free RAM on this machine"


def stage_label(stage: Stage) -> str:
    """A stage named by its layers, for reports: ``"layer 3 (Block)"``, ``"layers 3-5 (Block)"``."""
    layers = stage.layers
    if len(layers) == 1:
        return layers[0].describe()
    kinds = ", ".join(dict.fromkeys(type(layer.module).__name__ for layer in layers))
    return f"layers {layers[0].index}-{layers[-1].index} ({kinds})"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's planned peak: ``peak`` bytes of tensors during ``at`` (an action of the
    plan's program, as ``print(plan)`` writes it: ``"B32.0"``), made of ``terms``
    ((description, bytes), largest first); ``available``: what the device had free when
    planned (None: unknown); ``reserve``: what the device needs beside the tensors (a GPU's
    library workspaces and allocator rounding, ``reserve_note`` says which), left free by the
    check; ``during``: ``at`` in words, with the stage's name (``"the recompute and backward of
    layer 32 (Decoder), microbatch 0"``), and ``action`` the action itself (None: no peak)."""

    device: str
    peak: int
    at: str
    terms: tuple[tuple[str, int], ...]
    available: int | None
    reserve: int = 0
    reserve_note: str = ""
    during: str = ""
    action: Action | None = None

    @property
    def fits(self) -> bool:
        return self.available is None or self.peak + self.reserve <= self.available


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's bytes on a device for microbatch 0: ``weights`` (its upload),
    ``input`` (its input), ``forward`` (the most its forward allocates beyond them) and
    ``backward`` (the most its recompute and backward, or for the last stage its forward,
    ``loss_fn`` and backward, allocate beyond its input, weights and output gradient); None
    where not traced, and ``forward`` of the last stage of a training call, which runs no
    forward without grad."""

    stage: int
    weights: int
    input: int | None
    forward: int | None
    backward: int | None


@dataclasses.dataclass(frozen=True)
class PlannedCall:
    """What a planned call runs: its stages, plan, microbatches and settings (main thread)."""

    stages: Sequence[Stage]
    plan: Plan
    pool: DevicePool
    chunks: Sequence[tuple[tuple, dict]]
    sizes: Sequence[int]
    labels: Sequence[Any]
    loss_fn: Callable | None
    loss_takes_microbatch: bool
    cast_dtype: torch.dtype | None
    autocast: AutocastState
    grad_dtype: torch.dtype | None
    training: bool
    return_outputs: bool = False


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a call takes, before it runs: ``host`` (:class:`roundpipe.memory.host.HostTerms`),
    ``devices`` (a :class:`DeviceMemory` per device of an accelerator pool; empty on a CPU
    pool, whose stages compute in host memory), the microbatches it was planned with, the
    stages whose activations are not counted (``untraced``: stage -> the
    :class:`StageNotTraceable` that says why), those measured by a real CPU run instead of
    a trace (``measured``), and each stage's own bytes (``stages``, :class:`StageMemory`).
    ``stage_names``: how the report names each stage (by its layers, ``"layer 3 (Block)"``;
    the plan command, by the HF modules it runs); ``host_source``: what ``host.available``
    is (this machine's free RAM, or a figure given for another machine); ``recompute``:
    whether the plan's backwards recompute their stage (for the report's words).
    ``str(plan)`` is the report (docs/memory.md reads one)."""

    name: str
    host: HostTerms
    devices: tuple[DeviceMemory, ...]
    microbatch_sizes: tuple[int, ...]
    input_shapes: tuple[str, ...]
    untraced: dict[int, StageNotTraceable]
    measured: tuple[int, ...]
    notes: tuple[str, ...] = ()
    stages: tuple[StageMemory, ...] = ()
    stage_names: tuple[str, ...] = ()
    host_source: str = HOST_FREE_HERE
    recompute: bool = True

    def stage_name(self, stage: int) -> str:
        """How the report names ``stage``: its name in ``stage_names`` (``"layer 33 (Head)"``),
        else ``"stage 33"``."""
        if 0 <= stage < len(self.stage_names):
            return self.stage_names[stage]
        return f"stage {stage}"

    @property
    def largest(self) -> tuple[str, str, int]:
        """The largest single term: (where: ``"host"`` or a device, description, bytes)."""
        label, most = max(self.host.rows()[1:], key=lambda r: r[1])
        best: tuple[str, str, int] = ("host", label, most)
        for dev in self.devices:
            for term, nbytes in dev.terms:
                if nbytes > best[2]:
                    best = (dev.device, term, nbytes)
        return best

    @property
    def fits(self) -> bool:
        """Whether every planned total is within what was available (unknown counts as fits)."""
        host_ok = self.host.available is None or self.host.new_bytes <= self.host.available
        return host_ok and all(d.fits for d in self.devices)

    def describe_peak(self, dev: DeviceMemory) -> str:
        """When ``dev`` peaks, in words, with this plan's stage names (``dev.at`` when the
        action is not known)."""
        if dev.action is None:
            return dev.during or dev.at
        return dev.action.describe(self.stage_name, self.recompute)

    def _stage_table(self, most: int = 8) -> str:
        """Per stage (the ``most`` largest by backward, if there are more), microbatch 0."""
        rows = list(self.stages)
        title = "Stages, microbatch 0 (bytes beyond the stage's input and weights):"
        if len(rows) > most:
            rows = sorted(rows, key=lambda r: -(r.backward or 0))[:most]
            rows.sort(key=lambda r: r.stage)
            title = f"Stages, the {most} with the largest backward, microbatch 0:"
        names = [self.stage_name(r.stage) for r in rows]
        width = max([len(n) for n in names] + [5])
        lines = [
            title,
            f"  {'stage':<{width}} {'weights':>11} {'input':>11} {'forward':>11} {'backward':>11}",
        ]

        def cell(n: int | None) -> str:
            return "-" if n is None else format_bytes(n)

        for name, r in zip(names, rows):
            lines.append(
                f"  {name:<{width}} {cell(r.weights):>11} {cell(r.input):>11} "
                f"{cell(r.forward):>11} {cell(r.backward):>11}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        batch = sum(self.microbatch_sizes)
        lines = [f"Memory plan{self.name}"]
        if self.microbatch_sizes:
            sizes = sorted(set(self.microbatch_sizes))
            lines[0] += (
                f": {len(self.microbatch_sizes)} microbatch(es) of "
                f"{'/'.join(map(str, sizes))} (batch {batch})"
            )
        if self.input_shapes:
            lines.append(f"  microbatch 0 inputs: {', '.join(self.input_shapes)}")
        host = self.host
        lines.append("Host RAM")
        rows = host.rows()
        available_label = self.host_source + (
            ", for all but the weights" if host.weights_allocated else ""
        )
        width = max([len(r[0]) for r in rows] + [52, len(available_label)])
        for label, nbytes in rows:
            lines.append(f"  {label:<{width}} {format_bytes(nbytes):>11}")
        lines.append(f"  {'total':<{width}} {format_bytes(host.total):>11}")
        if host.available is not None:
            verdict = "fits" if host.new_bytes <= host.available else "DOES NOT FIT"
            lines.append(
                f"  {available_label:<{width}} "
                f"{format_bytes(host.available):>11}  {verdict}: "
                f"{format_bytes(host.new_bytes)} to allocate"
            )
        for dev in self.devices:
            free = (
                f" of {format_bytes(dev.available)} free"
                if dev.available is not None
                else " (free memory unknown)"
            )
            verdict = "" if dev.available is None else ("  fits" if dev.fits else "  DOES NOT FIT")
            during = self.describe_peak(dev)
            lines.append(
                f"Device {dev.device}: peak {format_bytes(dev.peak)}{free}, during {during}{verdict}"
            )
            for term, nbytes in dev.terms:
                lines.append(f"  {term:<{width}} {format_bytes(nbytes):>11}")
            if dev.reserve:
                label = f"reserve ({dev.reserve_note})"
                lines.append(f"  {label:<{width}} {format_bytes(dev.reserve):>11}")
        if not self.devices:
            lines.append("No accelerator: the stages compute in host memory (counted above).")
        if self.stages:
            lines.append(self._stage_table())
        where, term, nbytes = self.largest
        lines.append(f"Largest term: {term} ({where}), {format_bytes(nbytes)}")
        for s in self.measured:
            lines.append(
                f"Stage {s} could not run on fake tensors; measured with a real run on the CPU"
            )
        for _, exc in sorted(self.untraced.items()):
            lines.append(f"Not counted: {exc} (its activations are missing from the peaks)")
        lines.extend(self.notes)
        return "\n".join(lines)


def _stage_bytes(stage: Stage, grad_dtype: torch.dtype | None) -> StageBytes:
    copy = 0
    for rec in stage.params:
        if rec.master is None or not rec.param.requires_grad:
            continue
        dtype = grad_dtype or rec.master.dtype
        if rec.param.dtype != dtype:  # the first gradient is copied into the sum, not adopted
            copy += rec.param.numel() * dtype.itemsize
    return StageBytes(stage.upload_bytes, stage.grad_sum_bytes(grad_dtype), copy)


# [Note: reused traces]
# A search over sequence lengths plans each length under several settings (the activation
# offload on and off, say) that trace the same: a trace depends on the stages (their modules,
# whose repr shows what decides their memory, see [Note: identical stages]), the microbatches'
# shapes and the settings of the call below, not on where the kept inputs wait or how the
# program orders the moves. Inside ``reused_traces(memo)`` a call whose key is in ``memo``
# reuses that trace, so a length is traced once. The memo is the caller's: it lives as long as
# the caller's model does not change (the keys hold module ids), e.g. the plan command's
# ConfigPlanner.
class TraceMemo:
    """Traces kept by what decides them (see [Note: reused traces]), for :func:`reused_traces`.
    A subclass may answer a call otherwise (from traces of other sizes, say). Main thread."""

    def __init__(self) -> None:
        self._traces: dict[tuple, StageTraces] = {}
        self.described: dict[int, Any] = {}  # see roundpipe.memory.trace.describe_module
        self._host: dict[tuple, HostTerms] = {}

    def host_terms(self, key: tuple, make: Callable[[], HostTerms]) -> HostTerms:
        """The host terms of a model, kept by ``key`` (what the caller passes
        :func:`roundpipe.memory.host.host_terms` besides the RAM available): they depend on
        the model's parameters, not on the call."""
        if key not in self._host:
            self._host[key] = make()
        return self._host[key]

    def get(
        self, call: PlannedCall, real_runs: bool, trace: Callable[[], StageTraces]
    ) -> StageTraces:
        """``call``'s traces: kept ones where ``call`` traces the same, else ``trace()``."""
        key = _trace_key(call, real_runs)
        if key not in self._traces:
            self._traces[key] = trace()
        return self._traces[key]


_REUSED: contextvars.ContextVar[TraceMemo | None] = contextvars.ContextVar(
    "roundpipe_reused_traces", default=None
)


@contextlib.contextmanager
def reused_traces(memo: TraceMemo) -> Iterator[None]:
    """Within it, :func:`trace_call` asks ``memo`` for its traces, which reuses one where a
    call traces the same (see [Note: reused traces]). Main thread."""
    token = _REUSED.set(memo)
    try:
        with described_modules(memo.described):
            yield
    finally:
        _REUSED.reset(token)


def reusing_memo() -> TraceMemo | None:
    """The memo of the :func:`reused_traces` this runs in, if any."""
    return _REUSED.get()


def _trace_key(call: PlannedCall, real_runs: bool) -> tuple:
    stages = tuple(
        (
            stage.index,
            tuple((id(layer.module), describe_module(layer.module)) for layer in stage.layers),
        )
        for stage in call.stages
    )
    return (
        stages,
        tree_signature(list(call.chunks)),
        tree_signature(list(call.labels)),
        tuple(call.sizes),
        call.cast_dtype,
        dataclasses.astuple(call.autocast),
        call.training,
        call.loss_fn,
        call.loss_takes_microbatch,
        str(call.pool.backends[0].torch_device),
        real_runs,
    )


def trace_call(call: PlannedCall, real_runs: bool = True) -> StageTraces:
    """Trace ``call``'s stages on fake tensors on the pool's first device (``real_runs``: see
    :func:`roundpipe.memory.trace.trace_stages`); inside :func:`reused_traces`, once per
    distinct call."""
    memo = _REUSED.get()
    if memo is None:
        return _trace(call, real_runs)
    return memo.get(call, real_runs, lambda: _trace(call, real_runs))


def _trace(call: PlannedCall, real_runs: bool) -> StageTraces:
    device = call.pool.backends[0].torch_device
    return trace_stages(
        call.stages,
        call.chunks,
        device,
        call.cast_dtype,
        call.autocast,
        call.training,
        call.labels,
        call.loss_fn,
        call.loss_takes_microbatch,
        call.sizes,
        real_runs,
    )


def _input_grad(call: PlannedCall) -> bool:
    return call.training and any(
        x.requires_grad for x in pytree.tree_leaves(call.chunks) if isinstance(x, torch.Tensor)
    )


def plan_devices(call: PlannedCall, traces: StageTraces | None) -> tuple[DeviceMemory, ...]:
    """Each device's planned peak (empty on a CPU pool)."""
    plan = call.plan
    if not call.pool.streaming or not plan.stage_major:
        return ()
    acts: list[list[ActionBytes | None]]
    if traces is None:
        acts = [[None] * plan.num_microbatch for _ in call.stages]
    else:
        acts = traces.bytes
    peaks = device_peaks(
        plan,
        [_stage_bytes(stage, call.grad_dtype) for stage in call.stages],
        acts,
        input_grad=_input_grad(call),
        return_outputs=call.return_outputs,
    )
    out = []
    names = [stage_label(stage) for stage in call.stages]
    for peak, device, backend in zip(peaks, call.pool.devices, call.pool.accelerators):
        reserve, note = backend.reserve(peak.peak)
        out.append(
            DeviceMemory(
                str(device),
                peak.peak,
                str(peak.at) if peak.at is not None else "-",
                tuple((TERMS[t], b) for t, b in peak.terms),
                backend.memory_available(),
                reserve,
                note,
                during=(
                    peak.at.describe(names.__getitem__, plan.recompute)
                    if peak.at is not None
                    else "-"
                ),
                action=peak.at,
            )
        )
    return tuple(out)


def _host_activations(call: PlannedCall, traces: StageTraces | None) -> tuple[int, str | None]:
    """Host bytes of activations: stage inputs an accelerator offloads (each offload a pinned
    pool), or a CPU pool's activations; and a note on how they were counted."""
    if traces is None:
        return 0, None
    plan = call.plan
    if call.pool.streaming:
        assert plan.program is not None
        offloaded = 0
        for program in plan.program:
            for a in program:
                if a.kind is ActionKind.OFFLOAD:
                    x = traces.bytes[a.stage][a.mb_index]
                    offloaded += pool_layout([x.input]).taken if x is not None else 0
        return offloaded, None
    # A CPU pool: every stage input kept until its backward (per microbatch on one fused
    # worker, all microbatches otherwise), plus the largest action's own activations.
    rows = traces.bytes
    per_mb = [
        sum((rows[s][m] or ActionBytes()).input for s in range(len(rows)))
        for m in range(len(call.chunks))
    ]
    kept = max(per_mb, default=0) if plan.fused else sum(per_mb)
    action = max(
        ((x.backward_peak if call.training else x.forward_peak) for row in rows for x in row if x),
        default=0,
    )
    return kept + action, None


def make_memory_plan(
    name: str,
    host: HostTerms,
    call: PlannedCall | None,
    grads_pinned: int | None = None,
) -> MemoryPlan:
    """The memory plan of ``call`` (None: no inputs given, only the host terms and, on an
    accelerator pool, the weights' share of the devices). ``grads_pinned``: the host bytes of
    the masters' gradients when they are the pinned downloads themselves."""
    notes: list[str] = []
    traces = None
    if call is not None and call.chunks:
        traces = trace_call(call)
    if grads_pinned is not None:
        next_grads = grads_pinned if host.next_grads else 0
        host = dataclasses.replace(host, grads=grads_pinned, next_grads=next_grads)
        if (
            call is not None
            and call.grad_dtype is not None
            and call.grad_dtype != host.master_dtype
        ):
            host = dataclasses.replace(host, grads_dtype=call.grad_dtype)
    devices: tuple[DeviceMemory, ...] = ()
    sizes: tuple[int, ...] = ()
    shapes: tuple[str, ...] = ()
    if call is not None:
        activations, _ = _host_activations(call, traces)
        host = dataclasses.replace(host, activations=activations)
        devices = plan_devices(call, traces)
        sizes = tuple(call.sizes)
        if call.chunks:
            shapes = tuple(
                f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                for x in pytree.tree_leaves(call.chunks[0])
                if isinstance(x, torch.Tensor)
            )
    if traces is None:
        notes.append(
            "No example inputs: activations, stage inputs and hand-offs are not counted; "
            "give model.memory_plan() the inputs of a call to count them."
        )
    return MemoryPlan(
        name,
        host,
        devices,
        sizes,
        shapes,
        dict(traces.untraced) if traces is not None else {},
        tuple(traces.measured) if traces is not None else (),
        tuple(notes),
        _stage_rows(call, traces),
        stage_names=tuple(stage_label(stage) for stage in call.stages) if call is not None else (),
        recompute=call.plan.recompute if call is not None else True,
    )


def _stage_rows(call: PlannedCall | None, traces: StageTraces | None) -> tuple[StageMemory, ...]:
    if call is None or traces is None:
        return ()
    rows = []
    last = len(call.stages) - 1
    for s, stage in enumerate(call.stages):
        x = traces.bytes[s][0] if traces.bytes[s] else None
        if x is None:
            rows.append(StageMemory(s, stage.upload_bytes, None, None, None))
        else:
            backward = x.backward_peak if call.training else None
            # In training the last stage runs no forward without grad (its backward column
            # counts its forward, loss and backward).
            forward = None if call.training and s == last and s > 0 else x.forward_peak
            rows.append(StageMemory(s, stage.upload_bytes, x.input, forward, backward))
    return tuple(rows)
