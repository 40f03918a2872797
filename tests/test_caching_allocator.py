"""The model of CUDA's caching allocator (roundpipe.testing.caching_allocator, see
[Note: the caching allocator's reserve]): rounding, segments, per-stream pools, splitting and merging,
blocks held for other streams, giving segments back."""

import pytest

from roundpipe.testing.caching_allocator import (
    LARGE_SEGMENT,
    SMALL_SEGMENT,
    DeviceAllocator,
    NoRoom,
    block_size,
    segment_size,
)

MIB = 1 << 20


def _always(extra):
    return True


def _no_wait(held_for):
    raise AssertionError("nothing should wait")


def test_sizes_round_as_cudas():
    assert [block_size(n) for n in (1, 512, 513, 4000)] == [512, 512, 1024, 4096]
    assert segment_size(512) == segment_size(MIB) == SMALL_SEGMENT
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == LARGE_SEGMENT
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB) == 12 * MIB  # rounded to 2 MiB


def test_small_blocks_share_a_segment_of_their_stream_only():
    alloc = DeviceAllocator()
    blocks = [alloc.malloc("a", 1000, _always, _no_wait) for _ in range(3)]
    assert alloc.reserved == SMALL_SEGMENT
    alloc.malloc("b", 1000, _always, _no_wait)  # another stream: a segment of its own
    assert alloc.reserved == 2 * SMALL_SEGMENT
    alloc.free(blocks[0])
    alloc.malloc("a", 800, _always, _no_wait)  # the freed block comes back to its stream
    assert alloc.reserved == 2 * SMALL_SEGMENT


def test_freed_neighbours_merge_and_large_blocks_split():
    alloc = DeviceAllocator()
    a = alloc.malloc("s", 600 * 1024, _always, _no_wait)
    b = alloc.malloc("s", 600 * 1024, _always, _no_wait)
    alloc.free(a)
    alloc.free(b)
    alloc.malloc("s", MIB, _always, _no_wait)  # fits the merged space: no new segment
    assert alloc.reserved == SMALL_SEGMENT
    big = alloc.malloc("s", 3 * MIB, _always, _no_wait)  # a 20 MiB segment, split
    alloc.malloc("s", 15 * MIB, _always, _no_wait)  # the 17 MiB rest takes it
    assert alloc.reserved == SMALL_SEGMENT + LARGE_SEGMENT
    alloc.free(big)
    assert alloc.empty_cache() == 0  # the large segment is still in use


def test_a_block_held_for_another_stream_returns_once_that_work_is_done():
    alloc = DeviceAllocator()
    block = alloc.malloc("s", 12 * MIB, _always, _no_wait)  # a segment of its own
    alloc.free(block, held_for=(("other", 5),))
    alloc.malloc("s", 12 * MIB, _always, _no_wait)  # the held block is not reused
    assert alloc.reserved == 24 * MIB
    alloc.settle(lambda held_for: False)
    alloc.settle(lambda held_for: held_for == (("other", 5),))
    alloc.malloc("s", 12 * MIB, _always, _no_wait)  # now it is
    assert alloc.reserved == 24 * MIB


def test_without_room_the_cache_goes_back_and_then_it_is_no_room():
    alloc = DeviceAllocator()
    limit = LARGE_SEGMENT + SMALL_SEGMENT

    def room(extra):
        return alloc.reserved + extra <= limit

    waited = []
    kept = alloc.malloc("a", MIB, room, _no_wait)
    held = alloc.malloc("b", 3 * MIB, room, _no_wait)
    alloc.free(held, held_for=("b's work",))
    # stream a's large request: b's segment must go back first, after waiting for b's work
    alloc.malloc("a", 4 * MIB, room, waited.append)
    assert waited == [("b's work",)] and alloc.reserved == limit
    with pytest.raises(NoRoom) as info:
        alloc.malloc("a", 30 * MIB, room, waited.append)
    assert info.value.wanted == 30 * MIB
    alloc.free(kept)
    assert alloc.empty_cache() == SMALL_SEGMENT
    alloc.reset_peak()
    assert alloc.peak_reserved == alloc.reserved == LARGE_SEGMENT
