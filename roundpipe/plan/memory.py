"""A plan's device memory, action by action: :func:`device_peaks` walks a stage-major plan's
program (see [Note: the program] in :mod:`roundpipe.plan.actions`) with what each action holds
and allocates, and returns each device's peak and what makes it up.

Its :class:`DeviceLedger` is the one the lowering keeps (stage uploads, kept stage inputs; see
:mod:`roundpipe.plan.build`), here with what the lowering's budget leaves out: the hand-offs
between stages (a stage's output until the next stage takes it, an input gradient until the
stage before takes it), the gradient sums from the first backward of a run (not from the
upload), and the activations and workspace of the running action (:class:`ActionBytes`, which
:mod:`roundpipe.memory.trace` measures by tracing each stage on fake tensors). Devices are
walked together in the order :func:`simulate` completes their actions, so a hand-off to another
device leaves its producer when the consumer's action runs. Pure: no threads, no devices.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from roundpipe.plan.actions import Action, ActionKind, Plan, simulate

__all__ = [
    "ActionBytes",
    "DeviceLedger",
    "DevicePeak",
    "Held",
    "Holding",
    "StageBytes",
    "TERMS",
    "device_peaks",
]


@dataclasses.dataclass(frozen=True)
class ActionBytes:
    """What one stage's actions take on a device for one microbatch (bytes).

    ``input``: the stage input on the device (the copy of the call's inputs for stage 0);
    ``output``: what its forward hands to the next stage; ``forward_peak``: the most a forward
    without grad (a streamed ``F``) allocates beyond its input and weights, its output
    included; ``graph``: what a forward with grad keeps until its backward (``recompute=False``),
    its output included, and ``grad_forward_peak`` the most it allocates on the way;
    ``backward_peak``: the most a recompute and backward (``B``), or the last stage's forward,
    ``loss_fn`` and backward (``L``), allocate beyond the input, the weights and the output
    gradient they are handed; ``grad_phase_peak``: the most the backward alone reaches, counted
    from before its forward; ``backward_end``: what is alive at its end (the recomputed output,
    the parameter and input gradients); ``input_grad``: the gradient it hands to the stage
    before; ``param_grads``: its parameters' gradients (before they are summed); ``context``
    (stage 0 only): the microbatch's context its forward makes (an HF model's position ids,
    rotary tables, shifted labels; see :mod:`roundpipe.microbatch_context`), which every device that runs
    one of the microbatch's stages holds until the call ends."""

    input: int = 0
    output: int = 0
    forward_peak: int = 0
    graph: int = 0
    grad_forward_peak: int = 0
    backward_peak: int = 0
    grad_phase_peak: int = 0
    backward_end: int = 0
    input_grad: int = 0
    param_grads: int = 0
    context: int = 0


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """What a stage's run holds on a device: ``upload``, its parameters and buffers;
    ``grad_sum``, its gradient sums (from its first backward to its download); ``grad_copy``,
    what the first microbatch's sums allocate beside that microbatch's gradients (a gradient of
    the sums' dtype is adopted as the sum; one of another dtype is copied into a new one)."""

    upload: int
    grad_sum: int = 0
    grad_copy: int = 0


# The terms of a device's memory, in report order, with their descriptions.
TERMS = {
    "weights": "stage weights and buffers (uploads)",
    "grads": "gradient sums",
    "inputs": "stage inputs kept for the backward",
    "handoffs": "hand-offs (stage outputs, input gradients)",
    "graph": "saved activations (recompute off, or a recompute run ahead)",
    "outputs": "outputs kept to return",
    "context": "microbatch contexts (positions, rotary tables, labels)",
    "action": "activations and workspace of the running action",
}


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """One device's peak: ``peak`` bytes, reached at (during) action ``at``, made of ``terms``
    (a name of :data:`TERMS` and bytes each, the largest first)."""

    device: int
    peak: int
    at: Action | None
    terms: tuple[tuple[str, int], ...]

    @property
    def largest(self) -> tuple[str, int]:
        """The largest term: (name, bytes)."""
        return self.terms[0] if self.terms else ("weights", 0)


class Held(enum.Enum):
    """What a device holds, as the ledger files it; ``.term`` is the report's name for it
    (a key of :data:`TERMS`)."""

    WEIGHTS = "weights"  # a stage's upload (per stage)
    GRAD_SUMS = "grads"  # a stage's gradient sums (per stage)
    INPUT = "inputs"  # a stage input kept or taken (per stage and microbatch)
    OUTPUT = "out"  # a stage's output until the next stage takes it
    INPUT_GRAD = "gin"  # an input gradient until the stage before takes it
    GRAPH = "graph"  # activations a forward with grad saves (recompute off, or run ahead)
    RESULT = "res"  # a last-stage output kept until the call ends (per microbatch)
    CONTEXT = "context"  # a microbatch's context, from its first use here to the call's end

    @property
    def term(self) -> str:
        return _TERM_OF.get(self, self.value)


_TERM_OF = {Held.OUTPUT: "handoffs", Held.INPUT_GRAD: "handoffs", Held.RESULT: "outputs"}


@dataclasses.dataclass(frozen=True)
class Holding:
    """One entry of a device's ledger: ``what`` of stage ``stage`` (and microbatch
    ``mb_index``; -1 for what a stage holds across its microbatches)."""

    what: Held
    stage: int
    mb_index: int = -1


class DeviceLedger:
    """What one device holds, entry by entry (bytes). The lowering keeps one per device for its
    budget decisions (:mod:`roundpipe.plan.build`: uploads, kept stage inputs) and
    :func:`device_peaks` one for the reported peaks, with the same entries, so the two count
    the same things the same way. Pure; one thread."""

    def __init__(self) -> None:
        self._held: dict[Holding, int] = {}
        self._total = 0

    def put(self, entry: Holding, nbytes: int) -> None:
        self._total += nbytes - self._held.get(entry, 0)
        self._held[entry] = nbytes

    def pop(self, entry: Holding) -> int:
        """Remove ``entry``; its bytes (0: it was not held)."""
        nbytes = self._held.pop(entry, 0)
        self._total -= nbytes
        return nbytes

    def __contains__(self, entry: Holding) -> bool:
        return entry in self._held

    def total(self, what: Held | None = None) -> int:
        """Bytes held, of ``what`` only if given."""
        if what is None:
            return self._total
        return sum(b for e, b in self._held.items() if e.what is what)

    def terms(self) -> dict[str, int]:
        """Bytes held per report term."""
        out: dict[str, int] = {}
        for entry, nbytes in self._held.items():
            out[entry.what.term] = out.get(entry.what.term, 0) + nbytes
        return out


class _Walk:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.held = [DeviceLedger() for _ in range(plan.num_devices)]
        self.best: list[tuple[int, Action | None, dict[str, int]]] = [
            (0, None, {}) for _ in range(plan.num_devices)
        ]

    def note(self, d: int, extra: int, at: Action) -> None:
        total = self.held[d].total() + extra
        if total > self.best[d][0] or self.best[d][1] is None:
            terms = self.held[d].terms()
            if extra:
                terms["action"] = extra
            self.best[d] = (total, at, terms)

    def put(self, d: int, what: Held, s: int, m: int, nbytes: int) -> None:
        self.held[d].put(Holding(what, s, m), nbytes)

    def pop(self, d: int, what: Held, s: int, m: int = -1) -> int:
        return self.held[d].pop(Holding(what, s, m))

    def device_of(self, kind: ActionKind, s: int, m: int) -> int:
        return self.plan.action(kind, s, m).device


def device_peaks(
    plan: Plan,
    stages: Sequence[StageBytes],
    actions: Sequence[Sequence[ActionBytes | None]],
    input_grad: bool = False,
    return_outputs: bool = False,
) -> tuple[DevicePeak, ...]:
    """Each device's peak memory while ``plan`` (a stage-major plan, lowered) runs: ``stages``
    per stage, ``actions`` per stage and microbatch (None: unknown, counted as nothing).
    ``input_grad``: the call's inputs require grad (stage 0 hands a gradient back);
    ``return_outputs``: the last stage's outputs stay on the device until the call ends."""
    if not plan.stage_major or plan.program is None:
        raise ValueError("device_peaks walks a stage-major plan's program (an accelerator pool's)")
    S, M = plan.num_stages, plan.num_microbatch
    if len(stages) != S or len(actions) != S or any(len(row) != M for row in actions):
        raise ValueError(f"device_peaks needs {S} stages and {S} x {M} action byte counts")
    empty = ActionBytes()

    def act(s: int, m: int) -> ActionBytes:
        return actions[s][m] or empty

    walk = _Walk(plan)
    recompute = plan.recompute
    overlapped = plan.overlapped_recomputes()
    has_context: set[tuple[int, int]] = set()  # (device, microbatch)

    def hold_context(d: int, m: int) -> None:
        if (d, m) not in has_context:
            has_context.add((d, m))
            if act(0, m).context:
                walk.put(d, Held.CONTEXT, 0, m, act(0, m).context)

    for a in simulate(plan, moves=True):
        d, k, s, m = a.device, a.kind, a.stage, a.mb_index
        if s > 0 and k in (ActionKind.FORWARD, ActionKind.LAST, ActionKind.BACKWARD):
            hold_context(d, m)  # moved here before the stage runs
        if k in (ActionKind.UPLOAD, ActionKind.PREFETCH):
            walk.put(d, Held.WEIGHTS, s, -1, stages[s].upload)
        elif k is ActionKind.RELEASE:
            walk.pop(d, Held.WEIGHTS, s)
        elif k is ActionKind.DOWNLOAD:
            walk.pop(d, Held.GRAD_SUMS, s)
        elif k is ActionKind.OFFLOAD:
            walk.pop(d, Held.INPUT, s, m)
        elif k is ActionKind.RELOAD:
            walk.put(d, Held.INPUT, s, m, act(s, m).input)
        elif k is ActionKind.FORWARD:
            _take_input(walk, a, act(s, m), recompute)
            x = act(s, m)
            if recompute or not plan.training:
                walk.note(d, x.forward_peak, a)
                if not plan.training:
                    walk.pop(d, Held.INPUT, s, m)  # inference keeps no input
            else:
                walk.note(d, x.grad_forward_peak, a)
                walk.put(d, Held.GRAPH, s, m, max(x.graph - x.output, 0))
            if s == 0:
                hold_context(d, m)  # made by this forward (its peak counted it): kept
            if s < S - 1:
                walk.put(d, Held.OUTPUT, s, m, x.output)
            elif return_outputs or not plan.training:
                walk.put(d, Held.RESULT, S - 1, m, x.output)
        elif k in (ActionKind.LAST, ActionKind.BACKWARD):
            x = act(s, m)
            if k is ActionKind.LAST:
                _take_input(walk, a, x, recompute)
                extra = x.backward_peak
            else:
                after = ActionKind.LAST if s + 1 == S - 1 else ActionKind.BACKWARD
                source = walk.device_of(after, s + 1, m)
                nbytes = walk.pop(source, Held.INPUT_GRAD, s + 1, m)
                walk.put(d, Held.INPUT_GRAD, s + 1, m, nbytes)
                if recompute:
                    extra = x.backward_peak
                    if (s, m - 1) in overlapped:  # recomputed already: its peak counts it
                        walk.pop(d, Held.GRAPH, s, m)
                else:
                    extra = max(x.grad_phase_peak - x.graph, 0)
            end = x.backward_end - (0 if recompute or k is ActionKind.LAST else x.graph)
            if m == 0:  # the run's first backward: its gradients become the sums
                extra = max(extra, end + stages[s].grad_copy)
            if (s, m) in overlapped:
                # The next microbatch's recompute runs beside this backward and after it, until
                # its own backward: at most its forward's peak, from now on.
                walk.put(d, Held.GRAPH, s, m + 1, act(s, m + 1).grad_forward_peak)
            walk.note(d, extra, a)
            walk.pop(d, Held.INPUT, s, m)
            walk.pop(d, Held.INPUT_GRAD, s + 1, m)
            if not recompute and k is ActionKind.BACKWARD:
                walk.pop(d, Held.GRAPH, s, m)
                walk.pop(d, Held.OUTPUT, s, m)
            if s > 0 or input_grad:
                walk.put(d, Held.INPUT_GRAD, s, m, x.input_grad)
            if m == 0:
                walk.put(d, Held.GRAD_SUMS, s, -1, stages[s].grad_sum)
            if k is ActionKind.LAST and return_outputs:
                walk.put(d, Held.RESULT, S - 1, m, x.output)
        else:
            continue
        walk.note(d, 0, a)
    peaks = []
    for d, (peak, at, terms) in enumerate(walk.best):
        ordered = tuple(sorted(((t, b) for t, b in terms.items() if b), key=lambda tb: -tb[1]))
        peaks.append(DevicePeak(d, peak, at, ordered))
    return tuple(peaks)


def _take_input(walk: _Walk, a: Action, x: ActionBytes, recompute: bool) -> None:
    """A forward's input arrives on its device: the call's inputs copied in (stage 0), the
    stage before's output taken over (same device) or copied over (another device)."""
    d, s, m = a.device, a.stage, a.mb_index
    if s == 0:
        walk.put(d, Held.INPUT, 0, m, x.input)
        return
    source = walk.device_of(ActionKind.FORWARD, s - 1, m)
    if recompute or not walk.plan.training:
        handed = Holding(Held.OUTPUT, s - 1, m)
        nbytes = walk.held[source].pop(handed) if handed in walk.held[source] else x.input
        walk.put(d, Held.INPUT, s, m, nbytes)
    elif source != d:  # a copy; the original stays with the graph of the stage before
        walk.put(d, Held.INPUT, s, m, x.input)
