"""What the emulated device's modules share: its name and device count, the native guard and
autocast libraries (bound by ``install``), the rules in force, and the host waits the guard
keeps (see [Note: emulated streams] in :mod:`roundpipe.testing.emu.streams`)."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch

__all__ = [
    "DEVICE_COUNT",
    "NAME",
    "STATE",
    "EmuState",
    "Rules",
    "StreamOrderError",
    "aten",
    "bind_native",
    "host_waits",
    "index_of",
    "known",
]

NAME = "emu"
# Must match kDeviceCount in _emu_guard.cpp.
DEVICE_COUNT = 4

aten = torch.ops.aten


class StreamOrderError(RuntimeError):
    """Two accesses to one emulated device's memory that no stream order, event or host wait
    puts in order: on a GPU they would race."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which of CUDA's stricter behaviours the emulated device imitates; all on by default (the
    test suite runs with every one), each switchable (:func:`set_rules`, :func:`rules_set`, or
    ``ROUNDPIPE_EMU_LENIENT=name,name`` at install) to see whether a failure comes from it.

    * ``allocator_reuse``: freed device memory goes back to the pool of the stream that
      allocated it, and an allocation on that stream raises :class:`StreamOrderError` if another
      stream may still use that memory (no ``record_stream``, no event or host wait); see
      [Note: emulated allocator reuse].
    * ``cuda_attention``: ``scaled_dot_product_attention`` runs the math path (and holds its
      scores) where CUDA would (``roundpipe.testing.cuda_attention.cuda_sdpa_backend``); see
      [Note: emulated attention].
    * ``cuda_autocast``: ``torch.autocast("emu")`` applies CUDA's cast policy, its fp32 and
      promote lists too; see [Note: emulated autocast].
    * ``event_queries``: ``Event.query()`` and ``Stream.query()`` say done only once the host
      has waited for that work; see [Note: emulated event queries].
    * ``reserved_memory``: ``memory_reserved`` and ``mem_get_info`` report the segments CUDA's
      caching allocator would hold and the overheads :func:`set_gpu_overheads` gives, not only
      the live storages; see [Note: emulated device memory].
    * ``stream_pool``: ``torch.Stream()`` hands out the 32 streams of a device round-robin, as
      CUDA's pool does, so a new stream may be one handed out before; see
      [Note: emulated stream pool].
    * ``pinned_cache``: freed pinned host blocks are kept for reuse by a request of their size,
      as CUDA's caching host allocator keeps them (:attr:`PinnedMemoryStats.cached_bytes`); see
      [Note: emulated pinned memory]."""

    allocator_reuse: bool = True
    cuda_attention: bool = True
    cuda_autocast: bool = True
    event_queries: bool = True
    reserved_memory: bool = True
    stream_pool: bool = True
    pinned_cache: bool = True


@dataclasses.dataclass
class EmuState:
    """The emulated device's process-wide state: ``guard`` and ``autocast``, the native
    libraries through ctypes (None until ``install`` binds them); ``rules``, the rules in force
    (replaced whole by ``set_rules``, read by any thread); ``installed``."""

    guard: Any = None
    autocast: Any = None
    rules: Rules = dataclasses.field(default_factory=Rules)
    installed: bool = False


STATE = EmuState()


def bind_native(path: str, autocast_path: str) -> None:
    """The guard's C functions that the dispatcher calls (see [Note: emulated streams]), and the
    autocast library's (see [Note: emulated autocast])."""
    autocast = ctypes.CDLL(autocast_path)
    autocast.roundpipe_emu_cuda_autocast.restype = ctypes.c_int
    autocast.roundpipe_emu_cuda_autocast.argtypes = [ctypes.c_int]
    autocast.roundpipe_emu_autocast_error.restype = ctypes.c_char_p
    autocast.roundpipe_emu_autocast_error.argtypes = []
    STATE.autocast = autocast
    lib = ctypes.CDLL(path)
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    for name, restype, argtypes in (
        ("roundpipe_emu_current_stream", i64, [i64]),
        ("roundpipe_emu_enqueue", i64, [i64, i64]),
        ("roundpipe_emu_known", i64, [i64, i64, i64, i64]),
        ("roundpipe_emu_host_known", i64, [i64, i64]),
        ("roundpipe_emu_enqueued", i64, [i64, i64]),
        ("roundpipe_emu_set_honest_queries", None, [ctypes.c_int]),
        ("roundpipe_emu_set_stream_pool", None, [ctypes.c_int]),
        ("roundpipe_emu_set_pinned_cache", None, [ctypes.c_int]),
        ("roundpipe_emu_empty_pinned_cache", None, []),
        ("roundpipe_emu_autograd_recorded", ctypes.c_int, [i64, i64]),
        ("roundpipe_emu_join", None, [i64, i64, i64, i64]),
        ("roundpipe_emu_host_waits", ctypes.c_int, [i64, i64]),
        ("roundpipe_emu_pending", i64, [ctypes.c_int, vp, vp, i64, i64, i64, i64]),
        ("roundpipe_emu_land", None, [i64]),
        ("roundpipe_emu_finished", ctypes.c_int, [i64]),
        ("roundpipe_emu_error", ctypes.c_char_p, []),
        ("roundpipe_emu_pinned_stats", None, [vp, ctypes.c_int]),
        ("roundpipe_emu_set_pinned_round_limit", None, [i64]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    STATE.guard = lib


def host_waits(stream: tuple[int, int]) -> None:
    """The host waits for ``stream`` (device, stream id); raises what the guard found pending."""
    if STATE.guard.roundpipe_emu_host_waits(stream[0], stream[1]):
        raise StreamOrderError(STATE.guard.roundpipe_emu_error().decode())


def known(stream: tuple[int, int], other: tuple[int, int]) -> int:
    """How far ``stream`` knows ``other`` done (a count of ``other``'s ops)."""
    return STATE.guard.roundpipe_emu_known(stream[0], stream[1], other[0], other[1])


def index_of(device: Any) -> int:
    """The emulated device index of ``device`` (None: the current one)."""
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0
