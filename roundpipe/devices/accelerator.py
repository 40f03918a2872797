"""Every accelerator's backend (CUDA, the emulated ``emu``), on torch's device-agnostic APIs
(``torch.get_device_module``, ``torch.Stream``, ``torch.Event``; see :mod:`roundpipe.devices.kind`).

What the device does for each action of a plan's program (see [Note: the program] in
:mod:`roundpipe.plan.actions`) is here, one method per move: the model stays in pinned host
memory; a stage's parameters and buffers are uploaded once per run of actions
(:meth:`AcceleratorBackend.upload`, a :class:`Resident`), its layers run on those copies
(swapped in for the call, see [Note: the layer's device tensors]), its gradients accumulate on
the device and are downloaded once, into pinned host memory.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from roundpipe.devices import kind
from roundpipe.devices.backend import WorkerDevice
from roundpipe.devices.packed import packed_copy
from roundpipe.devices.pinned import TORCH_PINNED, PinnedAllocator, pin_module, pinned_empty

__all__ = ["AcceleratorBackend", "Resident", "cublas_workspace_bytes", "device_reserve"]

# [Note: the device reserve]
# What a call takes on a CUDA device beyond the tensors the memory plan counts, which the check
# leaves free:
# * cuBLAS's workspaces, which torch allocates in its caching allocator once per (handle,
#   stream) that runs a matmul and keeps for the process's life (measured on an H200: 65 MiB
#   allocated after a first call, two 32 MiB workspaces and cuBLASLt's);
# * the free space of partly used segments: the caching allocator carves blocks from 2 MiB
#   (requests up to 1 MiB) and 20 MiB segments that belong to the stream that made them, so
#   each stream that allocates (the caller's, and roundpipe's compute, copy and download
#   streams) holds up to a segment per pool that no other stream can use; the large pool's only
#   where the peak is large enough to hold tensors above 1 MiB (20 MiB or more);
# * the rounding of every block to 512 bytes, and splits a freed block of another size leaves.
# The CUDA context needs no reserve: it exists before the check, and mem_get_info's free
# memory already excludes it. The emulated device plans the same reserve when its capacity
# counts reserved memory as a GPU's does (set_memory_capacity(..., counts_reserved=True)),
# with the workspaces set_gpu_overheads gives; tests/test_memory_plan.py holds the plan to its
# model of the caching allocator.
CUBLAS_STREAMS = 2
ALLOCATING_STREAMS = 4
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
ALLOCATOR_SLACK = 0.03


def device_reserve(peak: int, cublas_workspace: int) -> tuple[int, str]:
    """The reserve beside a planned ``peak`` of tensors on a GPU whose cuBLAS workspace per
    stream is ``cublas_workspace`` bytes, and what it is made of (see
    [Note: the device reserve])."""
    per_stream = SMALL_SEGMENT + (LARGE_SEGMENT if peak >= LARGE_SEGMENT else 0)
    segments = ALLOCATING_STREAMS * per_stream
    slack = int(ALLOCATOR_SLACK * peak)
    parts = [f"segments {ALLOCATING_STREAMS} streams x {per_stream / 2**20:g} MiB"]
    if cublas_workspace:
        parts.insert(0, f"cuBLAS workspaces {CUBLAS_STREAMS} x {cublas_workspace / 2**20:.1f} MiB")
    parts.append(f"rounding {ALLOCATOR_SLACK:.0%}")
    return CUBLAS_STREAMS * cublas_workspace + segments + slack, ", ".join(parts)


def cublas_workspace_bytes(major: int, env: dict[str, str] | None = None) -> int:
    """torch's cuBLAS workspace per stream on a GPU of compute capability ``major``:
    ``$CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) if set, else torch's default (32
    MiB from Hopper, 8 MiB + 128 KiB before), plus cuBLASLt's
    (``$TORCH_CUBLASLT_WORKSPACE_SIZE`` KiB, default 1 MiB)."""
    env = dict(os.environ) if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = [int(x) for x in config.split(":")[1:] if x.strip().isdigit()] if config else []
    if pairs and len(pairs) % 2 == 0:
        kib = sum(size * count for size, count in zip(pairs[::2], pairs[1::2]))
    else:
        kib = 4096 * 8 if major >= 9 else 4096 * 2 + 16 * 8
    lt = env.get("TORCH_CUBLASLT_WORKSPACE_SIZE", "").strip()
    kib += int(lt) if lt.isdigit() else 1024
    return kib * 1024


# [Note: the layer's device tensors]
# A layer runs on its stage's upload: while it runs, each of its parameters and buffers is
# replaced by the device copy, in the dict of the submodule that owns it (``_parameters`` or
# ``_buffers``), and put back afterwards, even if the layer raised. That is what
# torch.func.functional_call does, but it resolves every dotted name and builds its swap on each
# call (a third of a millisecond for a HF decoder layer, on every forward and recompute of every
# microbatch, on the host path that issues the device's work); here the places are found once
# per upload. Every name of a tensor counts (a weight tied inside the layer is replaced under
# each of its names), and the originals go back in reverse order, so a tensor reached twice
# ends as it was.

# (the dict that holds the tensor, its key there, the device copy)
Swap = tuple[dict[str, Any], str, torch.Tensor]


def swaps_of(
    module: torch.nn.Module,
    copy: Any,
    buffers: list[tuple[torch.Tensor, torch.Tensor, bool]] | None = None,
) -> list[Swap]:
    """Where each parameter and buffer of ``module`` goes while it runs; ``copy(t, is_param)``
    gives a tensor's device copy. ``buffers``: each buffer's (host tensor, copy, whether its
    module is in training mode) is appended there."""
    swaps: list[Swap] = []
    for sub in module.modules():
        for key, p in sub._parameters.items():
            if p is not None:
                swaps.append((sub._parameters, key, copy(p, True)))
        for key, b in sub._buffers.items():
            if b is not None:
                swaps.append((sub._buffers, key, copy(b, False)))
                if buffers is not None:
                    buffers.append((b, swaps[-1][2], sub.training))
    return swaps


def run_swapped(layer: Callable[..., Any], swaps: list[Swap], args: tuple, kwargs: dict) -> Any:
    """``layer(*args, **kwargs)`` (a module, or its compiled module) with ``swaps`` in place,
    the originals back afterwards, also when it raises (see [Note: the layer's device
    tensors])."""
    originals = [owner[key] for owner, key, _ in swaps]
    try:
        for owner, key, copy in swaps:
            owner[key] = copy
        return layer(*args, **kwargs)
    finally:
        for (owner, key, _), original in zip(reversed(swaps), reversed(originals)):
            owner[key] = original


class Resident:
    """A stage's parameters and buffers on an accelerator for one run of actions: uploaded once
    by :meth:`AcceleratorBackend.upload`, read by every action of the run, dropped by
    :meth:`AcceleratorBackend.release`. Touched by the stage's worker only.

    ``swaps``: per layer module (by id), where each of its parameters and buffers goes while
    the layer runs, with its device copy (see [Note: the layer's device tensors]).
    ``leaves``: the device copies of the stage's trainable parameters, in the order given to
    ``upload``, that gradients are taken with respect to (None for a differentiable upload,
    whose gradients flow back to the host parameters).
    ``ready``: a prefetch's copies done (an event on the copy stream), until adopted.
    ``buffers``: (host buffer, device copy, whether its module is in training mode).
    ``carried``: the device copies of the tensors packed parameters carry (their quantization
    state, see [Note: packed parameters] in :mod:`roundpipe.devices.packed`), which no swap
    names."""

    __slots__ = ("swaps", "leaves", "buffers", "ready", "carried")

    def __init__(self) -> None:
        self.swaps: dict[int, list[Swap]] = {}
        self.leaves: list[torch.Tensor] | None = None
        self.ready: torch.Event | None = None
        self.buffers: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self.carried: list[torch.Tensor] = []


class AcceleratorBackend:
    """One accelerator of the pool (see :class:`roundpipe.devices.backend.StreamingBackend`).

    The model stays in host memory, pinned (:meth:`prepare_host`), so that uploads are
    asynchronous copies. In training the parameter copies are fresh leaves, so that gradients
    stay on the device and accumulate there; for a differentiable inference call the upload is a
    differentiable ``.to(device)`` instead, so a later ``backward()`` reaches the host
    parameters. Buffers that a training-mode module changed in place (BatchNorm's running stats)
    are copied back to the host at the end of a forward run (:meth:`release`).

    Three streams: compute (:attr:`stream`, every action), copy (:attr:`copy_stream`, prefetched
    uploads, adopted by the compute stream through an event) and download
    (:attr:`download_stream`, gradients and offloaded stage inputs, after the compute).

    Touched by the device's worker thread only, except :meth:`begin_call` and :meth:`drain`
    (main thread, while no action of a call runs) and :meth:`memory_available` (any thread).
    """

    def __init__(self, device: WorkerDevice, pinned: PinnedAllocator = TORCH_PINNED) -> None:
        self.device = device
        # How this device kind gets pinned host memory (see [Note: the pinned pool]).
        self.pinned = pinned
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
        with kind.device_index(self.torch_device), self.stream:
            yield

    def begin_call(self) -> None:
        # The caller's stream (where it made the inputs, where the scaler updated the scale)
        # is not the compute stream: without this wait a kernel could read them half-written.
        self.stream.wait_stream(kind.current_stream(self.torch_device))

    def memory_available(self) -> int | None:
        index = self.torch_device.index
        free, _ = self._module.mem_get_info(index)
        # Blocks torch's caching allocator holds but no tensor uses are free to this process.
        return int(
            free + self._module.memory_reserved(index) - self._module.memory_allocated(index)
        )

    def reserve(self, peak: int) -> tuple[int, str]:
        """Bytes a call with a planned ``peak`` of tensors needs beside them on this device, and
        what they are (see [Note: the device reserve]). Any thread."""
        if self.device_type == "cuda":
            major, _ = self._module.get_device_capability(self.torch_device.index)
            return device_reserve(peak, cublas_workspace_bytes(major))
        # The emulated device, when it runs out where a GPU would (its planning_overheads).
        overheads = getattr(self._module, "planning_overheads", None)
        gpu = overheads() if callable(overheads) else None
        return (0, "") if gpu is None else device_reserve(peak, gpu.cublas_workspace)

    def drain(self) -> None:
        # Uploads (prefetched ones too) may still be reading host parameters that the next
        # step writes, and downloads writing pinned buffers.
        for stream in (self.stream, self.copy_stream, self.download_stream):
            stream.synchronize()

    def prepare_host(self, module: torch.nn.Module) -> None:
        """Main thread, at wrap time: move the module's parameters and buffers into pinned host
        memory (same objects, new storage), so that uploads do not stage through a bounce
        buffer and can overlap compute. One pool of a few large allocations, not one per
        tensor, so the host allocator's rounding does not double the model
        (see [Note: the pinned pool] in :mod:`roundpipe.devices.pinned`)."""
        pin_module(module, self.pinned)

    def to_device(self, tree: Any, after: torch.Event | None = None) -> Any:
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
                source = kind.current_stream(x.device)
                source.wait_event(after)
                x.record_stream(source)
            return x.to(self.torch_device, non_blocking=True)

        if isinstance(tree, torch.Tensor):
            return move(tree)
        return pytree.tree_map(move, tree)

    def upload(
        self,
        modules: Sequence[torch.nn.Module],
        trainable: Sequence[torch.Tensor],
        leaves: bool,
        prefetch: bool = False,
    ) -> Resident:
        """Copy ``modules``' parameters and buffers to the device, each tensor once; a packed
        parameter as its packed data with its quantization state (see [Note: packed
        parameters] in :mod:`roundpipe.devices.packed`), never dequantized on the host.
        ``leaves``: the ``trainable`` parameters become device leaves that require grad
        (``Resident.leaves``, aligned with ``trainable``); else a differentiable copy.
        ``prefetch``: the copies run on :attr:`copy_stream`, beside the compute; the upload is
        usable after :meth:`adopt`. Else they run on the compute stream, in order."""
        if prefetch:
            with self.copy_stream:
                resident = self.upload(modules, trainable, leaves)
            resident.ready = torch.Event(device=self.torch_device)
            resident.ready.record(self.copy_stream)
            return resident
        device, resident = self.torch_device, Resident()
        copies: dict[int, torch.Tensor] = {}

        def carry(t: torch.Tensor) -> torch.Tensor:
            copy = copies.get(id(t))
            if copy is None:
                copy = copies[id(t)] = t.to(device, non_blocking=True)
                resident.carried.append(copy)
            return copy

        def up(t: torch.Tensor, leaf: bool) -> torch.Tensor:
            copy = copies.get(id(t))
            if copy is None:
                copy = packed_copy(t, lambda d: d.to(device, non_blocking=True), carry)
                if copy is None and leaf:
                    copy = t.detach().to(device, non_blocking=True).requires_grad_(True)
                elif copy is None:
                    copy = t.to(device, non_blocking=True)
                copies[id(t)] = copy
            return copy

        trainable_ids = {id(p) for p in trainable}
        for module in modules:
            resident.swaps[id(module)] = swaps_of(
                module,
                lambda t, is_param: up(t, is_param and leaves and id(t) in trainable_ids),
                resident.buffers,
            )
        if leaves:
            resident.leaves = [copies[id(p)] for p in trainable]
        return resident

    def adopt(self, upload: Any) -> None:
        """Before the compute stream reads an upload: wait (on the device, not the host) for a
        prefetch's copies, and tell the allocator the compute stream uses its tensors."""
        resident: Resident = upload
        ready, resident.ready = resident.ready, None
        if ready is None:
            return
        self.stream.wait_event(ready)
        for swaps in resident.swaps.values():
            for _, _, t in swaps:
                t.record_stream(self.stream)
        for t in resident.carried:
            t.record_stream(self.stream)

    def release(self, upload: Any, write_back: bool) -> torch.Event:
        """End of a run: with ``write_back``, buffers of training-mode modules take the values
        the run left on the device (a forward run; a recompute's updates are dropped)."""
        resident: Resident = upload
        if write_back:
            with torch.no_grad():
                for host, copy, training in resident.buffers:
                    if training:
                        host.copy_(copy)
        resident.swaps.clear()
        resident.leaves = None
        resident.buffers.clear()
        resident.carried.clear()
        return self._event()

    def call_layer(
        self,
        layer: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        upload: Any = None,
        call: Callable[..., Any] | None = None,
    ) -> Any:
        if upload is None:
            raise AssertionError(
                "an accelerator action ran a layer without its stage's upload; please report"
            )
        resident: Resident = upload
        return run_swapped(layer if call is None else call, resident.swaps[id(layer)], args, kwargs)

    def download(
        self, tensors: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], torch.Event]:
        """Start copying device tensors into fresh pinned host tensors on the download stream,
        after the compute so far; returns them and the event that completes when they have
        arrived. The worker goes on computing; whoever reads them waits for the event. The host
        tensors are views of one pinned pool (see [Note: the pinned pool] in
        :mod:`roundpipe.devices.pinned`), freed once all of them are."""
        down = self.download_stream
        down.wait_stream(self.stream)
        moved = [t for t in tensors if t is not None and t.device.type != "cpu"]
        pool = iter(pinned_empty([(t.shape, t.dtype) for t in moved], self.pinned))
        host: list[torch.Tensor | None] = []
        with down:
            for t in tensors:
                if t is None or t.device.type == "cpu":
                    host.append(t)
                    continue
                t.record_stream(down)  # the compute side may drop it before the copy ran
                host.append(next(pool).copy_(t.detach(), non_blocking=True))
        done = torch.Event(device=self.torch_device)
        done.record(down)
        return host, done

    def download_grads(
        self, tensors: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], torch.Tensor, torch.Event]:
        down = self.download_stream
        down.wait_stream(self.stream)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with down:
            for t in tensors:
                if t is not None and t.device.type != "cpu" and t.is_floating_point():
                    by_dtype.setdefault(t.dtype, []).append(t.detach())
            found = torch.zeros((), dtype=torch.float32, device=self.torch_device)
            one = torch.ones((), dtype=torch.float32, device=self.torch_device)
            largest = [torch.zeros((), dtype=torch.float32, device=self.torch_device)]
            for same in by_dtype.values():  # times 1.0: the values stay as they are
                torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
                # the largest magnitude, so a sum of two checked parts can stay checked
                largest += [n.float() for n in torch._foreach_norm(same, math.inf)]
            flag = torch.stack([found, torch.stack(largest).max()])
        host, done = self.download([*tensors, flag])  # done: after every copy, the flag's too
        host_flag = host.pop()
        assert host_flag is not None
        return host, host_flag, done

    def record_event(self) -> torch.Event:
        return self._event()

    def _event(self) -> torch.Event:
        event = torch.Event(device=self.torch_device)
        event.record(self.stream)
        return event

    def offload(self, tree: Any) -> tuple[Any, torch.Event]:
        leaves, spec = pytree.tree_flatten(tree)
        on_device = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, torch.Tensor) and x.device == self.torch_device
        ]
        host, arrived = self.download([leaves[i] for i in on_device])
        for i, h in zip(on_device, host):
            assert h is not None
            # The backward cuts its graph at the leaves that require grad: keep the flag.
            leaves[i] = h.requires_grad_(leaves[i].requires_grad)
        return pytree.tree_unflatten(leaves, spec), arrived

    def reload(self, tree: Any, arrived: torch.Event) -> Any:
        self.stream.wait_event(arrived)  # on the device: the host copies have landed
        return self.to_device(tree)

    def wait_for(self, event: torch.Event) -> None:
        event.synchronize()

    def finish(self) -> None:
        # Device event, then the host side: the action's future is set only after this returns.
        self._event().synchronize()

    def get_rng_state(self) -> torch.Tensor | None:
        return self._module.get_rng_state(self.torch_device.index)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self._module.set_rng_state(state, self.torch_device.index)

    def seeded_rng_state(self, seed: int) -> torch.Tensor | None:
        index = self.torch_device.index
        with (
            torch.random.fork_rng(devices=[index], device_type=self.device_type),
            kind.device_index(self.torch_device),
        ):
            self._module.manual_seed(seed)
            return self._module.get_rng_state(index)
