"""The masters in a file on a fast disk: :class:`MastersOnDisk`, a state placement
(``RoundPipe(..., state_placement=roundpipe.MastersOnDisk("/nvme/run1"))``).

See [Note: masters on disk].
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from roundpipe.memory.host import MASTERS_COPY_BUFFER_BYTES, format_bytes
from roundpipe.optim.spill_file import ALIGN, SpillFile
from roundpipe.runtime.grad_access import MasterParameter
from roundpipe.runtime.placement import MasterPlacement

__all__ = ["MastersOnDisk", "DEFAULT_COPY_BUFFER_BYTES", "file_of_master"]

# [Note: masters on disk]
# With MastersOnDisk, every fp32 master lives in one file, ``masters.bin``, in a fresh directory
# ``roundpipe-masters-HOST-PID-*`` under the user's directory (removed when the placement is
# collected; a killed process's directory is removed by the next one, as Adam's: see
# roundpipe.optim.spill_file). Each master takes a page-aligned run of the file, in
# ``named_parameters()`` order, reserved in full at construction, so a disk too small fails
# then. The host keeps the low-precision model (2 bytes per parameter) and the masters'
# gradients (4); with Adam's state spilled too (``Adam(state_dir=...)``) that is 6 bytes per
# parameter plus two bounded buffers, against 18 with everything in RAM.
#
# A master is a tensor over a shared memory map of the file, so everything that reads or writes
# a master by value keeps working unchanged (checkpoints, the HF export, torch optimizers, a
# user printing a weight): the kernel pages the bytes in and out through its page cache, which
# it reclaims under memory pressure. The two hot paths never touch the map, so the pages they
# move are never this process's resident memory:
#   * the step: roundpipe's Adam with ``state_dir`` (roundpipe.optim.spill.StateOnDisk) reads
#     each chunk's masters with pread into an extra row of its streaming buffer, next to the
#     moments, runs the fused kernel on it and writes it back with pwrite: bitwise the in-RAM
#     update, one sequential read and write of the masters per step;
#   * the master->model copy (``copy_layer``): each layer's masters are read with pread through
#     a bounded buffer and cast into the model's low-precision parameters: a second read of the
#     masters per step, and the price of keeping them off the host.
# pread and pwrite see the same page cache as the map, so both views agree at all times. After
# work that used the map in bulk (a checkpoint load, a refresh from the model), ``release``
# unmaps its pages from this process (madvise DONTNEED: shared pages stay in the page cache,
# dirty ones are written back), so resident memory returns to the 6 bytes per parameter.
#
# What the map costs: an I/O error under it is a SIGBUS, not an exception (the file is
# reserved in full, so a full disk cannot cause one); the hot paths' pread/pwrite errors are
# SpillErrors naming the directory.

#: host memory the master->model copy streams the masters through
DEFAULT_COPY_BUFFER_BYTES = MASTERS_COPY_BUFFER_BYTES

# master -> (its file, its byte offset): what StateOnDisk asks of a parameter
_FILES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def file_of_master(p: Tensor) -> tuple[SpillFile, int] | None:
    """``(file, byte offset)`` of a master that :class:`MastersOnDisk` keeps in a file, else
    None. Any thread."""
    return _FILES.get(p)


class MastersOnDisk(MasterPlacement):
    """Every master in a file under ``directory`` on a fast local disk (see [Note: masters on
    disk]): host RAM holds the low-precision model and the gradients, and the masters stream
    through a ``copy_buffer_bytes`` buffer for the master->model copy. Use it with
    ``roundpipe.optim.Adam(..., state_dir=...)`` (the same directory is fine), whose step
    streams the masters with the moments: 6 bytes of host RAM per parameter instead of 18.

    A placement serves one model: pass a new one to each ``RoundPipe``.

    Threads: built and assigned on the main thread; the copy runs on the optimizer thread."""

    name = "files"

    def __init__(
        self, directory: str | os.PathLike[str], copy_buffer_bytes: int | None = None
    ) -> None:
        self.directory = os.fspath(directory)
        size = DEFAULT_COPY_BUFFER_BYTES if copy_buffer_bytes is None else int(copy_buffer_bytes)
        if size < ALIGN:
            raise ValueError(
                f"MastersOnDisk: copy_buffer_bytes={copy_buffer_bytes} is too small; pass at "
                f"least {ALIGN} (default {format_bytes(DEFAULT_COPY_BUFFER_BYTES)})"
            )
        self.copy_buffer_bytes = size
        self._file: SpillFile | None = None
        self._map: mmap.mmap | None = None
        self._buffer: Tensor | None = None

    @property
    def masters_dir(self) -> str | None:
        return self.directory

    @property
    def path(self) -> str | None:
        """The directory the file is in (None before a model took this placement)."""
        return None if self._file is None else self._file.path

    def make_masters(
        self, params: Sequence[tuple[nn.Parameter, torch.dtype]]
    ) -> list[nn.Parameter]:
        if self._file is not None:
            raise ValueError(
                "this MastersOnDisk already holds another model's masters: pass a new "
                "MastersOnDisk to each RoundPipe"
            )
        if not params or any(p.is_meta for p, _ in params):
            return super().make_masters(params)  # shapes only: nothing to keep anywhere
        offsets, size = [], 0
        for p, dtype in params:
            offsets.append(size)
            size += max(1, -(-p.numel() * dtype.itemsize // ALIGN)) * ALIGN
        file = SpillFile(
            self.directory,
            "masters",
            "masters.bin",
            who=f"MastersOnDisk({self.directory!r})",
            what="the masters",
        )
        file.reserve(size)  # a disk too small fails here, and leaves this placement unused
        self._file = file
        self._buffer = torch.empty(self.copy_buffer_bytes, dtype=torch.uint8)
        self._map = mmap.mmap(file.fd, size)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        masters: list[nn.Parameter] = []
        with torch.no_grad():
            for (p, dtype), offset in zip(params, offsets):
                nbytes = p.numel() * dtype.itemsize
                master = MasterParameter(whole[offset : offset + nbytes].view(dtype).view(p.shape))
                master.copy_(p.detach())
                # Out of this process's resident memory at once (see the note).
                self._map.madvise(mmap.MADV_DONTNEED, offset, -(-nbytes // ALIGN) * ALIGN)
                _FILES[master] = (self._file, offset)
                masters.append(master)
        return masters

    def copy_layer(
        self,
        pairs: Sequence[tuple[nn.Parameter, nn.Parameter, bool]],
        done: AbstractSet[int] = frozenset(),
    ) -> None:
        with torch.no_grad():
            for p, master, held in pairs:
                where = file_of_master(master)
                if not held or id(p) in done:
                    continue
                if where is None or p.is_complex() or not p.is_contiguous():
                    p.copy_(master)  # through the map (never the case for a HF model)
                    continue
                file, offset = where
                assert self._buffer is not None
                dest = p.detach().view(-1)
                scratch = self._buffer.view(master.dtype)
                step = scratch.numel()
                for start in range(0, dest.numel(), step):
                    n = min(step, dest.numel() - start)
                    file.read(scratch[:n], offset + start * master.element_size())
                    dest[start : start + n].copy_(scratch[:n])

    def release(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Remove the file's directory: the masters' values are lost (their memory stays
        valid, as zeros or stale values, until they are collected). Idempotent; collecting the
        placement does it too."""
        if self._file is not None:
            self._file.close()
