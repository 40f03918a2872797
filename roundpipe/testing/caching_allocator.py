"""A model of CUDA's caching allocator, for the emulated device (:mod:`roundpipe.testing.emu`):
how much device memory a GPU *reserves* for what torch allocates.

[Note: the caching allocator's reserve]
torch's CUDA allocator never hands a tensor bare device memory. It rounds each request up to a
multiple of 512 bytes, and serves it from a segment it got from the driver: requests up to
1 MiB from 2 MiB segments (the small pool), larger ones from 20 MiB segments up to 10 MiB, and
above that from a segment of their own, rounded up to 2 MiB. A segment belongs to the stream
that was current when it was made, and a freed block goes back to that stream's pool, where
only that stream's allocations of the same pool find it (best fit, split when what is left is
worth a block: 512 bytes in the small pool, more than 1 MiB in the large one; freed neighbours
merge). A block that ``record_stream`` gave to other streams returns to the pool only once
those streams' work at the free is done. Segments are kept when their blocks are freed, until
``empty_cache``, or until a new segment does not fit: then every fully free segment goes back
to the driver (after waiting for the blocks still held by other streams' work) and the
allocation tries again.

So ``memory_reserved`` (the segments) exceeds ``memory_allocated`` (the live tensors, which a
GPU's counter rounds to 512 bytes and the emulated device does not): by the rounding, by the
free space of partly used segments, by segments cached for a stream or a pool that the next
request does not use, and, briefly, by blocks other streams still use. What the device has free
for the process is then ``capacity - reserved - overheads``, the overheads being what the
driver and libraries hold outside torch's counters: the CUDA context (hundreds of MiB, per
process and device) and a cuBLAS workspace per stream that ran a matmul (32 MiB on Hopper,
measured on an H200; torch keeps them in its allocator, for the process's life). A plan of a
run on a GPU has to leave that much beside its peak of live tensors.

What a plan of device memory adds to its peak of live tensors, per device, to fit a GPU:
the overheads (the context, and a workspace per stream that runs matmuls: roundpipe's compute
stream of the device, the caller's stream if the caller computes on the device); up to 511
bytes of rounding per live tensor; the free space of the segments of each stream that
allocates (the compute stream, the copy stream its prefetched uploads come from, the download
stream), which no other stream can use: a stream's peak of small tensors is served by whole
2 MiB segments, of 1 to 10 MiB tensors by 20 MiB ones; and blocks that ``record_stream`` keeps
for another stream's work. On the emulated device, ``max_memory_reserved`` after a run measures
all but the overheads, which ``roundpipe.testing.emu.overheads_held`` gives.

:class:`DeviceAllocator` is the model for one device, on sizes only (no memory). Not modelled:
``expandable_segments``, ``max_split_size_mb``, ``roundup_power2_divisions``,
``garbage_collection_threshold``, CUDA graphs' private pools, and the driver's own granularity.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable

__all__ = [
    "MIN_BLOCK",
    "SMALL_REQUEST",
    "SMALL_SEGMENT",
    "LARGE_SEGMENT",
    "Block",
    "DeviceAllocator",
    "NoRoom",
    "block_size",
    "segment_size",
]

MIN_BLOCK = 512  # every block is a multiple of it
SMALL_REQUEST = 1 << 20  # requests up to this go to the small pool
SMALL_SEGMENT = 2 << 20  # the small pool's segments
LARGE_SEGMENT = 20 << 20  # the large pool's segments for requests below _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20  # larger requests get a segment of their own, rounded to this


def block_size(nbytes: int) -> int:
    """The block a request of ``nbytes`` takes: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """The segment the allocator reserves when no cached block fits a ``block``-byte block."""
    if block <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if block < _MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-block // _ROUND_LARGE) * _ROUND_LARGE


class NoRoom(Exception):
    """A new segment would not fit the device, even after the cached ones went back."""

    def __init__(self, wanted: int) -> None:
        super().__init__(wanted)
        self.wanted = wanted


_ids = itertools.count()


class _Segment:
    __slots__ = ("size", "blocks_in_use")

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks_in_use = 0


class Block:
    """A block of a segment: ``size`` bytes at ``offset``, in the pool ``pool`` (a stream and
    small or large), ``allocated`` or free (or held for other streams' work)."""

    __slots__ = ("segment", "offset", "size", "pool", "allocated", "prev", "next", "ident")

    def __init__(self, segment: _Segment, offset: int, size: int, pool: tuple) -> None:
        self.segment, self.offset, self.size, self.pool = segment, offset, size, pool
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.ident = next(_ids)


class DeviceAllocator:
    """One device's caching allocator, on sizes (see [Note: the caching allocator's reserve]).
    Not thread-safe: the caller holds a lock. ``stream`` is any hashable naming a stream."""

    def __init__(self) -> None:
        self.reserved = 0  # bytes of the segments held
        self.peak_reserved = 0
        # (stream, small) -> free blocks, sorted by (size, ident)
        self._free: dict[tuple, list[tuple[int, int, Block]]] = {}
        self._segments: list[_Segment] = []
        self._held: list[tuple[Block, tuple]] = []  # freed, waiting for other streams' work

    def malloc(
        self,
        stream: object,
        nbytes: int,
        room: Callable[[int], bool],
        wait: Callable[[tuple], None],
    ) -> Block:
        """A block for ``nbytes`` on ``stream``. ``room(extra)``: whether the device has room
        for ``extra`` more reserved bytes; when a new segment has none, the held blocks are
        released (``wait(held_for)`` makes the host wait for what each waits for) and every
        fully free segment goes back, and then :class:`NoRoom` is raised if it still has
        none."""
        size = block_size(nbytes)
        pool = (stream, size <= SMALL_REQUEST)
        block = self._best_fit(pool, size)
        if block is None:
            seg_size = segment_size(size)
            if not room(seg_size):
                for held_for in self.release_held():
                    wait(held_for)
                self.empty_cache()
                block = self._best_fit(pool, size)
        if block is None:
            if not room(seg_size):
                raise NoRoom(seg_size)
            segment = _Segment(seg_size)
            self._segments.append(segment)
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = Block(segment, 0, seg_size, pool)
        self._split(block, size)
        block.allocated = True
        block.segment.blocks_in_use += 1
        return block

    def free(self, block: Block, held_for: tuple = ()) -> None:
        """``block``'s tensor is freed; ``held_for``: what other streams' work must be done
        before the block may be reused (see :meth:`settle`)."""
        block.allocated = False
        if held_for:
            self._held.append((block, held_for))
            return
        self._release(block)

    def settle(self, done: Callable[[tuple], bool]) -> None:
        """Return the held blocks whose wait ``done(held_for)`` says is over to their pool."""
        still = []
        for block, held_for in self._held:
            if done(held_for):
                self._release(block)
            else:
                still.append((block, held_for))
        self._held = still

    def release_held(self) -> Iterable[tuple]:
        """Return every held block to its pool, as after waiting for the work they wait for;
        yields what they waited for (the caller makes the host wait for it)."""
        held, self._held = self._held, []
        for block, held_for in held:
            self._release(block)
            yield held_for

    def empty_cache(self) -> int:
        """Give every fully free segment back; returns the bytes given back."""
        given = 0
        for segment in [s for s in self._segments if s.blocks_in_use == 0]:
            given += segment.size
            self._segments.remove(segment)
        if given:
            for pool, blocks in self._free.items():
                self._free[pool] = [e for e in blocks if e[2].segment.blocks_in_use > 0]
            self.reserved -= given
        return given

    def reset_peak(self) -> None:
        self.peak_reserved = self.reserved

    def _best_fit(self, pool: tuple, size: int) -> Block | None:
        blocks = self._free.get(pool)
        if not blocks:
            return None
        i = bisect.bisect_left(blocks, (size, -1))
        if i == len(blocks):
            return None
        return blocks.pop(i)[2]

    def _split(self, block: Block, size: int) -> None:
        rest = block.size - size
        small = block.pool[1]
        if rest >= MIN_BLOCK if small else rest > SMALL_REQUEST:
            tail = Block(block.segment, block.offset + size, rest, block.pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._add_free(tail)

    def _release(self, block: Block) -> None:
        block.segment.blocks_in_use -= 1
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and self._take(neighbour):
                if neighbour is block.prev:
                    block.offset, block.prev = neighbour.offset, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._add_free(block)

    def _add_free(self, block: Block) -> None:
        bisect.insort(self._free.setdefault(block.pool, []), (block.size, block.ident, block))

    def _take(self, block: Block) -> bool:
        """Remove a free block from its pool's list (False: it is held, not in the pool)."""
        blocks = self._free.get(block.pool, [])
        i = bisect.bisect_left(blocks, (block.size, block.ident))
        if i < len(blocks) and blocks[i][2] is block:
            del blocks[i]
            return True
        return False
