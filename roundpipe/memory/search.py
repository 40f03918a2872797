"""The longest that fits: a bisection over a plan's verdict, never a run. A sequence length (or
any size whose memory grows with it) is found in about log2(size) plans; each plan is shapes
only (:mod:`roundpipe.memory.trace`), so the search costs what that many traces cost."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["longest_fitting"]


def longest_fitting(fits: Callable[[int], bool], high: int, step: int = 1) -> int:
    """The largest multiple of ``step`` in ``[step, high]`` for which ``fits`` is true, assuming
    that what fits at ``n`` fits at every smaller ``n`` (memory grows with the size); 0 when
    not even ``step`` fits. ``fits(high)`` is asked first, so a size that fits costs one plan.
    Main thread (``fits`` plans a call)."""
    if high < step:
        return 0
    lo, hi = 0, high // step  # in units of step: fits(lo*step) is known true (or lo == 0)
    if fits(hi * step):
        return hi * step
    while hi - lo > 1:  # invariant: fits at lo (or lo == 0), not at hi
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step
