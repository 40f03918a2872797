"""The device pool and the backends (see :mod:`roundpipe.devices.pool`).

* :mod:`~roundpipe.devices.backend`: what the runtime calls on a device (the protocols).
* :mod:`~roundpipe.devices.cpu`: the CPU backend, the reference.
* :mod:`~roundpipe.devices.accelerator`: every accelerator's backend (CUDA, ``emu``).
* :mod:`~roundpipe.devices.pool`: device specs, the kinds registry, workers, the pool.
"""

from roundpipe.devices.accelerator import AcceleratorBackend, Resident
from roundpipe.devices.backend import Backend, StreamingBackend, Upload
from roundpipe.devices.cpu import CPUBackend
from roundpipe.devices.pool import (
    ENV_VAR,
    DeviceKind,
    DevicePool,
    DeviceSpec,
    WorkerDevice,
    caller_as_worker,
    get_worker,
    on_device_worker,
    parse_devices,
    register_device_kind,
    resolve_devices,
)
from roundpipe.threads.workers import Future

__all__ = [
    "ENV_VAR",
    "AcceleratorBackend",
    "Backend",
    "CPUBackend",
    "DeviceKind",
    "DevicePool",
    "DeviceSpec",
    "Future",
    "Resident",
    "StreamingBackend",
    "Upload",
    "WorkerDevice",
    "caller_as_worker",
    "get_worker",
    "on_device_worker",
    "parse_devices",
    "register_device_kind",
    "resolve_devices",
]
