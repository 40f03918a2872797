"""The emulated device's streams: the order a GPU would guarantee, tracked per device storage
(reads, writes, the allocating stream), the caching allocator's reuse hazards, and the pending
non-blocking copies. See [Note: emulated streams] and [Note: emulated allocator reuse]."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.testing.caching_allocator import Block
from roundpipe.testing.emu import memory
from roundpipe.testing.emu.memory import PinnedMemoryStats, charge, free_block, release
from roundpipe.testing.emu.native import NAME, STATE, StreamOrderError, known

__all__ = [
    "allocated",
    "async_download",
    "copies_in_flight_bytes",
    "current",
    "enqueue",
    "give_back",
    "join",
    "land_downloads",
    "landing_pending",
    "race",
    "record_outputs",
    "record_stream",
    "watch_upload",
]

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


# [Note: emulated stream pool]
# CUDA does not make a stream for each torch.Stream(): it hands out the 32 streams of a
# per-device pool round-robin, so after 32 of them a new torch.Stream is one some other code
# already holds, with that code's work pending on it. Code that takes a new stream for an
# empty, private one (that queries it for being idle, or expects a wait on it to order only its
# own work) is wrong on a GPU; the emulated device hands out streams the same way
# (Rules.stream_pool), so two models' streams may be the same here too. The default stream
# (0) is not in the pool.


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
_EMU_DIR = os.path.dirname(os.path.abspath(__file__))


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
        if not code.co_filename.startswith((_TORCH_DIR, _EMU_DIR)):
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
        STATE.guard.roundpipe_emu_autograd_recorded(stream[0], stream[1])
    )


def _note_freed(access: _Access, index: int, nbytes: int) -> None:
    """A device storage is freed (a finalizer, any thread): leave a hazard in its allocating
    stream's pool for each other stream's use that nothing recorded or ordered yet."""
    made_on = access.made_on
    if made_on is None or STATE.guard is None:
        return
    uses = tuple(
        (other, count, op)
        for other, (count, op) in access.foreign.items()
        if other not in access.recorded
        and known(made_on, other) < count
        and STATE.guard.roundpipe_emu_host_known(other[0], other[1]) < count
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
            pending = [u for u in hazard.uses if known(stream, u[0]) < u[1]]
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


def current(index: int) -> tuple[int, int]:
    return index, STATE.guard.roundpipe_emu_current_stream(index)


def race(
    func: Any, stream: tuple[int, int], other: tuple[int, int], what: str, other_op: Any
) -> StreamOrderError:
    return StreamOrderError(
        f"stream race on {NAME}:{stream[0]}: {func} on stream {stream[1]} {what} by {other_op} "
        f"on stream {other[1]} of {NAME}:{other[0]}, with nothing ordering the two; record an "
        f"event on "
        f"stream {other[1]} after that access and wait for it on stream {stream[1]} "
        f"(Stream.wait_event), or synchronize, first"
    )


def enqueue(
    func: Any,
    args: Any,
    kwargs: dict[str, Any],
    leaves: list[Any],
    stream: tuple[int, int],
    on_device: Callable[[Any], bool],
) -> tuple[int, dict[int, None]]:
    """Enqueue ``func`` on ``stream``: check its reads and writes of device memory against the
    stream order and record them. Returns its count on the stream and the storages it touched."""
    positions, names = _written_arguments(func)
    written_ids = set()
    for arg in [args[i] for i in positions if i < len(args)] + [
        kwargs[n] for n in names if n in kwargs
    ]:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):  # Tensor(a!) or Tensor(a!)[]
            if on_device(t):
                written_ids.add(id(t))
    touched: dict[int, None] = {}
    with _order_lock:
        count = STATE.guard.roundpipe_emu_enqueue(stream[0], stream[1])
        for t in leaves:
            if not on_device(t) or t.numel() == 0:
                continue
            key = _storage_key(t)
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
            if writer is not None and writer != stream and known(stream, writer) < access.written:
                raise race(func, stream, writer, "uses memory written", access.wrote)
            if id(t) in written_ids:
                for reader, (seen_at, op) in access.reads.items():
                    if reader != stream and known(stream, reader) < seen_at:
                        raise race(func, stream, reader, "writes memory read", op)
                access.writer, access.written, access.wrote = stream, count, func
                access.reads.clear()
            else:
                access.reads[stream] = (count, func)
    return count, touched


def record_outputs(
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
                made_on = stream if stream[0] == index else current(index)
            _charge(t, index, made_on)
            access = _accesses[key] = _Access(stream, count, func)
            _track_allocation(access, func, made_on, t.untyped_storage().nbytes())
            if made_on != stream:
                access.foreign[stream] = (count, func)


def _track_allocation(access: _Access, op: Any, made_on: tuple[int, int], nbytes: int) -> None:
    """A new device storage, allocated on ``made_on``: check the pool it comes from and start
    its allocator record (see [Note: emulated allocator reuse])."""
    if not STATE.rules.allocator_reuse:
        return
    if _hazards:
        _check_reuse(op, made_on, nbytes)
    access.made_on = made_on
    access.made_by = (op, _call_site(), threading.current_thread().name)


def allocated(t: torch.Tensor, index: int, op: Any) -> None:
    """Fresh device memory, made by ``op``: charged, and what a previous storage at its
    address saw no longer applies."""
    stream = current(index) if STATE.guard is not None else (index, 0)
    _charge(t, index, stream)
    if STATE.guard is not None and t.numel() > 0:
        with _order_lock:
            count = STATE.guard.roundpipe_emu_enqueue(stream[0], stream[1])
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
        _forget_settled()
        _pending_buffers[ident] = (host, snapshot)
        if landing is not None:
            _landing[ident] = landing


def _forget_settled() -> None:
    # Under _order_lock.
    for done in [i for i in _pending_buffers if STATE.guard.roundpipe_emu_finished(i)]:
        del _pending_buffers[done]
        _landing.pop(done, None)


def forget_settled() -> None:
    """Let go of the buffers of copies whose host side has run, so that a buffer freed by its
    owner is freed now, not at the next copy (memory statistics read after it). Any thread."""
    with _order_lock:
        _forget_settled()


def copies_in_flight_bytes() -> int:
    """The host bytes of the snapshots the emulator holds for asynchronous copies whose host
    side has not run yet (each copies its source when enqueued): memory a GPU run's host does
    not hold (a download's source is device memory until the copy runs; an upload reads its
    pinned source in place). Any thread."""
    with _order_lock:
        _forget_settled()
        return sum(s.untyped_storage().nbytes() for _, s in _pending_buffers.values())


def pinned_memory_stats(reset_peak: bool = False) -> PinnedMemoryStats:
    """The emulated pinned host memory in use (``memory.pinned_memory_stats``), once the
    buffers of settled copies that only the emulator still held are let go. Any thread."""
    forget_settled()
    return memory.pinned_memory_stats(reset_peak)


def empty_pinned_cache() -> None:
    """Give the freed pinned blocks kept for reuse back to the host
    (``memory.empty_pinned_cache``), once the buffers of settled copies that only the emulator
    still held are let go, so that none of them lands in the cache just after. Any thread."""
    forget_settled()
    memory.empty_pinned_cache()


def land_downloads(func: Any, source: torch.Tensor, stream: tuple[int, int]) -> None:
    """An upload from pinned ``source``: a pending download into it must be ordered before the
    upload (then its bytes land now), else the upload would read what is not there yet."""
    key = _storage_key(source)
    with _order_lock:
        waiting = [(i, at) for i, at in _landing.items() if at[0] == key]
    for ident, (_, writer, count) in waiting:
        if writer != stream and known(stream, writer) < count:
            raise race(
                func, stream, writer, "uploads host memory still being written", "a download"
            )
        STATE.guard.roundpipe_emu_land(ident)
        with _order_lock:
            _landing.pop(ident, None)


def async_download(
    host: torch.Tensor, snapshot: torch.Tensor, stream: tuple[int, int], count: int
) -> None:
    """``host.copy_(source, non_blocking=True)`` into pinned memory, ``snapshot`` holding the
    source's values in ``host``'s dtype and layout: ``host`` holds poison until the host waits
    for the copy."""
    host.reshape(-1).view(torch.uint8).fill_(0xFF)
    ident = STATE.guard.roundpipe_emu_pending(
        1,
        ctypes.c_void_p(host.data_ptr()),
        ctypes.c_void_p(snapshot.data_ptr()),
        host.numel() * host.element_size(),
        stream[0],
        stream[1],
        count,
    )
    _keep_until_settled(ident, host, snapshot, landing=(_storage_key(host), stream, count))


def watch_upload(source: torch.Tensor, stream: tuple[int, int], count: int) -> None:
    """A non-blocking upload from pinned ``source``: the host must not change it before it
    waits for the copy."""
    snapshot = source.clone()
    ident = STATE.guard.roundpipe_emu_pending(
        0,
        ctypes.c_void_p(source.data_ptr()),
        ctypes.c_void_p(snapshot.data_ptr()),
        source.numel() * source.element_size(),
        stream[0],
        stream[1],
        count,
    )
    _keep_until_settled(ident, source, snapshot)


def give_back(key: int, index: int, nbytes: int, block: Block) -> None:
    """A device storage died (its finalizer, any thread): its bytes are released, its stream
    order ends, and its block goes back to the allocator once the streams that
    ``record_stream`` named are done with it (see [Note: emulated allocator reuse])."""
    release(key, index)
    access = _accesses.pop(key, None)  # its stream order ends with it (one dict op: no lock)
    held_for: tuple = ()
    guard = STATE.guard
    if access is not None and access.recorded and guard is not None:
        # record_stream: the block waits for those streams' work at the free (an event each).
        held_for = tuple(
            (other, guard.roundpipe_emu_enqueued(other[0], other[1]))
            for other in access.recorded
            if other != access.made_on
        )
    free_block(index, block, held_for)
    if access is not None and access.foreign and STATE.rules.allocator_reuse:
        _note_freed(access, index, nbytes)


def _charge(t: torch.Tensor, index: int, stream: tuple[int, int]) -> None:
    storage = t.untyped_storage()
    block = charge(t, index, stream)
    if block is not None:
        weakref.finalize(storage, give_back, storage.data_ptr(), index, storage.nbytes(), block)


def record_stream(key: int, stream: torch.Stream) -> None:
    """``t.record_stream(stream)`` of the device storage ``key``: the allocator will not reuse
    its memory before the work ``stream`` has at the free is done."""
    access = _accesses.get(key)
    if access is not None:
        access.recorded.add((stream.device_index, stream.stream_id))


def join(a: tuple[int, int], b: tuple[int, int]) -> None:
    """Streams ``a`` and ``b`` each wait for what the other has enqueued."""
    STATE.guard.roundpipe_emu_join(a[0], a[1], b[0], b[1])


def landing_pending() -> bool:
    """Whether a download into pinned memory is still to land (cheap; no lock)."""
    return bool(_landing)
