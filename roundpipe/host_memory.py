"""Host memory: a model's pinned copy without doubling it, what the host has free, and the host
RAM a wrapped model takes.

* :func:`pin_module`: move a module's parameters and buffers into pinned host memory carved from
  a few pooled allocations (see [Note: the pinned pool]), keeping the same tensor objects.
* :class:`PinnedAllocator`: how a device kind gets pinned host memory and what an allocation
  really takes from the host; :data:`TORCH_PINNED` is torch's (CUDA's caching host allocator,
  which rounds each allocation up to a power of two).
* :func:`host_memory_available`: what the OS says this process may still allocate
  (``MemAvailable``, or a cgroup's limit minus its usage if lower).
* :func:`host_terms` and :class:`HostTerms`: the host RAM a wrap allocates, term by term;
  :func:`check_host_memory` raises :class:`HostMemoryError` when it exceeds what is available.

Main thread (wrap time), except :func:`host_memory_available` and the pure helpers (any thread).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "ALIGNMENT",
    "SKIP_CHECK_ENV",
    "HostMemoryError",
    "HostTerms",
    "PinnedAllocator",
    "PoolLayout",
    "TORCH_PINNED",
    "UNLIMITED",
    "check_host_memory",
    "cuda_pinned_round_limit",
    "format_bytes",
    "host_memory_available",
    "host_terms",
    "next_power_of_two",
    "master_dtype_of",
    "pin_module",
    "pinned_empty",
    "pinned_layout",
    "pool_layout",
    "skip_memory_check",
]

# Byte alignment of each tensor in the pool: a cache line, as torch's CPU allocator aligns.
ALIGNMENT = 64
# The environment variable that turns off roundpipe's memory checks (HostMemoryError, and the
# device check of the first forward_backward).
SKIP_CHECK_ENV = "ROUNDPIPE_SKIP_MEMORY_CHECK"


def skip_memory_check() -> bool:
    """Whether ``ROUNDPIPE_SKIP_MEMORY_CHECK`` is set to a true value. Any thread."""
    return os.environ.get(SKIP_CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def next_power_of_two(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes`` (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


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


def _pinnable(module: nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in list(module.parameters()) + list(module.buffers()):
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


def pinned_layout(module: nn.Module, allocator: PinnedAllocator | None = None) -> PoolLayout:
    """The pool :func:`pin_module` would make for ``module`` (what it would take), without
    allocating. Main thread."""
    allocator = allocator or TORCH_PINNED
    return pool_layout([g.hi - g.lo for g in _groups(_pinnable(module))], allocator)


def pin_module(module: nn.Module, allocator: PinnedAllocator | None = None) -> PoolLayout:
    """Move ``module``'s parameters and buffers (those on the CPU, not pinned yet) into pinned
    host memory from a pool of a few large allocations (see [Note: the pinned pool]). The
    tensor objects stay the same; their ``.data`` becomes a view of the pool, with the same
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


# -- what the host has free ------------------------------------------------------------------

_PROC = Path("/proc")
_CGROUP = Path("/sys/fs/cgroup")
# A cgroup v1 "no limit" reads as a page-rounded 2**63 - 1; anything this large is no limit.
_NO_LIMIT = 1 << 60


def host_memory_available() -> int | None:
    """Bytes this process may still allocate on the host: the kernel's ``MemAvailable``
    (``/proc/meminfo``), or, if lower, what the memory cgroup this process runs in leaves (its
    limit, or an ancestor's, minus its usage without the reclaimable page cache; cgroup v2 or
    v1). Without ``/proc/meminfo``, the free physical pages (``os.sysconf``); None when
    nothing can be read. Any thread; reads a few small files."""
    candidates = []
    meminfo = _read(_PROC / "meminfo")
    if meminfo is not None:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    cgroup = _cgroup_available()
    if cgroup is not None:
        candidates.append(cgroup)
    return min(candidates) if candidates else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_available() -> int | None:
    """What the tightest memory cgroup limit on this process's path leaves, or None."""
    text = _read(_PROC / "self" / "cgroup")
    if text is None:
        return None
    best: int | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2 (the unified hierarchy)
            roots = [_CGROUP, _CGROUP / "unified"]
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            roots = [_CGROUP / "memory"]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for root in roots:
            level = root / rel if rel else root
            while True:
                left = _left_in(level, *files)
                if left is not None:
                    best = left if best is None else min(best, left)
                if level == root or root not in level.parents:
                    break
                level = level.parent
    return best


def _left_in(level: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit = _number(level / limit_file)
    usage = _number(level / usage_file)
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    # The page cache the kernel reclaims before it kills anything does not count as used.
    used = max(usage - _stat(level / "memory.stat", inactive_key), 0)
    return max(limit - used, 0)


# -- the host RAM of a wrap -------------------------------------------------------------------


class HostMemoryError(MemoryError):
    """Wrapping the model would allocate more host RAM than the host has available (measured
    before allocating): the message lists each term, what is available, and the options."""


@dataclasses.dataclass(frozen=True)
class HostTerms:
    """The host RAM of a wrapped model, term by term (bytes).

    ``weights``: the model's own parameters and buffers (allocated already, by the caller);
    ``masters``: the master copies of the trainable parameters (``optim_dtype``);
    ``grads``: the masters' gradients (one per master, in its dtype);
    ``optimizer``: the optimizer's state, estimated as Adam's (two moments per master);
    ``pinned_overhead``: what the pinned pool takes beyond the weights' bytes (padding and
    block slack, see [Note: the pinned pool]; 0 on a CPU pool, which pins nothing);
    ``activations``: host bytes of stage inputs offloaded to the host (or, on a CPU pool, the
    activations), when known (``memory_plan`` with inputs), else 0.
    ``available``: :func:`host_memory_available` when measured (None: unknown)."""

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

    @property
    def new_bytes(self) -> int:
        """What wrapping and training add to the host beyond the weights already there."""
        return self.masters + self.grads + self.optimizer + self.pinned_overhead + self.activations

    @property
    def total(self) -> int:
        return self.weights + self.new_bytes

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) of each term, for reports."""
        dtype = str(self.master_dtype).removeprefix("torch.") if self.master_dtype else "masters'"
        rows = [
            ("model weights and buffers (allocated already)", self.weights),
            (
                f"master copies ({_count(self.trainable_numel)} trainable params, {dtype})",
                self.masters,
            ),
            ("gradients of the masters", self.grads),
            ("optimizer state (estimated as Adam: 2 x masters)", self.optimizer),
            ("pinned pool padding and block slack", self.pinned_overhead),
        ]
        if self.activations:
            rows.append(("activations held in host memory", self.activations))
        return rows


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
) -> HostTerms:
    """What wrapping ``module`` takes from the host, term by term (see :class:`HostTerms`);
    ``pinned``: the pool's allocator on an accelerator pool (None: nothing pinned). Reads
    shapes only. Main thread."""
    tensors: dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        tensors[id(t)] = t
    weights = sum(g.hi - g.lo for g in _groups(t for t in tensors.values() if t.numel() > 0))
    masters = trainable = frozen = 0
    dtypes = set()
    for p in module.parameters():
        if p.requires_grad:
            dtype = master_dtype_of(p, optim_dtype)
            dtypes.add(dtype)
            masters += p.numel() * dtype.itemsize
            trainable += p.numel()
        else:
            frozen += p.numel()
    overhead = pinned_layout(module, pinned).overhead if pinned is not None else 0
    return HostTerms(
        weights=weights,
        masters=masters,
        grads=masters,
        optimizer=2 * masters,
        pinned_overhead=overhead,
        trainable_numel=trainable,
        frozen_numel=frozen,
        master_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
        available=available,
    )


def check_host_memory(terms: HostTerms, what: str, offload_activations: bool = False) -> None:
    """Raise :class:`HostMemoryError` if ``terms.new_bytes`` exceeds ``terms.available``
    (unknown availability passes). ``what`` names the model in the message."""
    if terms.available is None or terms.new_bytes <= terms.available:
        return
    lines = [
        f"{what} would allocate about {format_bytes(terms.new_bytes)} of host RAM, more than "
        f"the {format_bytes(terms.available)} available (MemAvailable, or the memory cgroup's "
        f"limit minus its usage): the process would be killed by the OOM killer mid-run.",
    ]
    width = max(len(label) for label, _ in terms.rows())
    for label, nbytes in terms.rows():
        lines.append(f"  {label:<{width}}  {format_bytes(nbytes):>10}")
    lines.append(
        f"  {'to allocate (all but the weights)':<{width}}  {format_bytes(terms.new_bytes):>10}"
    )
    lines.append(f"  {'available':<{width}}  {format_bytes(terms.available):>10}")
    options = [
        "train LoRA adapters on a frozen base (requires_grad_(False) on the base parameters "
        "before wrapping): frozen parameters get no master, gradient or optimizer state",
        "keep the masters in bf16: RoundPipe(..., optim_dtype=torch.bfloat16) halves the "
        "masters, their gradients and the optimizer state (less precise updates)",
    ]
    if terms.pinned_overhead > terms.weights // 20:
        options.append(
            "let torch's pinned allocator take large blocks at their size "
            "(PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64): the pinned pool then takes "
            "the weights' bytes, not the next powers of two"
        )
    if offload_activations:
        options.append(
            "offload_activations=True keeps the stage inputs in pinned host memory: turn it "
            "off or use fewer microbatches"
        )
    options.append(
        "if the estimate is wrong for your optimizer (it assumes Adam's two moments per "
        f"master), skip this check: RoundPipe(..., memory_check=False) or {SKIP_CHECK_ENV}=1"
    )
    lines.append("Options:")
    lines.extend(f"  - {o}" for o in options)
    raise HostMemoryError("\n".join(lines))
