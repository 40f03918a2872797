"""What the facade asks of memory for a call: :meth:`RoundPipe.memory_plan` (plan a call
before it runs) and the device check at the first ``forward_backward`` on an accelerator pool.
The counting itself is :mod:`roundpipe.memory.report`'s; this module builds its
:class:`PlannedCall` from what the runtime already has (a :class:`ModelParts`, or the
:class:`CallSpec` of a call about to run). Main thread.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from roundpipe.devices import DevicePool
from roundpipe.devices.pinned import PinnedAllocator, pool_layout
from roundpipe.memory.checks import check_device_memory
from roundpipe.memory.host import DATA_PARALLEL_BUCKETS, HostTerms, host_terms
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.report import (
    MemoryPlan,
    PlannedCall,
    make_memory_plan,
    plan_devices,
    reusing_memo,
    trace_call,
)
from roundpipe.microbatch import split_inputs, split_label
from roundpipe.runtime.call import (
    CallSpec,
    ModelParts,
    device_grad_dtype,
    plan_call,
    takes_microbatch,
)
from roundpipe.runtime.config import ResolvedRunConfig
from roundpipe.runtime.grad_router import grad_dtype_of
from roundpipe.runtime.placement import MasterPlacement
from roundpipe.runtime.stages import Layer

__all__ = [
    "CallArgs",
    "attach_data_parallel",
    "check_call_memory",
    "data_parallel_buckets",
    "memory_plan_of",
    "pinned_allocator",
    "sharding_terms",
]


def pinned_allocator(pool: DevicePool) -> PinnedAllocator | None:
    """The pinned allocator of an accelerator pool (None: a CPU pool pins nothing)."""
    return pool.accelerators[0].pinned if pool.streaming else None


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """The arguments of the ``forward_backward`` a memory plan is made for."""

    args: tuple
    kwargs: dict
    label: Any
    loss_fn: Callable | None
    return_outputs: bool


def _planned_call(parts: ModelParts, cfg: ResolvedRunConfig, call: CallArgs) -> PlannedCall:
    args, kwargs, label, loss_fn = call.args, call.kwargs, call.label, call.loss_fn
    chunks: list = []
    sizes: list[int] = []
    labels: list = []
    if args or kwargs:
        chunks, sizes = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        labels = split_label(label, cfg.num_microbatch, sizes, cfg.split_label)
    stages, autocast, plan = plan_call(parts, cfg, True, chunks or None)
    return PlannedCall(
        stages=stages,
        plan=plan,
        pool=parts.pool,
        chunks=chunks,
        sizes=sizes,
        labels=labels,
        loss_fn=loss_fn,
        loss_takes_microbatch=loss_fn is not None and takes_microbatch(loss_fn),
        cast_dtype=parts.cast_dtype,
        autocast=autocast,
        grad_dtype=device_grad_dtype(parts.pool, cfg),
        training=True,
        return_outputs=call.return_outputs,
    )


def _pinned_grad_bytes(call: PlannedCall, pinned: PinnedAllocator | None) -> int | None:
    """Host bytes of the masters' gradients on an accelerator pool, where each stage's are
    downloaded into one pinned pool and adopted as the masters' ``.grad`` (None: not
    adopted, or a CPU pool)."""
    if pinned is None:
        return None
    dtype = call.grad_dtype
    total = 0
    for stage in call.stages:
        sizes = []
        for rec in stage.params:
            if rec.master is None or not rec.param.requires_grad:
                continue
            held = grad_dtype_of(rec.master)  # [Note: gradients in their summed dtype]
            if (rec.master.dtype if dtype is None else dtype) != held:
                return None
            sizes.append(rec.master.numel() * held.itemsize)
        total += pool_layout(sizes, pinned).taken
    return total


def sharding_terms(
    pool: DevicePool, placement: MasterPlacement | None, layers: Sequence[Layer]
) -> dict[str, Any]:
    """:func:`host_terms`'s ``ranks`` and ``layers`` for a model with ``placement`` on
    ``pool`` (a pool other than one CPU device hands the gradients over stage by stage), and
    its ``masters_dir`` and ``masters_buffer`` when it keeps the masters in files."""
    ranks = placement.world_size if placement is not None else 1
    by_stage = ranks > 1 and (pool.streaming or len(pool) > 1)
    terms: dict[str, Any] = {
        "ranks": ranks,
        "layers": [layer.module for layer in layers] if by_stage else None,
    }
    if placement is not None and placement.masters_dir is not None:
        terms["masters_dir"] = placement.masters_dir
        terms["masters_buffer"] = placement.copy_buffer_bytes
    return terms


def memory_plan_of(
    parts: ModelParts,
    module: nn.Module,
    optim_dtype: torch.dtype | None,
    cfg: ResolvedRunConfig,
    call: CallArgs,
    ranks: int = 1,
    layers: Sequence[nn.Module] | None = None,
    masters_dir: str | None = None,
    masters_buffer: int | None = None,
    buckets: tuple[int, int] | None = None,
) -> MemoryPlan:
    """:meth:`RoundPipe.memory_plan`: the host terms of ``module`` (``ranks``, ``layers``,
    ``masters_dir``, ``masters_buffer``: see :func:`sharding_terms`; ``buckets``: the bucket
    cap and buckets in flight of the DataParallel attached to it, see
    :func:`data_parallel_buckets`) and the planned call."""
    pinned = pinned_allocator(parts.pool)
    data_parallel = ranks > 1 or buckets is not None or _data_parallel_open()
    buckets = buckets or DATA_PARALLEL_BUCKETS

    def terms_of_module() -> HostTerms:
        return host_terms(
            module,
            optim_dtype,
            pinned,
            None,
            ranks,
            layers,
            masters_dir,
            masters_buffer,
            data_parallel=data_parallel,
            buckets=buckets,
        )

    memo = reusing_memo()  # a search plans one model many times: its terms once
    if memo is None:
        terms = terms_of_module()
    else:
        key = (
            id(module),
            optim_dtype,
            id(pinned),
            ranks,
            tuple(map(id, layers or ())),
            masters_dir,
            masters_buffer,
            data_parallel,
            buckets,
        )
        terms = memo.host_terms(key, terms_of_module)
    terms = dataclasses.replace(terms, available=host_memory_available())
    planned = _planned_call(parts, cfg, call)
    # Sharded, a rank keeps its share of the sums, not the pinned downloads of all of them.
    grads_pinned = _pinned_grad_bytes(planned, pinned) if ranks == 1 else None
    plan = make_memory_plan(parts.tag, terms, planned, grads_pinned)
    if parts.pool.memory_in_host:
        # The emulated device's memory is the host's (see [Note: what the host plan counts]).
        host = dataclasses.replace(plan.host, emulated_device=sum(d.peak for d in plan.devices))
        plan = dataclasses.replace(plan, host=host)
    return plan


# The bucket cap in bytes and buckets in flight of the DataParallel attached to each RoundPipe:
# what its memory plan counts (roundpipe.distributed.DataParallel sets and clears them).
_DATA_PARALLEL: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def attach_data_parallel(model: Any, buckets: tuple[int, int] | None) -> None:
    """Record that a DataParallel with ``buckets`` (cap in bytes, buckets in flight) is attached
    to ``model``, a RoundPipe (None: detached). Main thread."""
    if buckets is None:
        _DATA_PARALLEL.pop(model, None)
    else:
        _DATA_PARALLEL[model] = buckets


def data_parallel_buckets(model: Any) -> tuple[int, int] | None:
    """The bucket cap in bytes and buckets in flight of the DataParallel attached to ``model``
    (a RoundPipe), None if none is. Main thread."""
    return _DATA_PARALLEL.get(model)


def _data_parallel_open() -> bool:
    """Whether a :class:`roundpipe.distributed.DataParallel` is open in this process (one
    data-parallel group per process: the model planned is the one it reduces for)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from roundpipe.distributed.group import data_parallel_rank  # the package imports the runtime

    return data_parallel_rank() is not None


def check_call_memory(spec: CallSpec, what: str, cfg: ResolvedRunConfig) -> None:
    """Raise :class:`roundpipe.DeviceMemoryError` before anything of the call ``spec`` is
    allocated if its planned peak does not fit a device. The user's ``loss_fn`` is not called
    (it may count or log its calls): a stand-in loss is traced instead, and a stage fake
    tensors cannot run counts no activations (no real run either), so the check never refuses
    a run on what it could not see."""
    shared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(PlannedCall)}
    call = PlannedCall(**{**shared, "loss_fn": None, "loss_takes_microbatch": False})
    check_device_memory(plan_devices(call, trace_call(call, real_runs=False)), what, cfg)
