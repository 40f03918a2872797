"""Adam's moments in a file on a fast disk (``Adam(..., state_dir="/nvme/run1")``):
:class:`StateOnDisk` and its error, :class:`SpillError`.

See [Note: state on disk] for the file layout, the I/O and why the result is bitwise the in-RAM
optimizer's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from roundpipe.memory.host import SPILL_BUFFER_BYTES, format_bytes
from roundpipe.optim.kernel import fused_only_reason, run_fused_kernel
from roundpipe.optim.master_file import file_of_master
from roundpipe.optim.spill_file import ALIGN, SpillError, SpillFile

__all__ = ["StateOnDisk", "SpillError", "DEFAULT_BUFFER_BYTES", "SLOTS"]


def _shutdown(pools: tuple[ThreadPoolExecutor, ...]) -> None:
    for pool in pools:
        pool.shutdown(wait=True)


# [Note: state on disk]
# Layout: one file, ``adam_state.bin``, in a fresh directory ``roundpipe-adam-HOST-PID-*``
# made under ``state_dir`` (removed when the optimizer is closed or collected). A process that
# was killed cannot remove its directory, and its file is as large as Adam's state: the next
# StateOnDisk under the same ``state_dir`` removes, with a warning, every directory of this
# host whose process no longer exists (see _remove_orphans). Nothing in such a file is ever
# read back: a run resumes from a checkpoint, which holds the state itself. The parameters, in
# ``param_groups`` order, are cut into chunks of at most one buffer slot; a chunk holds pieces
# (segments) of parameters of one dtype, and is stored as its rows one after the other:
# ``exp_avg`` of its segments, then ``exp_avg_sq``, then ``max_exp_avg_sq`` with amsgrad. So a
# chunk is one sequential read and one sequential write. The file is reserved in full with
# posix_fallocate when a parameter is first laid out, so a disk too small fails then, naming
# the directory, instead of in the middle of a step.
#
# The I/O is plain buffered ``os.preadv``/``os.pwritev`` into the buffer's memory (no copy
# through Python bytes; both release the GIL). Why not O_DIRECT: it needs every offset, length
# and buffer aligned to the device's block size, which the tails of parameters are not, and it
# is refused by tmpfs and some filesystems; buffered I/O is sequential here, so the kernel's
# read-ahead and write-behind reach the disk's streaming bandwidth anyway (benchmarks/
# bench_spill.py measures it). Why not torch.from_file (an mmap): pages would be faulted in one
# at a time by the kernel thread and written back whenever the kernel likes, with no bound on
# the memory it takes and no error a step could report. After a chunk is written,
# posix_fadvise(DONTNEED) starts its write-back and lets the kernel drop its pages, so the page
# cache does not grow into the RAM the spill was meant to save.
#
# The pipeline: the buffer is SLOTS slots. While chunk i is updated in its slot, the reads of
# chunks i+1 .. i+SLOTS-2 run on the reader thread and the write of chunk i-1 on the writer
# thread; the read into a slot waits for the write that last used it. The step returns after
# its last write, so the file is complete whenever no step runs (state_dict reads it then).
#
# Bitwise: each chunk is updated by the same fused kernel (torch._fused_adam_/_fused_adamw_) on
# views of the parameter, its gradient and the chunk's rows. The kernel is elementwise, but not
# every element takes the same instructions: the CPU kernel runs vectors over the body of each
# range its threads get (ranges cut at cache-line multiples) and scalar code over the last
# partial vector of the tensor, and the two round exp_avg_sq differently in the last bit. So a
# parameter is cut into chunks only at multiples of _SPLIT_ELEMENTS (256 elements: a multiple of
# every vector and cache-line width), which leaves the scalar tail where the whole tensor has
# it; then every element gets the same instructions as in RAM (tests/test_optim_spill.py checks
# the spilled run against the in-RAM one bit for bit). A step the GradScaler skips
# (found_inf set) is known on the host before any I/O: the kernel would leave everything
# untouched, so nothing is read or written and the file is unchanged.

DEFAULT_BUFFER_BYTES = SPILL_BUFFER_BYTES
SLOTS = 4
_FILE = "adam_state.bin"
# A parameter is cut only at multiples of this many elements: see [Note: state on disk].
_SPLIT_ELEMENTS = 256
# A slot holds at least one cut of three rows of 8-byte elements, page-rounded.
_MIN_SLOT = 2 * ALIGN


@dataclasses.dataclass
class _Segment:
    param: int  # index into StateOnDisk._params
    start: int  # first element of the parameter's flat (real) view
    length: int
    pos: int  # first element within each row of its chunk


@dataclasses.dataclass
class _Chunk:
    dtype: torch.dtype
    rows: int
    numel: int  # elements per row
    offset: int  # bytes into the file
    segments: list[_Segment]
    #: the masters of its segments are in files too (see [Note: masters on disk]): one more
    #: row in its buffer slot, after the moments, read from and written back to their file
    masters: bool = False

    @property
    def nbytes(self) -> int:
        """Its bytes in this file."""
        return self.rows * self.numel * self.dtype.itemsize

    @property
    def slot_nbytes(self) -> int:
        """Its bytes in a buffer slot."""
        return (self.rows + self.masters) * self.numel * self.dtype.itemsize


@dataclasses.dataclass
class _Param:
    tensor: Tensor
    rows: int
    segments: list[tuple[int, _Segment]]  # (chunk index, segment)
    #: where its values are when it is a master in a file (MastersOnDisk), else None
    master_file: tuple[SpillFile, int] | None = None


def _flat(t: Tensor) -> Tensor:
    """The contiguous 1-D real view of ``t`` the kernel and the file see."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1)


class StateOnDisk:
    """Adam's moments in a file under ``state_dir``, streamed through ``buffer_bytes`` of host
    memory per step (see [Note: state on disk]).

    Threads: the optimizer's thread (the one its methods run on) owns the layout, the buffer and
    the file; one reader and one writer thread, owned by this object, do the file I/O of a step
    and hand each chunk back through a future. ``close()`` (idempotent) waits for them and
    removes the directory; collecting the object does the same."""

    def __init__(self, state_dir: str | os.PathLike[str], buffer_bytes: int | None) -> None:
        buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else int(buffer_bytes)
        if buffer_bytes < SLOTS * _MIN_SLOT:
            raise ValueError(
                f"Adam: state_buffer_bytes={buffer_bytes} is too small for {SLOTS} slots of at "
                f"least {_MIN_SLOT} bytes; pass at least {SLOTS * _MIN_SLOT} (default "
                f"{format_bytes(DEFAULT_BUFFER_BYTES)})"
            )
        self.state_dir = os.fspath(state_dir)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="roundpipe-adam-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="roundpipe-adam-write")
        pools = (self._reader, self._writer)
        self._file = SpillFile(
            self.state_dir,
            "adam",
            _FILE,
            who=f"Adam(state_dir={self.state_dir!r})",
            what="the optimizer state",
            on_close=functools.partial(_shutdown, pools),
        )
        self.path = self._file.path
        self.slot_bytes = buffer_bytes // SLOTS // ALIGN * ALIGN
        self._buffer = torch.empty(SLOTS * self.slot_bytes, dtype=torch.uint8)
        self._params: list[_Param] = []
        self._index: dict[int, int] = {}  # id(param) -> index in _params
        self._chunks: list[_Chunk] = []
        self._size = 0

    # -- OptimizerStatePlacement ---------------------------------------------------------------------
    def check_group(self, opt: torch.optim.Optimizer, group: dict) -> None:
        if group.get("state_dtype", "exact") != "exact":
            raise ValueError(
                f"Adam(state_dir=...) streams exact moments through files; "
                f"state_dtype={group['state_dtype']!r} keeps lean moments in RAM (4 or about 2 "
                f"bytes per parameter instead of 8): pass one of state_dir and state_dtype"
            )
        for index, p in enumerate(group["params"]):
            why = fused_only_reason(group, p)
            if why is not None:
                raise ValueError(
                    f"Adam(state_dir=...) streams the state through torch's fused kernel on the "
                    f"host, and param_groups[{len(opt.param_groups) - 1}]['params'][{index}] "
                    f"cannot take it: {why}. Keep that parameter in an optimizer without "
                    f"state_dir, or make it a contiguous fp32 tensor in host memory"
                )

    def step(
        self, opt: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> None:
        self._lay_out(opt)
        if found_inf is not None and bool(found_inf):
            return  # the kernel would leave everything untouched: so does the file
        device_scale = None
        if grad_scale is not None:
            device_scale = grad_scale.to(device="cpu", dtype=torch.float32)
        device_skip = None
        if found_inf is not None:
            device_skip = (found_inf.to("cpu") != 0).to(torch.float32)
        grads: dict[int, Tensor] = {}
        groups: dict[int, dict] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "Adam does not support sparse gradients; use "
                        "torch.optim.SparseAdam for sparse parameters"
                    )
                index = self._index[id(p)]
                if self._params[index].rows != (3 if group["amsgrad"] else 2):
                    raise RuntimeError(
                        "Adam(state_dir=...): amsgrad changed after the state file was laid "
                        "out; build a new optimizer and load the state dict into it"
                    )
                grads[index] = _flat(p.grad.to(p.dtype).contiguous())
                groups[index] = group
                state = opt.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
        if not grads:
            return
        # One increment per parameter per step, before its chunks run (as the in-RAM path).
        torch._foreach_add_([opt.state[self._params[i].tensor]["step"] for i in grads], 1)
        chunks = [
            i
            for i, chunk in enumerate(self._chunks)
            if any(s.param in grads for s in chunk.segments)
        ]

        def update(chunk: _Chunk, rows: list[Tensor]) -> None:
            by_group: dict[int, tuple[dict, list[list[Tensor]]]] = {}
            for seg in chunk.segments:
                if seg.param not in grads:
                    continue
                group = groups[seg.param]
                _, lists = by_group.setdefault(id(group), (group, [[], [], [], [], [], []]))
                record = self._params[seg.param]
                end = seg.start + seg.length
                if chunk.masters:
                    lists[0].append(rows[chunk.rows][seg.pos : seg.pos + seg.length])
                else:
                    lists[0].append(_flat(record.tensor)[seg.start : end])
                lists[1].append(grads[seg.param][seg.start : end])
                for r in range(chunk.rows):
                    lists[2 + r].append(rows[r][seg.pos : seg.pos + seg.length])
                lists[5].append(opt.state[record.tensor]["step"])
            for group, lists in by_group.values():
                run_fused_kernel(group, torch.device("cpu"), lists, device_scale, device_skip)

        try:
            self._stream(chunks, update)
        finally:
            if device_skip is not None:
                steps = [opt.state[self._params[i].tensor]["step"] for i in grads]
                torch._foreach_sub_(steps, [device_skip] * len(steps))

    def state_dict(
        self, opt: torch.optim.Optimizer, base: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        self._lay_out(opt)
        result = base()
        params = [p for g in opt.param_groups for p in g["params"]]
        for key, state in result["state"].items():
            record = self._params[self._index[id(params[key])]]
            names = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"][: record.rows]
            tensors = [torch.empty_like(record.tensor, memory_format=torch.contiguous_format)]
            tensors += [torch.empty_like(tensors[0]) for _ in names[1:]]
            for chunk_index, seg in record.segments:
                chunk = self._chunks[chunk_index]
                size = chunk.dtype.itemsize
                for r, t in enumerate(tensors):
                    dest = _flat(t)[seg.start : seg.start + seg.length]
                    self._read(dest, chunk.offset + (r * chunk.numel + seg.pos) * size)
            state.update(zip(names, tensors))
        return result

    def after_load(self, opt: torch.optim.Optimizer) -> None:
        self._lay_out(opt)
        names = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        for record in self._params:
            state = opt.state.get(record.tensor)
            moments = [state.pop(n, None) if state else None for n in names[: record.rows]]
            if state:
                for n in names[record.rows :]:
                    state.pop(n, None)
                if "step" in state:
                    state["step"] = state["step"].to(device="cpu", dtype=torch.float32)
            for chunk_index, seg in record.segments:
                chunk = self._chunks[chunk_index]
                size = chunk.dtype.itemsize
                for r, moment in enumerate(moments):
                    if moment is None:  # no state for it (or no max yet): zeros, as a new one
                        source = torch.zeros(seg.length, dtype=chunk.dtype)
                    else:
                        source = _flat(moment.contiguous())[seg.start : seg.start + seg.length]
                    self._write(source, chunk.offset + (r * chunk.numel + seg.pos) * size)

    def close(self) -> None:
        self._file.close()

    # -- private ----------------------------------------------------------------------------
    def _lay_out(self, opt: torch.optim.Optimizer) -> None:
        """Give every parameter not laid out yet its chunks at the end of the file."""
        params = [(p, g) for g in opt.param_groups for p in g["params"]]
        new = [(p, g) for p, g in params if id(p) not in self._index]
        if not new:
            return
        first = len(self._chunks)
        chunk: _Chunk | None = None
        for p, group in new:
            rows = 3 if group["amsgrad"] else 2
            flat = _flat(p.detach())
            record = _Param(p, rows, [], file_of_master(p))
            masters = record.master_file is not None
            width = (rows + masters) * flat.dtype.itemsize  # slot bytes per element
            self._index[id(p)] = len(self._params)
            self._params.append(record)
            start = 0
            while start < flat.numel():
                if (
                    chunk is None
                    or chunk.dtype != flat.dtype
                    or chunk.rows != rows
                    or chunk.masters != masters
                    or chunk.slot_nbytes + width > self.slot_bytes
                ):
                    chunk = _Chunk(flat.dtype, rows, 0, 0, [], masters)
                    self._chunks.append(chunk)
                capacity = self.slot_bytes // width - chunk.numel
                length = min(capacity, flat.numel() - start)
                if length < flat.numel() - start:
                    length -= length % _SPLIT_ELEMENTS  # [Note: state on disk], bitwise
                    if length == 0:
                        chunk = None
                        continue
                seg = _Segment(len(self._params) - 1, start, length, chunk.numel)
                chunk.segments.append(seg)
                chunk.numel += length
                record.segments.append((len(self._chunks) - 1, seg))
                start += length
        # The chunks made now go after everything laid out before, each at a page boundary.
        offset = self._size
        for c in self._chunks[first:]:
            c.offset = offset
            offset += -(-c.nbytes // ALIGN) * ALIGN
        self._size = offset
        self._file.reserve(offset)

    def _slot(self, index: int, chunk: _Chunk) -> Tensor:
        start = index * self.slot_bytes
        return self._buffer[start : start + chunk.slot_nbytes]

    def _rows(self, slot: Tensor, chunk: _Chunk) -> list[Tensor]:
        """The moments' rows, then the masters' row if the chunk has one."""
        values = slot.view(chunk.dtype)
        rows = chunk.rows + chunk.masters
        return [values[r * chunk.numel : (r + 1) * chunk.numel] for r in range(rows)]

    def _masters_io(self, chunk: _Chunk, slot: Tensor, write: bool) -> None:
        """Read (or write back) the masters' row of ``chunk`` in ``slot``, one run of its
        master's file per segment."""
        row = self._rows(slot, chunk)[chunk.rows]
        size = chunk.dtype.itemsize
        for seg in chunk.segments:
            where = self._params[seg.param].master_file
            assert where is not None
            file, offset = where
            piece = row[seg.pos : seg.pos + seg.length]
            if write:
                file.write(piece, offset + seg.start * size, drop_cache=True)
            else:
                file.read(piece, offset + seg.start * size)

    def _read_chunk(self, slot: Tensor, chunk: _Chunk) -> None:
        self._read(slot[: chunk.nbytes], chunk.offset)
        if chunk.masters:
            self._masters_io(chunk, slot, write=False)

    def _write_chunk(self, slot: Tensor, chunk: _Chunk) -> None:
        self._write(slot[: chunk.nbytes], chunk.offset, True)
        if chunk.masters:
            self._masters_io(chunk, slot, write=True)

    def _stream(self, order: list[int], update: Callable[[_Chunk, list[Tensor]], None]) -> None:
        """Read, update and write back the chunks ``order`` names (see [Note: state on disk])."""
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}  # slot -> the write that last used it

        def start_read(j: int) -> None:
            slot = j % SLOTS
            previous = writes.pop(slot, None)
            if previous is not None:
                previous.result()
            chunk = self._chunks[order[j]]
            reads[j] = self._reader.submit(self._read_chunk, self._slot(slot, chunk), chunk)

        try:
            for j in range(min(SLOTS - 1, len(order))):
                start_read(j)
            for i, chunk_index in enumerate(order):
                reads.pop(i).result()
                chunk = self._chunks[chunk_index]
                slot = self._slot(i % SLOTS, chunk)
                update(chunk, self._rows(slot, chunk))
                writes[i % SLOTS] = self._writer.submit(self._write_chunk, slot, chunk)
                if i + SLOTS - 1 < len(order):
                    start_read(i + SLOTS - 1)
            for future in list(writes.values()):
                future.result()
        finally:
            # On a failure, let what is in flight finish before the buffer is reused; the first
            # failure is the one already propagating.
            for future in list(reads.values()) + list(writes.values()):
                future.exception()

    def _read(self, dest: Tensor, offset: int) -> None:
        self._file.read(dest, offset)

    def _write(self, source: Tensor, offset: int, drop_cache: bool = False) -> None:
        self._file.write(source, offset, drop_cache)
