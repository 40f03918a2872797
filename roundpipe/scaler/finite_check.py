"""Gradients checked for inf/NaN on the device, so that the step need not read them again on the
host to find out (see [Note: checked on the device]).

* :func:`mark`: the optimizer thread, when a downloaded gradient becomes (or is added into) a
  master's ``.grad``, records what the device found, and the tensor's version.
* :func:`nonfinite`: the scaler, before its inf/NaN pass: what the device found for a
  gradient, or None when the gradient was not checked there or has changed since (its version
  moved: an in-place op, e.g. an all-reduce or a user's edit, or one on a view of the same
  storage).
* :func:`bound`: for a gradient known finite, a bound on its largest magnitude, which lets a sum
  of two checked gradients stay checked (:func:`sum_stays_finite`).
"""

from __future__ import annotations

import torch

__all__ = ["bound", "mark", "nonfinite", "sum_stays_finite"]

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
#
# A parameter used by two stages (a tied embedding and head) gets two sums, added on the host;
# finite + finite may overflow, so the flag alone would not survive the add, and that
# parameter (311M of a 152k-vocabulary model's) would be read again on the host every step.
# The device's check therefore also takes the largest magnitude of each stage's sums: when the
# two parts' bounds add up to at most the dtype's largest finite value, every element of the
# sum is at most that exactly, so it rounds to a finite value, and the sum stays checked.

_ATTR = "_roundpipe_nonfinite"


def mark(grad: torch.Tensor, found: bool | None, largest: float | None = None) -> None:
    """Optimizer thread: ``grad`` (a master's ``.grad``, just written) holds an inf/NaN exactly
    when ``found``; None: unknown (the record is dropped). ``largest``: for a finite ``grad``,
    a bound on its largest magnitude, if known."""
    if found is None:
        if hasattr(grad, _ATTR):
            delattr(grad, _ATTR)
        return
    setattr(grad, _ATTR, (grad._version, bool(found), None if found else largest))


def nonfinite(grad: torch.Tensor) -> bool | None:
    """Whether ``grad`` holds an inf/NaN as the device found it, or None if it was not checked
    there or changed since (see [Note: checked on the device]). Optimizer thread."""
    record = getattr(grad, _ATTR, None)
    if record is None or record[0] != grad._version:
        return None
    return record[1]


def bound(grad: torch.Tensor) -> float | None:
    """A bound on the largest magnitude of ``grad``, known finite and unchanged since it was
    checked; else None. Optimizer thread."""
    record = getattr(grad, _ATTR, None)
    if record is None or record[0] != grad._version:
        return None
    return record[2]


def sum_stays_finite(a: float | None, b: float | None, dtype: torch.dtype) -> bool:
    """Whether adding two finite tensors of magnitudes at most ``a`` and ``b`` into ``dtype``
    is finite for certain (see [Note: checked on the device]); False when a bound is unknown."""
    return a is not None and b is not None and a + b <= torch.finfo(dtype).max
