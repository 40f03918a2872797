"""What a plan is made of: typed actions, and the plan itself, a program per device.

A :class:`Plan` has two views of one call:

* the *order*, ``per_device``: the compute actions (``FORWARD``, ``LAST``, ``BACKWARD``,
  ``MICROBATCH``) each device runs, in its order; :mod:`roundpipe.plan.build` decides it;
* the *program*, ``program``: the order lowered into everything the device does, moves and
  waits included (see [Note: the program]). The runtime's executor performs exactly this list,
  action by action, so ``print(plan)`` is what runs.

Plans are plain immutable data: they are checked without threads (:func:`simulate`) and priced
without a device (:mod:`roundpipe.plan.price`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence

__all__ = ["ActionKind", "Action", "Plan", "PlanSizes", "Transfer", "TransferKind", "simulate"]


class ActionKind(enum.Enum):
    """The kinds of action. The first four compute; the others move data or wait."""

    FORWARD = "F"  # stage s forward of microbatch m
    LAST = "L"  # the last stage in training: forward, loss_fn and backward of microbatch m
    BACKWARD = "B"  # stage s backward of microbatch m (after its recompute, with recompute on)
    MICROBATCH = "M"  # a fused plan's whole microbatch (see [Note: fused stages])
    WAIT_PARAMS = "W"  # host: wait until the step's master->model copy wrote stage s's params
    UPLOAD = "U"  # stage s's weights to the device, on the compute stream
    PREFETCH = "P"  # stage s's weights to the device, on the copy stream, beside the compute
    RELEASE = "R"  # drop stage s's upload (``write_back``: training-mode buffers go home first)
    DOWNLOAD = "D"  # stage s's summed gradients to the host, then to the fp32 masters
    HANDOFF = "H"  # record a device event after (s, m) for its reader on another device
    OFFLOAD = "O"  # (s, m)'s saved stage input to pinned host memory, on the download stream
    RELOAD = "I"  # (s, m)'s offloaded stage input back in, before its backward
    SYNC = "S"  # host: wait until the device has run everything this call enqueued

    @property
    def computes(self) -> bool:
        """Whether this kind runs a stage (as opposed to moving data or waiting)."""
        return self in _COMPUTE


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.LAST, ActionKind.BACKWARD, ActionKind.MICROBATCH}
)


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a device's program: ``kind`` of ``stage`` for microbatch ``mb_index`` on
    ``device``.

    ``time`` is the clock tick of [Note: the clock] for a compute action, and that of the compute
    action a move belongs to for the others. A move also names the compute kind of the pass it
    serves (``of``: the run it uploads for, the action it hands off or offloads after), which
    tells apart, say, a stage's upload for its forward run from the one for its backward run.
    ``mb_index`` is -1 for moves of a whole stage, ``stage`` -1 for ``SYNC`` and for the
    ``DOWNLOAD`` of a fused plan, which takes every stage's gradients at once.
    """

    kind: ActionKind
    stage: int
    mb_index: int
    device: int
    time: int
    of: ActionKind | None = None
    write_back: bool = False

    @property
    def key(self) -> tuple:
        """Unique within a plan: ``(kind, stage, mb_index)`` for a compute action."""
        if self.kind.computes:
            return (self.kind, self.stage, self.mb_index)
        return (self.kind, self.stage, self.mb_index, self.of, self.device)

    def __str__(self) -> str:
        k = self.kind.value
        if self.kind is ActionKind.MICROBATCH:
            return f"M.{self.mb_index}"
        if self.kind is ActionKind.SYNC and self.stage < 0:
            return "S"
        if self.stage < 0:
            return f"{k}*"
        if self.mb_index < 0:
            return f"{k}{self.stage}" + ("w" if self.write_back else "")
        return f"{k}{self.stage}.{self.mb_index}"

    def describe(
        self, stage_name: Callable[[int], str] | None = None, recompute: bool = True
    ) -> str:
        """The action in words, for reports people read (``str(action)`` is the compact form
        the plan prints): ``"the recompute and backward of stage 3, microbatch 0"``.
        ``stage_name``: how a stage is named (default ``"stage 3"``); ``recompute``: whether a
        ``BACKWARD`` recomputes its stage first (the plan's ``recompute``)."""
        name = stage_name or (lambda s: f"stage {s}")
        kind = self.kind
        if kind is ActionKind.MICROBATCH:
            return f"microbatch {self.mb_index} (every stage, fused)"
        if kind is ActionKind.SYNC and self.stage < 0:
            return "the wait for the device at the call's end"
        doing = _DOING[kind]
        if kind is ActionKind.BACKWARD and recompute:
            doing = "the recompute and backward of"
        what = "every stage" if self.stage < 0 else name(self.stage)
        text = f"{doing} {what}"
        if self.mb_index >= 0:
            text += f", microbatch {self.mb_index}"
        return text


# Each kind in words, before the stage it acts on (Action.describe).
_DOING = {
    ActionKind.FORWARD: "the forward of",
    ActionKind.LAST: "the forward, loss and backward of",
    ActionKind.BACKWARD: "the backward of",
    ActionKind.WAIT_PARAMS: "the wait for the weights of",
    ActionKind.UPLOAD: "the upload of the weights of",
    ActionKind.PREFETCH: "the prefetch of the weights of",
    ActionKind.RELEASE: "the release of the weights of",
    ActionKind.DOWNLOAD: "the gradient download of",
    ActionKind.HANDOFF: "the hand-off after",
    ActionKind.OFFLOAD: "the offload of the kept input of",
    ActionKind.RELOAD: "the reload of the kept input of",
    ActionKind.SYNC: "the wait for the device after",
}


# [Note: the program]
# A plan's program lists, per device, every action the executor performs, in order. On the CPU
# there is nothing to move: the stages compute on the host parameters, so the program is the
# order itself; each forward waits for its stage's params (the optimizer thread writes them, see
# [Note: staleness]) and a stage's last backward hands its gradient sums to the optimizer thread.
# On an accelerator (a stage-major plan, see [Note: streaming]) the order is lowered into:
#   W s        wait (host) for stage s's "params ready" events, before anything reads its params;
#   U s / P s  its upload on the compute stream, or a prefetch on the copy stream, adopted by the
#              compute stream at the first action that uses it;
#   F/L/B      the compute actions, reading the stage's upload;
#   H s.m      a device event for an action on another device that reads this one's result
#              (the stage output or the input gradients); that action's copy waits for it;
#   O s.m      the stage input a forward keeps for its recompute, sent to pinned host memory
#              (offload_activations, or a device_memory_budget that leaves no room for it);
#   I s.m      brought back, before B s.m;
#   D s        the stage's gradient sums, downloaded once after its last backward and handed to
#              the optimizer thread;
#   R s        the upload dropped at the end of its run (``R sw``: training-mode buffers, such as
#              BatchNorm's running stats, written back first);
#   S s        the host waits until the device has finished the run that R s ended, before a
#              prefetch that takes the memory it gave back: the worker enqueues kernels far
#              faster than a GPU runs them, and without this bound it would run stages ahead,
#              each prefetch allocating fresh memory while the released blocks are still in use
#              (the caching allocator reuses a block only once the stream that used it is past
#              it); with it a device holds at most the running stage and the next one;
#   S          the host waits for the device, once, at the end.
# Budget decisions are made here, once, from the plan's sizes (stage bytes and the bytes of each
# saved stage input): a device ledger walks the program and keeps a saved input only while that
# leaves room for two stages, and prefetches an upload only where it fits beside what is held.
# Dependencies between devices go through H actions; within a device, program order is enough.


@dataclasses.dataclass(frozen=True)
class PlanSizes:
    """What a stage-major plan is lowered with (see [Note: the program]).

    ``stage_bytes``: per stage, what its run holds on the device: the upload (parameters and
    buffers) plus its gradient sums. ``input_bytes``: per stage and microbatch, the device bytes
    of the stage input a forward keeps for its recompute. ``budget``: bytes per device (None:
    no budget; moves are then decided without the ledger). ``offload``: every kept stage input
    goes to the host (``offload_activations``)."""

    stage_bytes: tuple[int, ...]
    input_bytes: tuple[tuple[int, ...], ...]
    budget: int | None = None
    offload: bool = False


class TransferKind(enum.Enum):
    UPLOAD = "up"  # a stage's weights (and buffers) to its device, for a run of actions
    DOWNLOAD = "down"  # a stage's summed gradients to the host, after the action


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A weight upload or gradient download of a stage-major plan, named by the compute action
    it serves (an upload: the first action of the run that reads it, wherever the program issues
    it; a download: the action after which it runs). A summary of the program's moves."""

    kind: TransferKind
    stage: int
    action: Action

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}@{self.action}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The order and the program of one call (see the module doc). Immutable; cached by the
    runtime.

    ``per_device``: per device, its compute actions in order. ``program``: per device, every
    action the executor performs (default: ``per_device``, a CPU plan). ``deps``: for each action
    that waits for an action on another device (or for a compute action's data), the actions it
    reads, by key (default: the data dependencies of the order). ``stage_major``: the order of
    [Note: streaming]; ``recompute``: whether its backward runs re-run each stage;
    ``overlap_recompute``: whether a backward overlaps the next microbatch's recompute of the
    same stage (see [Note: overlapped recompute] in :mod:`roundpipe.runtime.stage_ops`); ``sizes``:
    what the program was lowered with; ``peak_bytes``: per device, the ledger's peak (stages and
    saved inputs; None without sizes)."""

    num_stages: int
    num_microbatch: int
    num_devices: int
    training: bool
    per_device: tuple[tuple[Action, ...], ...]
    stage_major: bool = False
    recompute: bool = True
    overlap_recompute: bool = False
    program: tuple[tuple[Action, ...], ...] | None = None
    deps: dict[tuple, tuple[Action, ...]] | None = None
    sizes: PlanSizes | None = None
    peak_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.program is None:
            object.__setattr__(self, "program", self.per_device)
        index = _check_unique(a for actions in self.per_device for a in actions)
        object.__setattr__(self, "_index", index)
        if self.deps is None:
            object.__setattr__(
                self, "deps", {a.key: self._data_dependencies(a) for a in index.values()}
            )

    # -- the order ------------------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """Whether this is a fused plan: one ``MICROBATCH`` action per microbatch."""
        return self.per_device[0][0].kind is ActionKind.MICROBATCH

    def actions(self) -> list[Action]:
        """All compute actions, in no particular order across devices."""
        return [a for actions in self.per_device for a in actions]

    def action(self, kind: ActionKind, stage: int, mb_index: int) -> Action:
        return self._index[(kind, stage, mb_index)]  # type: ignore[attr-defined]

    def overlapped_recomputes(self) -> frozenset[tuple[int, int]]:
        """With ``overlap_recompute``: the (stage, microbatch) of each ``BACKWARD`` during which
        the same stage's recompute of the next microbatch runs (see
        [Note: overlapped recompute] in :mod:`roundpipe.runtime.stage_ops`): those whose
        device's next compute action is that backward, with no reload of its input between."""
        if not self.overlap_recompute or self.program is None:
            return frozenset()
        found = set()
        for program in self.program:
            pending: Action | None = None  # the last backward, while only moves followed it
            for a in program:
                if a.kind is ActionKind.BACKWARD:
                    if pending is not None and (a.stage, a.mb_index) == (
                        pending.stage,
                        pending.mb_index + 1,
                    ):
                        found.add((pending.stage, pending.mb_index))
                    pending = a
                elif a.kind.computes or (
                    pending is not None
                    and a.kind is ActionKind.RELOAD
                    and (a.stage, a.mb_index) == (pending.stage, pending.mb_index + 1)
                ):
                    pending = None
        return frozenset(found)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions whose results ``action`` reads (across devices, through their ``H``)."""
        assert self.deps is not None
        return self.deps.get(action.key, ())

    def _data_dependencies(self, action: Action) -> tuple[Action, ...]:
        s, m, last = action.stage, action.mb_index, self.num_stages - 1
        kind = action.kind
        if kind is ActionKind.MICROBATCH:  # microbatches only meet in the gradient buffers
            return ()
        if kind is ActionKind.FORWARD or kind is ActionKind.LAST:
            return (self.action(ActionKind.FORWARD, s - 1, m),) if s > 0 else ()
        # BACKWARD(s, m): its own saved forward and the gradient of the stage after it.
        after = (
            self.action(ActionKind.LAST, last, m)
            if s + 1 == last
            else self.action(ActionKind.BACKWARD, s + 1, m)
        )
        return (self.action(ActionKind.FORWARD, s, m), after)

    # -- the program's moves, summarised --------------------------------------------------------
    def transfers(self, device: int | None = None) -> tuple[Transfer, ...]:
        """The weight uploads and gradient downloads of the program (of ``device``, or of every
        device in turn), in the order of the compute actions they serve (empty for a CPU
        plan)."""
        devices = range(self.num_devices) if device is None else (device,)
        return tuple(t for d in devices for t in self._transfers(d))

    def _transfers(self, device: int) -> list[Transfer]:
        assert self.program is not None
        out: list[tuple[int, int, Transfer]] = []
        compute = [a for a in self.program[device] if a.kind.computes]
        position = {a.key: i for i, a in enumerate(compute)}
        prev = None
        for a in self.program[device]:
            if a.kind in (ActionKind.UPLOAD, ActionKind.PREFETCH):
                user = next(c for c in compute if c.stage == a.stage and c.kind is a.of)
                out.append((position[user.key], 0, Transfer(TransferKind.UPLOAD, a.stage, user)))
            elif a.kind is ActionKind.DOWNLOAD and prev is not None:
                out.append((position[prev.key], 1, Transfer(TransferKind.DOWNLOAD, a.stage, prev)))
            if a.kind.computes:
                prev = a
        return [t for _, _, t in sorted(out, key=lambda x: x[:2])]

    def __str__(self) -> str:
        mode = "train" if self.training else "infer"
        order = ", stage-major" if self.stage_major else ""
        lines = [
            f"Plan({mode}, stages={self.num_stages}, microbatches={self.num_microbatch}, "
            f"devices={self.num_devices}{order})"
        ]
        assert self.program is not None
        for d, actions in enumerate(self.per_device):
            lines.append(f"  device {d}: " + " ".join(str(a) for a in actions))
            if self.program[d] != actions:
                moves = self._transfers(d)
                if moves:
                    lines.append(f"    moves {d}: " + " ".join(str(t) for t in moves))
                lines.append(f"    program {d}: " + " ".join(str(a) for a in self.program[d]))
            if (
                self.peak_bytes is not None
                and self.sizes is not None
                and self.sizes.budget is not None
            ):
                lines.append(
                    f"    ledger peak {d}: {self.peak_bytes[d]} of {self.sizes.budget} bytes"
                )
        return "\n".join(lines)


def simulate(plan: Plan, moves: bool = False) -> list[Action]:
    """Run ``plan``'s program without threads: each device takes its next action once every
    action it depends on has completed. Returns the completion order of the compute actions (of
    every action with ``moves``); raises ``RuntimeError`` on a deadlock."""
    assert plan.program is not None
    heads = [0] * plan.num_devices
    done: set = set()
    order: list[Action] = []
    total = sum(len(p) for p in plan.program)
    finished = 0
    while finished < total:
        progressed = False
        for d, actions in enumerate(plan.program):
            if heads[d] < len(actions):
                a = actions[heads[d]]
                if all(dep.key in done for dep in plan.dependencies(a)):
                    done.add(a.key)
                    if moves or a.kind.computes:
                        order.append(a)
                    heads[d] += 1
                    finished += 1
                    progressed = True
        if not progressed:
            stuck = [str(p[h]) for p, h in zip(plan.program, heads) if h < len(p)]
            raise RuntimeError(f"plan deadlocks; blocked heads: {stuck}\n{plan}")
    return order


def _check_unique(actions: Iterable[Action]) -> dict[tuple, Action]:
    seen: dict[tuple, Action] = {}
    for a in actions:
        if a.key in seen:
            raise AssertionError(f"action {a} scheduled twice; please report")
        seen[a.key] = a
    return seen


def stage_device(stage: int, num_devices: int) -> int:
    """Round-robin placement: stage ``s`` runs on device ``s % num_devices``."""
    return stage % num_devices


def device_stages(num_stages: int, num_devices: int) -> Sequence[Sequence[int]]:
    """Per device, the stages it runs."""
    return [list(range(d, num_stages, num_devices)) for d in range(num_devices)]
