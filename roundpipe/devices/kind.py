"""A device's own backend module (``torch.cuda``, the emulated ``torch.emu``) for the calls that
name a device: its current stream, making it current, synchronizing it.

``torch.accelerator`` answers for one accelerator per process: the first registered one (an
installed emulated device is chosen before CUDA), and it refuses any other type (``ValueError:
cuda doesn't match the current accelerator emu``). roundpipe never passes it a device; it asks
the device's own module, which serves every device of its type whatever else is registered.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["module_of", "current_stream", "device_index", "synchronize"]


def module_of(device: torch.device) -> Any:
    """``torch.cuda`` for a CUDA device, the emulated device's module for ``emu``..."""
    return torch.get_device_module(device.type)


def current_stream(device: torch.device) -> torch.Stream:
    """The calling thread's current stream on ``device``."""
    return module_of(device).current_stream(device)


def device_index(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which ``device`` is the current device of its type."""
    return module_of(device).device(device.index)


def synchronize(device: torch.device) -> None:
    """Block until everything enqueued on ``device`` has run."""
    module_of(device).synchronize(device)
