"""An emulated accelerator, ``emu``, that lets CPU-only machines run roundpipe's accelerator path.

What it is: torch's PrivateUse1 backend renamed ``emu``, with up to :data:`DEVICE_COUNT` devices
(``emu:0`` ...). An ``emu`` tensor is a wrapper subclass (:class:`EmuTensor`) around a CPU tensor,
and every op on it runs on the host. What it catches, as CUDA would:

* Host tensors meeting device tensors: an op that mixes an ``emu`` tensor with a host tensor of
  one or more dimensions (or with a tensor on another ``emu`` device) raises CUDA's
  ``RuntimeError: Expected all tensors to be on the same device ...``.
* Thread-local state lost in backward: a small C++ device guard (``_emu_guard.cpp``, built once
  with ``torch.utils.cpp_extension.load`` and cached, as ``_emu_autocast.cpp`` is) makes
  torch's autograd engine run the backward of ``emu`` tensors on its own per-device thread, as
  it does for CUDA. Code that only works when backward runs on the thread that called it
  (Python thread-locals read during a checkpoint recompute, say) fails here as it would on a
  GPU.
* Results: random ops draw from the CPU generator and dropout draws as on the CPU, so a model
  on ``emu`` computes what it computes on the CPU, bit for bit, which the tests compare.
* Stream races: kernels run at once, but the order a GPU would guarantee is tracked (see
  [Note: emulated streams]); an op whose access to device memory no stream order, event or host
  wait orders after another stream's raises :class:`StreamOrderError`, a non-blocking download
  into pinned memory holds NaN until the host waits for it, and changing the pinned source of a
  non-blocking upload before waiting for it raises at the wait.
* The caching allocator's reuse (see [Note: emulated allocator reuse]): a tensor used on a
  stream other than the one that allocated it, without ``record_stream`` and without that use
  being ordered before its free, raises :class:`StreamOrderError` at the next allocation that
  could take its memory, naming both streams and where the tensor was made.
* Attention (see [Note: emulated attention]): ``scaled_dot_product_attention`` takes the math
  path, and holds its (query x key) scores, exactly where CUDA would
  (:func:`roundpipe.testing.cuda_attention.cuda_sdpa_backend`), else the CPU's fused kernel,
  which holds none, as a GPU's fused kernels hold none.
* Autocast (see [Note: emulated autocast]): ``torch.autocast("emu")`` applies CUDA's cast
  policy, registered from torch's own op lists: matmul-like ops in the autocast dtype, softmax,
  norms, sums, pow and the losses in fp32, mixed inputs of the promote list widened.
* Event queries (see [Note: emulated event queries]): ``Event.query()``/``Stream.query()`` say
  done only once the host has waited for that work, so code's not-ready branches run.
* The device APIs: ``torch.Stream``/``torch.Event``, ``torch.accelerator``,
  ``torch.get_device_module("emu")``, ``pin_memory()``/``is_pinned()`` and ``torch.autocast``.
* Device memory (see [Note: emulated device memory]): counted per storage
  (``memory_allocated``, ``max_memory_allocated``), and what CUDA's caching allocator would
  reserve for it (``memory_reserved``, ``max_memory_reserved``, ``empty_cache``: segments,
  rounding, per-stream pools; :mod:`roundpipe.testing.caching_allocator`); ``mem_get_info``
  leaves out the segments and the context and cuBLAS workspaces :func:`set_gpu_overheads`
  gives; an optional capacity beyond which allocations raise ``torch.OutOfMemoryError``, for
  the live storages or, with ``counts_reserved=True``, for the segments as on a GPU.
* Pinned host memory: each allocation takes the next power of two of its size, as CUDA's
  caching host allocator rounds it, is counted, and is kept for reuse once freed
  (:func:`pinned_memory_stats`, :func:`empty_pinned_cache`; see [Note: emulated pinned memory]).
* Streams (see [Note: emulated stream pool]): ``torch.Stream()`` hands out a device's 32 pool
  streams round-robin, as CUDA does, so a new stream may be one other code holds.

Each of the stricter behaviours is a rule (:class:`Rules`), all on by default and in the test
suite, each switchable (:func:`set_rules`, :func:`rules_set`, ``ROUNDPIPE_EMU_LENIENT``).

What it cannot catch:

* A CUDA kernel's own numerics (TF32, cuBLAS and cuDNN algorithms, other reduction orders): the
  results are the CPU's. Where the attention rule takes the math path the CPU would not, the
  last bits are the math path's.
* Host-side races between host threads: host threads count as one (a host wait on one thread
  orders later work that any thread enqueues).
* Allocator reuse through a tensor that autograd saved in the forward and a backward reads on a
  stream autograd handed gradients to (autograd's own record cannot name the tensor here); and
  which block the allocator hands out: a hazard raises at any allocation from the same pool,
  not only the one a GPU would give those bytes to.
* Memory: ``memory_allocated`` is not rounded to 512 bytes and leaves out cuBLAS workspaces
  (CUDA's counts both); the allocator model leaves out ``expandable_segments``,
  ``max_split_size_mb`` and the driver's granularity; kernels' internal scratch space (cuDNN,
  fused attention's) and NCCL buffers are not counted; the context's and workspaces' sizes are
  what :func:`set_gpu_overheads` is told. Dropout in attention takes the math path (the CPU's
  fused kernel draws no dropout), so its scores are counted where a GPU's fused kernels hold
  none.
* Speed: a Python call per op, several times slower than the CPU backend; timings say nothing
  about a GPU.

Call :func:`install` before the first ``backward()`` of the process: the autograd engine starts
its device threads once, on the first backward, and only for the device types it knows then.
``RoundPipe(devices="emu")`` and ``ROUNDPIPE_DEVICES=emu`` install it; the test suite's
conftest does so at start. It is test infrastructure, not a backend to train on.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention import SDPBackend

from roundpipe.testing.caching_allocator import Block, DeviceAllocator, NoRoom
from roundpipe.testing.cuda_attention import cuda_sdpa_backend

__all__ = [
    "NAME",
    "DEVICE_COUNT",
    "EmuTensor",
    "Copy",
    "StreamOrderError",
    "Rules",
    "rules",
    "set_rules",
    "rules_set",
    "record_copies",
    "set_memory_capacity",
    "GpuOverheads",
    "HOPPER_CUBLAS_WORKSPACE",
    "set_gpu_overheads",
    "overheads_held",
    "PinnedMemoryStats",
    "pinned_memory_stats",
    "empty_pinned_cache",
    "pinned_round_limit",
    "set_pinned_round_limit",
    "install",
    "is_installed",
]

NAME = "emu"
# Must match kDeviceCount in _emu_guard.cpp.
DEVICE_COUNT = 4

aten = torch.ops.aten
_HERE = os.path.dirname(os.path.abspath(__file__))
_INSTALL_LOCK = threading.Lock()
_installed = False
_late_error: RuntimeError | None = None  # installed too late (see _check_backward_threads)
_libraries: list[torch.library.Library] = []

# Ops that take host tensors next to device tensors on CUDA too: copies between devices, and
# indexing with host index tensors.
_CROSS_DEVICE_OK = frozenset(
    {
        aten.copy_.default,
        aten._to_copy.default,
        aten.index.Tensor,
        aten.index_put_.default,
        aten.index_put.default,
        aten._index_put_impl_.default,
    }
)
# Ops that the lenient autocast runs in the lower-precision dtype (see [Note: emulated autocast]).
_AUTOCAST_LOWER = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "_convolution",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
)


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy between the host and an emulated device, as :func:`record_copies` logs it.

    ``direction``: ``"h2d"`` or ``"d2h"``; ``host_ptr``: the data pointer of the host tensor,
    its first element (tensors of one pinned pool share a storage, not this): for an upload,
    what was read; for a download into an existing tensor, what was written; None for a
    download that made a new tensor. ``stream_id``: the stream current on the emulated device
    when the copy was made."""

    direction: str
    host_ptr: int | None
    numel: int
    dtype: torch.dtype
    pinned: bool
    stream_id: int


_copy_logs: list[list[Copy]] = []


@contextlib.contextmanager
def record_copies() -> Iterator[list[Copy]]:
    """Log every copy between the host and an emulated device made inside the block (by any
    thread) into the list it yields. Main thread; for tests that count transfers."""
    log: list[Copy] = []
    _copy_logs.append(log)
    try:
        yield log
    finally:
        _copy_logs.remove(log)


def _log_copy(direction: str, host: torch.Tensor | None, emu: torch.Tensor) -> None:
    entry = Copy(
        direction,
        None if host is None else host.data_ptr(),
        emu.numel(),
        emu.dtype,
        host is not None and host.is_pinned(),
        torch.accelerator.current_stream(emu.device).stream_id,
    )
    for log in _copy_logs:
        log.append(entry)  # list.append is atomic: workers may log at once


# [Note: emulated streams]
# Emu kernels run on the host at once, so nothing is ever late. What a GPU would allow to be
# late is tracked instead, and misuse raises :class:`StreamOrderError` (or shows as poison):
#
# * Every op is enqueued on its device's current stream and counted there. The native guard
#   keeps a vector clock per stream (how far each other stream is known done) that events carry
#   (``record``), waits merge (``wait_event``/``wait_stream``) and host waits merge into the
#   host's clock (``synchronize``, a blocking copy to the host, ``.item()``; ``query`` only
#   reports, see [Note: emulated event queries]). An op enqueued after a host wait may rely on
#   what the host waited for.
# * Per device storage, the last write and the newest read per stream. An op that reads a
#   storage last written on another stream, or writes one another stream wrote or read, without
#   the clocks ordering the two, raises: on a GPU it would race.
# * A copy between two devices orders both devices' current streams, as torch's does.
# * A non-blocking download into pinned memory leaves the destination poisoned (all bits set: NaN
#   for floats) until the host waits for the copy's stream or an event after it; host code that
#   reads it sooner computes with NaN. A non-blocking upload from pinned memory remembers its
#   source; if the host changed it by the time the host waits for the copy, the wait raises.
# * Freed device memory goes back to the allocating stream's pool: see
#   [Note: emulated allocator reuse]. Not modelled: host-side races between host threads (host
#   threads count as one: a host wait on one thread orders later work that any thread
#   enqueues).


# [Note: emulated event queries]
# On a GPU, Event.query() and Stream.query() answer False while the device has not reached the
# event (the end of the stream), which code that must not wait (a monitor converting losses
# that have arrived, HostCopy.ready) has to handle. Kernels here run at once, so "reached" is
# defined by what the host has waited for: a query answers True only once a host wait
# (synchronize of the event, its stream or its device, a blocking copy, .item()) covered the
# event, and never waits itself. A device-side wait (Stream.wait_event) tells the host nothing.
# An event never recorded is done, as on CUDA. With Rules.event_queries off, a query waits for
# the event and answers True (the lenient behaviour the emulated device had first).


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
_allocated_bytes = [0] * DEVICE_COUNT
_peak_bytes = [0] * DEVICE_COUNT
_live_storages: dict[int, int] = {}  # storage data pointer -> its bytes
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
    index = _index_of(device)
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
            _native.roundpipe_emu_host_known(d, s) >= count for (d, s), count in held_for
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
        _host_waits(stream)


def _charge(t: torch.Tensor, index: int, stream: tuple[int, int]) -> None:
    """Device memory for ``t``'s storage (a plain CPU tensor that an emu tensor wraps),
    allocated on ``stream``."""
    storage = t.untyped_storage()
    key, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0:
        return
    with _memory_lock:
        if key in _live_storages:
            return
        if (
            _capacity is not None
            and not _capacity_counts_reserved
            and _allocated_bytes[index] + nbytes > _capacity
        ):
            raise torch.OutOfMemoryError(
                f"{NAME}:{index} out of memory: tried to allocate {nbytes} bytes with "
                f"{_allocated_bytes[index]} of {_capacity} bytes in use (the emulated capacity, "
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
                f"{allocator.reserved} bytes reserved ({_allocated_bytes[index]} in live "
                f"tensors) and {overheads_held(index)} held by the context and cuBLAS "
                f"workspaces, of {_capacity} (the emulated capacity counting reserved memory, "
                f"roundpipe.testing.emu.set_memory_capacity); the difference is what a GPU's "
                f"caching allocator keeps cached for other streams and pools, or cannot use"
            ) from None
        _allocated_bytes[index] += nbytes
        _peak_bytes[index] = max(_peak_bytes[index], _allocated_bytes[index])
        _live_storages[key] = nbytes
    weakref.finalize(storage, _give_back, key, index, nbytes, block)


def _give_back(key: int, index: int, nbytes: int, block: Block) -> None:
    with _memory_lock:
        _allocated_bytes[index] -= nbytes
        _live_storages.pop(key, None)
    access = _accesses.pop(key, None)  # its stream order ends with it (one dict op: no lock)
    held_for: tuple = ()
    if access is not None and access.recorded and _native is not None:
        # record_stream: the block waits for those streams' work at the free (an event each).
        held_for = tuple(
            (other, _native.roundpipe_emu_enqueued(other[0], other[1]))
            for other in access.recorded
            if other != access.made_on
        )
    _freed_blocks.append((index, block, held_for))  # one deque op: no lock
    if access is not None and access.foreign and _rules.allocator_reuse:
        _note_freed(access, index, nbytes)


def _index_of(device: Any) -> int:
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


class StreamOrderError(RuntimeError):
    """Two accesses to one emulated device's memory that no stream order, event or host wait
    puts in order: on a GPU they would race."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which of CUDA's stricter behaviours the emulated device imitates; all on by default (the
    test suite runs with every one), each switchable (:func:`set_rules`, :func:`rules_set`, or
    ``ROUNDPIPE_EMU_LENIENT=name,name`` at install) to see whether a failure comes from it.

    * ``allocator_reuse``: freed device memory goes back to the pool of the stream that
      allocated it, and an allocation on that stream raises :class:`StreamOrderError` if another
      stream may still use that memory (no ``record_stream``, no event or host wait); see
      [Note: emulated allocator reuse].
    * ``cuda_attention``: ``scaled_dot_product_attention`` runs the math path (and holds its
      scores) where CUDA would (``roundpipe.testing.cuda_attention.cuda_sdpa_backend``); see
      [Note: emulated attention].
    * ``cuda_autocast``: ``torch.autocast("emu")`` applies CUDA's cast policy, its fp32 and
      promote lists too; see [Note: emulated autocast].
    * ``event_queries``: ``Event.query()`` and ``Stream.query()`` say done only once the host
      has waited for that work; see [Note: emulated event queries].
    * ``reserved_memory``: ``memory_reserved`` and ``mem_get_info`` report the segments CUDA's
      caching allocator would hold and the overheads :func:`set_gpu_overheads` gives, not only
      the live storages; see [Note: emulated device memory].
    * ``stream_pool``: ``torch.Stream()`` hands out the 32 streams of a device round-robin, as
      CUDA's pool does, so a new stream may be one handed out before; see
      [Note: emulated stream pool].
    * ``pinned_cache``: freed pinned host blocks are kept for reuse by a request of their size,
      as CUDA's caching host allocator keeps them (:attr:`PinnedMemoryStats.cached_bytes`); see
      [Note: emulated pinned memory]."""

    allocator_reuse: bool = True
    cuda_attention: bool = True
    cuda_autocast: bool = True
    event_queries: bool = True
    reserved_memory: bool = True
    stream_pool: bool = True
    pinned_cache: bool = True


_rules = Rules()


def rules() -> Rules:
    """The rules in force. Any thread."""
    return _rules


def set_rules(**changes: bool) -> Rules:
    """Switch rules by name (``set_rules(allocator_reuse=False)``); returns the previous
    :class:`Rules`, which ``set_rules(**dataclasses.asdict(previous))`` restores. Any thread,
    between steps: a rule switched while another thread runs ops on the device applies from
    that thread's next op on. ``cuda_autocast`` and ``event_queries`` need :func:`install`."""
    global _rules
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Rules)})
    if unknown:
        raise ValueError(
            f"unknown emulated-device rule(s) {unknown}; the rules are "
            f"{[f.name for f in dataclasses.fields(Rules)]}"
        )
    with _INSTALL_LOCK:
        previous = _rules
        new = dataclasses.replace(previous, **{k: bool(v) for k, v in changes.items()})
        if _installed:
            _apply_native_rules(new)
        _rules = new
    return previous


@contextlib.contextmanager
def rules_set(**changes: bool) -> Iterator[Rules]:
    """Switch rules for the block (see :func:`set_rules`), then restore them; yields the rules
    in force inside. For tests."""
    previous = set_rules(**changes)
    try:
        yield _rules
    finally:
        set_rules(**dataclasses.asdict(previous))


def _apply_native_rules(new: Rules) -> None:
    """The rules the native libraries carry (the caller holds _INSTALL_LOCK, after install)."""
    _native.roundpipe_emu_set_honest_queries(int(new.event_queries))
    _native.roundpipe_emu_set_stream_pool(int(new.stream_pool))
    _native.roundpipe_emu_set_pinned_cache(int(new.pinned_cache))
    _set_cuda_autocast(new.cuda_autocast)


# [Note: emulated stream pool]
# CUDA does not make a stream for each torch.Stream(): it hands out the 32 streams of a
# per-device pool round-robin, so after 32 of them a new torch.Stream is one some other code
# already holds, with that code's work pending on it. Code that takes a new stream for an
# empty, private one (that queries it for being idle, or expects a wait on it to order only its
# own work) is wrong on a GPU; the emulated device hands out streams the same way
# (Rules.stream_pool), so two models' streams may be the same here too. The default stream
# (0) is not in the pool.


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
# it are done; here the pending copy holds the block until the host has waited for it.
_pinned_limit = [1 << 62]  # the round limit in force (see roundpipe.host_memory.UNLIMITED)


def set_pinned_round_limit(nbytes: int) -> int:
    """Pinned allocations above ``nbytes`` take their own size, those below are rounded up to
    a power of two (as torch's ``pinned_max_round_threshold_mb``); returns the previous limit.
    Any thread; needs :func:`install`."""
    if _native is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    previous = _pinned_limit[0]
    _pinned_limit[0] = int(nbytes)
    _native.roundpipe_emu_set_pinned_round_limit(int(nbytes))
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
    if _native is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    _native.roundpipe_emu_empty_pinned_cache()


def pinned_memory_stats(reset_peak: bool = False) -> PinnedMemoryStats:
    """The emulated pinned host memory in use (see [Note: emulated pinned memory]);
    ``reset_peak``: the peak starts again from what is in use now. Any thread; needs
    :func:`install`."""
    if _native is None:
        raise RuntimeError(
            "the emulated device is not installed: call roundpipe.testing.emu.install() first"
        )
    out = (ctypes.c_int64 * 5)()
    _native.roundpipe_emu_pinned_stats(ctypes.cast(out, ctypes.c_void_p), int(reset_peak))
    return PinnedMemoryStats(*(int(v) for v in out))


_native: Any = None  # the guard library, through ctypes (set by install)
_order_lock = threading.Lock()
_pending_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (host, snapshot)
# id -> (host storage pointer, stream, count) of the pending downloads
_landing: dict[int, tuple[int, tuple[int, int], int]] = {}
_writes_cache: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}


class _Access:
    """The stream order of one device storage: its last write and newest read per stream, and
    for the allocator (see [Note: emulated allocator reuse]) the stream that allocated it, the
    other streams that used it since and those ``record_stream`` named."""

    __slots__ = ("writer", "written", "wrote", "reads", "made_on", "made_by", "foreign", "recorded")

    def __init__(self, writer: tuple[int, int] | None, written: int, wrote: Any) -> None:
        self.writer = writer  # (device, stream) or None (written before anything was tracked)
        self.written = written
        self.wrote = wrote  # the op that wrote it, for the error message
        self.reads: dict[tuple[int, int], tuple[int, Any]] = {}  # stream -> (count, op)
        self.made_on: tuple[int, int] | None = None  # the allocating stream (None: untracked)
        self.made_by: tuple[Any, Any, str] | None = None  # (op, call site, thread)
        # Other streams that used it: stream -> (its newest use's count, op).
        self.foreign: dict[tuple[int, int], tuple[int, Any]] = {}
        self.recorded: set[tuple[int, int]] = set()  # streams given to record_stream


# [Note: emulated allocator reuse]
# CUDA's caching allocator gives every block to the stream current when it was allocated, and a
# freed block goes straight back to that stream's pool (small blocks, up to 1 MiB, and large
# ones are pooled apart), to be handed to the next allocation on that stream: safe for that
# stream's own work, which runs in order, but not for another stream that used the tensor,
# unless ``t.record_stream(other)`` told the allocator (then it waits for an event on the other
# stream before reusing the block). So a tensor made on stream A and read on stream B, dropped
# on the host while B's read may still be pending, can be overwritten by A's next allocation.
#
# The emulated device keeps, per device storage, the stream that allocated it (the op's current
# stream on the storage's device), every other stream that used it (its newest use there), and
# the streams record_stream named. When the storage is freed, each other stream's use that is
# neither recorded nor ordered before the free (the allocating stream or the host waited for
# it) leaves a hazard in the pool of (device, allocating stream, small/large); the next
# allocation from that pool whose stream still does not know that use done raises
# StreamOrderError naming both streams and where the tensor was made. Any allocation from the
# pool counts, whatever its size: freed blocks coalesce with their free neighbours, so a
# larger request can land on the same bytes. A use ordered by the time of that allocation
# (the allocating stream waited for an event after it, or the host for the stream) is safe, as
# on a GPU. Rules.allocator_reuse switches it.
#
# torch's autograd engine records on the consumer stream every gradient it hands from one stream
# to another (its record_stream_any_impl), through the device guard, which gets the storage of
# the emulated tensor's wrapper (a placeholder without data) and so cannot name the tensor. The
# guard remembers the streams the engine handed gradients to, and a use on such a stream by an
# op the engine runs (a backward) counts as recorded. So a tensor saved in the forward on
# another stream and read by the backward on such a stream goes unseen (its forward use still
# counts).
_SMALL_BLOCK = 1 << 20  # CUDA's small pool: requests up to 1 MiB, rounded to 512 bytes
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)


@dataclasses.dataclass(frozen=True)
class _Hazard:
    """Freed memory in a stream's pool that other streams may still use."""

    pool: tuple[int, int, bool]  # (device, allocating stream, small pool)
    uses: tuple[tuple[tuple[int, int], int, Any], ...]  # (stream, count, op) not ordered yet
    made_by: tuple[Any, Any, str] | None
    nbytes: int


# pool -> hazard id -> hazard; finalizers add (a setdefault and a store: no lock)
_hazards: dict[tuple[int, int, bool], dict[int, _Hazard]] = {}
_hazard_ids = itertools.count()
_hazard_lock = threading.Lock()  # the checkers' (never taken by a finalizer)


def _small_pool(nbytes: int) -> bool:
    return nbytes <= _SMALL_BLOCK


def _call_site() -> Any:
    """The innermost caller outside torch and this module, as (code, line), or None (an op
    autograd's engine ran). Cheap: the message formats it only if it is ever shown."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_TORCH_DIR) and code.co_filename != _THIS_FILE:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def _describe_made(made_by: tuple[Any, Any, str] | None) -> str:
    if made_by is None:
        return "before the emulated device tracked it"
    op, site, thread = made_by
    where = (
        f"at {site[0].co_filename}:{site[1]} in {site[0].co_name}"
        if site is not None
        else "in a backward autograd's engine ran, no Python caller"
    )
    return f"by {op} {where}, thread {thread!r}"


def _recorded_by_autograd(stream: tuple[int, int]) -> bool:
    """Whether an op that autograd's engine runs on ``stream`` reads gradients the engine
    recorded there (see [Note: emulated allocator reuse])."""
    return torch._C._current_graph_task_id() != -1 and bool(
        _native.roundpipe_emu_autograd_recorded(stream[0], stream[1])
    )


def _record_stream(t: Any, stream: torch.Stream) -> None:
    """``t.record_stream(stream)``: the allocator will not reuse ``t``'s memory before the work
    ``stream`` has at the free is done."""
    if isinstance(t, EmuTensor) and t.numel() > 0:
        access = _accesses.get(_storage_key(t._elem))
        if access is not None:
            access.recorded.add((stream.device_index, stream.stream_id))


def _note_freed(access: _Access, index: int, nbytes: int) -> None:
    """A device storage is freed (a finalizer, any thread): leave a hazard in its allocating
    stream's pool for each other stream's use that nothing recorded or ordered yet."""
    made_on = access.made_on
    if made_on is None or _native is None:
        return
    uses = tuple(
        (other, count, op)
        for other, (count, op) in access.foreign.items()
        if other not in access.recorded
        and _known(made_on, other) < count
        and _native.roundpipe_emu_host_known(other[0], other[1]) < count
    )
    if uses:
        pool = (index, made_on[1], _small_pool(nbytes))
        _hazards.setdefault(pool, {})[next(_hazard_ids)] = _Hazard(
            pool, uses, access.made_by, nbytes
        )


def _check_reuse(op: Any, stream: tuple[int, int], nbytes: int) -> None:
    """An allocation of ``nbytes`` on ``stream``: raise if the pool it draws from holds freed
    memory another stream may still use (see [Note: emulated allocator reuse])."""
    pool = (stream[0], stream[1], _small_pool(nbytes))
    bucket = _hazards.get(pool)
    if not bucket:
        return
    with _hazard_lock:
        for ident, hazard in list(bucket.items()):
            del bucket[ident]
            pending = [u for u in hazard.uses if _known(stream, u[0]) < u[1]]
            if not pending:
                continue
            (other, _, use), device = pending[0], stream[0]
            raise StreamOrderError(
                f"caching allocator reuse on {NAME}:{device}: {op} allocates {nbytes} bytes on "
                f"stream {stream[1]}, from its pool of {'small' if pool[2] else 'large'} blocks, "
                f"where a tensor of {hazard.nbytes} bytes made on stream {stream[1]} "
                f"({_describe_made(hazard.made_by)}) was freed while stream {other[1]} of "
                f"{NAME}:{other[0]} may still be using it ({use} there). On a GPU the allocator "
                f"can hand that memory to this allocation, whose writes then race with stream "
                f"{other[1]}. Call t.record_stream(stream) for stream {other[1]} where it starts "
                f"using the tensor (the allocator then waits for that stream's work before "
                f"reusing the memory), or order that use before the free: stream {stream[1]} "
                f"waits for an event recorded on stream {other[1]} after the use, or the host "
                f"waits for it"
            )


_accesses: dict[int, _Access] = {}  # storage data pointer -> its order


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positions and names of the arguments ``func`` writes (``Tensor(a!)`` in its schema)."""
    found = _writes_cache.get(func)
    if found is None:
        positions, names = [], []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                if arg.kwarg_only:
                    names.append(arg.name)
                else:
                    positions.append(i)
        found = _writes_cache[func] = (tuple(positions), tuple(names))
    return found


def _current(index: int) -> tuple[int, int]:
    return index, _native.roundpipe_emu_current_stream(index)


def _known(stream: tuple[int, int], other: tuple[int, int]) -> int:
    return _native.roundpipe_emu_known(stream[0], stream[1], other[0], other[1])


def _race(
    func: Any, stream: tuple[int, int], other: tuple[int, int], what: str, other_op: Any
) -> StreamOrderError:
    return StreamOrderError(
        f"stream race on {NAME}:{stream[0]}: {func} on stream {stream[1]} {what} by {other_op} "
        f"on stream {other[1]} of {NAME}:{other[0]}, with nothing ordering the two; record an "
        f"event on "
        f"stream {other[1]} after that access and wait for it on stream {stream[1]} "
        f"(Stream.wait_event), or synchronize, first"
    )


def _host_waits(stream: tuple[int, int]) -> None:
    if _native.roundpipe_emu_host_waits(stream[0], stream[1]):
        raise StreamOrderError(_native.roundpipe_emu_error().decode())


def _enqueue(
    func: Any, args: Any, kwargs: dict[str, Any], leaves: list[Any], stream: tuple[int, int]
) -> tuple[int, dict[int, None]]:
    """Enqueue ``func`` on ``stream``: check its reads and writes of device memory against the
    stream order and record them. Returns its count on the stream and the storages it touched."""
    positions, names = _written_arguments(func)
    written_ids = set()
    for arg in [args[i] for i in positions if i < len(args)] + [
        kwargs[n] for n in names if n in kwargs
    ]:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):  # Tensor(a!) or Tensor(a!)[]
            if isinstance(t, EmuTensor):
                written_ids.add(id(t))
    touched: dict[int, None] = {}
    with _order_lock:
        count = _native.roundpipe_emu_enqueue(stream[0], stream[1])
        for t in leaves:
            if not isinstance(t, EmuTensor) or t.numel() == 0:
                continue
            key = _storage_key(t._elem)
            touched[key] = None
            access = _accesses.get(key)
            if access is None:
                access = _accesses[key] = _Access(None, 0, None)
            if (
                access.made_on is not None
                and access.made_on != stream
                and not _recorded_by_autograd(stream)
            ):
                access.foreign[stream] = (count, func)
            writer = access.writer
            if writer is not None and writer != stream and _known(stream, writer) < access.written:
                raise _race(func, stream, writer, "uses memory written", access.wrote)
            if id(t) in written_ids:
                for reader, (seen_at, op) in access.reads.items():
                    if reader != stream and _known(stream, reader) < seen_at:
                        raise _race(func, stream, reader, "writes memory read", op)
                access.writer, access.written, access.wrote = stream, count, func
                access.reads.clear()
            else:
                access.reads[stream] = (count, func)
    return count, touched


def _record_outputs(
    func: Any,
    outputs: list[Any],
    leaves: list[Any],
    touched: dict[int, None],
    stream: tuple[int, int],
    count: int,
    index: int,
) -> None:
    """An op's outputs in fresh device memory were written by it, on its stream, and take
    device memory on ``index``, allocated on that device's current stream (a copy from another
    device runs on the source's stream)."""
    made_on: tuple[int, int] | None = None
    for t in outputs:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            key = _storage_key(t)
            if key in touched or any(leaf is t for leaf in leaves):
                continue
            if made_on is None:
                made_on = stream if stream[0] == index else _current(index)
            _charge(t, index, made_on)
            access = _accesses[key] = _Access(stream, count, func)
            _track_allocation(access, func, made_on, t.untyped_storage().nbytes())
            if made_on != stream:
                access.foreign[stream] = (count, func)


def _track_allocation(access: _Access, op: Any, made_on: tuple[int, int], nbytes: int) -> None:
    """A new device storage, allocated on ``made_on``: check the pool it comes from and start
    its allocator record (see [Note: emulated allocator reuse])."""
    if not _rules.allocator_reuse:
        return
    if _hazards:
        _check_reuse(op, made_on, nbytes)
    access.made_on = made_on
    access.made_by = (op, _call_site(), threading.current_thread().name)


def _allocated(t: torch.Tensor, index: int, op: Any) -> None:
    """Fresh device memory, made by ``op``: charged, and what a previous storage at its
    address saw no longer applies."""
    stream = _current(index) if _native is not None else (index, 0)
    _charge(t, index, stream)
    if _native is not None and t.numel() > 0:
        with _order_lock:
            count = _native.roundpipe_emu_enqueue(stream[0], stream[1])
        access = _accesses[_storage_key(t)] = _Access(stream, count, op)
        _track_allocation(access, op, stream, t.untyped_storage().nbytes())


def _keep_until_settled(
    ident: int,
    host: torch.Tensor,
    snapshot: torch.Tensor,
    landing: tuple[int, tuple[int, int], int] | None = None,
) -> None:
    """Hold a pending copy's buffers until its host side has run (and forget those that have);
    ``landing``: a download's entry for :func:`_land_downloads`."""
    with _order_lock:
        for done in [i for i in _pending_buffers if _native.roundpipe_emu_finished(i)]:
            del _pending_buffers[done]
            _landing.pop(done, None)
        _pending_buffers[ident] = (host, snapshot)
        if landing is not None:
            _landing[ident] = landing


def _land_downloads(func: Any, source: torch.Tensor, stream: tuple[int, int]) -> None:
    """An upload from pinned ``source``: a pending download into it must be ordered before the
    upload (then its bytes land now), else the upload would read what is not there yet."""
    key = _storage_key(source)
    with _order_lock:
        waiting = [(i, at) for i, at in _landing.items() if at[0] == key]
    for ident, (_, writer, count) in waiting:
        if writer != stream and _known(stream, writer) < count:
            raise _race(
                func, stream, writer, "uploads host memory still being written", "a download"
            )
        _native.roundpipe_emu_land(ident)
        with _order_lock:
            _landing.pop(ident, None)


def _async_download(
    host: torch.Tensor, snapshot: torch.Tensor, stream: tuple[int, int], count: int
) -> None:
    """``host.copy_(source, non_blocking=True)`` into pinned memory, ``snapshot`` holding the
    source's values in ``host``'s dtype and layout: ``host`` holds poison until the host waits
    for the copy."""
    host.reshape(-1).view(torch.uint8).fill_(0xFF)
    ident = _native.roundpipe_emu_pending(
        1,
        ctypes.c_void_p(host.data_ptr()),
        ctypes.c_void_p(snapshot.data_ptr()),
        host.numel() * host.element_size(),
        stream[0],
        stream[1],
        count,
    )
    _keep_until_settled(ident, host, snapshot, landing=(_storage_key(host), stream, count))


def _watch_upload(source: torch.Tensor, stream: tuple[int, int], count: int) -> None:
    """A non-blocking upload from pinned ``source``: the host must not change it before it
    waits for the copy."""
    snapshot = source.clone()
    ident = _native.roundpipe_emu_pending(
        0,
        ctypes.c_void_p(source.data_ptr()),
        ctypes.c_void_p(snapshot.data_ptr()),
        source.numel() * source.element_size(),
        stream[0],
        stream[1],
        count,
    )
    _keep_until_settled(ident, source, snapshot)


def _asynchronous_host(t: Any, non_blocking: bool) -> bool:
    """Whether a copy between the device and host tensor ``t`` is asynchronous, as on CUDA:
    non-blocking, pinned, and (here) one contiguous block."""
    return (
        non_blocking
        and isinstance(t, torch.Tensor)
        and t.numel() > 0
        and t.is_pinned()
        and t.is_contiguous()
    )


def _same_device_error(func: Any, a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two "
        f"devices, {a} and {b}! (when checking arguments for {func})"
    )


def _histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``histc`` of an integer tensor, which CUDA computes and the CPU refuses (code that
    counts on the GPU path takes integers for determinism): counted in float, returned in the
    input's dtype as CUDA returns it."""
    if input.is_floating_point():
        return torch.histc(input, bins, min, max)
    return torch.histc(input.double(), bins, min, max).to(input.dtype)


# Ops whose CPU kernel lacks a dtype CUDA's has: what the device computes instead.
_DEVICE_KERNELS: dict[Any, Any] = {aten.histc.default: _histc}


class EmuTensor(torch.Tensor):
    """A tensor on ``emu:<index>``: a wrapper whose data is the CPU tensor ``_elem``."""

    _elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, index: int = 0) -> EmuTensor:
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise AssertionError(
                f"an emu tensor wraps a plain CPU tensor, got {type(elem)} on "
                f"{elem.device}; please report"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=torch.device(NAME, index),
            requires_grad=elem.requires_grad,
        )
        out._elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self._elem!r} (on {self.device})"

    # Storage identity, as code that checks aliasing reads it on CUDA tensors.
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._elem.untyped_storage()

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.record_stream.default:  # nothing to compute: the allocator's business
            _record_stream(args[0], args[1])
            return None
        leaves = pytree.tree_leaves((args, kwargs))
        index = _check_devices(func, leaves)
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            EmuTensor, lambda t: t._elem, (args, kwargs)
        )
        non_blocking = bool(
            kwargs.get("non_blocking", False)
            or (func is aten.copy_.default and len(args) > 2 and args[2])
        )
        stream = _current(index)
        # A copy between two devices runs on the source's current stream, between two
        # barriers with the destination's (``peer``), as torch's does.
        peer: tuple[int, int] | None = None
        download_into: torch.Tensor | None = None  # a host tensor this op copies into
        upload_from: torch.Tensor | None = None  # a host tensor this op copies from
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, EmuTensor) and not isinstance(src, EmuTensor):
                upload_from = src
                if _copy_logs:
                    _log_copy("h2d", src, dst)
            elif isinstance(src, EmuTensor) and not isinstance(dst, EmuTensor):
                download_into = dst
                stream = _current(src.device.index)
                if _copy_logs:
                    _log_copy("d2h", dst, src)
            elif isinstance(src, EmuTensor) and src.device != dst.device:
                peer, stream = stream, _current(src.device.index)
        elif func is aten._to_copy.default and not isinstance(args[0], EmuTensor):
            upload_from = args[0]
        target = unwrapped_kwargs.get("device")
        if target is not None:
            target = torch.device(target)
            if target.type == "cpu":  # a copy to the host: hand out the plain tensor
                if _copy_logs and func is aten._to_copy.default:
                    _log_copy("d2h", None, args[0])
                return _to_host(
                    func,
                    args,
                    kwargs,
                    unwrapped_args,
                    unwrapped_kwargs,
                    leaves,
                    stream,
                    non_blocking,
                )
            if isinstance(args[0], EmuTensor) and (target.index or 0) != index:
                peer = _current(target.index or 0)
            index = target.index or 0
            unwrapped_kwargs["device"] = torch.device("cpu")
        if "pin_memory" in unwrapped_kwargs:
            unwrapped_kwargs["pin_memory"] = False
        if peer is not None:
            _join(stream, peer)  # the destination's current stream is done with its memory
        count, touched = _enqueue(func, args, kwargs, leaves, stream)
        if peer is not None:
            _join(stream, peer)  # and waits for the copy
        if upload_from is not None and _landing and upload_from.is_pinned():
            _land_downloads(func, upload_from, stream)
        if download_into is not None:
            if _asynchronous_host(download_into, non_blocking):
                snapshot = torch.empty_like(download_into).copy_(unwrapped_args[1])
                _async_download(download_into, snapshot, stream, count)
                return download_into
            _host_waits(stream)  # a blocking copy: the host waits, then the bytes land
        out = _DEVICE_KERNELS.get(func, func)(*unwrapped_args, **unwrapped_kwargs)
        if upload_from is not None and _asynchronous_host(upload_from, non_blocking):
            _watch_upload(upload_from, stream, count)
        if func in _CUBLAS_OPS and stream[1] not in _matmul_streams[stream[0]]:
            _matmul_streams[stream[0]].add(stream[1])  # a set add: atomic
        outputs = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
        if not all(isinstance(t, torch.Tensor) or t is None for t in outputs):
            _host_waits(stream)  # a number for the host: .item() and the like
        # An in-place or out= op returns one of its arguments: hand back that very object.
        mine: dict[int, torch.Tensor] = {}
        for t in leaves:
            if isinstance(t, EmuTensor):
                mine[id(t._elem)] = t
            elif isinstance(t, torch.Tensor):
                mine[id(t)] = t
        _record_outputs(func, outputs, leaves, touched, stream, count, index)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: mine[id(t)] if id(t) in mine else EmuTensor(t, index), out
        )


def _join(a: tuple[int, int], b: tuple[int, int]) -> None:
    _native.roundpipe_emu_join(a[0], a[1], b[0], b[1])


def _to_host(
    func: Any,
    args: Any,
    kwargs: dict[str, Any],
    unwrapped_args: Any,
    unwrapped_kwargs: dict[str, Any],
    leaves: list[Any],
    stream: tuple[int, int],
    non_blocking: bool,
) -> torch.Tensor:
    """``tensor.to("cpu")``: blocking, the host waits for the stream; non-blocking, the result
    is pinned, as on CUDA, and holds poison until the host waits for the copy."""
    count, _ = _enqueue(func, args, kwargs, leaves, stream)
    if not non_blocking:
        out = func(*unwrapped_args, **unwrapped_kwargs)
        _host_waits(stream)
        return out
    unwrapped_kwargs = dict(unwrapped_kwargs, pin_memory=False)
    source = func(*unwrapped_args, **unwrapped_kwargs).contiguous()  # a fresh copy: the snapshot
    host = torch.empty_like(source, pin_memory=True)
    _async_download(host, source, stream, count)
    return host


def _check_devices(func: Any, leaves: list[Any]) -> int:
    """The emu device index of the op, after CUDA's same-device check."""
    index: int | None = None
    host: torch.Tensor | None = None
    for t in leaves:
        if isinstance(t, EmuTensor):
            i = t.device.index
            if index is None:
                index = i
            elif i != index and func not in _CROSS_DEVICE_OK:
                raise _same_device_error(func, torch.device(NAME, index), t.device)
        elif isinstance(t, torch.Tensor) and t.dim() > 0 and host is None:
            host = t
    if host is not None and index is not None and func not in _CROSS_DEVICE_OK:
        raise _same_device_error(func, torch.device(NAME, index), host.device)
    return 0 if index is None else index


def _device_index(kwargs: dict[str, Any]) -> int:
    device = kwargs.get("device")
    return 0 if device is None else (torch.device(device).index or 0)


def _empty(size: Any, **kwargs: Any) -> EmuTensor:
    """``aten::empty.memory_format`` on the emulated device."""
    index = _device_index(kwargs)
    kwargs.update(device="cpu", pin_memory=False)
    elem = aten.empty.memory_format(size, **kwargs)
    _allocated(elem, index, aten.empty.memory_format)
    return EmuTensor(elem, index)


def _empty_strided(size: Any, stride: Any, **kwargs: Any) -> EmuTensor:
    """``aten::empty_strided`` on the emulated device."""
    index = _device_index(kwargs)
    kwargs.update(device="cpu", pin_memory=False)
    elem = aten.empty_strided(size, stride, **kwargs)
    _allocated(elem, index, aten.empty_strided.default)
    return EmuTensor(elem, index)


# Factories whose ATen kernel makes an empty tensor and fills it through their out= overload,
# which resizes it: a wrapper's shape cannot change, so on the emulated device they would hand
# back a 0-element wrapper around the filled storage. They run on the host and are wrapped.
_RESIZING_FACTORIES = ("arange", "arange.start", "arange.start_step", "eye", "eye.m")


def _host_factory(overload: str) -> Any:
    op = getattr(aten, overload.split(".")[0])
    op = getattr(op, overload.split(".")[1] if "." in overload else "default")

    def factory(*args: Any, **kwargs: Any) -> EmuTensor:
        index = _device_index(kwargs)
        kwargs.update(device="cpu", pin_memory=False)
        elem = op(*args, **kwargs)
        _allocated(elem, index, op)
        return EmuTensor(elem, index)

    factory.__name__ = f"_{overload.replace('.', '_')}"
    return factory


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::_copy_from`` on the emulated device. ``torch.tensor(data, device="emu")`` copies
    its host data with the Python dispatch key excluded, so the copy reaches the backend's kernel
    rather than :meth:`EmuTensor.__torch_dispatch__`; it is handed to the same copy there."""
    return EmuTensor.__torch_dispatch__(aten.copy_.default, (EmuTensor,), (dst, src, non_blocking))


class _DeviceModule:
    """``torch.emu``: what ``torch.amp``, ``torch.utils.checkpoint``, ``torch.random.fork_rng``
    and ``torch.get_device_module`` look up. Random ops on emu tensors draw from the CPU
    generator, so the "device" generator state is the CPU one."""

    _initialized = True
    Stream = torch.Stream
    Event = torch.Event

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def _lazy_init() -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return DEVICE_COUNT

    @staticmethod
    def current_device() -> int:
        return torch.accelerator.current_device_index()

    @staticmethod
    def set_device(device: Any) -> None:
        torch.accelerator.set_device_index(device)

    @staticmethod
    def device(device: Any) -> contextlib.AbstractContextManager:
        return torch.accelerator.device_index(
            torch.device(NAME, device).index if not isinstance(device, int) else device
        )

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        # torch.manual_seed calls this after seeding the CPU generator, which emu ops draw from.
        return None

    @staticmethod
    def current_stream(device: Any = None) -> torch.Stream:
        return torch.accelerator.current_stream(device)

    @staticmethod
    def stream(stream: torch.Stream) -> torch.Stream:
        return stream  # torch.Stream is its own context manager

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.accelerator.synchronize(device)

    # Memory, as torch.cuda reports it (see [Note: emulated device memory]).
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return _allocated_bytes[_index_of(device)]

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        index = _index_of(device)
        if not _rules.reserved_memory:
            return _allocated_bytes[index]  # no cache: what is live is what is held
        with _memory_lock:
            _settle_blocks(index)
            return _allocators[index].reserved

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        index = _index_of(device)
        if not _rules.reserved_memory:
            return _peak_bytes[index]
        return _allocators[index].peak_reserved

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return _peak_bytes[_index_of(device)]

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        index = _index_of(device)
        with _memory_lock:
            _peak_bytes[index] = _allocated_bytes[index]
            _settle_blocks(index)
            _allocators[index].reset_peak()

    @staticmethod
    def empty_cache() -> None:
        """Give every device's fully free segments back (as torch.cuda.empty_cache)."""
        with _memory_lock:
            for index, allocator in enumerate(_allocators):
                _settle_blocks(index)
                allocator.empty_cache()

    @staticmethod
    def planning_overheads() -> GpuOverheads | None:
        """What a memory plan must leave beside its tensors as on a GPU (see [Note: the device
        reserve] in :mod:`roundpipe.devices.accelerator`): the overheads set_gpu_overheads
        gives when the capacity counts reserved memory, else None (the device then runs out
        only when its live storages would not fit, and needs no reserve). Any thread."""
        if not (_rules.reserved_memory and _capacity_counts_reserved):
            return None
        return _overheads

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) as the driver reports them: the capacity less what the process holds,
        which is the reserved segments and the overheads (see [Note: emulated device
        memory]) under Rules.reserved_memory, else the live storages. So ``free +
        memory_reserved - memory_allocated`` is what a run may still allocate, as on CUDA. A
        capacity that counts live storages only may be smaller than one segment: ``free`` is
        then negative, which a GPU's never is, and that sum still right."""
        index, total = _index_of(device), _capacity_of_device()
        if not _rules.reserved_memory:
            return max(total - _allocated_bytes[index], 0), total
        return total - _DeviceModule.memory_reserved(index) - overheads_held(index), total


# [Note: emulated autocast]
# torch.autocast("emu") runs CUDA's cast policy (Rules.cuda_autocast): the op lists torch
# registers for AutocastCUDA, which ATen/autocast_mode.h keeps for other backends to share,
# registered for the emulated device by a small C++ library (_emu_autocast.cpp) with torch's own
# wrappers. So matmul-like ops run in the autocast dtype; softmax, log_softmax, layer_norm,
# rms_norm, sum, pow, exp, the losses (nll_loss, mse_loss, ...) and the norms run in fp32;
# addcmul, dot, index_put, scatter_add and the like promote mixed inputs to the widest dtype;
# binary_cross_entropy is refused; fp32 leaf weights' casts are cached for the autocast region,
# as on CUDA. Only device tensors are cast (a host tensor in the call is left alone, as CUDA's
# policy leaves it). Switched off, only the matmul-like ops (_AUTOCAST_LOWER) are lowered, by a
# Python kernel: the lenient policy the emulated device had first.
_autocast_native: Any = None  # the autocast library, through ctypes (set by install)
_lenient_autocast: torch.library.Library | None = None


def _set_cuda_autocast(on: bool) -> None:
    """Register CUDA's autocast policy, or the lenient one, for the emulated device (the caller
    holds _INSTALL_LOCK)."""
    global _lenient_autocast
    if on:
        if _lenient_autocast is not None:
            _lenient_autocast._destroy()
            _lenient_autocast = None
        if _autocast_native.roundpipe_emu_cuda_autocast(1):
            raise RuntimeError(
                "could not register CUDA's autocast policy for the emulated device: "
                + _autocast_native.roundpipe_emu_autocast_error().decode()
            )
        return
    _autocast_native.roundpipe_emu_cuda_autocast(0)
    if _lenient_autocast is None:
        _lenient_autocast = torch.library.Library("aten", "IMPL")
        _lower_matmuls(_lenient_autocast)


def _lower_matmuls(aten_lib: torch.library.Library) -> None:
    """The lenient ``torch.autocast("emu")``: matmul-like ops cast their floating inputs to the
    autocast dtype; every other op passes through untouched."""
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]
    for name in _AUTOCAST_LOWER:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)

            def kernel(*args: Any, _op: Any = op, **kwargs: Any) -> Any:
                dtype = torch.get_autocast_dtype(NAME)
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: t.to(dtype) if t.is_floating_point() else t,
                    (args, kwargs),
                )
                with torch._C._ExcludeDispatchKeyGuard(excluded):
                    return _op(*args, **kwargs)

            qualified = name if overload == "default" else f"{name}.{overload}"
            aten_lib.impl(qualified, kernel, "AutocastPrivateUse1")


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` on emu tensors, as torch computes it for CPU tensors: torch would take
    its fused ``native_dropout`` kernel for an accelerator, which draws other masks from the same
    generator state. With this, an emu run and a CPU run draw the same masks."""
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise


# [Note: emulated attention]
# torch decomposes scaled_dot_product_attention into its math path for any PrivateUse1 device,
# which holds the (query x key) scores that a GPU's fused kernels never allocate. The emulated
# device instead computes what the CPU computes, with the CPU's fused (flash) kernel where the
# CPU takes it (no scores), else the math composite. Under Rules.cuda_attention it also takes
# the math path wherever CUDA would (roundpipe.testing.cuda_attention,
# [Note: CUDA's attention backends]: a mask with a head dim that is no multiple of 8 in fp16,
# 3-D inputs, fp64, ...), so device memory holds the scores exactly where a GPU's does; the
# results then are the math path's, which may differ from the CPU's fused kernel in the last
# bits. Where CUDA would fuse but the CPU would not (dropout: the CPU's fused kernel draws no
# dropout), the math path runs and its scores are counted, more than a GPU holds.
def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` on emu tensors (see [Note: emulated attention]):
    the math path where CUDA would take it, else the CPU's fused kernel where the CPU takes it,
    which never holds the (query x key) scores."""
    cpu_fused = dropout_p == 0.0  # a memory trace (fake tensors): the CPU's choice, roughly
    if not is_fake(query):
        cpu_fused = (
            torch.ops.aten._fused_sdp_choice(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            == SDPBackend.FLASH_ATTENTION.value
        )
    fused = cpu_fused
    if _rules.cuda_attention:
        backend = cuda_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if backend == SDPBackend.ERROR:
            raise RuntimeError(
                "scaled_dot_product_attention: no kernel CUDA would run takes these inputs "
                f"(query {tuple(query.shape)} {query.dtype}, attn_mask "
                f"{'none' if attn_mask is None else tuple(attn_mask.shape)}), and the math path "
                "is switched off (torch.nn.attention.sdpa_kernel or torch.backends.cuda); allow "
                "SDPBackend.MATH, or see roundpipe.testing.cuda_attention for what the fused "
                "kernels take"
            )
        fused = cpu_fused and backend != SDPBackend.MATH
    if not fused:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it first
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf")
        )
    # The CPU kernel takes fewer key/value heads than query heads itself (grouped queries).
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def is_installed() -> bool:
    """Whether :func:`install` has run in this process. Any thread."""
    return _installed


def _extension_name(name: str) -> str:
    """The name torch builds the C++ library ``_{name}.cpp`` under: named by its source, so
    checkouts with different sources share torch's cache."""
    with open(os.path.join(_HERE, f"_{name}.cpp"), "rb") as f:
        return f"roundpipe_{name}_{hashlib.sha256(f.read()).hexdigest()[:16]}"


# [Note: the build lock]
# torch's cpp_extension.load serializes builds of one extension across processes with a "lock"
# file in its build directory (a FileBaton), which every load takes, even of an extension
# already built, and which only the process that made it removes: a process killed while it
# held it (killed mid-build, say) leaves it, and every later load waits for it forever. The
# emulated device's builds therefore also take an flock on a file of their own beside it, which
# the kernel releases when its holder dies: holding that, no other install of this extension is
# building, so a baton found there is a dead process's and is removed before torch looks.
def _build_lock(ext: str) -> contextlib.AbstractContextManager[None]:
    from torch.utils import cpp_extension

    directory = getattr(cpp_extension, "_get_build_directory", None)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's baton alone
        return contextlib.nullcontext()
    if directory is None:
        return contextlib.nullcontext()
    return _flocked(directory(ext, False), fcntl)


@contextlib.contextmanager
def _flocked(build_dir: str, fcntl: Any) -> Iterator[None]:
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "roundpipe-build.flock"), "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a live build elsewhere: wait for it
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))  # a killed build's baton
            yield
        finally:
            fcntl.flock(held.fileno(), fcntl.LOCK_UN)


def install() -> None:
    """Register the ``emu`` device in this process (idempotent; any thread). Builds its two C++
    libraries on first use (the guard in seconds, CUDA's autocast policy in about a minute of
    one core; cached under torch's extension directory; needs a C++ compiler and ninja). Must
    run before the process's first ``backward()``."""
    global _installed, _late_error, _rules
    with _INSTALL_LOCK:
        if _late_error is not None:
            raise RuntimeError(str(_late_error))
        if _installed:
            return
        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
            raise RuntimeError(
                f"cannot install the emulated device: the PrivateUse1 backend is already "
                f"{torch._C._get_privateuse1_backend_name()!r} in this process"
            )
        from torch.utils import cpp_extension

        def build(name: str) -> str:
            ext = _extension_name(name)
            with _build_lock(ext):
                return cpp_extension.load(
                    name=ext,
                    sources=[os.path.join(_HERE, f"_{name}.cpp")],
                    is_python_module=False,
                    verbose=False,
                )

        _bind_native(build("emu_guard"), build("emu_autocast"))
        lenient = os.environ.get("ROUNDPIPE_EMU_LENIENT", "")
        names = [n.strip() for n in lenient.split(",") if n.strip()]
        try:
            _rules = dataclasses.replace(_rules, **dict.fromkeys(names, False))
        except TypeError:
            raise ValueError(
                f"ROUNDPIPE_EMU_LENIENT={lenient!r} names an unknown rule; the rules are "
                f"{[f.name for f in dataclasses.fields(Rules)]}"
            ) from None
        # The pinned allocator rounds as CUDA's would under the same allocator config.
        from roundpipe.host_memory import cuda_pinned_round_limit

        set_pinned_round_limit(cuda_pinned_round_limit())
        capacity = os.environ.get("ROUNDPIPE_EMU_MEMORY")
        if capacity:
            set_memory_capacity(int(capacity))
        torch.utils.rename_privateuse1_backend(NAME)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
        torch._register_device_module(NAME, _DeviceModule())
        aten_lib = torch.library.Library("aten", "IMPL")
        any_lib = torch.library.Library("_", "IMPL")
        aten_lib.impl("empty.memory_format", _empty, "PrivateUse1")
        aten_lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        for overload in _RESIZING_FACTORIES:
            aten_lib.impl(overload, _host_factory(overload), "PrivateUse1")
        aten_lib.impl("_copy_from", _copy_from, "PrivateUse1")
        aten_lib.impl("dropout", _dropout, "AutogradPrivateUse1")
        aten_lib.impl("scaled_dot_product_attention", _attention, "AutogradPrivateUse1")
        # Ops on neither autocast list pass through; the lists are the rule's (_set_cuda_autocast).
        any_lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
        _libraries.extend((aten_lib, any_lib))
        _apply_native_rules(_rules)
        _installed = True
        try:
            _check_backward_threads()
        except RuntimeError as exc:
            _late_error = exc
            raise


def _bind_native(path: str, autocast_path: str) -> None:
    """The guard's C functions that the dispatcher calls (see [Note: emulated streams]), and the
    autocast library's (see [Note: emulated autocast])."""
    global _native, _autocast_native
    autocast = ctypes.CDLL(autocast_path)
    autocast.roundpipe_emu_cuda_autocast.restype = ctypes.c_int
    autocast.roundpipe_emu_cuda_autocast.argtypes = [ctypes.c_int]
    autocast.roundpipe_emu_autocast_error.restype = ctypes.c_char_p
    autocast.roundpipe_emu_autocast_error.argtypes = []
    _autocast_native = autocast
    lib = ctypes.CDLL(path)
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    for name, restype, argtypes in (
        ("roundpipe_emu_current_stream", i64, [i64]),
        ("roundpipe_emu_enqueue", i64, [i64, i64]),
        ("roundpipe_emu_known", i64, [i64, i64, i64, i64]),
        ("roundpipe_emu_host_known", i64, [i64, i64]),
        ("roundpipe_emu_enqueued", i64, [i64, i64]),
        ("roundpipe_emu_set_honest_queries", None, [ctypes.c_int]),
        ("roundpipe_emu_set_stream_pool", None, [ctypes.c_int]),
        ("roundpipe_emu_set_pinned_cache", None, [ctypes.c_int]),
        ("roundpipe_emu_empty_pinned_cache", None, []),
        ("roundpipe_emu_autograd_recorded", ctypes.c_int, [i64, i64]),
        ("roundpipe_emu_join", None, [i64, i64, i64, i64]),
        ("roundpipe_emu_host_waits", ctypes.c_int, [i64, i64]),
        ("roundpipe_emu_pending", i64, [ctypes.c_int, vp, vp, i64, i64, i64, i64]),
        ("roundpipe_emu_land", None, [i64]),
        ("roundpipe_emu_finished", ctypes.c_int, [i64]),
        ("roundpipe_emu_error", ctypes.c_char_p, []),
        ("roundpipe_emu_pinned_stats", None, [vp, ctypes.c_int]),
        ("roundpipe_emu_set_pinned_round_limit", None, [i64]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    _native = lib


def _check_backward_threads() -> None:
    """A backward on the device: it starts autograd's device threads if none ran yet, and fails
    if they started before the device existed (then emu backwards would fail later, less
    clearly)."""
    leaf = torch.ones(2).to(NAME).requires_grad_()
    try:
        (leaf * 2).sum().backward()
    except RuntimeError as exc:
        raise RuntimeError(
            "the emulated device was installed after this process's first backward(), so "
            "autograd has no thread for it; install it first: set ROUNDPIPE_DEVICES=emu before "
            "the process starts, or call roundpipe.testing.emu.install() before any backward"
        ) from exc
