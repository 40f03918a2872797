"""The execution plan: which stage runs on which device, for which microbatch, in which order.

This module only decides *order*; :mod:`roundpipe.runtime` executes a plan on the device workers.
A plan is a list of small typed actions per device, printable as text (``str(plan)``), and can be
checked without threads (:func:`simulate`).

Actions (see [Note: the clock]):

* ``FORWARD(s, m)``: stage ``s`` forward of microbatch ``m``. In training with recompute on it
  runs under ``torch.utils.checkpoint`` and keeps only the stage input; without recompute it
  keeps the graph.
  In inference (:meth:`RoundPipe.forward`) every stage, the last included, is a ``FORWARD``.
* ``LAST(S-1, m)``: the last stage in training: forward with grad, ``loss_fn`` and backward in one
  action, so ``loss_fn`` runs exactly once per microbatch.
* ``BACKWARD(s, m)``: ``torch.autograd.grad`` through stage ``s``; with recompute on, autograd
  first re-runs the stage from its saved input (under the forward's RNG and autocast state).
* ``MICROBATCH(m)``: a fused plan's only kind (one device, ``fuse_stages=True``): every stage's
  forward of microbatch ``m``, ``loss_fn``, and one backward through all of them (see
  [Note: fused stages] in :mod:`roundpipe.runtime`). Printed ``M.m``: it has no single stage.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Iterable, List, Sequence, Tuple

__all__ = ["ActionKind", "Action", "Plan", "build_plan", "simulate", "partition", "stage_device"]


class ActionKind(enum.Enum):
    FORWARD = "F"
    LAST = "L"
    BACKWARD = "B"
    MICROBATCH = "M"


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` of ``stage`` for microbatch ``mb_index`` on worker ``device``.

    ``time`` is the clock tick of [Note: the clock]; actions of one device run in (time, stage)
    order.
    """

    kind: ActionKind
    stage: int
    mb_index: int
    device: int
    time: int

    @property
    def key(self) -> Tuple[ActionKind, int, int]:
        return (self.kind, self.stage, self.mb_index)

    def __str__(self) -> str:
        if self.kind is ActionKind.MICROBATCH:
            return f"M.{self.mb_index}"
        return f"{self.kind.value}{self.stage}.{self.mb_index}"


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """The per-device action lists of one call. Immutable; cached by the runtime."""

    num_stages: int
    num_microbatch: int
    num_devices: int
    training: bool
    per_device: Tuple[Tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        index = _check_unique(a for actions in self.per_device for a in actions)
        object.__setattr__(self, "_index", index)

    @property
    def fused(self) -> bool:
        """Whether this is a fused plan: one ``MICROBATCH`` action per microbatch."""
        return self.per_device[0][0].kind is ActionKind.MICROBATCH

    def actions(self) -> List[Action]:
        """All actions, in no particular order across devices."""
        return [a for actions in self.per_device for a in actions]

    def action(self, kind: ActionKind, stage: int, mb_index: int) -> Action:
        return self._index[(kind, stage, mb_index)]  # type: ignore[attr-defined]

    def dependencies(self, action: Action) -> Tuple[Action, ...]:
        """The actions whose results ``action`` reads."""
        s, m, last = action.stage, action.mb_index, self.num_stages - 1
        kind = action.kind
        if kind is ActionKind.MICROBATCH:  # microbatches only meet in the gradient buffers
            return ()
        if kind is ActionKind.FORWARD or kind is ActionKind.LAST:
            return (self.action(ActionKind.FORWARD, s - 1, m),) if s > 0 else ()
        # BACKWARD(s, m): its own saved forward and the gradient of the stage after it.
        after = (self.action(ActionKind.LAST, last, m) if s + 1 == last
                 else self.action(ActionKind.BACKWARD, s + 1, m))
        return (self.action(ActionKind.FORWARD, s, m), after)

    def __str__(self) -> str:
        mode = "train" if self.training else "infer"
        lines = [f"Plan({mode}, stages={self.num_stages}, microbatches={self.num_microbatch}, "
                 f"devices={self.num_devices})"]
        for d, actions in enumerate(self.per_device):
            lines.append(f"  device {d}: " + " ".join(str(a) for a in actions))
        return "\n".join(lines)


def stage_device(stage: int, num_devices: int) -> int:
    """Round-robin placement: stage ``s`` runs on device ``s % num_devices``."""
    return stage % num_devices


def build_plan(num_stages: int, num_microbatch: int, num_devices: int, training: bool,
               fuse_stages: bool = False) -> Plan:
    """Build the plan of one ``forward_backward`` (``training=True``) or ``forward`` call.

    ``fuse_stages`` (training on one device only): one ``MICROBATCH`` action per microbatch
    instead of a forward and a backward per stage."""
    for name, value in (("num_stages", num_stages), ("num_microbatch", num_microbatch),
                        ("num_devices", num_devices)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    S, M, D = num_stages, num_microbatch, num_devices
    if fuse_stages:
        if D != 1 or not training:
            raise ValueError(f"fuse_stages needs one device and training, got "
                             f"num_devices={D}, training={training}")
        fused = tuple(Action(ActionKind.MICROBATCH, 0, m, 0, m) for m in range(M))
        return Plan(S, M, D, training, (fused,))
    actions: List[Action] = []

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
    per_device: List[List[Action]] = [[] for _ in range(D)]
    if D == 1:  # see [Note: the clock]
        order = sorted(actions, key=lambda a: (a.mb_index, a.time, a.stage))
    else:
        order = sorted(actions, key=lambda a: (a.time, a.stage))
    for a in order:
        per_device[a.device].append(a)
    return Plan(S, M, D, training, tuple(tuple(p) for p in per_device))


def simulate(plan: Plan) -> List[Action]:
    """Run ``plan`` without threads: each device takes its next action once every dependency
    has completed. Returns the completion order; raises ``RuntimeError`` on a deadlock."""
    heads = [0] * plan.num_devices
    done: set = set()
    order: List[Action] = []
    total = sum(len(p) for p in plan.per_device)
    while len(order) < total:
        progressed = False
        for d, actions in enumerate(plan.per_device):
            if heads[d] < len(actions):
                a = actions[heads[d]]
                if all(dep.key in done for dep in plan.dependencies(a)):
                    done.add(a.key)
                    order.append(a)
                    heads[d] += 1
                    progressed = True
        if not progressed:
            stuck = [str(p[h]) for p, h in zip(plan.per_device, heads) if h < len(p)]
            raise RuntimeError(f"plan deadlocks; blocked heads: {stuck}\n{plan}")
    return order


def _check_unique(actions: Iterable[Action]) -> Dict[Tuple, Action]:
    seen: Dict[Tuple, Action] = {}
    for a in actions:
        if a.key in seen:
            raise AssertionError(f"action {a} scheduled twice; please report")
        seen[a.key] = a
    return seen


def partition(num_layers: int, execute_plan: Sequence[int] | None) -> List[Tuple[int, int]]:
    """Turn ``execute_plan`` (layers per stage, or None for one layer per stage) into
    ``[(first_layer, end_layer), ...]``; raises ``ValueError`` when it does not fit."""
    if execute_plan is None:
        return [(i, i + 1) for i in range(num_layers)]
    sizes = list(execute_plan)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(
            f"execute_plan must be a non-empty list of positive ints (layers per stage), "
            f"got {execute_plan!r}")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"execute_plan {sizes} covers {sum(sizes)} layers but the model has {num_layers}; "
            f"the numbers of layers per stage must sum to the layer count")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds
