"""``HostCopy``: the values of a few scalar tensors on their way to the host, read as Python
numbers without waiting for anything but that copy.

The scaler publishes its scale, growth tracker and skipped-step count through it, and the
training monitor stores each iteration's loss in one: neither may sync the device on the
training loop's path, and a monitoring read must not wait for the device's other work.

[Note: host copies]
On an accelerator the values are packed into one tensor and copied to host memory with
``non_blocking=True`` on the *current stream of the tensors' own device* (which is where the
packing and the copy run), and an event is recorded on that stream behind the copy. Reading
waits for that event only. Recording on the current device's stream instead (what
``torch.Event.record()`` does without a stream) misses the copy whenever the tensors sit on
another device (a pool whose last stage is on device 1): the read then returns whatever the
pinned buffer held before the copy landed (the emulated device fills it with NaN).
"""

from __future__ import annotations

import torch

from roundpipe.devices import kind

__all__ = ["HostCopy"]


class HostCopy:
    """The values of some scalar (one-element) tensors, or plain numbers, copied to the host
    without waiting for the device (see [Note: host copies]).

    Made on one thread (the one that produced the tensors, after their producing work was
    issued on the current stream of their device); read on any thread after the hand-off that
    publishes the object. :meth:`ready` never blocks; :meth:`values`/:meth:`value` wait for the
    copy only, the first time, and then hold plain Python numbers (the tensor is dropped).

    ``_value``: the host tensor until first read, then a float (one value) or a list of floats;
    ``_event``: the event behind the copy, None on the CPU or once waited for.
    """

    __slots__ = ("_value", "_event", "_count")

    def __init__(self, *values: torch.Tensor | float | int) -> None:
        if not values:
            raise ValueError("HostCopy needs at least one value")
        self._count = len(values)
        self._event: torch.Event | None = None
        if not any(isinstance(v, torch.Tensor) for v in values):
            self._value: torch.Tensor | float | list[float] = self._unpack(
                [float(v) for v in values]
            )
            return
        devices = {v.device for v in values if isinstance(v, torch.Tensor)}
        if len(devices) != 1:
            raise AssertionError(
                f"HostCopy of tensors on several devices {sorted(map(str, devices))}; please report"
            )
        (device,) = devices
        packed = torch.stack(
            [
                v.detach().reshape(()).to(torch.float64)
                if isinstance(v, torch.Tensor)
                else torch.tensor(float(v), dtype=torch.float64, device=device)
                for v in values
            ]
        )
        if device.type == "cpu":
            self._value = packed
            return
        stream = kind.current_stream(device)
        self._value = packed.to("cpu", non_blocking=True)
        self._event = torch.Event(device=device)
        self._event.record(stream)

    def _unpack(self, numbers: list[float]) -> float | list[float]:
        return numbers[0] if self._count == 1 else numbers

    def ready(self) -> bool:
        """Whether :meth:`values` would return without waiting for the device. Any thread;
        never blocks."""
        return self._event is None or self._event.query()

    def values(self) -> list[float]:
        """The values as floats, in the order given. Waits for the copy the first time."""
        value = self._value
        if isinstance(value, torch.Tensor):
            event = self._event
            if event is not None:
                event.synchronize()
                self._event = None
            value = self._value = self._unpack(value.tolist())
        return list(value) if isinstance(value, list) else [value]

    def value(self) -> float:
        """The first (usually the only) value as a float. Waits for the copy the first time."""
        return self.values()[0]
