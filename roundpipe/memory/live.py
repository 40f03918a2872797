"""Live-storage accounting, the one count of "bytes alive now, and the most since a reset" that
both the planner's tracing (:mod:`roundpipe.memory.trace`, fake tensors) and the emulated
device (:mod:`roundpipe.testing.emu`, real allocations) keep.

A storage is counted once, from :meth:`LiveBytes.add` until :meth:`LiveBytes.remove` (its
finalizer); what the callers key it by (a storage's address) and when they call (a dispatch
mode's output, an allocation) is theirs. Not thread-safe: a caller whose finalizers run on other
threads holds its own lock around every call.
"""

from __future__ import annotations

__all__ = ["LiveBytes"]


class LiveBytes:
    """Bytes of the storages alive now (``live``) and the most they have been since the last
    :meth:`reset_peak` or :meth:`forget` (``peak``)."""

    __slots__ = ("live", "peak", "_sizes")

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # key -> bytes counted now, of the storages known

    def __contains__(self, key: int) -> bool:
        return key in self._sizes

    def add(self, key: int, nbytes: int) -> bool:
        """Count the storage ``key`` of ``nbytes`` as alive; False (nothing changes) if it is
        already counted."""
        if key in self._sizes:
            return False
        self._sizes[key] = nbytes
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        return True

    def remove(self, key: int) -> int:
        """The storage ``key`` died: its bytes (0 if it was not counted, or was forgotten) stop
        counting. Returns them."""
        nbytes = self._sizes.pop(key, 0)
        self.live -= nbytes
        return nbytes

    def reset_peak(self) -> None:
        """The peak starts again from what is alive now."""
        self.peak = self.live

    def forget(self) -> None:
        """Count from zero: the storages counted so far stay known (:meth:`add` does not count
        them again) but no longer count, alive or when they die (a finalizer the garbage
        collector runs late changes nothing)."""
        self._sizes = dict.fromkeys(self._sizes, 0)
        self.live = self.peak = 0
