"""What the runtime calls on a device: the :class:`Backend` protocol, and for accelerators, whose
stages stream through the device, :class:`StreamingBackend` and its per-run :class:`Upload`.

Implementations: :mod:`roundpipe.devices.cpu` (the reference; moves are the identity) and
:mod:`roundpipe.devices.accelerator` (every accelerator: CUDA and the emulated ``emu``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Backend", "StreamingBackend", "Upload", "WorkerDevice"]


@dataclasses.dataclass(frozen=True)
class WorkerDevice:
    """A slot of the pool: ``("cpu", i)`` is the i-th CPU worker, ``("cuda", i)`` is cuda:i,
    ``("emu", i)`` is emu:i."""

    type: str
    index: int

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type, self.index)

    def __str__(self) -> str:
        return f"cpu#{self.index}" if self.type == "cpu" else f"{self.type}:{self.index}"


class Upload(Protocol):
    """A stage's parameters and buffers on a device for one run of actions. ``leaves``: the
    device copies of the stage's trainable parameters that gradients are taken with respect to
    (None for a differentiable upload, whose gradients flow back to the host parameters)."""

    leaves: list[torch.Tensor] | None


class Backend(Protocol):
    """A device as the runtime uses it. Every method runs on the device's worker thread (or the
    calling thread standing in for it), except :meth:`prepare_host`, which the main thread calls
    once per wrapped model, :meth:`begin_call` and :meth:`drain` (main thread, while no action of
    a call runs), :meth:`memory_available` (any thread), and the RNG state accessors, which the
    main thread uses around a call (see [Note: RNG chains])."""

    device_type: str
    torch_device: torch.device

    def action_context(self) -> contextlib.AbstractContextManager:
        """Entered around every action (an accelerator's device and stream)."""
        ...

    def prepare_host(self, module: torch.nn.Module) -> None:
        """Main thread, once per wrapped model: ready the host copy of ``module``."""
        ...

    def begin_call(self) -> None:
        """Main thread, at the start of a call, before any of its actions: the device work the
        caller enqueued so far (its inputs, the scaler's scale) comes before the call's."""
        ...

    def memory_available(self) -> int | None:
        """Any thread: bytes this device could still allocate (None: the host's memory)."""
        ...

    def drain(self) -> None:
        """Main thread, after a failed call, once no worker touches it: wait until nothing the
        call enqueued runs any more (its last actions, which wait for the device, did not run)."""
        ...

    def to_device(self, tree: Any, after: torch.Event | None = None) -> Any:
        """A pytree's tensors on this device (the identity on the CPU); tensors from another
        device are read once ``after`` (their producer's event) has completed."""
        ...

    def call_layer(
        self,
        layer: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        upload: Upload | None = None,
        call: Callable[..., Any] | None = None,
    ) -> Any:
        """Run one layer; on an accelerator, on its stage's ``upload``. ``call``: what runs in
        place of ``layer(*args, **kwargs)`` (its compiled module), on the layer's tensors."""
        ...

    def get_rng_state(self) -> torch.Tensor | None:
        """The device generator's state (None: the CPU generator is the device's)."""
        ...

    def set_rng_state(self, state: torch.Tensor | None) -> None: ...

    def seeded_rng_state(self, seed: int) -> torch.Tensor | None:
        """The device generator's state after seeding it with ``seed``, the generator left as
        it was."""
        ...


class StreamingBackend(Backend, Protocol):
    """An accelerator: the host keeps the weights and each stage streams through the device (see
    [Note: streaming] in :mod:`roundpipe.plan.build`). One method per move of a plan's program
    (see [Note: the program] in :mod:`roundpipe.plan.actions`)."""

    def upload(
        self,
        modules: Sequence[torch.nn.Module],
        trainable: Sequence[torch.Tensor],
        leaves: bool,
        prefetch: bool = False,
    ) -> Upload:
        """``U``/``P``: a stage's parameters and buffers on the device for one run (``prefetch``:
        on a copy stream, beside the compute; usable after :meth:`adopt`)."""
        ...

    def adopt(self, upload: Upload) -> None:
        """Before the compute stream first reads an upload: order it after a prefetch's copies."""
        ...

    def release(self, upload: Upload, write_back: bool) -> torch.Event:
        """``R``: end of a run: drop the upload (``write_back``: training-mode buffers go home
        first). Returns an event after the run's work, for a later :meth:`wait_for`."""
        ...

    def record_event(self) -> torch.Event:
        """``H``: an event at the current end of the compute stream, for another device."""
        ...

    def offload(self, tree: Any) -> tuple[Any, torch.Event]:
        """``O``: start copying a pytree's device tensors to pinned host memory; returns the
        host pytree and the event of their arrival."""
        ...

    def reload(self, tree: Any, arrived: torch.Event) -> Any:
        """``I``: an :meth:`offload`'s pytree back on this device, once ``arrived``."""
        ...

    def download(
        self, tensors: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], torch.Event]:
        """``D``: start copying device tensors to fresh pinned host tensors, after the compute
        so far; returns them and the event of their arrival."""
        ...

    def reserve(self, peak: int) -> tuple[int, str]:
        """Bytes a call whose tensors peak at ``peak`` needs beside them on this device (a GPU's
        library workspaces and allocator rounding), and a description; ``(0, "")`` where
        nothing is reserved. Any thread."""
        ...

    def download_grads(
        self, tensors: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], torch.Tensor, torch.Event]:
        """``D`` of gradient sums: :meth:`download`, plus a two-element fp32 host tensor,
        arrived with them: 1.0 if any of them holds an inf or NaN, else 0.0; and the largest
        magnitude among them (checked on the device; see [Note: checked on the device] in
        :mod:`roundpipe.scaler.finite_check`)."""
        ...

    def wait_for(self, event: torch.Event) -> None:
        """A host wait (``S`` of a stage): block until ``event`` has completed."""
        ...

    def finish(self) -> None:
        """``S``: block until everything enqueued on the device so far has run."""
        ...
