"""The emulated device's memory: what each device holds (live storages, the caching
allocator's segments, a GPU's overheads), its capacity, and the emulated pinned host memory.
See [Note: emulated device memory] and [Note: emulated pinned memory]."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import threading
from typing import Any

import torch

from roundpipe.memory.live import LiveBytes
from roundpipe.testing.caching_allocator import Block, DeviceAllocator, NoRoom
from roundpipe.testing.emu.native import (
    DEVICE_COUNT,
    NAME,
    STATE,
    aten,
    host_waits,
    index_of,
)

__all__ = [
    "GpuOverheads",
    "HOPPER_CUBLAS_WORKSPACE",
    "PinnedMemoryStats",
    "charge",
    "empty_cache",
    "empty_pinned_cache",
    "free_block",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "note_matmul",
    "planning_overheads",
    "overheads_held",
    "pinned_memory_stats",
    "pinned_round_limit",
    "release",
    "reset_peak_memory_stats",
    "set_gpu_overheads",
    "set_memory_capacity",
    "set_pinned_round_limit",
]

# [Note: emulated device memory]
# Device memory is counted per device: every storage an op or an allocation makes on the device
# is charged when it is made and given back when torch frees it (a finalizer on the storage,
# which torch keeps as one Python object for its whole life), so ``torch.emu.memory_allocated``
# and ``max_memory_allocated`` are exact, as CUDA's are for its caching allocator's live blocks
# (which CUDA rounds to 512 bytes; the emulated counter does not).
#
# What a GPU reserves for them is modelled too (Rules.reserved_memory; see
# [Note: the caching allocator's reserve] in roundpipe.testing.caching_allocator): each
# storage takes a block of a segment of its allocating stream's pool, so ``memory_reserved``
# and ``max_memory_reserved`` hold the segments, ``empty_cache`` gives the free ones back, and
# ``mem_get_info`` reports ``capacity - reserved - overheads``, the overheads being the ones
# set_gpu_overheads gives: the CUDA context and a cuBLAS workspace per stream that ran a matmul
# (none by default).
#
# With a capacity (set_memory_capacity, or ROUNDPIPE_EMU_MEMORY=bytes before install), a
# storage that would not fit raises torch.OutOfMemoryError as CUDA's allocator does: by default
# when the live storages would exceed it (the emulated device then fits what a GPU's rounding,
# segments and overheads would not); with ``counts_reserved=True`` when a new segment would not
# fit beside the reserved ones and the overheads, after the cached segments went back, as on a
# GPU. Without one, the capacity is the host's memory.

_memory_lock = threading.RLock()  # finalizers may run on any thread, inside a charge
# Per device, the live storages (keyed by data pointer) and their peak: memory_allocated and
# max_memory_allocated. The same count the planner's tracing keeps (roundpipe.memory.live).
_live = [LiveBytes() for _ in range(DEVICE_COUNT)]
_capacity: int | None = None
_capacity_counts_reserved = False
_allocators = [DeviceAllocator() for _ in range(DEVICE_COUNT)]
# Blocks whose storages were freed, for the allocators (finalizers append, one deque op each;
# a charge or a query settles them under _memory_lock): (device, block, what it waits for).
_freed_blocks: collections.deque[tuple[int, Block, tuple]] = collections.deque()
_matmul_streams: list[set[int]] = [set() for _ in range(DEVICE_COUNT)]
# Ops whose CUDA kernels come from cuBLAS, which keeps a workspace per stream that runs one.
_CUBLAS_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten._addmm_activation.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
        aten.mv.default,
        aten.addmv.default,
    }
)

# What a GPU holds outside torch's counters (see set_gpu_overheads); measured on an H200.
HOPPER_CUBLAS_WORKSPACE = 32 << 20  # per stream that ran a matmul


@dataclasses.dataclass(frozen=True)
class GpuOverheads:
    """Device memory a GPU process holds beside torch's live tensors and cached segments:
    ``context`` bytes per device (the CUDA context, a few hundred MiB: measure it with
    ``nvidia-smi`` against ``torch.cuda.memory_reserved``) and ``cublas_workspace`` bytes per
    stream that ran a matmul (:data:`HOPPER_CUBLAS_WORKSPACE` on Hopper, 8 MiB before)."""

    context: int = 0
    cublas_workspace: int = 0


_overheads = GpuOverheads()


def set_gpu_overheads(context: int = 0, cublas_workspace: int = 0) -> GpuOverheads:
    """Count ``context`` bytes per emulated device and ``cublas_workspace`` bytes per stream that
    ran a matmul as held (see [Note: emulated device memory]); returns the previous
    :class:`GpuOverheads`. They count in ``mem_get_info`` and, with a capacity that counts
    reserved memory, against it; never in ``memory_allocated`` or ``memory_reserved``. Any
    thread."""
    global _overheads
    for name, value in (("context", context), ("cublas_workspace", cublas_workspace)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
    with _memory_lock:
        previous, _overheads = _overheads, GpuOverheads(context, cublas_workspace)
    return previous


def overheads_held(device: Any = None) -> int:
    """The overhead bytes an emulated device holds now: the context and a workspace per stream
    that ran a matmul on it (see :func:`set_gpu_overheads`). Any thread."""
    index = index_of(device)
    return _overheads.context + _overheads.cublas_workspace * len(_matmul_streams[index])


def set_memory_capacity(nbytes: int | None, *, counts_reserved: bool = False) -> int | None:
    """Give every emulated device ``nbytes`` of memory (None: the host's); returns the previous
    setting. A device allocation beyond it raises ``torch.OutOfMemoryError``: by default when
    the live storages would exceed it; ``counts_reserved=True``: when a new segment of the
    caching allocator would not fit beside the reserved ones and the overheads, as on a GPU
    (see [Note: emulated device memory]). Any thread."""
    global _capacity, _capacity_counts_reserved
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 1):
        raise ValueError(
            f"the emulated device's memory capacity must be None or a positive int "
            f"(bytes), got {nbytes!r}"
        )
    with _memory_lock:
        previous, _capacity = _capacity, nbytes
        _capacity_counts_reserved = bool(counts_reserved) and nbytes is not None
    return previous


def _capacity_of_device() -> int:
    if _capacity is not None:
        return _capacity
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _settle_blocks(index: int) -> None:
    """Hand the freed blocks to their allocators, and return to its pool every held block whose
    streams the host knows done (_memory_lock held)."""
    while _freed_blocks:
        device, block, held_for = _freed_blocks.popleft()
        _allocators[device].free(block, held_for)
    _allocators[index].settle(
        lambda held_for: all(
            STATE.guard.roundpipe_emu_host_known(d, s) >= count for (d, s), count in held_for
        )
    )


def _room_for(index: int) -> Any:
    def room(extra: int) -> bool:
        if not _capacity_counts_reserved:
            return True
        assert _capacity is not None  # counts_reserved needs a capacity
        held = _allocators[index].reserved + overheads_held(index)
        return held + extra <= _capacity

    return room


def _wait_for_held(held_for: tuple) -> None:
    for stream, _ in held_for:  # the allocator synchronizes on their events
        host_waits(stream)


def charge(t: torch.Tensor, index: int, stream: tuple[int, int]) -> Block | None:
    """Device memory for ``t``'s storage (a plain CPU tensor that an emu tensor wraps),
    allocated on ``stream``: its allocator block, which the caller gives back through
    :func:`release` when the storage dies (None: nothing was charged)."""
    storage = t.untyped_storage()
    key, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        return None
    with _memory_lock:
        if any(key in live for live in _live):
            return None
        if (
            _capacity is not None
            and not _capacity_counts_reserved
            and _live[index].live + nbytes > _capacity
        ):
            raise torch.OutOfMemoryError(
                f"{NAME}:{index} out of memory: tried to allocate {nbytes} bytes with "
                f"{_live[index].live} of {_capacity} bytes in use (the emulated capacity, "
                f"roundpipe.testing.emu.set_memory_capacity)"
            )
        _settle_blocks(index)
        allocator = _allocators[index]
        try:
            block = allocator.malloc(stream[1], nbytes, _room_for(index), _wait_for_held)
        except NoRoom as exc:
            raise torch.OutOfMemoryError(
                f"{NAME}:{index} out of memory: tried to allocate {nbytes} bytes, for which the "
                f"caching allocator needs a new segment of {exc.wanted} bytes, with "
                f"{allocator.reserved} bytes reserved ({_live[index].live} in live "
                f"tensors) and {overheads_held(index)} held by the context and cuBLAS "
                f"workspaces, of {_capacity} (the emulated capacity counting reserved memory, "
                f"roundpipe.testing.emu.set_memory_capacity); the difference is what a GPU's "
                f"caching allocator keeps cached for other streams and pools, or cannot use"
            ) from None
        _live[index].add(key, nbytes)
    return block


def release(key: int, index: int) -> None:
    """A charged storage died (a finalizer, any thread): its bytes are no longer live."""
    with _memory_lock:
        _live[index].remove(key)


def free_block(index: int, block: Block, held_for: tuple) -> None:
    """Hand a dead storage's ``block`` back to its device's allocator once the streams in
    ``held_for`` ((stream, count) pairs) are known done. Any thread, a finalizer too (one deque
    op: no lock)."""
    _freed_blocks.append((index, block, held_for))


def note_matmul(op: Any, stream: tuple[int, int]) -> None:
    """``op`` ran on ``stream``: a cuBLAS op makes the stream hold a workspace."""
    if op in _CUBLAS_OPS and stream[1] not in _matmul_streams[stream[0]]:
        _matmul_streams[stream[0]].add(stream[1])  # a set add: atomic


# Memory, as torch.cuda reports it (see [Note: emulated device memory]).
def memory_allocated(device: Any = None) -> int:
    return _live[index_of(device)].live


def memory_reserved(device: Any = None) -> int:
    index = index_of(device)
    if not STATE.rules.reserved_memory:
        return _live[index].live  # no cache: what is live is what is held
    with _memory_lock:
        _settle_blocks(index)
        return _allocators[index].reserved


def max_memory_reserved(device: Any = None) -> int:
    index = index_of(device)
    if not STATE.rules.reserved_memory:
        return _live[index].peak
    return _allocators[index].peak_reserved


def max_memory_allocated(device: Any = None) -> int:
    return _live[index_of(device)].peak


def reset_peak_memory_stats(device: Any = None) -> None:
    index = index_of(device)
    with _memory_lock:
        _live[index].reset_peak()
        _settle_blocks(index)
        _allocators[index].reset_peak()


def empty_cache() -> None:
    """Give every device's fully free segments back (as torch.cuda.empty_cache)."""
    with _memory_lock:
        for index, allocator in enumerate(_allocators):
            _settle_blocks(index)
            allocator.empty_cache()


def planning_overheads() -> GpuOverheads | None:
    """What a memory plan must leave beside its tensors as on a GPU (see [Note: the device
    reserve] in :mod:`roundpipe.devices.accelerator`): the overheads set_gpu_overheads
    gives when the capacity counts reserved memory, else None (the device then runs out
    only when its live storages would not fit, and needs no reserve). Any thread."""
    if not (STATE.rules.reserved_memory and _capacity_counts_reserved):
        return None
    return _overheads


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) as the driver reports them: the capacity less what the process holds,
    which is the reserved segments and the overheads (see [Note: emulated device
    memory]) under Rules.reserved_memory, else the live storages. So ``free +
    memory_reserved - memory_allocated`` is what a run may still allocate, as on CUDA. A
    capacity that counts live storages only may be smaller than one segment: ``free`` is
    then negative, which a GPU's never is, and that sum still right."""
    index, total = index_of(device), _capacity_of_device()
    if not STATE.rules.reserved_memory:
        return max(total - _live[index].live, 0), total
    return total - memory_reserved(index) - overheads_held(index), total


# [Note: emulated pinned memory]
# pin_memory(), torch.empty(..., pin_memory=True) and non-blocking downloads get their host
# memory from the guard's pinned allocator (_emu_guard.cpp). CUDA's caching host allocator
# rounds every pinned allocation up to the next power of two (its default config), so pinning
# a model tensor by tensor can take nearly twice its bytes (pytorch#95823); the emulated one
# takes the same rounded bytes from the CPU allocator and counts them, so a test can measure
# what pinning costs the host exactly. As torch's, it leaves allocations above
# ``pinned_max_round_threshold_mb`` / ``pinned_max_cached_size_mb`` (PYTORCH_ALLOC_CONF, read
# at install; set_pinned_round_limit) unrounded. A freed rounded block is kept, as CUDA keeps
# it, for the next request of its size class (Rules.pinned_cache; empty_pinned_cache gives them
# back); an unrounded one goes back at once. CUDA reuses a block only once the copies that used
# it are done; here the pending copy holds the block until the host has waited for it. Each
# fresh block is written a page at a time, so that it is resident in full, as page-locked
# memory is (the rounding's slack included, which the CPU allocator's untouched pages would
# leave out of a process's RSS).
_pinned_limit = [1 << 62]  # the round limit in force (see roundpipe.devices.pinned.UNLIMITED)


def set_pinned_round_limit(nbytes: int) -> int:
    """Pinned allocations above ``nbytes`` take their own size, those below are rounded up to
    a power of two (as torch's ``pinned_max_round_threshold_mb``); returns the previous limit.
    Any thread; needs :func:`install`."""
    if STATE.guard is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    previous = _pinned_limit[0]
    _pinned_limit[0] = int(nbytes)
    STATE.guard.roundpipe_emu_set_pinned_round_limit(int(nbytes))
    return previous


def pinned_round_limit() -> int:
    """The largest pinned allocation the emulated allocator rounds up. Any thread."""
    return _pinned_limit[0]


@dataclasses.dataclass(frozen=True)
class PinnedMemoryStats:
    """The emulated pinned host allocations alive now: ``allocated_bytes`` (what the host gives
    them, each rounded up to a power of two), ``requested_bytes`` (what was asked for),
    ``peak_allocated_bytes`` (the most ``allocated_bytes`` has been since the last reset),
    ``allocations`` (how many) and ``cached_bytes`` (freed blocks kept for reuse, which the host
    holds too; see [Note: emulated pinned memory])."""

    allocated_bytes: int
    requested_bytes: int
    peak_allocated_bytes: int
    allocations: int
    cached_bytes: int


def empty_pinned_cache() -> None:
    """Give the freed pinned blocks kept for reuse back to the host (as
    ``torch._C._host_emptyCache``). Any thread; needs :func:`install`."""
    if STATE.guard is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    STATE.guard.roundpipe_emu_empty_pinned_cache()


def pinned_memory_stats(reset_peak: bool = False) -> PinnedMemoryStats:
    """The emulated pinned host memory in use (see [Note: emulated pinned memory]);
    ``reset_peak``: the peak starts again from what is in use now. Any thread; needs
    :func:`install`."""
    if STATE.guard is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    out = (ctypes.c_int64 * 5)()
    STATE.guard.roundpipe_emu_pinned_stats(ctypes.cast(out, ctypes.c_void_p), int(reset_peak))
    return PinnedMemoryStats(*(int(v) for v in out))
