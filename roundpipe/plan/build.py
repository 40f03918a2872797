"""Building a plan: the order the stages run in, and its lowering into each device's program.

* :func:`build_plan` is the one entry point: it picks the order (the clock, one device's
  microbatch-by-microbatch order, a fused order, or the stage-major order of accelerators) and,
  for a stage-major plan, lowers it into moves and waits (see [Note: the program] in
  :mod:`roundpipe.plan.actions`), deciding prefetches and offloads from the plan's sizes.

Everything here is pure: plans are built and checked without threads or devices.
"""

from __future__ import annotations

from roundpipe.plan.actions import Action, ActionKind, Plan, PlanSizes, stage_device
from roundpipe.plan.memory import DeviceLedger, Held, Holding

__all__ = ["build_plan"]


# [Note: the clock]
# A GPipe-like clock with S stages and M microbatches:
#   FORWARD(s, m)  at s + m
#   LAST(S-1, m)   at S-1 + m
#   BACKWARD(s, m) at (S-1) + (M-1) + (S-1-s) + m + 1, i.e. after every LAST, in reverse stage
#                  order, one tick after BACKWARD(s+1, m) (or LAST(S-1, m)).
# Every dependency of an action has a strictly smaller time. With several devices, each runs its
# actions sorted by (time, stage); then the unfinished action with the smallest (time, stage)
# overall is always at the head of its device's list and its dependencies are done, so execution
# never deadlocks. A single device has no other device to overlap with, so it runs microbatch by
# microbatch instead, sorted by (mb_index, time, stage): the forward and backward of microbatch 0,
# then of microbatch 1, ... (a dependency is of the same microbatch and earlier in time, so it
# comes first). It keeps one microbatch's stage inputs alive instead of all of them, as plain
# PyTorch's loop over microbatches does. In training the runtime usually goes one step further
# and fuses each microbatch's actions into one MICROBATCH action (fuse_stages), which has the
# same order; the per-stage order remains for inference and for tied weights.
# Microbatches of one stage run in increasing mb_index on one device, which is what makes the
# order of gradient accumulation independent of the number of devices.


# [Note: streaming]
# On an accelerator the stages' weights live in host memory and must be uploaded before a stage
# computes. A stage-major plan (stage_major=True) makes each device run all microbatches of one
# stage before the next: the forward pass stage by stage upwards (FORWARD s.0 .. s.M-1, then the
# LAST stage's actions), then the backward pass stage by stage downwards (BACKWARD s.0 ..
# s.M-1). So each device meets a stage in one run of consecutive actions per pass, and a stage's
# weights are uploaded once per run, whatever M is:
#   * a stage before the last: twice per iteration, for its forward run and for its backward run
#     (whose recompute needs them again); with recompute off the forward's upload is kept and
#     serves the backward run too: once;
#   * the last stage: once (its LAST actions run forward, loss_fn and backward together);
#   * inference: once per stage.
# Gradients of a stage accumulate on the device over its microbatches and are downloaded once,
# after its last backward action. While a run computes, the next run's upload on the device is
# prefetched on a separate stream, issued after the run's first action (so the device has work
# while the host waits for the next stage's params): at most two stages' weights are on a
# device. A device's first upload has no run before it: it is prefetched before anything else
# in its program, so it overlaps the host preparing the call and, on a device after the first,
# the wait for its first input. The next upload of the running stage itself (on every device but
# the last stage's, the backward run of its highest stage follows that stage's forward run) is
# prefetched at the end of the run instead, once the run has written its buffers back, while the
# device waits for the gradients from above.
# A device's actions are ordered by its stream, so the host waits for a device only at the end
# of its program (S). An action whose output or input gradients another device reads is followed
# by a device event (H) that the reader's copy waits for. Gradient downloads (D) and offloads (O)
# run on their own stream; the optimizer thread waits for a download's event before it adds the
# gradients to the masters. Dependencies only point to lower stages in the forward pass and to
# higher stages (or the same stage's forward) in the backward pass, so a device never waits for
# an action that comes later in another device's list: no deadlock, and with several devices
# stage s+1 of microbatch 0 starts while stage s computes microbatch 1. All microbatches' stage
# inputs stay alive until their backward, as in any stage-major pipeline.


def build_plan(
    num_stages: int,
    num_microbatch: int,
    num_devices: int,
    training: bool,
    fuse_stages: bool = False,
    stage_major: bool = False,
    recompute: bool = True,
    sizes: PlanSizes | None = None,
    overlap_recompute: bool = False,
) -> Plan:
    """The plan of one ``forward_backward`` (``training=True``) or ``forward`` call.

    ``fuse_stages`` (training on one device only): one ``MICROBATCH`` action per microbatch
    instead of a forward and a backward per stage. ``stage_major``: the order of
    [Note: streaming], for accelerator pools, lowered into its moves with ``recompute`` and
    ``sizes`` (without sizes, or without a budget in them, nothing is offloaded unless
    ``sizes.offload`` and every prefetch is made); ``overlap_recompute`` (with recompute): see
    [Note: overlapped recompute] in :mod:`roundpipe.runtime.stage_ops`."""
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatch", num_microbatch),
        ("num_devices", num_devices),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    S, M, D = num_stages, num_microbatch, num_devices
    if fuse_stages:
        if D != 1 or not training:
            raise ValueError(
                f"fuse_stages needs one device and training, got "
                f"num_devices={D}, training={training}"
            )
        if stage_major:
            raise ValueError("fuse_stages and stage_major exclude each other")
        fused = tuple(Action(ActionKind.MICROBATCH, 0, m, 0, m) for m in range(M))
        return Plan(S, M, D, training, (fused,))
    actions: list[Action] = []

    def add(kind: ActionKind, s: int, m: int, time: int) -> None:
        actions.append(Action(kind, s, m, stage_device(s, D), time))

    for m in range(M):
        for s in range(S):
            if training and s == S - 1:
                add(ActionKind.LAST, s, m, s + m)
            else:
                add(ActionKind.FORWARD, s, m, s + m)
            if training and s < S - 1:
                add(ActionKind.BACKWARD, s, m, (S - 1) + (M - 1) + (S - 1 - s) + m + 1)
    per_device: list[list[Action]] = [[] for _ in range(D)]
    if stage_major:  # see [Note: streaming]
        order = sorted(
            actions,
            key=lambda a: (
                (1, -a.stage, a.mb_index)
                if a.kind is ActionKind.BACKWARD
                else (0, a.stage, a.mb_index)
            ),
        )
    elif D == 1:  # see [Note: the clock]
        order = sorted(actions, key=lambda a: (a.mb_index, a.time, a.stage))
    else:
        order = sorted(actions, key=lambda a: (a.time, a.stage))
    for a in order:
        per_device[a.device].append(a)
    devices = tuple(tuple(p) for p in per_device)
    if not stage_major:
        return Plan(S, M, D, training, devices)
    order_only = Plan(
        S,
        M,
        D,
        training,
        devices,
        stage_major=True,
        recompute=recompute,
        overlap_recompute=overlap_recompute and recompute and training,
    )
    return _lower(order_only, sizes)


def _lower(order: Plan, sizes: PlanSizes | None) -> Plan:
    """A stage-major order lowered into each device's program (see [Note: the program])."""
    S, M = order.num_stages, order.num_microbatch
    if sizes is not None and (
        len(sizes.stage_bytes) != S
        or len(sizes.input_bytes) != S
        or any(len(row) != M for row in sizes.input_bytes)
    ):
        raise ValueError(
            f"plan sizes must give {S} stage byte counts and {S} x {M} input byte "
            f"counts, got {len(sizes.stage_bytes)} and "
            f"{[len(row) for row in sizes.input_bytes]}"
        )
    handoffs = {
        dep.key for a in order.actions() for dep in order.dependencies(a) if dep.device != a.device
    }
    programs, peaks = [], []
    for d, actions in enumerate(order.per_device):
        program, peak = _DeviceLowering(order, sizes, handoffs).lower(d, actions)
        programs.append(tuple(program))
        peaks.append(peak)
    deps: dict[tuple, tuple[Action, ...]] = {}
    for a in order.actions():
        deps[a.key] = tuple(_through_handoff(dep, a, handoffs) for dep in order.dependencies(a))
    return Plan(
        order.num_stages,
        M,
        order.num_devices,
        order.training,
        order.per_device,
        stage_major=True,
        recompute=order.recompute,
        overlap_recompute=order.overlap_recompute,
        program=tuple(programs),
        deps=deps,
        sizes=sizes,
        peak_bytes=tuple(peaks) if sizes is not None else None,
    )


def _handoff_of(a: Action) -> Action:
    return Action(ActionKind.HANDOFF, a.stage, a.mb_index, a.device, a.time, of=a.kind)


def _through_handoff(dep: Action, reader: Action, handoffs: set) -> Action:
    """What ``reader`` waits for: ``dep`` itself on its own device, else the event after it."""
    return _handoff_of(dep) if dep.device != reader.device and dep.key in handoffs else dep


class _DeviceLowering:
    """One device's program, with its memory ledger (see [Note: the program]): the bytes of the
    stage uploads it holds and of the saved stage inputs it keeps, walked in program order, in
    the :class:`DeviceLedger` that :func:`roundpipe.plan.memory.device_peaks` reports with."""

    def __init__(self, order: Plan, sizes: PlanSizes | None, handoffs: set) -> None:
        self.order = order
        self.sizes = sizes
        self.budget = sizes.budget if sizes is not None else None
        self.handoffs = handoffs
        self.program: list[Action] = []
        self.ledger = DeviceLedger()  # stage uploads and kept stage inputs
        self.waited: set[int] = set()  # stages whose params this device has waited for
        self.unsynced_release: Action | None = None  # the last R the host has not waited for
        self.peak = 0

    def stage_bytes(self, s: int) -> int:
        return self.sizes.stage_bytes[s] if self.sizes is not None else 0

    def input_bytes(self, s: int, m: int) -> int:
        return self.sizes.input_bytes[s][m] if self.sizes is not None else 0

    def held(self) -> int:
        return self.ledger.total()

    def fits(self, extra: int) -> bool:
        return self.budget is None or self.held() + extra <= self.budget

    def emit(self, kind: ActionKind, s: int, m: int, at: Action, write_back: bool = False) -> None:
        self.program.append(
            Action(kind, s, m, at.device, at.time, of=at.kind, write_back=write_back)
        )
        self.peak = max(self.peak, self.held())

    def upload(self, run: list[Action], prefetch: bool) -> None:
        s = run[0].stage
        if s not in self.waited:
            self.waited.add(s)
            self.emit(ActionKind.WAIT_PARAMS, s, -1, run[0])
        self.emit(ActionKind.PREFETCH if prefetch else ActionKind.UPLOAD, s, -1, run[0])
        self.ledger.put(Holding(Held.WEIGHTS, s), self.stage_bytes(s))
        self.peak = max(self.peak, self.held())

    def lower(self, device: int, actions: tuple[Action, ...]) -> tuple[list[Action], int]:
        order = self.order
        training, recompute = order.training, order.recompute
        offload = self.sizes is not None and self.sizes.offload
        runs: list[list[Action]] = []
        for a in actions:
            if runs and runs[-1][0].stage == a.stage and runs[-1][0].kind is a.kind:
                runs[-1].append(a)
            else:
                runs.append([a])
        # The runs that need an upload: all but a backward run without recompute, which computes
        # on the upload its forward run kept.
        uploads = [
            r for r, run in enumerate(runs) if run[0].kind is not ActionKind.BACKWARD or recompute
        ]
        prefetched: set[int] = set()
        # Every stage's own worst case: it and the one beside it (see [Note: the program]).
        reserve = 2 * max((self.stage_bytes(run[0].stage) for run in runs), default=0)
        streamed_forward = training and recompute
        for r, run in enumerate(runs):
            s, kind = run[0].stage, run[0].kind
            uploading = r in uploads
            if uploading and r not in prefetched:
                first = r == uploads[0]
                self.upload(
                    run,
                    prefetch=first and (self.budget is None or self.stage_bytes(s) <= self.budget),
                )
            for i, a in enumerate(run):
                m = a.mb_index
                if kind is ActionKind.BACKWARD and recompute:
                    if Holding(Held.INPUT, s, m) in self.ledger:
                        self.ledger.pop(Holding(Held.INPUT, s, m))
                    else:
                        self.emit(ActionKind.RELOAD, s, m, a)
                self.program.append(a)
                if a.key in self.handoffs:
                    self.emit(ActionKind.HANDOFF, s, m, a)
                if kind is ActionKind.FORWARD and streamed_forward:
                    nbytes = self.input_bytes(s, m)
                    if offload or (
                        self.budget is not None
                        and self.ledger.total(Held.INPUT) + nbytes + reserve > self.budget
                    ):
                        self.emit(ActionKind.OFFLOAD, s, m, a)
                    else:
                        self.ledger.put(Holding(Held.INPUT, s, m), nbytes)
                        self.peak = max(self.peak, self.held())
                if i == 0 and uploading:
                    self.prefetch_next(runs, uploads, r, prefetched, same_stage=False)
            grads_done = (
                kind in (ActionKind.BACKWARD, ActionKind.LAST)
                and run[-1].mb_index == order.num_microbatch - 1
            )
            if grads_done:
                self.emit(ActionKind.DOWNLOAD, s, -1, run[-1])
            if not (kind is ActionKind.FORWARD and training and not recompute):
                # Kept from the forward to the backward run when recompute is off.
                self.emit(
                    ActionKind.RELEASE,
                    s,
                    -1,
                    run[-1],
                    write_back=not (kind is ActionKind.BACKWARD and recompute),
                )
                self.unsynced_release = self.program[-1]
                self.ledger.pop(Holding(Held.WEIGHTS, s))
            self.prefetch_next(runs, uploads, r, prefetched, same_stage=True)
        if actions:
            self.program.append(Action(ActionKind.SYNC, -1, -1, device, actions[-1].time))
        return self.program, self.peak

    def prefetch_next(
        self,
        runs: list[list[Action]],
        uploads: list[int],
        r: int,
        prefetched: set[int],
        same_stage: bool,
    ) -> None:
        """Prefetch the device's next upload after run ``r``. While run ``r`` computes
        (``same_stage`` False): unless it is of the same stage, whose upload this run may still
        write buffers into. At the end of run ``r`` (``same_stage`` True): only the very next
        run's, if it was not prefetched yet (its own stage's, or one that did not fit)."""
        later = [u for u in uploads if u > r]
        if not later:
            return
        nxt = later[0]
        if nxt in prefetched:
            return
        s = runs[nxt][0].stage
        if same_stage:
            if nxt != r + 1:
                return
        elif s == runs[r][0].stage or Holding(Held.WEIGHTS, s) in self.ledger:
            return
        if self.fits(self.stage_bytes(s)):
            prefetched.add(nxt)
            release = self.unsynced_release
            if release is not None:
                # Host wait: the prefetch takes the memory that release gave back only once the
                # device has finished the run that used it (see [Note: the program]).
                self.unsynced_release = None
                self.program.append(
                    Action(
                        ActionKind.SYNC,
                        release.stage,
                        -1,
                        release.device,
                        release.time,
                        of=release.of,
                    )
                )
            self.upload(runs[nxt], prefetch=True)
