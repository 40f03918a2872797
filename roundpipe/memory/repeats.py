"""Repeated pieces of a traced loop, run once: a loop over equal pieces (the MLP's token tiles,
the loss's chunks) costs a trace as many ops as it has pieces, and its memory is the same at
every middle piece but for what the pieces before it left behind. Inside :func:`elided` (the
memory tracer opens it around a fake-tensor trace) such a loop runs only the pieces
:func:`runs` names and stands in for the others with what they leave behind (their outputs'
storage, their input gradients'), so a trace costs what four pieces cost at any length.
See [Note: elided repeats].

Any thread may ask; only the thread that opened :func:`elided` elides.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["elided", "eliding", "runs"]

_local = threading.local()


# [Note: elided repeats]
# In a loop over n equal pieces, piece k's peak is what it allocates while it runs (the same for
# every full piece) on top of what the pieces before it left: in a tiled forward each earlier
# tile's output (kept for the concatenation), in its backward each later tile's input gradient
# (kept until the split's backward joins them); the loss's chunks leave nothing (their
# gradients are written into one preallocated tensor). So over the middle pieces the forward's
# peak is at piece n - 2 and the backward's (which runs the pieces last to first) at piece 1,
# and these, the first (which allocates what the others reuse, as a gradient accumulated into)
# and the last (which may be shorter) are all a peak can be at. Those four run; a piece between
# them is a stand-in that makes and keeps what the piece would leave (the loss's chunks need
# none). The traced bytes are those of the whole loop, stage by stage and action by action
# (tests/test_trace_repeats.py traces both ways and compares every count); a real run never
# elides.
@contextlib.contextmanager
def elided() -> Iterator[None]:
    """Inside, on this thread, loops over equal pieces run only the pieces :func:`runs`
    names. For fake-tensor traces only: the values of a stood-in piece are never computed."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def eliding() -> bool:
    """Whether this thread is inside :func:`elided`."""
    return getattr(_local, "on", False)


def runs(k: int, n: int, elide: bool) -> bool:
    """Whether piece ``k`` of ``n`` runs: all of them unless ``elide`` (what :func:`eliding`
    said when the loop began), else the first two and the last two (see [Note: elided
    repeats])."""
    return not elide or k < 2 or k >= n - 2
