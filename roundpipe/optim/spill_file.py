"""One file of training state on a fast disk, shared by what spills: Adam's moments
(:class:`roundpipe.optim.spill.StateOnDisk`) and the masters
(:class:`roundpipe.optim.master_file.MastersOnDisk`).

:class:`SpillFile` makes a directory of its own under the user's directory (``roundpipe-KIND-
HOST-PID-*``), removing those that killed processes of this host left behind, reserves the file's
bytes up front and reads and writes tensors' memory at byte offsets with plain buffered
``os.preadv``/``os.pwritev`` (why not O_DIRECT nor an mmap: [Note: state on disk] in
:mod:`roundpipe.optim.spill`). Every failure is a :class:`SpillError` naming the directory.

Threads: a file's reads and writes may run on any threads at once (``pread``/``pwrite`` take
their own offsets); opening, reserving and closing belong to its owner's thread.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from roundpipe.memory.host import format_bytes
from roundpipe.user_frame import user_stacklevel

__all__ = ["SpillError", "SpillFile", "ALIGN"]

#: byte alignment of everything laid out in a file (a page)
ALIGN = 4096

# mkdtemp's random suffix has no "-", so the PID is the last field before it.
_DIR_NAME = re.compile(r"^roundpipe-(?P<kind>adam|masters)-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")


class SpillError(OSError):
    """Reading or writing training state in files under a spill directory failed (disk full,
    an I/O error, the directory not writable): Adam's state (``state_dir``) or the masters
    (:class:`roundpipe.MastersOnDisk`). Raised by the call that needed the file (so on the main
    thread at the next dependent call when it ran on the optimizer thread); the message names
    the directory and what to do."""


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): it exists
        return True
    return True


def _remove_orphans(directory: str, who: str) -> None:
    """Remove the state directories under ``directory`` that processes of this host left when
    they were killed, with one warning naming them and the bytes freed. A directory of another
    host (a shared filesystem) is left alone: its process cannot be asked about."""
    host = socket.gethostname()
    removed, freed = [], 0
    for entry in os.scandir(directory):
        match = _DIR_NAME.match(entry.name)
        if match is None or match["host"] != host or _process_exists(int(match["pid"])):
            continue
        for root, _, files in os.walk(entry.path):
            freed += sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    if removed:
        warnings.warn(
            f"{who}: removed {len(removed)} state director"
            f"{'y' if len(removed) == 1 else 'ies'} left by killed processes "
            f"({', '.join(sorted(removed))}; {format_bytes(freed)} freed on the disk)",
            stacklevel=user_stacklevel(),
        )


def _close(fd: list[int], path: str) -> None:
    if fd:
        os.close(fd.pop())
    shutil.rmtree(path, ignore_errors=True)


def _bytes(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class SpillFile:
    """The file ``name`` in a fresh directory ``roundpipe-KIND-HOST-PID-*`` under ``directory``
    (made if missing). ``who`` (``"Adam(state_dir='/nvme')"``) and ``what`` (``"the optimizer
    state"``) name it in warnings and errors. The directory is removed by :meth:`close`
    (idempotent) or when the object is collected; ``on_close`` runs first (the owner's I/O
    threads)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        kind: str,
        name: str,
        who: str,
        what: str,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.who, self.what = who, what
        self.size = 0
        try:
            os.makedirs(self.directory, exist_ok=True)
            _remove_orphans(self.directory, who)
            self.path = tempfile.mkdtemp(
                prefix=f"roundpipe-{kind}-{socket.gethostname()}-{os.getpid()}-",
                dir=self.directory,
            )
            self.file = os.path.join(self.path, name)
            self._fd = [os.open(self.file, os.O_RDWR | os.O_CREAT, 0o600)]
        except OSError as exc:
            raise SpillError(
                exc.errno,
                f"{who}: cannot make the file for {what} there ({exc.strerror}); pass a "
                f"directory this process can write to",
            ) from exc
        self._finalizer = weakref.finalize(self, _run_then_close, on_close, self._fd, self.path)

    @property
    def fd(self) -> int:
        return self._fd[0]

    def reserve(self, size: int) -> None:
        """Grow the file to ``size`` bytes, its blocks allocated now (``posix_fallocate``), so
        that a disk too small fails here, naming the directory, rather than in a step."""
        if size <= self.size:
            return
        try:
            os.posix_fallocate(self.fd, self.size, size - self.size)
        except OSError as exc:
            free = shutil.disk_usage(self.directory).free
            raise SpillError(
                exc.errno,
                f"{self.who}: cannot reserve {format_bytes(size - self.size)} for {self.what} "
                f"there ({exc.strerror}; {format_bytes(free)} free): free space or pass a "
                f"directory on a larger disk",
            ) from exc
        self.size = size

    def read(self, dest: Tensor, offset: int) -> None:
        """Fill the contiguous CPU tensor ``dest`` with the file's bytes from ``offset``."""
        view = _bytes(dest)
        done = 0
        try:
            while done < len(view):
                n = os.preadv(self.fd, [view[done:]], offset + done)
                if n == 0:
                    raise OSError(errno.EIO, "unexpected end of file")
                done += n
        except OSError as exc:
            raise self.error("reading", exc) from exc

    def write(self, source: Tensor, offset: int, drop_cache: bool = False) -> None:
        """Write the contiguous CPU tensor ``source`` at ``offset``. ``drop_cache``: start its
        write-back and let the kernel drop its pages from the page cache, so that streaming the
        state does not grow the cache into the RAM the spill saves."""
        view = _bytes(source)
        done = 0
        try:
            while done < len(view):
                done += _pwrite(self.fd, view[done:], offset + done)
            if drop_cache:
                os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise self.error("writing", exc) from exc

    def error(self, doing: str, exc: OSError) -> SpillError:
        return SpillError(
            exc.errno,
            f"{self.who}: {doing} {self.what} in {self.path} failed ({exc.strerror or exc}). "
            f"The state on disk may be incomplete: free space or fix the disk, then load the "
            f"last checkpoint (or pass another directory)",
        )

    def close(self) -> None:
        self._finalizer()


def _run_then_close(on_close: Callable[[], None] | None, fd: list[int], path: str) -> None:
    try:
        if on_close is not None:
            on_close()
    finally:
        _close(fd, path)


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    # A module-level function so that tests can make a write fail.
    return os.pwritev(fd, [data], offset)
