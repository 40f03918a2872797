"""An emulated accelerator, ``emu``, that lets CPU-only machines run roundpipe's accelerator path.

What it is: torch's PrivateUse1 backend renamed ``emu``, with up to :data:`DEVICE_COUNT` devices
(``emu:0`` ...). An ``emu`` tensor is a wrapper subclass (:class:`EmuTensor`) around a CPU tensor,
and every op on it runs on the host. What it catches, as CUDA would:

* Host tensors meeting device tensors: an op that mixes an ``emu`` tensor with a host tensor of
  one or more dimensions (or with a tensor on another ``emu`` device) raises CUDA's
  ``RuntimeError: Expected all tensors to be on the same device ...``.
* Thread-local state lost in backward: a small C++ device guard (``_emu_guard.cpp``, built once
  with ``torch.utils.cpp_extension.load`` and cached, as ``_emu_autocast.cpp`` is) makes
  torch's autograd engine run the backward of ``emu`` tensors on its own per-device thread, as
  it does for CUDA. Code that only works when backward runs on the thread that called it
  (Python thread-locals read during a checkpoint recompute, say) fails here as it would on a
  GPU.
* Results: random ops draw from the CPU generator and dropout draws as on the CPU, so a model
  on ``emu`` computes what it computes on the CPU, bit for bit, which the tests compare.
* Stream races: kernels run at once, but the order a GPU would guarantee is tracked (see
  [Note: emulated streams]); an op whose access to device memory no stream order, event or host
  wait orders after another stream's raises :class:`StreamOrderError`, a non-blocking download
  into pinned memory holds NaN until the host waits for it, and changing the pinned source of a
  non-blocking upload before waiting for it raises at the wait.
* The caching allocator's reuse (see [Note: emulated allocator reuse]): a tensor used on a
  stream other than the one that allocated it, without ``record_stream`` and without that use
  being ordered before its free, raises :class:`StreamOrderError` at the next allocation that
  could take its memory, naming both streams and where the tensor was made.
* Attention (see [Note: emulated attention]): ``scaled_dot_product_attention`` takes the math
  path, and holds its (query x key) scores, exactly where CUDA would
  (:func:`roundpipe.testing.cuda_attention.cuda_sdpa_backend`), else the CPU's fused kernel,
  which holds none, as a GPU's fused kernels hold none.
* Autocast (see [Note: emulated autocast]): ``torch.autocast("emu")`` applies CUDA's cast
  policy, registered from torch's own op lists: matmul-like ops in the autocast dtype, softmax,
  norms, sums, pow and the losses in fp32, mixed inputs of the promote list widened.
* Event queries (see [Note: emulated event queries]): ``Event.query()``/``Stream.query()`` say
  done only once the host has waited for that work, so code's not-ready branches run.
* The device APIs: ``torch.Stream``/``torch.Event``, ``torch.accelerator``,
  ``torch.get_device_module("emu")``, ``pin_memory()``/``is_pinned()`` and ``torch.autocast``.
* Device memory (see [Note: emulated device memory]): counted per storage
  (``memory_allocated``, ``max_memory_allocated``), and what CUDA's caching allocator would
  reserve for it (``memory_reserved``, ``max_memory_reserved``, ``empty_cache``: segments,
  rounding, per-stream pools; :mod:`roundpipe.testing.caching_allocator`); ``mem_get_info``
  leaves out the segments and the context and cuBLAS workspaces :func:`set_gpu_overheads`
  gives; an optional capacity beyond which allocations raise ``torch.OutOfMemoryError``, for
  the live storages or, with ``counts_reserved=True``, for the segments as on a GPU.
* Pinned host memory: each allocation takes the next power of two of its size, as CUDA's
  caching host allocator rounds it, is counted, and is kept for reuse once freed
  (:func:`pinned_memory_stats`, :func:`empty_pinned_cache`; see [Note: emulated pinned memory]);
  :func:`copies_in_flight_bytes` is what the snapshots of pending asynchronous copies hold.
* Streams (see [Note: emulated stream pool]): ``torch.Stream()`` hands out a device's 32 pool
  streams round-robin, as CUDA does, so a new stream may be one other code holds.

Each of the stricter behaviours is a rule (:class:`Rules`), all on by default and in the test
suite, each switchable (:func:`set_rules`, :func:`rules_set`, ``ROUNDPIPE_EMU_LENIENT``).

What it cannot catch:

* A CUDA kernel's own numerics (TF32, cuBLAS and cuDNN algorithms, other reduction orders): the
  results are the CPU's. Where the attention rule takes the math path the CPU would not, the
  last bits are the math path's.
* Host-side races between host threads: host threads count as one (a host wait on one thread
  orders later work that any thread enqueues).
* Allocator reuse through a tensor that autograd saved in the forward and a backward reads on a
  stream autograd handed gradients to (autograd's own record cannot name the tensor here); and
  which block the allocator hands out: a hazard raises at any allocation from the same pool,
  not only the one a GPU would give those bytes to.
* Memory: ``memory_allocated`` is not rounded to 512 bytes and leaves out cuBLAS workspaces
  (CUDA's counts both); the allocator model leaves out ``expandable_segments``,
  ``max_split_size_mb`` and the driver's granularity; kernels' internal scratch space (cuDNN,
  fused attention's) and NCCL buffers are not counted; the context's and workspaces' sizes are
  what :func:`set_gpu_overheads` is told. Dropout in attention takes the math path (the CPU's
  fused kernel draws no dropout), so its scores are counted where a GPU's fused kernels hold
  none.
* Speed: a Python call per op, several times slower than the CPU backend; timings say nothing
  about a GPU.

Call :func:`install` before the first ``backward()`` of the process: the autograd engine starts
its device threads once, on the first backward, and only for the device types it knows then.
``RoundPipe(devices="emu")`` and ``ROUNDPIPE_DEVICES=emu`` install it; the test suite's
conftest does so at start. It is test infrastructure, not a backend to train on.

The package by concern: :mod:`.native` (the native libraries, the rules in force, host waits),
:mod:`.memory` (device and pinned memory), :mod:`.streams` (stream order, allocator reuse,
pending copies), :mod:`.kernels` (autocast, dropout, attention), :mod:`.dispatch`
(:class:`EmuTensor`, ``__torch_dispatch__``, ``torch.emu``); this module installs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
from collections.abc import Iterator

import torch

from roundpipe.native_build import build_source, load_library
from roundpipe.testing.emu.dispatch import (
    RESIZING_FACTORIES,
    Copy,
    DeviceModule,
    EmuTensor,
    copy_from,
    empty,
    empty_strided,
    host_factory,
    record_copies,
)
from roundpipe.testing.emu.kernels import attention, dropout, set_cuda_autocast
from roundpipe.testing.emu.memory import (
    HOPPER_CUBLAS_WORKSPACE,
    GpuOverheads,
    PinnedMemoryStats,
    overheads_held,
    pinned_round_limit,
    set_gpu_overheads,
    set_memory_capacity,
    set_pinned_round_limit,
)
from roundpipe.testing.emu.native import (
    DEVICE_COUNT,
    NAME,
    STATE,
    Rules,
    StreamOrderError,
    bind_native,
)
from roundpipe.testing.emu.streams import (
    copies_in_flight_bytes,
    empty_pinned_cache,
    pinned_memory_stats,
)

__all__ = [
    "NAME",
    "DEVICE_COUNT",
    "EmuTensor",
    "Copy",
    "StreamOrderError",
    "Rules",
    "rules",
    "set_rules",
    "rules_set",
    "record_copies",
    "set_memory_capacity",
    "GpuOverheads",
    "HOPPER_CUBLAS_WORKSPACE",
    "set_gpu_overheads",
    "overheads_held",
    "PinnedMemoryStats",
    "pinned_memory_stats",
    "empty_pinned_cache",
    "copies_in_flight_bytes",
    "pinned_round_limit",
    "set_pinned_round_limit",
    "install",
    "is_installed",
]

# The C++ sources live beside the package (package data of roundpipe.testing).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INSTALL_LOCK = threading.Lock()
_late_error: RuntimeError | None = None  # installed too late (see _check_backward_threads)
_libraries: list[torch.library.Library] = []


def rules() -> Rules:
    """The rules in force. Any thread."""
    return STATE.rules


def set_rules(**changes: bool) -> Rules:
    """Switch rules by name (``set_rules(allocator_reuse=False)``); returns the previous
    :class:`Rules`, which ``set_rules(**dataclasses.asdict(previous))`` restores. Any thread,
    between steps: a rule switched while another thread runs ops on the device applies from
    that thread's next op on. ``cuda_autocast`` and ``event_queries`` need :func:`install`."""
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Rules)})
    if unknown:
        raise ValueError(
            f"unknown emulated-device rule(s) {unknown}; the rules are "
            f"{[f.name for f in dataclasses.fields(Rules)]}"
        )
    with _INSTALL_LOCK:
        previous = STATE.rules
        new = dataclasses.replace(previous, **{k: bool(v) for k, v in changes.items()})
        if STATE.installed:
            _apply_native_rules(new)
        STATE.rules = new
    return previous


@contextlib.contextmanager
def rules_set(**changes: bool) -> Iterator[Rules]:
    """Switch rules for the block (see :func:`set_rules`), then restore them; yields the rules
    in force inside. For tests."""
    previous = set_rules(**changes)
    try:
        yield STATE.rules
    finally:
        set_rules(**dataclasses.asdict(previous))


def _apply_native_rules(new: Rules) -> None:
    """The rules the native libraries carry (the caller holds _INSTALL_LOCK, after install)."""
    STATE.guard.roundpipe_emu_set_honest_queries(int(new.event_queries))
    STATE.guard.roundpipe_emu_set_stream_pool(int(new.stream_pool))
    STATE.guard.roundpipe_emu_set_pinned_cache(int(new.pinned_cache))
    set_cuda_autocast(new.cuda_autocast)


def is_installed() -> bool:
    """Whether :func:`install` has run in this process. Any thread."""
    return STATE.installed


def _extension_name(name: str) -> str:
    """The name torch builds the C++ library ``_{name}.cpp`` under: named by its source, so
    checkouts with different sources share torch's cache."""
    with open(os.path.join(_HERE, f"_{name}.cpp"), "rb") as f:
        return f"roundpipe_{name}_{hashlib.sha256(f.read()).hexdigest()[:16]}"


def _build_source(name: str) -> str:
    """The path ``_{name}.cpp`` is compiled from (see [Note: the build's source path] in
    roundpipe.native_build). The caller holds the build lock."""
    return build_source(_extension_name(name), os.path.join(_HERE, f"_{name}.cpp"))


def install() -> None:
    """Register the ``emu`` device in this process (idempotent; any thread). Builds its two C++
    libraries on first use (the guard in seconds, CUDA's autocast policy in about a minute of
    one core; cached under torch's extension directory; needs a C++ compiler and ninja). Must
    run before the process's first ``backward()``."""
    global _late_error
    with _INSTALL_LOCK:
        if _late_error is not None:
            raise RuntimeError(str(_late_error))
        if STATE.installed:
            return
        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
            raise RuntimeError(
                f"cannot install the emulated device: the PrivateUse1 backend is already "
                f"{torch._C._get_privateuse1_backend_name()!r} in this process"
            )

        def build(name: str) -> str:
            return load_library(_extension_name(name), os.path.join(_HERE, f"_{name}.cpp"))

        bind_native(build("emu_guard"), build("emu_autocast"))
        lenient = os.environ.get("ROUNDPIPE_EMU_LENIENT", "")
        names = [n.strip() for n in lenient.split(",") if n.strip()]
        try:
            STATE.rules = dataclasses.replace(STATE.rules, **dict.fromkeys(names, False))
        except TypeError:
            raise ValueError(
                f"ROUNDPIPE_EMU_LENIENT={lenient!r} names an unknown rule; the rules are "
                f"{[f.name for f in dataclasses.fields(Rules)]}"
            ) from None
        # The pinned allocator rounds as CUDA's would under the same allocator config.
        from roundpipe.devices.pinned import cuda_pinned_round_limit

        set_pinned_round_limit(cuda_pinned_round_limit())
        capacity = os.environ.get("ROUNDPIPE_EMU_MEMORY")
        if capacity:
            set_memory_capacity(int(capacity))
        torch.utils.rename_privateuse1_backend(NAME)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
        torch._register_device_module(NAME, DeviceModule())
        aten_lib = torch.library.Library("aten", "IMPL")
        any_lib = torch.library.Library("_", "IMPL")
        aten_lib.impl("empty.memory_format", empty, "PrivateUse1")
        aten_lib.impl("empty_strided", empty_strided, "PrivateUse1")
        for overload in RESIZING_FACTORIES:
            aten_lib.impl(overload, host_factory(overload), "PrivateUse1")
        aten_lib.impl("_copy_from", copy_from, "PrivateUse1")
        aten_lib.impl("dropout", dropout, "AutogradPrivateUse1")
        aten_lib.impl("scaled_dot_product_attention", attention, "AutogradPrivateUse1")
        # Ops on neither autocast list pass through; the lists are the rule's (_set_cuda_autocast).
        any_lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
        _libraries.extend((aten_lib, any_lib))
        _apply_native_rules(STATE.rules)
        STATE.installed = True
        try:
            _check_backward_threads()
        except RuntimeError as exc:
            _late_error = exc
            raise


def _check_backward_threads() -> None:
    """A backward on the device: it starts autograd's device threads if none ran yet, and fails
    if they started before the device existed (then emu backwards would fail later, less
    clearly)."""
    leaf = torch.ones(2).to(NAME).requires_grad_()
    try:
        (leaf * 2).sum().backward()
    except RuntimeError as exc:
        raise RuntimeError(
            "the emulated device was installed after this process's first backward(), so "
            "autograd has no thread for it; install it first: set ROUNDPIPE_DEVICES=emu before "
            "the process starts, or call roundpipe.testing.emu.install() before any backward"
        ) from exc
