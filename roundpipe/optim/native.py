"""The optimizer's compiled step kernels (``roundpipe/optim/_step_kernels.cpp``): built on first
use, in the background, and used once they are there; see [Note: the compiled step].

Any thread.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import torch

__all__ = ["ENV_VAR", "PIECE", "Builder", "kernels", "start_build", "status"]

# [Note: the compiled step]
# The one-pass step (Adam and the master->model copy in one pass over memory, and the lean
# moments' kernels) is C++: _step_kernels.cpp, built with torch.utils.cpp_extension (ninja and
# a C++ compiler; about a minute of one core, once, cached under torch's extension directory
# by a hash of the source and flags). The build starts in a background thread when the first
# roundpipe Adam is made, so the first steps never wait for it: until it is loaded, the step
# runs torch's kernels, which give the same bits (the exact moments: torch's fused Adam, then
# the model's separate master->model copy; the lean moments: lean.lean_reference_step, torch
# ops, slower). If the build fails (no compiler, no ninja, a torch whose headers do not fit),
# one warning says so and everything keeps stepping with torch's kernels. ROUNDPIPE_OPTIM_NATIVE=0
# never builds (torch's kernels only). Flags: -ffp-contract=off (the lean arithmetic must not be
# contracted into FMAs, see [Note: lean moments] in lean.py), -fopenmp (at::parallel_for runs on
# torch's OpenMP threads: the process has one libgomp), and -mavx2 -mf16c where torch itself
# runs AVX2 or better kernels (the scalar code otherwise: the same bits).

ENV_VAR = "ROUNDPIPE_OPTIM_NATIVE"
#: elements per piece of work: a multiple of 256 (see [Note: state on disk] in spill.py, and the
#: 8-bit blocks); 64K fp32 elements of the four Adam tensors stay in the caches between the
#: update and the cast
PIECE = 65536

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_step_kernels.cpp")


def _flags() -> list[str]:
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    if capability.startswith(("AVX2", "AVX512")):
        flags += ["-mavx2", "-mf16c"]
    return flags


def _reason(exc: BaseException) -> str:
    """One line for a failed build: the compiler's first error, else the exception's last
    line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = errors[0] if errors else (lines[-1] if lines else "")
    return f"{type(exc).__name__}: {line}"[:300]


class Builder:
    """One background build of a kernels' source (the process has one, for
    ``_step_kernels.cpp``; a test makes its own). Any thread."""

    def __init__(self, source: str = _SOURCE, prefix: str = "roundpipe_optim") -> None:
        self.source = source
        self.prefix = prefix
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.ops: Any = None
        self.error: str | None = None

    def _build(self) -> None:
        try:
            from roundpipe.native_build import extension_name, load_library

            flags = _flags()
            load_library(extension_name(self.prefix, self.source, flags), self.source, flags)
            self.ops = torch.ops.roundpipe_optim
        except BaseException as exc:  # noqa: B036 -- a failed build is reported, never raised
            self.error = _reason(exc)
            warnings.warn(
                f"roundpipe.optim: the compiled optimizer step could not be built "
                f"({self.error}); stepping with torch's kernels instead (same results, more "
                f"memory traffic per step). Install g++ and ninja to get it, or set "
                f"{ENV_VAR}=0 to skip it",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self._done.set()

    def start(self) -> None:
        """Start the build in the background (idempotent); never blocks."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._build, name="roundpipe-optim-build", daemon=True
            )
            self._thread.start()

    def kernels(self, wait: bool = False) -> Any:
        """The ops once built, else None; ``wait``: start the build and block until it
        ends."""
        if wait:
            self.start()
            self._done.wait()
        return self.ops

    def status(self) -> str:
        if self.ops is not None:
            return "compiled"
        if self.error is not None:
            return f"torch's kernels (build failed: {self.error})"
        return "torch's kernels (building)" if self._thread is not None else "not built yet"


_BUILDER = Builder()


def _off() -> bool:
    return os.environ.get(ENV_VAR, "1") == "0"


def start_build() -> None:
    """Start building the kernels in the background (idempotent; nothing with
    ``ROUNDPIPE_OPTIM_NATIVE=0``). Any thread; never blocks."""
    if not _off():
        _BUILDER.start()


def kernels(wait: bool = False) -> Any:
    """``torch.ops.roundpipe_optim`` once built and loaded, else None (not built yet, failed,
    or switched off with ``ROUNDPIPE_OPTIM_NATIVE=0``). ``wait``: start the build if needed
    and block until it ends. Any thread."""
    if _off():
        return None
    return _BUILDER.kernels(wait)


def status() -> str:
    """A line for reports: whether the compiled step is in use. Never blocks."""
    if _off():
        return f"off ({ENV_VAR}=0)"
    return _BUILDER.status()
