"""The device pool: which devices compute, one worker per device, and their backends.

* :func:`parse_devices` turns ``"cpu"``, ``"cpu:2"`` (two CPU workers), ``"cuda"`` (every CUDA
  device), ``"cuda:0,1"``, or a registered kind's spec (``"emu"``, ``"emu:2"``: one or two
  emulated accelerators, registered by :mod:`roundpipe.testing`) into a tuple of
  :class:`WorkerDevice`.
* :func:`register_device_kind`: an accelerator kind besides CUDA. A kind named in a spec that is
  not registered yet is looked up among the ``roundpipe.devices`` entry points of the installed
  distributions (roundpipe's own names ``emu``), so ``ROUNDPIPE_DEVICES=emu`` works before
  anything imported the test package.
* :func:`resolve_devices`: the ``devices=`` argument beats ``ROUNDPIPE_DEVICES``, which beats the
  default (every CUDA device, else one CPU worker).
* One worker thread per device, process-wide (:func:`get_worker`): a
  :class:`roundpipe.threads.workers.WorkerThread` whose work items have future-like results
  (:class:`roundpipe.threads.workers.Future`). Except CPU device 0, whose work the calling thread runs
  itself, in :func:`caller_as_worker` (see [Note: the calling thread runs CPU device 0]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any

import torch

from roundpipe.devices.accelerator import AcceleratorBackend
from roundpipe.devices.backend import Backend, WorkerDevice
from roundpipe.devices.cpu import CPUBackend
from roundpipe.devices.pinned import TORCH_PINNED, PinnedAllocator
from roundpipe.threads.workers import Future, WorkerThread

__all__ = [
    "ENV_VAR",
    "WorkerDevice",
    "DeviceKind",
    "register_device_kind",
    "parse_devices",
    "resolve_devices",
    "DevicePool",
    "on_device_worker",
    "caller_as_worker",
    "get_worker",
]

ENV_VAR = "ROUNDPIPE_DEVICES"
ENTRY_POINT_GROUP = "roundpipe.devices"


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """An accelerator kind a spec may name. ``indices(rest)`` turns what follows ``kind:`` in a
    spec (``""`` for the bare kind) into device indices, raising ``ValueError`` naming its
    accepted forms; ``activate()`` makes the kind usable (installs its torch backend) and is
    called once, when a spec first names it; ``forms`` describes the specs it accepts;
    ``pinned``: how the kind gets pinned host memory, and what an allocation of it takes
    (default: torch's, which CUDA's caching host allocator rounds up to a power of two);
    ``memory_in_host``: the device's memory is host RAM (an emulator's), so a memory plan
    counts the devices' peaks against the host too."""

    name: str
    indices: Callable[[str], Sequence[int]]
    activate: Callable[[], None]
    forms: str
    pinned: PinnedAllocator = TORCH_PINNED
    memory_in_host: bool = False


def _cuda_indices(rest: str) -> Sequence[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not rest:
        if count == 0:
            raise ValueError(
                "it asks for every CUDA device but none is available; use 'cpu' or 'cpu:N'"
            )
        return range(count)
    parts = [p.strip().removeprefix("cuda:") for p in rest.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError("'cuda:I[,J...]' takes device indices")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise ValueError("it names a CUDA device twice")
    for i in indices:
        if i >= count:
            raise ValueError(f"it names cuda:{i} but only {count} CUDA device(s) are available")
    return indices


_KINDS: dict[str, DeviceKind] = {
    "cuda": DeviceKind(
        "cuda", _cuda_indices, lambda: None, "'cuda' (every CUDA device), 'cuda:I[,J...]'"
    ),
}
_ACTIVE: set[str] = {"cuda"}
_KINDS_LOCK = threading.Lock()


def register_device_kind(kind: DeviceKind) -> None:
    """Make ``kind`` nameable in device specs. Any thread; idempotent for the same name."""
    with _KINDS_LOCK:
        _KINDS[kind.name] = kind


def _kind(name: str) -> DeviceKind | None:
    """The registered kind ``name``, activated; looked up among the entry points if needed."""
    with _KINDS_LOCK:
        kind = _KINDS.get(name)
    if kind is None:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry.name == name:
                entry.load()  # registers the kind
        with _KINDS_LOCK:
            kind = _KINDS.get(name)
    if kind is not None and kind.name not in _ACTIVE:
        kind.activate()
        with _KINDS_LOCK:
            _ACTIVE.add(kind.name)
    return kind


def _accepted() -> str:
    with _KINDS_LOCK:
        forms = [k.forms for k in _KINDS.values()]
    return "'cpu', 'cpu:N' (N CPU workers), " + ", ".join(forms)


# What a device pool is named by: ``"cpu"``, ``"cpu:2"``, ``"cuda:0,1"``, a torch.device, or a
# sequence of those.
DeviceSpec = str | torch.device | Sequence[str | torch.device]


def parse_devices(spec: DeviceSpec) -> tuple[WorkerDevice, ...]:
    """Parse a device spec; raises ``ValueError`` naming the accepted forms. Any thread."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        try:
            items = list(spec)
        except TypeError:
            raise ValueError(f"bad device spec {spec!r}: use {_accepted()}") from None
        out: list[WorkerDevice] = []
        for item in items:
            out.extend(parse_devices(item))
        if not out:
            raise ValueError(f"empty device list: use {_accepted()}")
        _check_one_kind(out, spec)
        return tuple(out)
    text = spec.strip().lower()
    name, _, rest = text.partition(":")
    if name == "cpu":
        if not rest:
            return (WorkerDevice("cpu", 0),)
        if rest.isdigit() and int(rest) >= 1:
            return tuple(WorkerDevice("cpu", i) for i in range(int(rest)))
        raise ValueError(
            f"bad device spec {spec!r}: 'cpu:N' takes a number of workers N >= 1; use {_accepted()}"
        )
    kind = _kind(name) if name else None
    if kind is None:
        raise ValueError(f"bad device spec {spec!r}: use {_accepted()}")
    try:
        indices = kind.indices(rest)
    except ValueError as exc:
        raise ValueError(f"bad device spec {spec!r}: {exc}; use {_accepted()}") from None
    return tuple(WorkerDevice(name, i) for i in indices)


def _check_one_kind(devices: Sequence[WorkerDevice], spec: DeviceSpec) -> None:
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            f"device spec {spec!r} mixes device types; a pool is all CPU, all CUDA or all emulated"
        )
    if len(set(devices)) != len(devices):
        raise ValueError(f"device spec {spec!r} names a device twice")


def resolve_devices(devices: DeviceSpec | None = None) -> tuple[WorkerDevice, ...]:
    """``devices`` if given, else ``$ROUNDPIPE_DEVICES`` if set, else every CUDA device, else one
    CPU worker."""
    if devices is not None:
        return parse_devices(devices)
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            return parse_devices(env)
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}={env!r}: {exc}") from None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return parse_devices("cuda")
    return parse_devices("cpu")


def _activate_named_kind() -> None:
    """A kind that ``ROUNDPIPE_DEVICES`` names is activated at import, before any backward of
    the process can run (the emulated device needs that, see :mod:`roundpipe.testing.emu`)."""
    name = os.environ.get(ENV_VAR, "").strip().lower().partition(":")[0]
    if name and name != "cpu":
        _kind(name)


_activate_named_kind()


# -- workers ----------------------------------------------------------------------------------


_WORKER_TLS = threading.local()


@contextlib.contextmanager
def caller_as_worker(device_type: str) -> Iterator[None]:
    """Run the body on the calling thread as a device worker would run it: marked as a worker
    (:func:`on_device_worker` is True), with the caller's autocast off and inference mode off,
    which the actions then set explicitly, as a fresh worker thread starts with them."""
    was_worker = on_device_worker()
    _WORKER_TLS.is_worker = True
    try:
        with torch.autocast(device_type, enabled=False), torch.inference_mode(False):
            yield
    finally:
        _WORKER_TLS.is_worker = was_worker


def on_device_worker() -> bool:
    """Whether the calling thread is one of roundpipe's device workers. Never blocks."""
    return getattr(_WORKER_TLS, "is_worker", False)


def _mark_worker() -> None:
    _WORKER_TLS.is_worker = True


class DeviceWorker(WorkerThread):
    """One thread that runs work items for one device, in submission order (a
    :class:`roundpipe.threads.workers.WorkerThread`). ``role``: "worker" (the device's programs) or
    "recompute" (its helper, see [Note: overlapped recompute] in
    :mod:`roundpipe.runtime.stage_ops`)."""

    def __init__(self, device: WorkerDevice, role: str = "worker") -> None:
        super().__init__(
            name=f"roundpipe-{role}-{device}",
            thread_init=_mark_worker,
            closed_message=f"the roundpipe {role} thread for {device} has shut down (the "
            f"interpreter is exiting); no new work can be submitted",
        )
        self.device = device

    def submit(self, fn: Callable, *args: Any, future: Future | None = None) -> Future:
        """Queue ``fn(*args)``; returns its future at once. Any thread."""
        fut = future if future is not None else Future()
        self.enqueue(functools.partial(fut.run, fn, *args))
        return fut


_WORKERS: dict[tuple[WorkerDevice, str], DeviceWorker] = {}
_WORKERS_LOCK = threading.Lock()


def get_worker(device: WorkerDevice, role: str = "worker") -> DeviceWorker:
    """The process-wide worker of ``device`` (created on first use); ``role="recompute"``: its
    helper thread. Any thread."""
    with _WORKERS_LOCK:
        worker = _WORKERS.get((device, role))
        if worker is None:
            worker = _WORKERS[(device, role)] = DeviceWorker(device, role)
        return worker


# [Note: the calling thread runs CPU device 0]
# torch's CPU intra-op threads come from OpenMP, one team per thread that runs a parallel op,
# and libgomp keeps every team's threads. Once a process has more of them than cores (the
# caller's team, which built the model, plus a worker's), libgomp stops letting idle team
# threads spin between parallel regions: every matmul then pays a futex wake-up of its helpers.
# On a 2-core machine that made a one-worker forward_backward about 1.35x slower than the same
# ops on the calling thread. So in a CPU pool the calling thread runs device 0's actions itself,
# in caller_as_worker(); devices 1.. have worker threads. Accelerators compute on the device and
# keep a worker thread each.
class DevicePool:
    """The devices of one model, their workers and their backends. Built on the main thread;
    read-only afterwards. ``caller_device``: the device whose actions the calling thread runs
    (CPU pools: 0, see [Note: the calling thread runs CPU device 0]), or None. ``streaming``:
    whether the stages stream through accelerators (see [Note: streaming]).
    ``memory_in_host``: the devices' memory is host RAM (see :class:`DeviceKind`)."""

    def __init__(self, devices: DeviceSpec | None = None) -> None:
        self.devices = resolve_devices(devices)
        self.device_type = self.devices[0].type
        self.streaming = self.device_type != "cpu"
        self.backends: list[Backend]
        self.accelerators: list[AcceleratorBackend] = []
        self.memory_in_host = False
        if self.streaming:
            kind = _kind(self.device_type)
            pinned = kind.pinned if kind is not None else TORCH_PINNED
            self.memory_in_host = kind is not None and kind.memory_in_host
            self.accelerators = [AcceleratorBackend(d, pinned) for d in self.devices]
            self.backends = list(self.accelerators)
        else:
            self.backends = [CPUBackend(d) for d in self.devices]
        self.caller_device: int | None = None if self.streaming else 0

    def __len__(self) -> int:
        return len(self.devices)

    def worker(self, i: int) -> DeviceWorker:
        return get_worker(self.devices[i])

    def __repr__(self) -> str:
        return f"DevicePool({', '.join(str(d) for d in self.devices)})"
