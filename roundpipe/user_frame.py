"""Where a warning raised inside the library should point: the user's line (any thread)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["user_stacklevel"]

# Frames in these directories are skipped: the user's line is the one that called torch (an
# ``opt.zero_grad()``, a ``clip_grad_norm_``) or roundpipe.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made in the function that calls this one,
    pointing at the first frame outside torch and roundpipe."""
    frame: Any | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        if frame.f_back is None:
            break
        frame = frame.f_back
        level += 1
    return level
