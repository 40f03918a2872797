"""Pinned host memory for the devices that copy from it: a model's pinned copy without doubling
it, and how a device kind gets pinned memory.

* :func:`pin_module`: move a module's parameters and buffers into pinned host memory carved from
  a few pooled allocations (see [Note: the pinned pool]), keeping the same tensor objects.
* :class:`PinnedAllocator`: how a device kind gets pinned host memory and what an allocation
  really takes from the host; :data:`TORCH_PINNED` is torch's (CUDA's caching host allocator,
  which rounds each allocation up to a power of two).
* :func:`pinned_layout` / :func:`pool_layout`: what a pool takes, without allocating (the
  memory estimate of :mod:`roundpipe.memory.host` reads them).

Main thread (wrap time), except the pure helpers (any thread).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from roundpipe.devices.packed import carried

__all__ = [
    "ALIGNMENT",
    "EXACT_BLOCK",
    "PinnedAllocator",
    "PoolLayout",
    "TORCH_PINNED",
    "UNLIMITED",
    "cuda_pinned_round_limit",
    "module_tensors",
    "next_power_of_two",
    "pin_module",
    "pinned_empty",
    "pinned_layout",
    "pool_layout",
    "storage_bytes",
]

# Byte alignment of each tensor in the pool: a cache line, as torch's CPU allocator aligns.
ALIGNMENT = 64


def next_power_of_two(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes`` (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


# No limit: every allocation is rounded.
UNLIMITED = 1 << 62
# Exact blocks (above the allocator's rounding limit) are at most this large, so pinning holds
# the model plus one block at the most.
EXACT_BLOCK = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class PinnedAllocator:
    """How a device kind gets pinned host memory: ``allocate(nbytes)`` returns a fresh pinned
    ``uint8`` tensor of ``nbytes``; ``round_limit()`` is the largest allocation the allocator
    rounds up to the next power of two (larger ones take their own size; 0: none is rounded;
    :data:`UNLIMITED`: all are, CUDA's caching host allocator by default)."""

    name: str
    allocate: Callable[[int], torch.Tensor]
    round_limit: Callable[[], int]

    def allocation_bytes(self, nbytes: int) -> int:
        """What an allocation of ``nbytes`` really takes from the host."""
        return nbytes if nbytes > self.round_limit() else next_power_of_two(nbytes)


def _torch_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def cuda_pinned_round_limit(env: Mapping[str, str] | None = None) -> int:
    """The largest pinned allocation CUDA's caching host allocator rounds up to a power of two,
    from ``PYTORCH_ALLOC_CONF`` (else ``PYTORCH_CUDA_ALLOC_CONF``):
    ``pinned_max_round_threshold_mb`` and ``pinned_max_cached_size_mb`` (above either, torch
    takes an allocation's own size). :data:`UNLIMITED` when neither is set. Any thread."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    limit = UNLIMITED
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            try:
                limit = min(limit, int(float(value)) * 2**20)
            except ValueError:
                continue
    return limit


# torch's pinned memory of the current accelerator: on CUDA its caching host allocator, which
# rounds each allocation up to a power of two (CachingHostAllocator.h) unless the allocator
# config says otherwise (cuda_pinned_round_limit).
TORCH_PINNED = PinnedAllocator(
    "torch pinned memory (CUDA's caching host allocator)", _torch_pinned, cuda_pinned_round_limit
)


# [Note: the pinned pool]
# Pinning a model tensor by tensor (t.pin_memory()) copies each tensor into its own pinned
# allocation, and CUDA's caching host allocator rounds every allocation up to the next power of
# two: a 4096 x 11008 fp16 weight (86 MiB) takes 128 MiB, and a model's pinned copy can take
# up to twice its bytes (pytorch#95823). pin_module copies the tensors into a pool instead:
#   * the tensors (each storage once, tied weights stay tied) are laid out, ALIGNMENT-aligned,
#     into a few large blocks;
#   * an allocator that takes large allocations at their size (CUDA's with
#     PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:N, see docs/memory.md) gets blocks of
#     about EXACT_BLOCK bytes, each just above its rounding limit, filled in order: the pool is
#     the model's bytes plus padding;
#   * one that rounds every allocation (CUDA's default) gets blocks whose sizes are powers of
#     two, so the rounding adds nothing to a block: they are filled first-fit, largest tensor
#     first, each new block the largest power of two that what is left to place fills (or
#     the tensor's own size, rounded up). What stays unused is the end of a block that no
#     remaining tensor fits: little for models of many similar matrices, but a tensor just
#     above a power of two (GPT-2's 77 MB embedding) still takes the next one. The layout is
#     never worse than a block per tensor (it falls back to that).
#   * one block at a time is allocated, filled and its tensors re-pointed (.data = a view of
#     the block), so the old storages go as the blocks fill: the host holds the model plus one
#     block at the most, never two copies;
#   * the parameter and buffer objects stay the same (users and optimizers hold references);
#     only their storage changes. A view of a block keeps the whole block alive: the pool is
#     freed once every tensor in it is.
# pool_layout computes the layout (and what it takes) without allocating.


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Where each item goes in a pinned pool (see [Note: the pinned pool]): ``blocks``, the
    block sizes in bytes; ``places``, per item (in the order given), its block and byte offset
    (block -1: an empty item). ``item_bytes``: the items' own bytes; ``taken``: what the host
    gives the blocks."""

    blocks: tuple[int, ...]
    places: tuple[tuple[int, int], ...]
    item_bytes: int
    taken: int

    @property
    def overhead(self) -> int:
        """Bytes the pool takes beyond its items' own (padding and unfilled block ends)."""
        return self.taken - self.item_bytes


def pool_layout(sizes: Sequence[int], allocator: PinnedAllocator | None = None) -> PoolLayout:
    """Lay out items of ``sizes`` bytes into a pinned pool of ``allocator`` (see
    [Note: the pinned pool]). Pure but for reading the allocator's rounding limit; any
    thread."""
    allocator = allocator or TORCH_PINNED
    aligned = [_align(n) for n in sizes]
    limit = allocator.round_limit()
    if sum(aligned) > limit:
        blocks, places = _exact_blocks(aligned, max(EXACT_BLOCK, limit + 1), limit)
    else:
        blocks, places = _power_of_two_blocks(aligned)
        if sum(blocks) > sum(next_power_of_two(n) for n in sizes):
            # Never worse than an allocation per item (tensor by tensor pinning).
            blocks, places = [], []
            for n in sizes:
                places.append((len(blocks), 0) if n else (-1, 0))
                if n:
                    blocks.append(n)
    taken = sum(allocator.allocation_bytes(b) for b in blocks)
    return PoolLayout(tuple(blocks), tuple(places), sum(sizes), taken)


def _exact_blocks(
    aligned: list[int], target: int, limit: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Items in order, into blocks closed once they reach ``target`` bytes (a last block the
    allocator would round, at most ``limit`` bytes, joins the one before)."""
    blocks: list[int] = []
    places: list[tuple[int, int]] = []
    used = 0
    for n in aligned:
        if n == 0:
            places.append((-1, 0))
            continue
        if not blocks or used >= target:
            blocks.append(0)
            used = 0
        places.append((len(blocks) - 1, used))
        used += n
        blocks[-1] = used
    if len(blocks) > 1 and blocks[-1] <= limit:
        last = len(blocks) - 1
        shift = blocks[last - 1]
        blocks[last - 1] += blocks.pop()
        places = [(b - 1, o + shift) if b == last else (b, o) for b, o in places]
    return blocks, places


def _power_of_two_blocks(aligned: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    order = sorted(range(len(aligned)), key=lambda i: -aligned[i])
    blocks: list[int] = []
    used: list[int] = []
    places: list[tuple[int, int]] = [(-1, 0)] * len(aligned)
    unplaced = sum(aligned)
    for i in order:
        n = aligned[i]
        if n == 0:
            continue
        for b, size in enumerate(blocks):
            if size - used[b] >= n:
                places[i] = (b, used[b])
                used[b] += n
                break
        else:
            blocks.append(max(next_power_of_two(n), 1 << (unplaced.bit_length() - 1)))
            used.append(n)
            places[i] = (len(blocks) - 1, 0)
        unplaced -= n
    return blocks, places


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass
class _Group:
    """The tensors of one storage: copied as one span of bytes, ``[lo, hi)`` of the storage."""

    storage: torch.UntypedStorage
    tensors: list[torch.Tensor]
    lo: int
    hi: int


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters and buffers, and the tensors packed parameters carry (their
    quantization state, see [Note: packed parameters] in :mod:`roundpipe.devices.packed`),
    each once: what the host holds of the model and an upload copies."""
    seen: dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen.setdefault(id(t), t)
        for c in carried(t):
            seen.setdefault(id(c), c)
    return list(seen.values())


def _pinnable(module: nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in module_tensors(module):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if (
            t.device.type == "cpu"
            and t.layout == torch.strided
            and t.numel() > 0
            and not t.is_pinned()
            and not t.is_quantized
        ):
            out.append(t)
    return out


def _groups(tensors: Iterable[torch.Tensor]) -> list[_Group]:
    by_storage: dict[int, _Group] = {}
    for t in tensors:
        storage = t.untyped_storage()
        size = t.element_size()
        start = int(t.storage_offset()) * size
        end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size
        end = int(end)
        # A storage without an address (a meta tensor's: shapes only) is its tensor's own.
        key = storage.data_ptr() if t.device.type != "meta" else -id(t)
        group = by_storage.get(key)
        if group is None:
            # 16: every dtype's item size divides it, so each tensor's offset stays a whole
            # number of items from the span's start.
            by_storage[key] = _Group(storage, [t], start // 16 * 16, end)
        else:
            group.tensors.append(t)
            group.lo = min(group.lo, start // 16 * 16)
            group.hi = max(group.hi, end)
    return list(by_storage.values())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the storages of ``tensors`` span, each storage once (tied weights count once;
    a meta tensor is its own storage). Reads shapes only."""
    return sum(g.hi - g.lo for g in _groups(tensors))


def pinned_layout(module: nn.Module, allocator: PinnedAllocator | None = None) -> PoolLayout:
    """The pool :func:`pin_module` would make for ``module`` (what it would take), without
    allocating. Main thread."""
    allocator = allocator or TORCH_PINNED
    return pool_layout([g.hi - g.lo for g in _groups(_pinnable(module))], allocator)


def pin_module(module: nn.Module, allocator: PinnedAllocator | None = None) -> PoolLayout:
    """Move ``module``'s parameters and buffers, and the quantization state packed parameters
    carry (:func:`module_tensors`; those on the CPU, not pinned yet), into pinned host memory
    from a pool of a few large allocations (see [Note: the pinned pool]). The tensor objects
    stay the same; their ``.data`` becomes a view of the pool, with the same
    values, shape and strides, and their old storage is freed (unless something else holds
    it). Tensors that shared a storage still do. ``allocator``: how the pinned blocks are made
    (None: :data:`TORCH_PINNED`, the current accelerator's; a RoundPipe passes its device
    kind's). Returns the pool's layout. Main thread, before anything else reads the tensors
    (another thread holding them sees the old storage)."""
    allocator = allocator or TORCH_PINNED
    groups = _groups(_pinnable(module))
    layout = pool_layout([g.hi - g.lo for g in groups], allocator)
    with torch.no_grad():
        for block, members in _blocks(layout, allocator):
            for i, offset in members:
                group = groups[i]
                source = torch.empty(0, dtype=torch.uint8).set_(group.storage)
                block[offset : offset + group.hi - group.lo].copy_(source[group.lo : group.hi])
                for t in group.tensors:
                    item = t.element_size()
                    start = (offset + t.storage_offset() * item - group.lo) // item
                    t.data = block.view(t.dtype).as_strided(t.shape, t.stride(), start)
    return layout


def pinned_empty(
    specs: Sequence[tuple[torch.Size, torch.dtype]], allocator: PinnedAllocator | None = None
) -> list[torch.Tensor]:
    """Fresh contiguous pinned tensors of the given shapes and dtypes, carved from one pool
    (see [Note: the pinned pool]) instead of one allocation each. The pool is freed once every
    one of them is. Any thread."""
    allocator = allocator or TORCH_PINNED
    nbytes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    layout = pool_layout(nbytes, allocator)
    out: list[torch.Tensor | None] = [None] * len(specs)
    for block, members in _blocks(layout, allocator):
        for i, offset in members:
            shape, dtype = specs[i]
            out[i] = block[offset : offset + nbytes[i]].view(dtype).view(shape)
    # Empty tensors take no pool bytes.
    return [
        t if t is not None else torch.empty(shape, dtype=dtype)
        for t, (shape, dtype) in zip(out, specs)
    ]


def _blocks(
    layout: PoolLayout, allocator: PinnedAllocator
) -> Iterable[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """Each block of ``layout``, allocated when reached, with its (item, offset) pairs."""
    members: list[list[tuple[int, int]]] = [[] for _ in layout.blocks]
    for i, (b, offset) in enumerate(layout.places):
        if b >= 0:
            members[b].append((i, offset))
    for b, size in enumerate(layout.blocks):
        yield allocator.allocate(size), members[b]
