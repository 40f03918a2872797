"""The execution plan: which stage runs on which device, for which microbatch, in which order.

This module only decides *order*; :mod:`roundpipe.runtime.execute` executes a plan on the device workers.
A plan is a list of small typed actions per device, printable as text (``str(plan)``), and can be
checked without threads (:func:`simulate`).

Actions (see [Note: the clock]):

* ``FORWARD(s, m)``: stage ``s`` forward of microbatch ``m``. In training with recompute on it
  keeps only the stage input: under ``torch.utils.checkpoint`` on CPU pools, without a graph
  (``no_grad``) on accelerator pools (see [Note: streaming]); without recompute it keeps the
  graph.
  In inference (:meth:`RoundPipe.forward`) every stage, the last included, is a ``FORWARD``.
* ``LAST(S-1, m)``: the last stage in training: forward with grad, ``loss_fn`` and backward in one
  action, so ``loss_fn`` runs exactly once per microbatch.
* ``BACKWARD(s, m)``: ``torch.autograd.grad`` through stage ``s``; with recompute on, the stage
  is first re-run from its saved input under the forward's RNG and autocast state (by autograd,
  through checkpoint, on CPU pools; by the worker itself on accelerator pools).
* ``MICROBATCH(m)``: a fused plan's only kind (one device, ``fuse_stages=True``): every stage's
  forward of microbatch ``m``, ``loss_fn``, and one backward through all of them (see
  [Note: fused stages] in :mod:`roundpipe.runtime.execute`). Printed ``M.m``: it has no single stage.

Orders: the clock order of [Note: the clock] (CPU pools), or the stage-major order of
[Note: streaming] (accelerator pools), whose plan also lists the weight uploads and gradient
downloads it implies (:meth:`Plan.transfers`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["ActionKind", "Action", "Plan", "Transfer", "TransferKind", "build_plan", "simulate",
           "partition", "stage_device", "stages_by_size"]


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
# copied in on a separate stream (next_upload): at most two stages' weights are on a device.
# A device's first upload (first_upload) has no run before it: it is queued on the copy stream
# as the call starts, ahead of the device's actions, once the step launched before the call has
# written its params, so it overlaps the host preparing the call and, on a device after the
# first, the wait for its first input. A next upload of the running stage itself (on every
# device but the last stage's, the backward run of its highest stage follows that stage's
# forward run) is copied in at the end of the run instead, once the run has written its
# buffers back (upload_after), while the device waits for the gradients from above.
# A device's actions are ordered by its stream, so the host waits for a device only after its
# last action of the call (needs_sync). An action whose output or input gradients another device
# reads records a device event (hands_off); the reader's copy waits for it on the device.
# Gradient downloads run on their own stream; the optimizer thread waits for their event before
# it adds them to the masters. Dependencies only point to lower stages in the forward pass and
# to higher stages (or the same stage's forward) in the backward pass, so a device never waits for
# an action that comes later in another device's list: no deadlock, and with several devices
# stage s+1 of microbatch 0 starts while stage s computes microbatch 1. All microbatches' stage
# inputs stay alive until their backward, as in any stage-major pipeline.


class TransferKind(enum.Enum):
    UPLOAD = "up"        # a stage's weights (and buffers) to its device, before the action
    DOWNLOAD = "down"    # a stage's summed gradients to the host, after the action


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A move that a stage-major plan implies, at ``action`` (see [Note: streaming])."""

    kind: TransferKind
    stage: int
    action: Action

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}@{self.action}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The per-device action lists of one call. Immutable; cached by the runtime.

    ``stage_major``: the order of [Note: streaming]; ``recompute``: whether its backward run
    re-runs each stage (so uploads the stage again)."""

    num_stages: int
    num_microbatch: int
    num_devices: int
    training: bool
    per_device: Tuple[Tuple[Action, ...], ...]
    stage_major: bool = False
    recompute: bool = True

    def __post_init__(self) -> None:
        index = _check_unique(a for actions in self.per_device for a in actions)
        object.__setattr__(self, "_index", index)
        run_ends = set()
        for actions in self.per_device:
            for a, nxt in zip(actions, actions[1:] + (None,)):
                if nxt is None or nxt.stage != a.stage or nxt.kind is not a.kind:
                    run_ends.add(a.key)
        object.__setattr__(self, "_run_ends", frozenset(run_ends))
        # The last action of each device (the host waits for it) and the actions that an action
        # on another device reads (they publish a device event); see [Note: streaming].
        object.__setattr__(self, "_syncs",
                           frozenset(actions[-1].key for actions in self.per_device if actions))
        object.__setattr__(self, "_handoffs", frozenset(
            dep.key for a in index.values() for dep in self.dependencies(a)
            if dep.device != a.device))
        # For each upload, the next upload on its device: what to prefetch while it computes;
        # each device's first upload, which has no run before it to hide behind; and for the
        # last action of a run, the upload that the device's next action starts with.
        next_up: Dict[Tuple, "Transfer"] = {}
        first_up: List[Optional["Transfer"]] = []
        up_after: Dict[Tuple, "Transfer"] = {}
        for d in range(self.num_devices):
            ups = [t for t in self._transfers(d) if t.kind is TransferKind.UPLOAD]
            first_up.append(ups[0] if ups else None)
            for t, nxt in zip(ups, ups[1:]):
                next_up[t.action.key] = nxt
            actions = self.per_device[d]
            at = {t.action.key: t for t in ups}
            for a, nxt_a in zip(actions, actions[1:]):
                if nxt_a.key in at:
                    up_after[a.key] = at[nxt_a.key]
        object.__setattr__(self, "_next_up", next_up)
        object.__setattr__(self, "_first_up", tuple(first_up))
        object.__setattr__(self, "_up_after", up_after)

    def needs_sync(self, action: Action) -> bool:
        """Whether the host waits for ``action``'s device work before publishing it: the last
        action of its device, which the host reads after the call."""
        return action.key in self._syncs  # type: ignore[attr-defined]

    def hands_off(self, action: Action) -> bool:
        """Whether an action on another device reads ``action``'s result (it then publishes a
        device event that the reader's copy waits for)."""
        return action.key in self._handoffs  # type: ignore[attr-defined]

    def next_upload(self, action: Action) -> "Optional[Transfer]":
        """At an upload (``action`` starts a run that uploads its stage): the next upload on the
        same device, which can be copied in while this run computes. None otherwise."""
        return self._next_up.get(action.key)  # type: ignore[attr-defined]

    def upload_after(self, action: Action) -> "Optional[Transfer]":
        """The upload that the action after ``action`` on its device starts with (``action``
        then ends a run); None if there is none. It may be of ``action``'s own stage: the
        backward run of a device's last stage before the loss follows its forward run."""
        return self._up_after.get(action.key)  # type: ignore[attr-defined]

    def first_upload(self, device: int) -> "Optional[Transfer]":
        """The first upload on ``device`` (at its first action), which can be copied in as the
        call starts; None for a device without actions or a clock-order plan."""
        return self._first_up[device]  # type: ignore[attr-defined]

    def ends_run(self, action: Action) -> bool:
        """Whether ``action`` is the last of a run of its stage and kind on its device (see
        [Note: streaming])."""
        return action.key in self._run_ends  # type: ignore[attr-defined]

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

    def transfers(self) -> Tuple[Transfer, ...]:
        """The weight uploads and gradient downloads of a stage-major plan, per device in
        execution order (see [Note: streaming]); empty for a clock-order (CPU) plan."""
        return tuple(t for d in range(self.num_devices) for t in self._transfers(d))

    def _transfers(self, device: int) -> List[Transfer]:
        if not self.stage_major:
            return []
        out: List[Transfer] = []
        actions = self.per_device[device]
        for i, a in enumerate(actions):
            prev = actions[i - 1] if i else None
            backward_pass = a.kind is ActionKind.BACKWARD
            new_run = prev is None or prev.stage != a.stage or prev.kind is not a.kind
            if new_run and (not backward_pass or self.recompute):
                out.append(Transfer(TransferKind.UPLOAD, a.stage, a))
            grads_done = (a.kind in (ActionKind.BACKWARD, ActionKind.LAST)
                          and a.mb_index == self.num_microbatch - 1)
            if grads_done and self.ends_run(a):
                out.append(Transfer(TransferKind.DOWNLOAD, a.stage, a))
        return out

    def __str__(self) -> str:
        mode = "train" if self.training else "infer"
        order = ", stage-major" if self.stage_major else ""
        lines = [f"Plan({mode}, stages={self.num_stages}, microbatches={self.num_microbatch}, "
                 f"devices={self.num_devices}{order})"]
        for d, actions in enumerate(self.per_device):
            lines.append(f"  device {d}: " + " ".join(str(a) for a in actions))
            moves = self._transfers(d)
            if moves:
                lines.append(f"    moves {d}: " + " ".join(str(t) for t in moves))
        return "\n".join(lines)


def stage_device(stage: int, num_devices: int) -> int:
    """Round-robin placement: stage ``s`` runs on device ``s % num_devices``."""
    return stage % num_devices


def build_plan(num_stages: int, num_microbatch: int, num_devices: int, training: bool,
               fuse_stages: bool = False, stage_major: bool = False,
               recompute: bool = True) -> Plan:
    """Build the plan of one ``forward_backward`` (``training=True``) or ``forward`` call.

    ``fuse_stages`` (training on one device only): one ``MICROBATCH`` action per microbatch
    instead of a forward and a backward per stage. ``stage_major``: the order of
    [Note: streaming], for accelerator pools (``recompute`` tells its transfers)."""
    for name, value in (("num_stages", num_stages), ("num_microbatch", num_microbatch),
                        ("num_devices", num_devices)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    S, M, D = num_stages, num_microbatch, num_devices
    if fuse_stages:
        if D != 1 or not training:
            raise ValueError(f"fuse_stages needs one device and training, got "
                             f"num_devices={D}, training={training}")
        if stage_major:
            raise ValueError("fuse_stages and stage_major exclude each other")
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
    if stage_major:  # see [Note: streaming]
        order = sorted(actions, key=lambda a: (1, -a.stage, a.mb_index)
                       if a.kind is ActionKind.BACKWARD else (0, a.stage, a.mb_index))
    elif D == 1:  # see [Note: the clock]
        order = sorted(actions, key=lambda a: (a.mb_index, a.time, a.stage))
    else:
        order = sorted(actions, key=lambda a: (a.time, a.stage))
    for a in order:
        per_device[a.device].append(a)
    return Plan(S, M, D, training, tuple(tuple(p) for p in per_device), stage_major,
                recompute)


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


def check_execute_plan(execute_plan: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``execute_plan`` is a non-empty list of positive ints."""
    plan = execute_plan
    if (isinstance(plan, (str, bytes)) or not hasattr(plan, "__len__") or len(plan) == 0
            or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in plan)):
        raise ValueError(f"execute_plan must be a non-empty list of positive ints (layers per "
                         f"stage), got {execute_plan!r}")


def partition(num_layers: int, execute_plan: Sequence[int] | None) -> List[Tuple[int, int]]:
    """Turn ``execute_plan`` (layers per stage, or None for one layer per stage) into
    ``[(first_layer, end_layer), ...]``; raises ``ValueError`` when it does not fit."""
    if execute_plan is None:
        return [(i, i + 1) for i in range(num_layers)]
    check_execute_plan(execute_plan)
    sizes = list(execute_plan)
    if sum(sizes) != num_layers:
        raise ValueError(
            f"execute_plan {sizes} covers {sum(sizes)} layers but the model has {num_layers}; "
            f"the numbers of layers per stage must sum to the layer count")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def stages_by_size(model: "torch.nn.Sequential", num_stages: Optional[int] = None,
                   max_stage_bytes: Optional[int] = None,
                   costs: Optional[Sequence[float]] = None) -> List[int]:
    """An ``execute_plan`` that groups the consecutive layers of ``model`` into stages of about
    equal parameter bytes, or equal ``costs``, so that a model of many small layers does not pay
    per-stage costs (an upload, a gradient download and an action per microbatch) for each
    layer.

    Give ``num_stages`` (that many stages, the largest as small as it can be; fewer when there
    are fewer layers with parameters), ``max_stage_bytes`` (as few stages as keep each under
    it, where a layer larger than it is a stage of its own), or both (``num_stages`` stages as
    balanced as they can be with each under ``max_stage_bytes``; ``ValueError`` naming the
    fewest stages the cap allows when ``num_stages`` is below it). Layers without parameters
    join the stage before them. With ``costs`` (one finite number >= 0 per layer, such as
    :func:`roundpipe.measure_layer_costs` returns), ``num_stages`` balances those instead of the
    bytes (a layer of cost 0 joins the stage before it), while ``max_stage_bytes``, if given,
    still caps each stage's parameter bytes: time balanced, memory bounded. ``costs`` need
    ``num_stages``. On an accelerator a running stage also holds its buffers and gradient sums
    (see ``device_memory_budget``), so its device bytes exceed its parameter bytes.
    Any thread; reads only the parameters' sizes. Use it as
    ``RoundPipeRunConfig(execute_plan=stages_by_size(seq, num_stages=8))``.
    """
    if num_stages is None and max_stage_bytes is None:
        raise ValueError("stages_by_size needs num_stages, max_stage_bytes, or both")
    layers = list(model.children()) if isinstance(model, torch.nn.Sequential) else None
    if not layers:
        raise ValueError("stages_by_size groups the children of a non-empty nn.Sequential")
    if costs is not None:
        costs = list(costs)
        bad = [i for i, c in enumerate(costs) if not isinstance(c, (int, float))
               or isinstance(c, bool) or not 0 <= c < float("inf")]
        if len(costs) != len(layers) or bad:
            got = (f"costs[{bad[0]}] = {costs[bad[0]]!r}" if bad
                   else f"{len(costs)} values for {len(layers)} layers")
            raise ValueError(f"costs must be one finite number >= 0 per layer, got {got}")
        if num_stages is None:
            raise ValueError("costs balance a number of stages: give num_stages too "
                             "(max_stage_bytes alone makes as few stages as fit under it)")
    sizes, seen = [], set()
    for layer in layers:
        size = 0
        for p in layer.parameters():
            # A parameter shared by two layers counts where it first appears.
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel() * p.element_size()
        sizes.append(size)
    if max_stage_bytes is not None and (not isinstance(max_stage_bytes, int)
                                        or isinstance(max_stage_bytes, bool)
                                        or max_stage_bytes < 1):
        raise ValueError(f"max_stage_bytes must be a positive int, got {max_stage_bytes!r}")
    if num_stages is None:
        return _greedy_groups(sizes, max_stage_bytes)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    # What num_stages balances: the bytes, or the costs in integer units for the search below,
    # where a layer of positive cost costs at least 1 unit, so only a cost of 0 is free.
    weights = sizes
    if costs is not None:
        top = max(costs) or 1.0
        weights = [max(1, round(c / top * 1_000_000_000)) if c > 0 else 0 for c in costs]
    cap = (sizes, max_stage_bytes) if max_stage_bytes is not None else None
    fewest = len(_greedy_groups(weights, max(sum(weights), 1), cap))
    if fewest > num_stages:
        raise ValueError(f"max_stage_bytes={max_stage_bytes} needs at least {fewest} stages, "
                         f"num_stages={num_stages} asks for fewer: give num_stages >= {fewest} "
                         f"or a larger max_stage_bytes")
    # The smallest capacity whose greedy grouping (under the cap) needs at most num_stages
    # stages; greedy needs the fewest stages for a capacity, and no more for a larger one.
    lo, hi = max(weights), max(sum(weights), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_groups(weights, mid, cap)) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    groups = _greedy_groups(weights, lo, cap)
    # Fewer stages than asked (the largest layer set the capacity): split the heaviest stage
    # that holds two layers with a weight, which never makes the largest stage larger, nor
    # any stage's bytes.
    while len(groups) < num_stages:
        bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
        splittable = [i for i in range(len(groups))
                      if sum(1 for b in weights[bounds[i]:bounds[i + 1]] if b) >= 2]
        if not splittable:
            break
        i = max(splittable, key=lambda j: sum(weights[bounds[j]:bounds[j + 1]]))
        part = weights[bounds[i]:bounds[i + 1]]
        cut = min((c for c in range(1, len(part)) if sum(part[:c]) and sum(part[c:])),
                  key=lambda c: (max(sum(part[:c]), sum(part[c:])), -c))
        groups[i:i + 1] = [cut, len(part) - cut]
    return groups


def _greedy_groups(weights: Sequence[int], capacity: int,
                   cap: Optional[Tuple[Sequence[int], int]] = None) -> List[int]:
    """Layers per stage: fill each stage up to ``capacity`` in ``weights``, in order, and with
    ``cap`` = (bytes per layer, max bytes) up to that many bytes too. A layer with no weight
    (and no bytes) joins the stage before it."""
    groups: List[int] = []
    total = nbytes = count = 0
    for i, w in enumerate(weights):
        b = cap[0][i] if cap is not None else 0
        full = (w and total + w > capacity) or (cap is not None and b and nbytes + b > cap[1])
        if count and full:
            groups.append(count)
            total = nbytes = count = 0
        total += w
        nbytes += b
        count += 1
    groups.append(count)
    return groups
