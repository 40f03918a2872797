"""The host RAM a wrapped model takes, term by term: :func:`host_terms` and :class:`HostTerms`
(weights, masters, their gradients, an Adam-sized optimizer state, the pinned pool's slack, the
activations held on the host, a data-parallel run's reduction buffers
(:func:`data_parallel_bytes`), the runtime's own memory, and on the emulated device its
memory), the masters' dtype rule (:func:`master_dtype_of`) and how bytes are written
(:func:`format_bytes`). Main thread (wrap time), except the pure helpers.

What the terms leave out, and how close they come to a process's RSS: see
[Note: what the host plan counts]."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from roundpipe.devices.packed import logical_numel
from roundpipe.devices.pinned import (
    PinnedAllocator,
    module_tensors,
    pinned_layout,
    pool_layout,
    storage_bytes,
)

__all__ = [
    "DATA_PARALLEL_BUCKETS",
    "DATA_PARALLEL_BUCKET_BYTES",
    "DATA_PARALLEL_IN_FLIGHT",
    "HostTerms",
    "OPTIM_STATES",
    "adam_state_bytes",
    "MASTERS_COPY_BUFFER_BYTES",
    "RUNTIME_BYTES",
    "SPILL_BUFFER_BYTES",
    "data_parallel_bytes",
    "format_bytes",
    "host_terms",
    "master_dtype_of",
    "stage_grad_bytes",
]

#: the default buffer Adam's state in files streams through (``Adam(state_buffer_bytes=)``)
SPILL_BUFFER_BYTES = 256 << 20
#: the default buffer the master->model copy streams masters in files through
#: (``MastersOnDisk(copy_buffer_bytes=)``)
MASTERS_COPY_BUFFER_BYTES = 64 << 20
#: what roundpipe itself adds to a process's host memory besides the model's state, whatever
#: the model's size: its threads (their stacks and heaps), the code and libraries a wrap and
#: the first iterations load, the stages' and plans' Python objects; measured 17 to 22 MiB on
#: the CPU and the emulated device (benchmarks/bench_host_memory.py), rounded up. It leaves
#: out an accelerator's own libraries (CUDA's context, cuBLAS), loaded before the wrap
#: measures what is available or by the first call, per process.
RUNTIME_BYTES = 32 << 20
#: DataParallel's defaults (``bucket_cap_mb=25``, ``buckets_in_flight=2``; it takes them from
#: here), which the plan assumes for a data-parallel run's buffers
DATA_PARALLEL_BUCKET_BYTES = 25 << 20
DATA_PARALLEL_IN_FLIGHT = 2
#: both, as ``host_terms``' ``buckets``: (cap in bytes, buckets in flight)
DATA_PARALLEL_BUCKETS = (DATA_PARALLEL_BUCKET_BYTES, DATA_PARALLEL_IN_FLIGHT)


# [Note: what the host plan counts]
# The host terms are what the wrap and training allocate and keep: the masters, their
# gradients (on an accelerator the pinned pools the downloads land in, which CUDA's caching
# host allocator, and the emulated one, keep for reuse once a step frees them) and the next
# call's, which an asynchronous step overlaps with (see below), Adam's two
# moments, the pinned pool's slack, the activations a call keeps on the host, a
# data-parallel run's reduction buffers, and a constant for the runtime itself
# (RUNTIME_BYTES). Held to a process's RSS growth over the wrap and two iterations (after
# malloc_trim) on the emulated device (benchmarks/bench_host_memory.py), the storages
# roundpipe holds equal these terms; the rest of the growth is the runtime's constant, and
# on the emulator its device's memory: an emulated device's tensors are host tensors, computed
# on the threads that run its work, and glibc keeps what those threads freed in their own
# arenas (malloc_trim does not shrink a thread's heap below its top), up to the device's
# peak. So on an emulated pool the plan counts its devices' planned peaks as host memory
# too (``emulated_device``); on a GPU that memory is the device's. Not counted: transients
# that are freed before a call returns (the optimizer step's temporaries, the wrap check's
# fp32 copy of a cut of the model), which a peak (VmHWM) shows and RSS after it does not; the
# emulator's copies of data in flight (it snapshots every asynchronous copy); and an
# accelerator's libraries (see RUNTIME_BYTES). Measured at the moment the plan is for (a
# slow step let go with both sets of gradients alive) without the emulator's memory, the plan
# is within 1% in one process and on replicated ranks; a sharded rank holds 5-12% more than
# planned: freed download blocks the pinned cache keeps in size classes the next stage does
# not ask for, and the reducer's freed copies of the owned sums that glibc keeps resident in
# its thread's heap. The plan names a margin for them (see [Note: the sharded sums' slack]).


# [Note: the next call's gradients]
# An asynchronous step (model.step(fn), the default) holds the masters' gradients until its
# zero_grad, while the next forward_backward already computes: each stage's sums of that call
# are handed over (downloaded into pinned memory on an accelerator, summed in host buffers on
# a CPU pool) as its backward produces them, and their move into the masters waits behind the
# step. So when the step outlasts the next call's forward, which is the rule for models of
# billions of parameters (an 8B model's step takes seconds on a desktop's memory bandwidth),
# two sets of gradients are alive at once, and the pinned pool keeps both for reuse. The plan
# counts the second set (this rank's masters' bytes: sharded, the sums installed for the
# other ranks' shares are sent, not kept), since it cannot know which step the loop will call
# and the asynchronous one is the default; a synchronous step (model.step(fn,
# is_async=False)) holds one set. Measured exactly on the emulated device
# (tests/test_host_memory.py): a step held until the next call downloaded its last stage's
# sums grew the pool by the next weights and a second set of gradients.


# [Note: the sharded sums' slack]
# A sharded rank (ShardedState on an accelerator pool or several devices) downloads each
# stage's sums whole into a pinned pool, keeps its own and hands the rest to their owners; the
# plan counts its share of both sets and two layers' sums in flight. Measured at the moment a
# slow step is let go (benchmarks/bench_host_memory.py, two ranks of a 34M-parameter llama
# shape), the rank held more than that: the pinned cache keeps freed download blocks in size
# classes the next stage does not ask for (12-24 MiB), and the reducer's copies of the owned
# sums churn through its thread's heap, where glibc keeps some of the freed ones resident
# (18-60 MiB, varying from run to run); the plan was 5-12% short, 0.8 to 1.8 of its largest
# layer's sums. Neither is simulated: the plan names a margin of one layer's sums for them, in
# its output (with it, one run measured 0.91x and 1.08x).


def format_bytes(nbytes: float) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``512 B``: for reports and messages."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"


@dataclasses.dataclass(frozen=True)
class HostTerms:
    """The host RAM of a wrapped model, term by term (bytes).

    ``weights``: the model's own parameters and buffers (allocated already, by the caller),
    a packed (quantized) weight as its packed bytes plus its quantization state;
    ``masters``: the master copies of the trainable parameters (``optim_dtype``) this process
    holds: all of them, or with ``ranks`` > 1 (sharded state) the largest rank's share; with
    ``masters_dir`` (:class:`roundpipe.MastersOnDisk`) they are in files there and this is the
    buffer the master->model copy streams them through;
    ``grads``: the masters' gradients (one per trainable parameter, in its master's dtype);
    sharded (``ranks`` > 1) with the gradients handed over stage by stage (``grads_by_stage``:
    a pool of accelerators or of several CPU devices, see [Note: sharded state] in
    :mod:`roundpipe.distributed.sharded`), this rank's share plus two layers' sums on their way to
    their owners; one CPU device's fused call hands every sum at its end, so all of them;
    ``optimizer``: the optimizer's state, estimated as Adam's: two moments per held master in
    its dtype (``optim_states`` "exact"), in bf16 ("bf16"), or 8-bit with an fp32 absmax per
    block of 256 ("8bit"; parameters under 4096 elements exact), as
    ``roundpipe.optim.AdamW(state_dtype=...)`` keeps them; or, with ``optimizer_dir``
    (``Adam(state_dir=...)``), the host buffer it streams through;
    ``next_weights``: the second low-precision copy of the held parameters that roundpipe's
    one-pass asynchronous step writes while the next iteration computes with the first (see
    [Note: the copy in the step] in :mod:`roundpipe.runtime.step_copy`; 0 with the masters in
    files, whose step does not write it);
    ``next_grads``: the gradients of the next call, made while an asynchronous step still
    holds these (see [Note: the next call's gradients]): as many bytes as this rank's masters'
    gradients (all of them unsharded, its share sharded);
    ``pinned_overhead``: what the pinned pool takes beyond the weights' bytes (padding and
    block slack, see [Note: the pinned pool]; 0 on a CPU pool, which pins nothing);
    ``activations``: host bytes of stage inputs offloaded to the host (or, on a CPU pool, the
    activations), when known (``memory_plan`` with inputs), else 0;
    ``data_parallel``: a :class:`roundpipe.distributed.DataParallel`'s reduction buffers, with
    its bucket cap and buckets in flight (``buckets``, bytes and count: the attached one's, else
    its defaults; :func:`data_parallel_bytes`; 0 without one);
    ``layer_grads``: the largest gradient sum one layer (stage) hands over, in the masters'
    dtype: sharded with the gradients handed over stage by stage, the margin
    :attr:`sums_slack` is one of them; unsharded, what the advice to shard counts
    (:func:`ranks_to_fit`);
    ``grads_dtype``: the dtype the gradients are held in where it is not the masters' (summed
    in bf16 or fp16 and handed to the step so, see [Note: gradients in their summed dtype] in
    :mod:`roundpipe.runtime.grad_router`; None: the masters');
    ``runtime``: roundpipe's own memory besides the state (:data:`RUNTIME_BYTES`);
    ``emulated_device``: on the emulated accelerator, whose memory is host memory, its
    devices' planned peaks (0 elsewhere; see [Note: what the host plan counts]);
    ``share``: with ``ranks`` > 1, the part of all the masters the largest share holds.
    ``available``: :func:`host_memory_available` when measured (None: unknown);
    ``weights_allocated``: whether the weights exist already (a model being wrapped) or are
    still to be allocated (a plan from a config), in which case they count against
    ``available`` too."""

    weights: int
    masters: int
    grads: int
    optimizer: int
    pinned_overhead: int
    activations: int = 0
    trainable_numel: int = 0
    frozen_numel: int = 0
    master_dtype: torch.dtype | None = None
    available: int | None = None
    weights_allocated: bool = True
    ranks: int = 1
    optimizer_dir: str | None = None
    grads_by_stage: bool = False
    masters_dir: str | None = None
    next_weights: int = 0
    next_grads: int = 0
    optim_states: str = "exact"
    data_parallel: int = 0
    buckets: tuple[int, int] = DATA_PARALLEL_BUCKETS
    runtime: int = 0
    emulated_device: int = 0
    share: float | None = None
    layer_grads: int = 0
    grads_dtype: torch.dtype | None = None

    @property
    def sums_slack(self) -> int:
        """Sharded with the gradients handed over stage by stage, a margin of one layer's
        sums for what the allocators keep of the sums on their way
        (see [Note: the sharded sums' slack]); 0 otherwise."""
        return self.layer_grads if self.ranks > 1 and self.grads_by_stage else 0

    @property
    def new_bytes(self) -> int:
        """What is still to be allocated: what wrapping and training add to the host, and the
        weights when they do not exist yet."""
        added = (
            self.masters
            + self.grads
            + self.optimizer
            + self.next_weights
            + self.next_grads
            + self.pinned_overhead
            + self.activations
            + self.data_parallel
            + self.sums_slack
            + self.runtime
            + self.emulated_device
        )
        return added if self.weights_allocated else added + self.weights

    @property
    def total(self) -> int:
        return self.new_bytes + (self.weights if self.weights_allocated else 0)

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) of each term, for reports."""
        dtype = _name(self.master_dtype) if self.master_dtype else "masters'"
        rows = [
            (
                "model weights and buffers "
                + ("(allocated already)" if self.weights_allocated else "(to allocate)"),
                self.weights,
            ),
            (
                f"master copies ({_count(self.trainable_numel)} trainable params, {dtype})"
                + (f", this rank's share of {self.ranks}" if self.ranks > 1 else "")
                + (f" (the largest: {self.share:.1%} of them)" if self.share is not None else "")
                + (
                    f": in files under {self.masters_dir} (copy buffer)" if self.masters_dir else ""
                ),
                self.masters,
            ),
            (
                "gradients of the masters"
                + (f" (in {_name(self.grads_dtype)})" if self.grads_dtype is not None else "")
                + self._grads_note(),
                self.grads,
            ),
            (
                f"optimizer state: in files under {self.optimizer_dir} (streaming buffer)"
                if self.optimizer_dir
                else f"optimizer state (estimated as Adam: {_MOMENTS[self.optim_states]})",
                self.optimizer,
            ),
        ]
        if self.next_weights:
            rows.append(
                ("next weights (the one-pass step's second copy, async)", self.next_weights)
            )
        if self.next_grads:
            rows.append(
                (
                    "gradients of the next call, while the async step holds these "
                    "(is_async=False: none)",
                    self.next_grads,
                )
            )
        rows.append(("pinned pool padding and block slack", self.pinned_overhead))
        if self.activations:
            rows.append(("activations held in host memory", self.activations))
        if self.data_parallel:
            rows.append(
                (
                    f"data-parallel reduction buffers ({self.buckets[1]} in flight, "
                    f"{format_bytes(self.buckets[0])} buckets)",
                    self.data_parallel,
                )
            )
        if self.sums_slack:
            rows.append(
                (
                    "margin for the allocators' slack around the sums on their way (one "
                    "layer's sums)",
                    self.sums_slack,
                )
            )
        if self.runtime:
            rows.append(
                ("roundpipe's runtime (threads, code loaded, Python objects)", self.runtime)
            )
        if self.emulated_device:
            rows.append(
                (
                    "emulated devices' memory (host RAM here: their planned peaks)",
                    self.emulated_device,
                )
            )
        return rows

    def _grads_note(self) -> str:
        if self.ranks == 1:
            return ""
        if self.grads_by_stage:
            return " (this rank's share, plus two layers' sums on their way to their owners)"
        return " (every parameter's until the call's end hands them to their owners)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ranks_to_fit(terms: HostTerms) -> tuple[int, int] | None:
    """The fewest machines (at least 2) over which sharding the masters, the optimizer state
    and the next call's gradients (``roundpipe.distributed.ShardedState``, one rank per
    machine) brings what one machine allocates within ``terms.available``, and what each then
    allocates; None where no number does (what is not sharded alone takes it all) or the RAM
    is unknown. Counts the gradients whole (a rank's share and two layers' sums on their way
    are at most that) and the margin of one layer's sums a sharded plan names
    ([Note: the sharded sums' slack]). Pure."""
    if terms.available is None:
        return None
    sharded = terms.masters + terms.optimizer + terms.next_grads
    rest = terms.new_bytes - sharded + terms.layer_grads
    room = terms.available - rest
    if room <= 0:
        return None
    n = max(2, -(-sharded // room))
    return n, rest + -(-sharded // n)


def stage_grad_bytes(layers: Sequence[nn.Module], optim_dtype: torch.dtype | None) -> int:
    """The largest gradient sum one of ``layers`` hands over (its trainable parameters in
    their masters' dtype). Reads shapes only."""
    return max(
        (
            sum(
                p.numel() * master_dtype_of(p, optim_dtype).itemsize
                for p in layer.parameters()
                if p.requires_grad
            )
            for layer in layers
        ),
        default=0,
    )


_MOMENTS = {
    "exact": "2 x masters",
    "bf16": "bf16 moments, 4 B/param",
    "8bit": "8-bit moments, about 2 B/param",
}
#: ``host_terms``' ``optim_states``: how Adam's moments are kept
OPTIM_STATES = tuple(_MOMENTS)


def adam_state_bytes(numel: int, master_itemsize: int, optim_states: str) -> int:
    """Host bytes of Adam's two moments of one parameter of ``numel`` elements (exact: in the
    master's dtype), as ``roundpipe.optim.AdamW(state_dtype=...)`` keeps them (see [Note: lean
    moments] in :mod:`roundpipe.optim.lean`). Pure."""
    if optim_states == "exact" or (optim_states == "8bit" and numel < _MIN_8BIT_NUMEL):
        return 2 * numel * master_itemsize
    if optim_states == "bf16":
        return 4 * numel
    if optim_states == "8bit":
        return 2 * numel + 2 * 4 * -(-numel // _BLOCK)
    raise ValueError(f"optim_states={optim_states!r}: one of {OPTIM_STATES}")


# roundpipe.optim.lean's BLOCK and MIN_8BIT_NUMEL (that module imports torch's optimizers; this
# one stays light): checked equal by tests/test_host_memory.py.
_BLOCK = 256
_MIN_8BIT_NUMEL = 4096


def _count(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def master_dtype_of(param: torch.Tensor, optim_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``param``'s master: ``optim_dtype``, else fp32 for fp16/bf16 params, else
    the param's own (as the runtime makes them)."""
    if optim_dtype is not None:
        return optim_dtype
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def host_terms(
    module: nn.Module,
    optim_dtype: torch.dtype | None,
    pinned: PinnedAllocator | None,
    available: int | None = None,
    ranks: int = 1,
    layers: Sequence[nn.Module] | None = None,
    masters_dir: str | None = None,
    masters_buffer: int | None = None,
    optim_states: str = "exact",
    one_pass: bool = True,
    data_parallel: bool | None = None,
    buckets: tuple[int, int] = DATA_PARALLEL_BUCKETS,
) -> HostTerms:
    """What wrapping ``module`` takes from the host, term by term (see :class:`HostTerms`);
    ``pinned``: the pool's allocator on an accelerator pool (None: nothing pinned; a module
    pinned already counts the blocks it sits in); ``ranks``: data-parallel ranks the state is
    sharded over (1: not sharded; else the masters and the optimizer state of the largest
    share, see :func:`roundpipe.runtime.placement.shard_by_bytes`); ``layers``: the model's
    layers (its stages), which, with ``ranks`` > 1, says that its pool hands the gradients
    over stage by stage (None: one CPU device, whose call hands all of them at its end);
    ``masters_dir``: the masters are in files there (:class:`roundpipe.MastersOnDisk`), so the
    host holds only ``masters_buffer`` bytes of them (default: its default copy buffer), and
    Adam's state is taken to be in files there too (``Adam(state_dir=...)``, which such
    masters call for: an Adam in RAM warns), so only its default streaming buffer counts;
    ``optim_states``: how Adam keeps its moments ("exact", "bf16", "8bit"); ``one_pass``:
    count the next weights of roundpipe's one-pass asynchronous step; ``data_parallel``: a
    :class:`roundpipe.distributed.DataParallel` reduces the gradients (None: when ``ranks`` >
    1, which needs one), ``buckets``: its bucket cap in bytes and buckets in flight. Reads
    shapes only. Main thread."""
    from roundpipe.runtime.placement import shard_by_bytes  # runtime imports this module

    weights = storage_bytes(t for t in module_tensors(module) if t.numel() > 0)
    if optim_states not in OPTIM_STATES:
        raise ValueError(f"optim_states={optim_states!r}: one of {OPTIM_STATES}")
    trainable = frozen = 0
    sizes = []
    states = []
    lows = []
    dtypes = set()
    for p in module.parameters():
        if p.requires_grad:
            dtype = master_dtype_of(p, optim_dtype)
            dtypes.add(dtype)
            sizes.append(p.numel() * dtype.itemsize)
            states.append(adam_state_bytes(p.numel(), dtype.itemsize, optim_states))
            lows.append(p.numel() * p.element_size())
            trainable += p.numel()
        else:
            frozen += logical_numel(p)
    masters = held = sum(sizes)
    held_states = sum(states)
    owners: list[int] | None = None
    largest = 0
    share = None
    if ranks > 1:
        owners = shard_by_bytes(sizes, ranks)
        shares = [0] * ranks
        share_states = [0] * ranks
        for owner, size, st in zip(owners, sizes, states):
            shares[owner] += size
            share_states[owner] += st
        largest = max(range(ranks), key=lambda r: shares[r])
        held = shares[largest]
        held_states = share_states[largest]
        share = held / masters if masters else None
    # the low-precision copies of the held masters: what the next weights double
    mine = [low for i, low in enumerate(lows) if owners is None or owners[i] == largest]
    grads = masters
    next_grads = held  # [Note: the next call's gradients]
    layer = stage_grad_bytes(layers if layers is not None else _layers_of(module), optim_dtype)
    if ranks > 1 and layers is not None:
        grads = min(masters, held + 2 * layer)
    overhead = _pinned_overhead(module, pinned) if pinned is not None else 0
    in_ram, optimizer = held, held_states
    # On an accelerator pool the next weights are one pinned pool (StepCopies), rounded as the
    # allocator rounds.
    next_weights = 0
    if one_pass:
        next_weights = sum(mine) if pinned is None else pool_layout(mine, pinned).taken
    if masters_dir is not None:
        buffer = MASTERS_COPY_BUFFER_BYTES if masters_buffer is None else masters_buffer
        in_ram = min(held, buffer)
        optimizer = min(optimizer, SPILL_BUFFER_BYTES)
        next_weights = 0
    reduces = ranks > 1 if data_parallel is None else data_parallel
    buffers = 0
    if reduces:
        stages = layers if layers is not None else _layers_of(module)
        buffers = data_parallel_bytes(
            [
                [(p.numel(), master_dtype_of(p, optim_dtype)) for p in _trainable(stage)]
                for stage in stages
            ],
            owners,
            *buckets,
        )
    return HostTerms(
        weights=weights,
        masters=in_ram,
        grads=grads,
        optimizer=optimizer,
        pinned_overhead=overhead,
        trainable_numel=trainable,
        frozen_numel=frozen,
        master_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
        available=available,
        ranks=ranks,
        grads_by_stage=ranks > 1 and layers is not None,
        masters_dir=masters_dir,
        optimizer_dir=masters_dir,
        data_parallel=buffers,
        buckets=buckets,
        runtime=RUNTIME_BYTES,
        layer_grads=layer,
        share=share,
        next_weights=next_weights,
        next_grads=next_grads,
        optim_states=optim_states,
    )


def _layers_of(module: nn.Module) -> list[nn.Module]:
    return list(module.children()) if isinstance(module, nn.Sequential) else [module]


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _pinned_overhead(module: nn.Module, pinned: PinnedAllocator) -> int:
    """What pinning ``module`` takes beyond its bytes: the pool :func:`pin_module` would make
    for what is not pinned yet, and for what is (a wrapped model's), the blocks it sits in."""
    done: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for t in module_tensors(module):
        if t.device.type == "cpu" and t.numel() > 0 and t.is_pinned():
            st = t.untyped_storage()
            done.setdefault(st.data_ptr(), (st.nbytes(), []))[1].append(t)
    blocks = sum(pinned.allocation_bytes(n) for n, _ in done.values())
    inside = storage_bytes(t for _, ts in done.values() for t in ts)
    return blocks - inside + pinned_layout(module, pinned).overhead


def data_parallel_bytes(
    stages: Sequence[Sequence[tuple[int, torch.dtype]]],
    owners: Sequence[int] | None,
    cap_bytes: int = DATA_PARALLEL_BUCKET_BYTES,
    in_flight: int = DATA_PARALLEL_IN_FLIGHT,
) -> int:
    """The host bytes of a :class:`roundpipe.distributed.DataParallel`'s reduction buffers,
    once all are allocated: ``stages``, per stage, each trainable parameter's (numel, master
    dtype), in the model's order; ``owners``: each parameter's owner rank with sharded state
    (None: replicated). Replicated, the step all-reduces buckets of at most ``cap_bytes`` (a
    larger parameter alone) through ``in_flight`` flat buffers per dtype, each of the largest
    bucket; sharded, the reducer sums each stage's buckets of one owner's parameters onto it
    through ``in_flight`` flat buffers per dtype, each of the largest bucket of several
    parameters that slot packed (with one count per parameter after the data; a bucket of one
    parameter is summed in place). Pure (the buckets are
    :func:`roundpipe.distributed.plan_buckets`'s); any thread."""
    from roundpipe.distributed.buckets import plan_buckets  # the package imports the runtime

    def named(params: Sequence[tuple[int, torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
        return [(str(i), torch.empty(n, dtype=d, device="meta")) for i, (n, d) in enumerate(params)]

    flats: dict[tuple[torch.dtype, int], int] = {}  # (dtype, slot) -> elements
    if owners is None:
        for bucket in plan_buckets(named([p for stage in stages for p in stage]), cap_bytes):
            for slot in range(in_flight):
                key = (bucket.dtype, slot)
                flats[key] = max(flats.get(key, 0), bucket.numel)
    else:
        position = 0
        for stage in stages:
            mine = owners[position : position + len(stage)]
            position += len(stage)
            slot = 0
            for owner in dict.fromkeys(mine):
                params = [p for p, o in zip(stage, mine) if o == owner]
                for bucket in plan_buckets(named(params), cap_bytes):
                    if len(bucket.names) > 1:
                        key = (bucket.dtype, slot % in_flight)
                        numel = bucket.numel + len(bucket.names)
                        flats[key] = max(flats.get(key, 0), numel)
                    slot += 1
    return sum(n * dtype.itemsize for (dtype, _), n in flats.items())
