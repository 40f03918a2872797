"""The CPU backend, the reference: tensors already live on the host, so moves are the identity
and nothing runs once an action has returned."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.devices.backend import Upload, WorkerDevice

__all__ = ["CPUBackend"]


class CPUBackend:
    """A CPU worker (see :class:`roundpipe.devices.backend.Backend`)."""

    device_type = "cpu"

    def __init__(self, device: WorkerDevice) -> None:
        self.device = device
        self.torch_device = device.torch_device

    def action_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prepare_host(self, module: torch.nn.Module) -> None:
        """Nothing to do when the host is the device."""

    def begin_call(self) -> None:
        """Nothing to order: the host runs the caller's work before the call's."""

    def memory_available(self) -> int | None:
        return None

    def drain(self) -> None:
        """Nothing runs on the CPU once its actions have returned."""

    def to_device(self, tree: Any, after: torch.Event | None = None) -> Any:
        return tree

    def call_layer(
        self,
        layer: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        upload: Upload | None = None,
        call: Callable[..., Any] | None = None,
    ) -> Any:
        return (layer if call is None else call)(*args, **kwargs)

    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        return None

    def seeded_rng_state(self, seed: int) -> torch.Tensor | None:
        return None
