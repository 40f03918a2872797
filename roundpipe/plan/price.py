"""A plan prices itself: given each stage's compute times and a link's bandwidth, its program
gives a timeline per stream and the iteration time (:func:`price`).

The model (see [Note: pricing]) is what the emulated device cannot show, since its kernels run
at once: which copies hide behind compute, where the compute stream waits, and how far the host
runs ahead of the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from roundpipe.plan.actions import Action, ActionKind, Plan

__all__ = [
    "HOST_CONTENTION",
    "Costs",
    "Span",
    "Timeline",
    "contention_shown",
    "overlapped",
    "price",
]


# [Note: pricing]
# Each device has a host thread (its worker) and three streams: compute, copy and download. The
# worker walks the program: it issues an action at its host time (a compute action costs it
# ``issue`` seconds, the Python that enqueues the stage's kernels; a move costs nothing) and
# only blocks at a host wait (S). An action starts on its stream once the stream is free, the
# action is issued, and what it waits for on the device is done:
#   F/L/B (compute)   a prefetched upload of its stage (adopted by the run's first action), the
#                     hand-off events it reads (plus copying that data in, on its stream, at
#                     ``peer_bandwidth``); it lasts forward, forward + backward (L), or backward
#                     plus the recompute's forward (B with recompute);
#   U (compute)       upload bytes / bandwidth, in order with the compute;
#   P (copy)          the same on the copy stream;
#   O (download)      after the compute so far (the stream waits for it), input bytes / bandwidth;
#   I (compute)       after its O, input bytes / bandwidth;
#   D (download)      after the compute so far, gradient bytes / bandwidth;
#   H, R              events at the compute stream's current end (an R's is what a later S of
#                     that stage waits for on the host);
#   W                 the master->model copy is taken as done (its cost is the optimizer
#                     thread's, priced as a whole below).
# The iteration ends when every device's final S returns, and no sooner than the optimizer
# thread's work of one step (``optimizer``: the step and the master->model copy): with the
# asynchronous step that work overlaps the next iteration, so a steady run takes the longer of
# the two per iteration. On a GPU with a host-side Adam the optimizer thread is often the longer
# (host memory traffic: about 28 bytes per parameter for Adam and 6 for the copy), which is why
# it is priced at all. The two overlap on one host, though: the step's threads stream memory
# beside the iteration's DMA and take cores from the threads that issue the device's work, so
# while they overlap both run slower. ``contention`` c prices that: during the overlap each
# side runs at 1 / (1 + c) of its speed alone, so the shorter side (s) ends at s * (1 + c), the
# longer one (l) after s more of its own work, and a steady iteration takes l + c * s
# (c = 0: the plain maximum; c = 1: the two serialized). c is a property of the host, measured,
# not derived: see HOST_CONTENTION. Host wait S of a stage is the bound on how far the worker
# runs ahead: a prefetch that reuses the memory a run released is issued only once the device
# has finished that run.

# The contention measured on the GPU machines so far (benchmarks/results/gpu.md: H200s of 16
# Xeon cores, fused Adam on 14 of them), measured minus the longer side, over the shorter: the
# GPT's iterations (devices priced, the step timed alone) 0.42 and 0.41, which the value is
# fitted on; Qwen3's shape with compiled layers (forward_backward and the step each timed
# alone) 0.30 in the harness's loop and 0.53 in profile_hf's.
HOST_CONTENTION = 0.4


def overlapped(devices: float, optimizer: float, contention: float) -> float:
    """A steady iteration's seconds: the devices' work and the optimizer thread's step, each
    that long alone, overlapped on one host with ``contention`` (see [Note: pricing])."""
    return max(devices, optimizer) + contention * min(devices, optimizer)


def contention_shown(measured: float, devices: float, optimizer: float) -> float | None:
    """The contention a ``measured`` iteration shows beside its two sides timed alone (the
    inverse of :func:`overlapped`); None where the shorter side is under a tenth of the longer,
    too short beside it for the figure to mean anything."""
    longer, shorter = max(devices, optimizer), min(devices, optimizer)
    return (measured - longer) / shorter if shorter > 0.1 * longer else None


@dataclasses.dataclass(frozen=True)
class Costs:
    """What a plan is priced with; seconds, bytes and bytes per second.

    ``forward``/``backward``: per stage, one microbatch's forward, and its backward alone (the
    recompute's forward is added for a backward with recompute). ``upload_bytes``: per stage,
    its weights and buffers; ``grad_bytes``: its gradient sums. ``bandwidth``: the host link,
    each way. ``peer_bandwidth``: between devices (None: ``bandwidth``). ``issue``: per stage,
    the host time to enqueue one of its compute actions (0: the host is never the limit).
    ``optimizer``: the optimizer thread's seconds per step (the step and the master->model
    copy); a steady run's iteration takes at least that long (0: never the limit).
    ``contention``: how much slower the step and the devices' work run while they overlap
    on one host (0: not at all; :data:`HOST_CONTENTION` is what GPU machines measured; see
    [Note: pricing]).
    Stage inputs (offloads, hand-offs) have the sizes the plan was lowered with (none without
    them)."""

    forward: Sequence[float]
    backward: Sequence[float]
    upload_bytes: Sequence[int]
    grad_bytes: Sequence[int]
    bandwidth: float
    peer_bandwidth: float | None = None
    issue: Sequence[float] | None = None
    optimizer: float = 0.0
    contention: float = 0.0


@dataclasses.dataclass(frozen=True)
class Span:
    """One action's time on a stream of a device (``stream``: "compute", "copy" or
    "download")."""

    device: int
    stream: str
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A priced plan: every action with a duration, when the devices are done
    (``device_time``), and when a steady iteration ends (``iteration_time``: the devices' work
    and the optimizer thread's step overlapped, see [Note: pricing])."""

    spans: tuple[Span, ...]
    iteration_time: float
    device_time: float = 0.0
    optimizer_time: float = 0.0

    @property
    def optimizer_bound(self) -> bool:
        """Whether the optimizer thread's step, not the devices, is the longer side."""
        return self.optimizer_time > self.device_time

    def on(self, device: int, stream: str) -> list[Span]:
        """The spans of one stream, in time order."""
        return sorted(
            (s for s in self.spans if s.device == device and s.stream == stream),
            key=lambda s: s.start,
        )

    def compute_time(self, device: int | None = None) -> float:
        """The time the stages compute (upload and reload copies on the compute stream not
        counted), on ``device`` or summed over all."""
        return sum(
            s.end - s.start
            for s in self.spans
            if s.action.kind.computes and (device is None or s.device == device)
        )

    def compute_idle(self, device: int) -> float:
        """How long the compute stream of ``device`` stands idle between its first and its
        last stage computation (waiting for an upload, a reload or another device)."""
        busy = self.on(device, "compute")
        compute = [i for i, s in enumerate(busy) if s.action.kind.computes]
        if not compute:
            return 0.0
        idle, end = 0.0, busy[compute[0]].end
        for s in busy[compute[0] + 1 : compute[-1] + 1]:
            idle += max(0.0, s.start - end)
            end = max(end, s.end)
        return idle


def price(plan: Plan, costs: Costs) -> Timeline:
    """The timeline of ``plan``'s program under ``costs`` (see [Note: pricing]). Any thread."""
    S = plan.num_stages
    for name in ("forward", "backward", "upload_bytes", "grad_bytes"):
        if len(getattr(costs, name)) != S:
            raise ValueError(
                f"costs.{name} needs one value per stage ({S}), got {len(getattr(costs, name))}"
            )
    if costs.bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {costs.bandwidth}")
    if costs.optimizer < 0:
        raise ValueError(f"optimizer seconds must be >= 0, got {costs.optimizer}")
    if not 0 <= costs.contention <= 1:
        raise ValueError(f"contention must be within [0, 1], got {costs.contention}")
    assert plan.program is not None
    peer = costs.peer_bandwidth or costs.bandwidth
    issue = list(costs.issue) if costs.issue is not None else [0.0] * S
    inputs = plan.sizes.input_bytes if plan.sizes is not None else None

    def input_bytes(s: int, m: int) -> int:
        return inputs[s][m] if inputs is not None and 0 <= s < S else 0

    def compute_cost(a: Action) -> float:
        s = a.stage
        if a.kind is ActionKind.FORWARD:
            return costs.forward[s]
        if a.kind is ActionKind.LAST:
            return costs.forward[s] + costs.backward[s]
        if a.kind is ActionKind.BACKWARD:
            return costs.backward[s] + (costs.forward[s] if plan.recompute else 0.0)
        # A fused microbatch: every stage's forward and backward, and the recomputes.
        redo = sum(costs.forward[:-1]) if plan.recompute else 0.0
        return sum(costs.forward) + sum(costs.backward) + redo

    spans: list[Span] = []
    events: dict[tuple, float] = {}  # H actions, by key: when their event completes
    host = [0.0] * plan.num_devices
    free = [{"compute": 0.0, "copy": 0.0, "download": 0.0} for _ in range(plan.num_devices)]
    adopt: list[dict[int, float]] = [{} for _ in range(plan.num_devices)]
    released: list[dict[tuple, float]] = [{} for _ in range(plan.num_devices)]
    offloaded: list[dict[tuple, float]] = [{} for _ in range(plan.num_devices)]
    heads = [0] * plan.num_devices
    remaining = sum(len(p) for p in plan.program)

    def run(d: int, stream: str, a: Action, earliest: float, duration: float) -> float:
        start = max(free[d][stream], earliest)
        end = start + duration
        free[d][stream] = end
        spans.append(Span(d, stream, a, start, end))
        return end

    while remaining:
        progressed = False
        for d, program in enumerate(plan.program):
            if heads[d] == len(program):
                continue
            a = program[heads[d]]
            deps = [dep for dep in plan.dependencies(a) if dep.device != d]
            if any(dep.key not in events for dep in deps):
                continue
            heads[d] += 1
            remaining -= 1
            progressed = True
            k, s, m = a.kind, a.stage, a.mb_index
            if k.computes:
                host[d] += issue[s] if s >= 0 else sum(issue)
                earliest = max([host[d], adopt[d].pop(s, 0.0)] + [events[x.key] for x in deps])
                moved = (
                    sum(
                        input_bytes(x.stage + (1 if x.of is ActionKind.FORWARD else 0), m)
                        for x in deps
                        if x.kind is ActionKind.HANDOFF
                    )
                    / peer
                )
                events[a.key] = run(d, "compute", a, earliest, compute_cost(a) + moved)
            elif k is ActionKind.UPLOAD:
                run(d, "compute", a, host[d], costs.upload_bytes[s] / costs.bandwidth)
            elif k is ActionKind.PREFETCH:
                adopt[d][s] = run(d, "copy", a, host[d], costs.upload_bytes[s] / costs.bandwidth)
            elif k is ActionKind.OFFLOAD:
                offloaded[d][(s, m)] = run(
                    d,
                    "download",
                    a,
                    max(host[d], free[d]["compute"]),
                    input_bytes(s, m) / costs.bandwidth,
                )
            elif k is ActionKind.RELOAD:
                run(
                    d,
                    "compute",
                    a,
                    max(host[d], offloaded[d].pop((s, m), 0.0)),
                    input_bytes(s, m) / costs.bandwidth,
                )
            elif k is ActionKind.DOWNLOAD:
                grads = costs.grad_bytes[s] if s >= 0 else sum(costs.grad_bytes)
                run(d, "download", a, max(host[d], free[d]["compute"]), grads / costs.bandwidth)
            elif k is ActionKind.HANDOFF:
                events[a.key] = max(host[d], free[d]["compute"])
            elif k is ActionKind.RELEASE:
                released[d][(s, a.of)] = max(host[d], free[d]["compute"])
            elif k is ActionKind.SYNC:
                if s >= 0:
                    host[d] = max(host[d], released[d][(s, a.of)])
                else:
                    host[d] = max([host[d]] + list(free[d].values()))
        if not progressed:
            raise RuntimeError(f"plan deadlocks; cannot price it\n{plan}")
    end = max(host + [t for f in free for t in f.values()])
    iteration = overlapped(end, costs.optimizer, costs.contention)
    return Timeline(tuple(spans), iteration, end, costs.optimizer)
