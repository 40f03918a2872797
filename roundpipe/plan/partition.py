"""Partitions: which consecutive layers form each stage (``execute_plan``), and
:func:`stages_by_size`, which makes one by bytes or by measured costs. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_execute_plan", "partition", "stages_by_size"]


def check_execute_plan(execute_plan: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``execute_plan`` is a non-empty list of positive ints."""
    plan = execute_plan
    if (
        isinstance(plan, (str, bytes))
        or not hasattr(plan, "__len__")
        or len(plan) == 0
        or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in plan)
    ):
        raise ValueError(
            f"execute_plan must be a non-empty list of positive ints (layers per "
            f"stage), got {execute_plan!r}"
        )


def partition(num_layers: int, execute_plan: Sequence[int] | None) -> list[tuple[int, int]]:
    """Turn ``execute_plan`` (layers per stage, or None for one layer per stage) into
    ``[(first_layer, end_layer), ...]``; raises ``ValueError`` when it does not fit."""
    if execute_plan is None:
        return [(i, i + 1) for i in range(num_layers)]
    check_execute_plan(execute_plan)
    sizes = list(execute_plan)
    if sum(sizes) != num_layers:
        raise ValueError(
            f"execute_plan {sizes} covers {sum(sizes)} layers but the model has {num_layers}; "
            f"the numbers of layers per stage must sum to the layer count"
        )
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def stages_by_size(
    model: torch.nn.Sequential,
    num_stages: int | None = None,
    max_stage_bytes: int | None = None,
    costs: Sequence[float] | None = None,
) -> list[int]:
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
        bad = [
            i
            for i, c in enumerate(costs)
            if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 <= c < float("inf")
        ]
        if len(costs) != len(layers) or bad:
            got = (
                f"costs[{bad[0]}] = {costs[bad[0]]!r}"
                if bad
                else f"{len(costs)} values for {len(layers)} layers"
            )
            raise ValueError(f"costs must be one finite number >= 0 per layer, got {got}")
        if num_stages is None:
            raise ValueError(
                "costs balance a number of stages: give num_stages too "
                "(max_stage_bytes alone makes as few stages as fit under it)"
            )
    sizes, seen = [], set()
    for layer in layers:
        size = 0
        for p in layer.parameters():
            # A parameter shared by two layers counts where it first appears.
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel() * p.element_size()
        sizes.append(size)
    if max_stage_bytes is not None and (
        not isinstance(max_stage_bytes, int)
        or isinstance(max_stage_bytes, bool)
        or max_stage_bytes < 1
    ):
        raise ValueError(f"max_stage_bytes must be a positive int, got {max_stage_bytes!r}")
    if num_stages is None:
        assert max_stage_bytes is not None  # checked above
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
        raise ValueError(
            f"max_stage_bytes={max_stage_bytes} needs at least {fewest} stages, "
            f"num_stages={num_stages} asks for fewer: give num_stages >= {fewest} "
            f"or a larger max_stage_bytes"
        )
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
        splittable = [
            i
            for i in range(len(groups))
            if sum(1 for b in weights[bounds[i] : bounds[i + 1]] if b) >= 2
        ]
        if not splittable:
            break
        i = max(splittable, key=lambda j: sum(weights[bounds[j] : bounds[j + 1]]))
        part = weights[bounds[i] : bounds[i + 1]]
        cut = min(
            (c for c in range(1, len(part)) if sum(part[:c]) and sum(part[c:])),
            key=lambda c: (max(sum(part[:c]), sum(part[c:])), -c),
        )
        groups[i : i + 1] = [cut, len(part) - cut]
    return groups


def _greedy_groups(
    weights: Sequence[int], capacity: int, cap: tuple[Sequence[int], int] | None = None
) -> list[int]:
    """Layers per stage: fill each stage up to ``capacity`` in ``weights``, in order, and with
    ``cap`` = (bytes per layer, max bytes) up to that many bytes too. A layer with no weight
    (and no bytes) joins the stage before it."""
    groups: list[int] = []
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
