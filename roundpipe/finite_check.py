"""Gradients checked for inf/NaN on the device, so that the step need not read them again on the
host to find out (see [Note: checked on the device]).

* :func:`mark`: the optimizer thread, when a downloaded gradient becomes (or is added into) a
  master's ``.grad``, records what the device found, and the tensor's version.
* :func:`nonfinite`: the scaler, before its inf/NaN pass: what the device found for a
  gradient, or None when the gradient was not checked there or has changed since (its version
  moved: an in-place op, e.g. an all-reduce or a user's edit, or one on a view of the same
  storage).
"""

from __future__ import annotations

import torch

__all__ = ["mark", "nonfinite"]

# [Note: checked on the device]
# On an accelerator each stage's gradient sums are checked for inf/NaN by one kernel on the
# download stream, before the copy (a read of device memory, a fraction of a millisecond per
# GB), and the flag travels with them. A fused step (roundpipe.optim's Adam, torch's fused
# optimizers) unscales inside its own kernel, so the only other pass over the gradients on the
# host was GradScaler's inf/NaN check: one read and one write of every gradient, over a tenth of
# a step's host time for Adam. With the device's flag that pass is skipped for every gradient
# the flag still describes: the same tensor, at the version it had when the flag was recorded.
# Anything else (a gradient summed by a plain backward, one edited in place) is checked on the
# host as before, so the flag can only save work, never change the result.

_ATTR = "_roundpipe_nonfinite"


def mark(grad: torch.Tensor, found: bool | None) -> None:
    """Optimizer thread: ``grad`` (a master's ``.grad``, just written) holds an inf/NaN exactly
    when ``found``; None: unknown (the record is dropped)."""
    if found is None:
        if hasattr(grad, _ATTR):
            delattr(grad, _ATTR)
        return
    setattr(grad, _ATTR, (grad._version, bool(found)))


def nonfinite(grad: torch.Tensor) -> bool | None:
    """Whether ``grad`` holds an inf/NaN as the device found it, or None if it was not checked
    there or changed since (see [Note: checked on the device]). Optimizer thread."""
    record = getattr(grad, _ATTR, None)
    if record is None or record[0] != grad._version:
        return None
    return record[1]
