"""Building roundpipe's C++ libraries with ``torch.utils.cpp_extension.load`` (ninja and a C++
compiler on first use, cached under torch's extension directory), safe against builds that
were killed: see [Note: the build lock]. Used by the emulated device
(:mod:`roundpipe.testing.emu`) and the optimizer's compiled step (:mod:`roundpipe.optim.native`).
Any thread."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["build_lock", "build_source", "extension_name", "load_library"]


def extension_name(prefix: str, source: str, flags: Sequence[str] = ()) -> str:
    """The name torch builds ``source`` under: ``prefix`` and a hash of the source and flags,
    so that checkouts with different sources (or machines with other flags) share torch's
    cache without clashing."""
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        digest.update(f.read())
    digest.update("\0".join(flags).encode())
    return f"{prefix}_{digest.hexdigest()[:16]}"


# [Note: the build lock]
# torch's cpp_extension.load serializes builds of one extension across processes with a "lock"
# file in its build directory (a FileBaton), which every load takes, even of an extension
# already built, and which only the process that made it removes: a process killed while it
# held it (killed mid-build, say) leaves it, and every later load waits for it forever.
# roundpipe's builds therefore also take an flock on a file of their own beside it, which
# the kernel releases when its holder dies: holding that, no other load of this extension is
# building, so a baton found there is a dead process's and is removed before torch looks.
def build_lock(ext: str) -> contextlib.AbstractContextManager[None]:
    """Hold the flock of extension ``ext``'s build directory (see [Note: the build lock])."""
    directory = _build_directory(ext)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's baton alone
        return contextlib.nullcontext()
    if directory is None:
        return contextlib.nullcontext()
    return _flocked(directory, fcntl)


def _build_directory(ext: str) -> str | None:
    """Where torch builds ``ext`` (None where this torch does not say)."""
    from torch.utils import cpp_extension

    directory = getattr(cpp_extension, "_get_build_directory", None)
    return None if directory is None else directory(ext, False)


# [Note: the build's source path]
# ninja rebuilds a library whose build command changed, and torch's command names the source
# file by its path. Checkouts at different paths (worktrees, CI's copy, an installed package)
# share torch's cache under one name per source (extension_name), so compiling each its own
# file made every load from another checkout rebuild the library, up to a minute of a core
# each time, in every process. The build compiles a copy of the source kept in the build
# directory instead: one path for every checkout, so the cache holds.
def build_source(ext: str, source: str) -> str:
    """The path to compile ``source`` from as extension ``ext`` (named by the source's hash):
    its copy in the build directory (written once, atomically), the same for every checkout.
    The caller holds the build lock."""
    directory = _build_directory(ext)
    if directory is None:
        return source
    copy = os.path.join(directory, os.path.basename(source))
    if not os.path.exists(copy):  # the name is the source's hash: an existing copy is the same
        os.makedirs(directory, exist_ok=True)
        partial = f"{copy}.{os.getpid()}.partial"
        shutil.copyfile(source, partial)
        os.replace(partial, copy)
    return copy


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


def load_library(
    name: str, source: str, cflags: Sequence[str] = (), ldflags: Sequence[str] = ()
) -> str:
    """Build (or find built) the shared library of ``source`` as extension ``name`` and load
    it into the process (``is_python_module=False``: it registers what it registers, torch ops
    or C functions for ctypes); returns its path. Raises what the build raises."""
    from torch.utils import cpp_extension

    with build_lock(name):
        return cpp_extension.load(
            name=name,
            sources=[build_source(name, source)],  # [Note: the build's source path]
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            is_python_module=False,
            verbose=False,
        )
