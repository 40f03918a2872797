"""The device pool: which devices compute, one worker per device, and the backends.

* :func:`parse_devices` turns ``"cpu"``, ``"cpu:2"`` (two CPU workers), ``"cuda"`` (every CUDA
  device), ``"cuda:0,1"``, ``"emu"`` or ``"emu:2"`` (one or two emulated accelerators, see
  :mod:`roundpipe.testing.emu`) into a tuple of :class:`WorkerDevice`.
* :func:`resolve_devices`: the ``devices=`` argument beats ``ROUNDPIPE_DEVICES``, which beats the
  default (every CUDA device, else one CPU worker).
* One worker thread per device, process-wide (:func:`get_worker`): a
  :class:`roundpipe.workers.WorkerThread` (a daemon thread started on first use, FIFO, drained
  at exit) whose work items have future-like results (:class:`Future`): the worker catches
  ``BaseException`` and stores it, the waiter re-raises it.
  Except CPU device 0, whose work the calling thread runs itself, in :func:`caller_as_worker`
  (see [Note: the calling thread runs CPU device 0]).
* Backends (typed by the :class:`Backend` protocol, what the runtime calls; an accelerator's is
  also a :class:`StreamingBackend`): the CPU backend is the reference (host <-> device moves are the identity). Every
  accelerator (CUDA, the emulated ``emu``) has one backend written against torch's
  device-agnostic APIs (``torch.get_device_module``, ``torch.Stream``, ``torch.Event``): the
  model stays in pinned host memory, a stage is uploaded once per run of actions
  (:class:`Resident`), its gradients accumulate on the device and are downloaded once, and an
  action's end is published by a device event that the worker waits for before setting the
  host-side future.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from typing import (Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple,
                    Union)

import torch
from torch.utils import _pytree as pytree

from roundpipe.workers import Future, WorkerThread

__all__ = ["WorkerDevice", "parse_devices", "resolve_devices", "DevicePool", "Backend",
           "StreamingBackend", "Future", "Resident", "on_device_worker", "caller_as_worker",
           "get_worker", "ENV_VAR"]

ENV_VAR = "ROUNDPIPE_DEVICES"

_ACCEPTED = ("'cpu', 'cpu:N' (N CPU workers), 'cuda' (every CUDA device), 'cuda:I[,J...]', or "
             "'emu' / 'emu:N' (N emulated accelerators, for tests)")


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


def parse_devices(spec: Union[str, torch.device, Sequence[Union[str, torch.device]]]
                  ) -> Tuple[WorkerDevice, ...]:
    """Parse a device spec; raises ``ValueError`` naming the accepted forms. Any thread."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        try:
            items = list(spec)
        except TypeError:
            raise ValueError(f"bad device spec {spec!r}: use {_ACCEPTED}") from None
        out: List[WorkerDevice] = []
        for item in items:
            out.extend(parse_devices(item))
        if not out:
            raise ValueError(f"empty device list: use {_ACCEPTED}")
        _check_one_kind(out, spec)
        return tuple(out)
    text = spec.strip().lower()
    kind, _, rest = text.partition(":")
    if kind == "cpu":
        if not rest:
            return (WorkerDevice("cpu", 0),)
        if rest.isdigit() and int(rest) >= 1:
            return tuple(WorkerDevice("cpu", i) for i in range(int(rest)))
        raise ValueError(f"bad device spec {spec!r}: 'cpu:N' takes a number of workers N >= 1; "
                         f"use {_ACCEPTED}")
    if kind == "emu":
        from roundpipe.testing import emu

        if rest and not (rest.isdigit() and 1 <= int(rest) <= emu.DEVICE_COUNT):
            raise ValueError(f"bad device spec {spec!r}: 'emu:N' takes a number of emulated "
                             f"devices 1 <= N <= {emu.DEVICE_COUNT}; use {_ACCEPTED}")
        emu.install()
        return tuple(WorkerDevice("emu", i) for i in range(int(rest) if rest else 1))
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not rest:
            if count == 0:
                raise ValueError(f"device spec {spec!r} asks for every CUDA device but none is "
                                 f"available; use 'cpu' or 'cpu:N'")
            return tuple(WorkerDevice("cuda", i) for i in range(count))
        parts = [p.strip().removeprefix("cuda:") for p in rest.split(",")]
        if not parts or not all(p.isdigit() for p in parts):
            raise ValueError(f"bad device spec {spec!r}: use {_ACCEPTED}")
        indices = [int(p) for p in parts]
        if len(set(indices)) != len(indices):
            raise ValueError(f"device spec {spec!r} names a CUDA device twice")
        for i in indices:
            if i >= count:
                raise ValueError(f"device spec {spec!r} names cuda:{i} but only {count} CUDA "
                                 f"device(s) are available")
        return tuple(WorkerDevice("cuda", i) for i in indices)
    raise ValueError(f"bad device spec {spec!r}: use {_ACCEPTED}")


def _check_one_kind(devices: Sequence[WorkerDevice], spec: Any) -> None:
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"device spec {spec!r} mixes device types; a pool is all CPU, all CUDA "
                         f"or all emulated")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device spec {spec!r} names a device twice")


def resolve_devices(devices: Any = None) -> Tuple[WorkerDevice, ...]:
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


def _install_emu_if_named() -> None:
    """``ROUNDPIPE_DEVICES=emu...``: install the emulated device at import, before any backward
    of the process can run (see :mod:`roundpipe.testing.emu`)."""
    if os.environ.get(ENV_VAR, "").strip().lower().startswith("emu"):
        from roundpipe.testing import emu

        emu.install()


_install_emu_if_named()


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


class _Worker(WorkerThread):
    """One thread that runs work items for one device, in submission order (a
    :class:`roundpipe.workers.WorkerThread`)."""

    def __init__(self, device: WorkerDevice) -> None:
        super().__init__(
            name=f"roundpipe-worker-{device}", thread_init=_mark_worker,
            closed_message=f"the roundpipe worker for {device} has shut down (the interpreter "
                           f"is exiting); no new work can be submitted")
        self.device = device

    def submit(self, fn: Callable, *args: Any, future: Optional[Future] = None) -> Future:
        """Queue ``fn(*args)``; returns its future at once. Any thread."""
        fut = future if future is not None else Future()
        self.enqueue(functools.partial(fut.run, fn, *args))
        return fut


_WORKERS: Dict[WorkerDevice, _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def get_worker(device: WorkerDevice) -> _Worker:
    """The process-wide worker of ``device`` (created on first use). Any thread."""
    with _WORKERS_LOCK:
        worker = _WORKERS.get(device)
        if worker is None:
            worker = _WORKERS[device] = _Worker(device)
        return worker


# -- backends ---------------------------------------------------------------------------------


class Backend(Protocol):
    """What the runtime calls on a device's backend (:class:`_CPUBackend`, the reference, or
    :class:`_AcceleratorBackend`). Every method runs on the device's worker thread (or the
    calling thread standing in for it), except :meth:`prepare_host`, which the main thread calls
    once per wrapped model, and the RNG state accessors, which the main thread uses around a
    call (see [Note: RNG chains])."""

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

    def memory_available(self) -> Optional[int]:
        """Any thread: bytes this device could still allocate (None: the host's memory)."""
        ...

    def drain(self) -> None:
        """Main thread, after a failed call, once no worker touches it: wait until nothing the
        call enqueued runs any more (its last actions, which wait for the device, did not run)."""
        ...

    def to_device(self, tree: Any, after: Optional[torch.Event] = None) -> Any:
        """A pytree's tensors on this device (the identity on the CPU); tensors from another
        device are read once ``after`` (their producer's event) has completed."""
        ...

    def record_event(self) -> Optional[torch.Event]:
        """An event at the current end of this device's work (None on the CPU)."""
        ...

    def offload(self, tree: Any) -> Tuple[Any, Optional[torch.Event]]:
        """Start copying a pytree's device tensors to pinned host memory; returns the host
        pytree and the event of their arrival (the identity and None on the CPU)."""
        ...

    def reload(self, tree: Any, arrived: torch.Event) -> Any:
        """An :meth:`offload`'s pytree back on this device, once ``arrived`` has completed."""
        ...

    def call_layer(self, layer: torch.nn.Module, args: tuple, kwargs: dict,
                   resident: Optional["Resident"] = None) -> Any:
        """Run one layer; on an accelerator, on its stage's upload ``resident``."""
        ...

    def download(self, tensors: List[Optional[torch.Tensor]]
                 ) -> Tuple[List[Optional[torch.Tensor]], Optional[torch.Event]]:
        """Start copying device tensors to host tensors; returns the host tensors and an event
        that completes when they have arrived (None: they already have)."""
        ...

    def finish(self) -> None:
        """End of an action: its work is done once this returns."""
        ...

    def get_rng_state(self) -> Optional[torch.Tensor]:
        """The device generator's state (None: the CPU generator is the device's)."""
        ...

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:
        ...

    def seeded_rng_state(self, seed: int) -> Optional[torch.Tensor]:
        """The device generator's state after seeding it with ``seed``, the generator left as
        it was."""
        ...


class StreamingBackend(Backend, Protocol):
    """A backend whose stages are uploaded once per run of actions (every accelerator; see
    [Note: streaming] in :mod:`roundpipe.schedule`)."""

    def upload(self, modules: Sequence[torch.nn.Module], trainable: Sequence[torch.Tensor],
               leaves: bool, prefetch: bool = False) -> "Resident":
        """Copy a stage's parameters and buffers to the device for one run of actions
        (``prefetch``: on a copy stream, beside the compute)."""
        ...

    def adopt(self, resident: "Resident") -> None:
        """Before the compute stream reads an upload: order it after a prefetch's copies."""
        ...

    def release(self, resident: "Resident", write_back: bool) -> None:
        """End of a run: drop the upload (``write_back``: training-mode buffers go home)."""
        ...


class _CPUBackend:
    """The reference backend: tensors already live on the host, so moves are the identity."""

    device_type = "cpu"

    def __init__(self, device: WorkerDevice) -> None:
        self.device = device
        self.torch_device = device.torch_device

    def action_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin_call(self) -> None:
        """Nothing to order: the host runs the caller's work before the call's."""

    def drain(self) -> None:
        """Nothing runs on the CPU once its actions have returned."""

    def memory_available(self) -> Optional[int]:
        return None

    def to_device(self, tree: Any, after: Optional[torch.Event] = None) -> Any:
        return tree

    def record_event(self) -> Optional[torch.Event]:
        return None

    def offload(self, tree: Any) -> Tuple[Any, Optional[torch.Event]]:
        return tree, None

    def reload(self, tree: Any, arrived: torch.Event) -> Any:
        return tree

    def prepare_host(self, module: torch.nn.Module) -> None:
        """Called once per wrapped model; nothing to do when the host is the device."""

    def call_layer(self, layer: torch.nn.Module, args: tuple, kwargs: dict,
                   resident: Optional["Resident"] = None) -> Any:
        return layer(*args, **kwargs)

    def download(self, tensors: List[Optional[torch.Tensor]]
                 ) -> Tuple[List[Optional[torch.Tensor]], Optional[torch.Event]]:
        return tensors, None

    def finish(self) -> None:
        """Called at the end of every action on the worker."""

    def get_rng_state(self) -> Optional[torch.Tensor]:
        return None

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:
        return None

    def seeded_rng_state(self, seed: int) -> Optional[torch.Tensor]:
        return None


class Resident:
    """A stage's parameters and buffers on an accelerator for one run of actions (see
    [Note: streaming] in :mod:`roundpipe.schedule`): uploaded once by
    :meth:`_AcceleratorBackend.upload`, read by every action of the run, dropped by
    :meth:`_AcceleratorBackend.release`. Touched by the stage's worker only.

    ``tensors``: per layer module (by id), its parameters and buffers by name, for
    ``torch.func.functional_call``. ``leaves``: the device copies of the stage's trainable
    parameters, in the order given to ``upload``, that gradients are taken with respect to
    (None for a differentiable upload, whose gradients flow back to the host parameters)."""

    __slots__ = ("tensors", "leaves", "_buffers", "_ready")

    def __init__(self) -> None:
        self.tensors: Dict[int, Dict[str, torch.Tensor]] = {}
        self.leaves: Optional[List[torch.Tensor]] = None
        self._ready: Optional[torch.Event] = None  # a prefetch's copies done (copy stream)
        # (host buffer, device copy, whether its module is in training mode)
        self._buffers: List[Tuple[torch.Tensor, torch.Tensor, bool]] = []


class _AcceleratorBackend:
    """Every accelerator's backend (CUDA, the emulated ``emu``), on torch's device-agnostic APIs.

    The model stays in host memory, pinned (:meth:`prepare_host`), so that uploads are
    asynchronous copies. A stage's parameters and buffers are uploaded once per run of actions
    (:meth:`upload`, see [Note: streaming] in :mod:`roundpipe.schedule`); the actions call their
    layers on those copies through ``torch.func.functional_call``. In training the parameter
    copies are fresh leaves, so that gradients stay on the device and accumulate there; they are
    downloaded once per stage and call into pinned host memory (:meth:`download`). For a
    differentiable inference call the upload is a differentiable ``.to(device)`` instead, so a
    later ``backward()`` reaches the host parameters. Buffers that a training-mode module changed
    in place (BatchNorm's running stats) are copied back to the host at the end of a forward run
    (:meth:`release`).

    Three streams: compute (:attr:`stream`, every action), copy (:attr:`copy_stream`, prefetched
    uploads, adopted by the compute stream through an event) and download
    (:attr:`download_stream`, gradients and offloaded stage inputs, after the compute).
    :meth:`record_event` marks a hand-off to another device; :meth:`finish` records a device
    event on the compute stream and waits for it on the host.

    Touched by the device's worker thread only, except :meth:`begin_call` and :meth:`drain`
    (main thread, while no action of a call runs).
    """

    def __init__(self, device: WorkerDevice) -> None:
        self.device = device
        self.device_type = device.type
        self.torch_device = device.torch_device
        self._module = torch.get_device_module(device.type)
        # Made here, on the main thread, before any thread uses them: the main thread orders
        # the compute stream after its own (begin_call) while the worker may already upload.
        self.stream = torch.Stream(device=self.torch_device)  # compute: every action
        self.copy_stream = torch.Stream(device=self.torch_device)  # prefetched uploads
        self.download_stream = torch.Stream(device=self.torch_device)  # after the compute

    @contextlib.contextmanager
    def action_context(self) -> Iterator[None]:
        with torch.accelerator.device_index(self.torch_device.index), self.stream:
            yield

    def begin_call(self) -> None:
        # The caller's stream (where it made the inputs, where the scaler updated the scale)
        # is not the compute stream: without this wait a kernel could read them half-written.
        self.stream.wait_stream(torch.accelerator.current_stream(self.torch_device))

    def memory_available(self) -> Optional[int]:
        index = self.torch_device.index
        free, _ = self._module.mem_get_info(index)
        # Blocks torch's caching allocator holds but no tensor uses are free to this process.
        return free + self._module.memory_reserved(index) - self._module.memory_allocated(index)

    def drain(self) -> None:
        # Uploads (prefetched ones too) may still be reading host parameters that the next
        # step writes, and downloads writing pinned buffers.
        for stream in (self.stream, self.copy_stream, self.download_stream):
            stream.synchronize()

    def prepare_host(self, module: torch.nn.Module) -> None:
        """Main thread, at wrap time: move the module's parameters and buffers into pinned host
        memory (same objects, new storage), so that uploads do not stage through a bounce
        buffer and can overlap compute."""
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if t.device.type == "cpu" and not t.is_pinned():
                    t.data = t.data.pin_memory()

    def to_device(self, tree: Any, after: Optional[torch.Event] = None) -> Any:
        def move(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.device == self.torch_device:
                # Keep the allocator from reusing it while this stream still reads it.
                x.record_stream(self.stream)
                return x
            if after is not None and x.device.type == self.device_type:
                # From another device of the pool: torch copies it on that device's current
                # stream (on this thread), which must first wait for the producer's event.
                source = torch.accelerator.current_stream(x.device)
                source.wait_event(after)
                x.record_stream(source)
            return x.to(self.torch_device, non_blocking=True)

        if isinstance(tree, torch.Tensor):
            return move(tree)
        return pytree.tree_map(move, tree)

    def upload(self, modules: Sequence[torch.nn.Module], trainable: Sequence[torch.Tensor],
               leaves: bool, prefetch: bool = False) -> Resident:
        """Copy ``modules``' parameters and buffers to the device, each tensor once.
        ``leaves``: the ``trainable`` parameters become device leaves that require grad
        (``Resident.leaves``, aligned with ``trainable``); else a differentiable copy.
        ``prefetch``: the copies run on :attr:`copy_stream`, beside the compute; the upload is
        usable after :meth:`adopt`. Else they run on the compute stream, in order."""
        if prefetch:
            with self.copy_stream:
                resident = self.upload(modules, trainable, leaves)
            resident._ready = torch.Event(device=self.torch_device)
            resident._ready.record(self.copy_stream)
            return resident
        device, resident = self.torch_device, Resident()
        copies: Dict[int, torch.Tensor] = {}

        def up(t: torch.Tensor, leaf: bool) -> torch.Tensor:
            copy = copies.get(id(t))
            if copy is None:
                if leaf:
                    copy = t.detach().to(device, non_blocking=True).requires_grad_(True)
                else:
                    copy = t.to(device, non_blocking=True)
                copies[id(t)] = copy
            return copy

        trainable_ids = {id(p) for p in trainable}
        for module in modules:
            tensors = {n: up(p, leaves and id(p) in trainable_ids)
                       for n, p in module.named_parameters()}
            for prefix, sub in module.named_modules():
                for n, b in sub.named_buffers(prefix=prefix, recurse=False):
                    tensors[n] = up(b, False)
                    resident._buffers.append((b, tensors[n], sub.training))
            resident.tensors[id(module)] = tensors
        if leaves:
            resident.leaves = [copies[id(p)] for p in trainable]
        return resident

    def adopt(self, resident: Resident) -> None:
        """Before the compute stream reads an upload: wait (on the device, not the host) for a
        prefetch's copies, and tell the allocator the compute stream uses its tensors."""
        ready, resident._ready = resident._ready, None
        if ready is None:
            return
        self.stream.wait_event(ready)
        for tensors in resident.tensors.values():
            for t in tensors.values():
                t.record_stream(self.stream)

    def release(self, resident: Resident, write_back: bool) -> None:
        """End of a run: with ``write_back``, buffers of training-mode modules take the values
        the run left on the device (a forward run; a recompute's updates are dropped)."""
        if write_back:
            with torch.no_grad():
                for host, copy, training in resident._buffers:
                    if training:
                        host.copy_(copy)
        resident.tensors.clear()
        resident.leaves = None
        resident._buffers.clear()

    def call_layer(self, layer: torch.nn.Module, args: tuple, kwargs: dict,
                   resident: Optional[Resident] = None) -> Any:
        if resident is None:
            raise AssertionError("an accelerator action ran a layer without its stage's upload; "
                                 "please report")
        return torch.func.functional_call(layer, resident.tensors[id(layer)], args, kwargs)

    def download(self, tensors: List[Optional[torch.Tensor]]
                 ) -> Tuple[List[Optional[torch.Tensor]], Optional[torch.Event]]:
        """Start copying device tensors into fresh pinned host tensors on the download stream,
        after the compute so far; returns them and the event that completes when they have
        arrived. The worker goes on computing; whoever reads them waits for the event."""
        down = self.download_stream
        down.wait_stream(self.stream)
        host = []
        with down:
            for t in tensors:
                if t is None or t.device.type == "cpu":
                    host.append(t)
                    continue
                t.record_stream(down)  # the compute side may drop it before the copy ran
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.append(dst.copy_(t.detach(), non_blocking=True))
        done = torch.Event(device=self.torch_device)
        done.record(down)
        return host, done

    def record_event(self) -> Optional[torch.Event]:
        event = torch.Event(device=self.torch_device)
        event.record(self.stream)
        return event

    def offload(self, tree: Any) -> Tuple[Any, Optional[torch.Event]]:
        leaves, spec = pytree.tree_flatten(tree)
        on_device = [i for i, x in enumerate(leaves)
                     if isinstance(x, torch.Tensor) and x.device == self.torch_device]
        host, arrived = self.download([leaves[i] for i in on_device])
        for i, h in zip(on_device, host):
            # The backward cuts its graph at the leaves that require grad: keep the flag.
            leaves[i] = h.requires_grad_(leaves[i].requires_grad)
        return pytree.tree_unflatten(leaves, spec), arrived

    def reload(self, tree: Any, arrived: torch.Event) -> Any:
        self.stream.wait_event(arrived)  # on the device: the host copies have landed
        return self.to_device(tree)

    def finish(self) -> None:
        # Device event, then the host side: the action's future is set only after this returns.
        event = torch.Event(device=self.torch_device)
        event.record(self.stream)
        event.synchronize()

    def get_rng_state(self) -> Optional[torch.Tensor]:
        return self._module.get_rng_state(self.torch_device.index)

    def set_rng_state(self, state: Optional[torch.Tensor]) -> None:
        if state is not None:
            self._module.set_rng_state(state, self.torch_device.index)

    def seeded_rng_state(self, seed: int) -> Optional[torch.Tensor]:
        index = self.torch_device.index
        with torch.random.fork_rng(devices=[index], device_type=self.device_type), \
                torch.accelerator.device_index(index):
            self._module.manual_seed(seed)
            return self._module.get_rng_state(index)


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
    (CPU pools: 0, see [Note: the calling thread runs CPU device 0]), or None."""

    def __init__(self, devices: Any = None) -> None:
        self.devices = resolve_devices(devices)
        self.device_type = self.devices[0].type
        backend_cls = _CPUBackend if self.device_type == "cpu" else _AcceleratorBackend
        self.backends: List[Backend] = [backend_cls(d) for d in self.devices]
        self.caller_device: Optional[int] = 0 if self.device_type == "cpu" else None

    def __len__(self) -> int:
        return len(self.devices)

    def worker(self, i: int) -> _Worker:
        return get_worker(self.devices[i])

    def __repr__(self) -> str:
        return f"DevicePool({', '.join(str(d) for d in self.devices)})"
