"""The emulated device's tensors and ops: :class:`EmuTensor` and its ``__torch_dispatch__``
(the device check, the stream order of each op, host copies), the factories the backend
registers, and ``torch.emu`` (:class:`DeviceModule`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from roundpipe.testing.emu import memory, streams
from roundpipe.testing.emu.kernels import DEVICE_KERNELS
from roundpipe.testing.emu.native import DEVICE_COUNT, NAME, aten, host_waits

__all__ = [
    "RESIZING_FACTORIES",
    "Copy",
    "DeviceModule",
    "EmuTensor",
    "copy_from",
    "empty",
    "empty_strided",
    "host_factory",
    "record_copies",
]

# Ops that take host tensors next to device tensors on CUDA too: copies between devices, and
# indexing with host index tensors.
_CROSS_DEVICE_OK = frozenset(
    {
        aten.copy_.default,
        aten._to_copy.default,
        aten.index.Tensor,
        aten.index_put_.default,
        aten.index_put.default,
        aten._index_put_impl_.default,
    }
)


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy between the host and an emulated device, as :func:`record_copies` logs it.

    ``direction``: ``"h2d"`` or ``"d2h"``; ``host_ptr``: the data pointer of the host tensor,
    its first element (tensors of one pinned pool share a storage, not this): for an upload,
    what was read; for a download into an existing tensor, what was written; None for a
    download that made a new tensor. ``device``: the emulated device's index; ``stream_id``:
    the stream current on it when the copy was made (stream ids are per device, as CUDA's)."""

    direction: str
    host_ptr: int | None
    numel: int
    dtype: torch.dtype
    pinned: bool
    stream_id: int
    device: int = 0


_copy_logs: list[list[Copy]] = []


@contextlib.contextmanager
def record_copies() -> Iterator[list[Copy]]:
    """Log every copy between the host and an emulated device made inside the block (by any
    thread) into the list it yields. Main thread; for tests that count transfers."""
    log: list[Copy] = []
    _copy_logs.append(log)
    try:
        yield log
    finally:
        _copy_logs.remove(log)


def _log_copy(direction: str, host: torch.Tensor | None, emu: torch.Tensor) -> None:
    entry = Copy(
        direction,
        None if host is None else host.data_ptr(),
        emu.numel(),
        emu.dtype,
        host is not None and host.is_pinned(),
        torch.accelerator.current_stream(emu.device).stream_id,
        emu.device.index or 0,
    )
    for log in _copy_logs:
        log.append(entry)  # list.append is atomic: workers may log at once


def _asynchronous_host(t: Any, non_blocking: bool) -> bool:
    """Whether a copy between the device and host tensor ``t`` is asynchronous, as on CUDA:
    non-blocking, pinned, and (here) one contiguous block."""
    return (
        non_blocking
        and isinstance(t, torch.Tensor)
        and t.numel() > 0
        and t.is_pinned()
        and t.is_contiguous()
    )


def _same_device_error(func: Any, a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two "
        f"devices, {a} and {b}! (when checking arguments for {func})"
    )


class EmuTensor(torch.Tensor):
    """A tensor on ``emu:<index>``: a wrapper whose data is the CPU tensor ``_elem``."""

    _elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, index: int = 0) -> EmuTensor:
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise AssertionError(
                f"an emu tensor wraps a plain CPU tensor, got {type(elem)} on "
                f"{elem.device}; please report"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=torch.device(NAME, index),
            requires_grad=elem.requires_grad,
        )
        out._elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self._elem!r} (on {self.device})"

    # Storage identity, as code that checks aliasing reads it on CUDA tensors.
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._elem.untyped_storage()

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.record_stream.default:  # nothing to compute: the allocator's business
            if isinstance(args[0], EmuTensor) and args[0].numel() > 0:
                streams.record_stream(args[0].untyped_storage().data_ptr(), args[1])
            return None
        leaves = pytree.tree_leaves((args, kwargs))
        index = _check_devices(func, leaves)
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            EmuTensor, lambda t: t._elem, (args, kwargs)
        )
        non_blocking = bool(
            kwargs.get("non_blocking", False)
            or (func is aten.copy_.default and len(args) > 2 and args[2])
        )
        stream = streams.current(index)
        # A copy between two devices runs on the source's current stream, between two
        # barriers with the destination's (``peer``), as torch's does.
        peer: tuple[int, int] | None = None
        download_into: torch.Tensor | None = None  # a host tensor this op copies into
        upload_from: torch.Tensor | None = None  # a host tensor this op copies from
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, EmuTensor) and not isinstance(src, EmuTensor):
                upload_from = src
                if _copy_logs:
                    _log_copy("h2d", src, dst)
            elif isinstance(src, EmuTensor) and not isinstance(dst, EmuTensor):
                download_into = dst
                stream = streams.current(src.device.index)
                if _copy_logs:
                    _log_copy("d2h", dst, src)
            elif isinstance(src, EmuTensor) and src.device != dst.device:
                peer, stream = stream, streams.current(src.device.index)
        elif func is aten._to_copy.default and not isinstance(args[0], EmuTensor):
            upload_from = args[0]
        target = unwrapped_kwargs.get("device")
        if target is not None:
            target = torch.device(target)
            if target.type == "cpu":  # a copy to the host: hand out the plain tensor
                if _copy_logs and func is aten._to_copy.default:
                    _log_copy("d2h", None, args[0])
                return _to_host(
                    func,
                    args,
                    kwargs,
                    unwrapped_args,
                    unwrapped_kwargs,
                    leaves,
                    stream,
                    non_blocking,
                )
            if isinstance(args[0], EmuTensor) and (target.index or 0) != index:
                peer = streams.current(target.index or 0)
            index = target.index or 0
            unwrapped_kwargs["device"] = torch.device("cpu")
        if "pin_memory" in unwrapped_kwargs:
            unwrapped_kwargs["pin_memory"] = False
        if peer is not None:
            streams.join(stream, peer)  # the destination's current stream is done with its memory
        count, touched = streams.enqueue(func, args, kwargs, leaves, stream, _is_emu)
        if peer is not None:
            streams.join(stream, peer)  # and waits for the copy
        if upload_from is not None and streams.landing_pending() and upload_from.is_pinned():
            streams.land_downloads(func, upload_from, stream)
        if download_into is not None:
            if _asynchronous_host(download_into, non_blocking):
                snapshot = torch.empty_like(download_into).copy_(unwrapped_args[1])
                streams.async_download(download_into, snapshot, stream, count)
                return download_into
            host_waits(stream)  # a blocking copy: the host waits, then the bytes land
        out = DEVICE_KERNELS.get(func, func)(*unwrapped_args, **unwrapped_kwargs)
        if upload_from is not None and _asynchronous_host(upload_from, non_blocking):
            streams.watch_upload(upload_from, stream, count)
        memory.note_matmul(func, stream)
        outputs = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
        if not all(isinstance(t, torch.Tensor) or t is None for t in outputs):
            host_waits(stream)  # a number for the host: .item() and the like
        # An in-place or out= op returns one of its arguments: hand back that very object.
        mine: dict[int, torch.Tensor] = {}
        for t in leaves:
            if isinstance(t, EmuTensor):
                mine[id(t._elem)] = t
            elif isinstance(t, torch.Tensor):
                mine[id(t)] = t
        streams.record_outputs(func, outputs, leaves, touched, stream, count, index)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: mine[id(t)] if id(t) in mine else EmuTensor(t, index), out
        )


def _to_host(
    func: Any,
    args: Any,
    kwargs: dict[str, Any],
    unwrapped_args: Any,
    unwrapped_kwargs: dict[str, Any],
    leaves: list[Any],
    stream: tuple[int, int],
    non_blocking: bool,
) -> torch.Tensor:
    """``tensor.to("cpu")``: blocking, the host waits for the stream; non-blocking, the result
    is pinned, as on CUDA, and holds poison until the host waits for the copy."""
    count, _ = streams.enqueue(func, args, kwargs, leaves, stream, _is_emu)
    if not non_blocking:
        out = func(*unwrapped_args, **unwrapped_kwargs)
        host_waits(stream)
        return out
    unwrapped_kwargs = dict(unwrapped_kwargs, pin_memory=False)
    source = func(*unwrapped_args, **unwrapped_kwargs).contiguous()  # a fresh copy: the snapshot
    host = torch.empty_like(source, pin_memory=True)
    streams.async_download(host, source, stream, count)
    return host


def _check_devices(func: Any, leaves: list[Any]) -> int:
    """The emu device index of the op, after CUDA's same-device check."""
    index: int | None = None
    host: torch.Tensor | None = None
    for t in leaves:
        if isinstance(t, EmuTensor):
            i = t.device.index
            if index is None:
                index = i
            elif i != index and func not in _CROSS_DEVICE_OK:
                raise _same_device_error(func, torch.device(NAME, index), t.device)
        elif isinstance(t, torch.Tensor) and t.dim() > 0 and host is None:
            host = t
    if host is not None and index is not None and func not in _CROSS_DEVICE_OK:
        raise _same_device_error(func, torch.device(NAME, index), host.device)
    return 0 if index is None else index


def _device_index(kwargs: dict[str, Any]) -> int:
    device = kwargs.get("device")
    return 0 if device is None else (torch.device(device).index or 0)


def empty(size: Any, **kwargs: Any) -> EmuTensor:
    """``aten::empty.memory_format`` on the emulated device."""
    index = _device_index(kwargs)
    kwargs.update(device="cpu", pin_memory=False)
    elem = aten.empty.memory_format(size, **kwargs)
    streams.allocated(elem, index, aten.empty.memory_format)
    return EmuTensor(elem, index)


def empty_strided(size: Any, stride: Any, **kwargs: Any) -> EmuTensor:
    """``aten::empty_strided`` on the emulated device."""
    index = _device_index(kwargs)
    kwargs.update(device="cpu", pin_memory=False)
    elem = aten.empty_strided(size, stride, **kwargs)
    streams.allocated(elem, index, aten.empty_strided.default)
    return EmuTensor(elem, index)


# Factories whose ATen kernel makes an empty tensor and fills it through their out= overload,
# which resizes it: a wrapper's shape cannot change, so on the emulated device they would hand
# back a 0-element wrapper around the filled storage. They run on the host and are wrapped.
RESIZING_FACTORIES = ("arange", "arange.start", "arange.start_step", "eye", "eye.m")


def host_factory(overload: str) -> Any:
    op = getattr(aten, overload.split(".")[0])
    op = getattr(op, overload.split(".")[1] if "." in overload else "default")

    def factory(*args: Any, **kwargs: Any) -> EmuTensor:
        index = _device_index(kwargs)
        kwargs.update(device="cpu", pin_memory=False)
        elem = op(*args, **kwargs)
        streams.allocated(elem, index, op)
        return EmuTensor(elem, index)

    factory.__name__ = f"_{overload.replace('.', '_')}"
    return factory


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::_copy_from`` on the emulated device. ``torch.tensor(data, device="emu")`` copies
    its host data with the Python dispatch key excluded, so the copy reaches the backend's kernel
    rather than :meth:`EmuTensor.__torch_dispatch__`; it is handed to the same copy there."""
    return EmuTensor.__torch_dispatch__(aten.copy_.default, (EmuTensor,), (dst, src, non_blocking))


class DeviceModule:
    """``torch.emu``: what ``torch.amp``, ``torch.utils.checkpoint``, ``torch.random.fork_rng``
    and ``torch.get_device_module`` look up. Random ops on emu tensors draw from the CPU
    generator, so the "device" generator state is the CPU one."""

    _initialized = True
    Stream = torch.Stream
    Event = torch.Event

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def _lazy_init() -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return DEVICE_COUNT

    @staticmethod
    def current_device() -> int:
        return torch.accelerator.current_device_index()

    @staticmethod
    def set_device(device: Any) -> None:
        torch.accelerator.set_device_index(device)

    @staticmethod
    def device(device: Any) -> contextlib.AbstractContextManager:
        return torch.accelerator.device_index(
            torch.device(NAME, device).index if not isinstance(device, int) else device
        )

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        # torch.manual_seed calls this after seeding the CPU generator, which emu ops draw from.
        return None

    @staticmethod
    def current_stream(device: Any = None) -> torch.Stream:
        return torch.accelerator.current_stream(device)

    @staticmethod
    def stream(stream: torch.Stream) -> torch.Stream:
        return stream  # torch.Stream is its own context manager

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.accelerator.synchronize(device)

    # Memory, as torch.cuda reports it (see [Note: emulated device memory]).
    memory_allocated = staticmethod(memory.memory_allocated)
    memory_reserved = staticmethod(memory.memory_reserved)
    max_memory_reserved = staticmethod(memory.max_memory_reserved)
    max_memory_allocated = staticmethod(memory.max_memory_allocated)
    reset_peak_memory_stats = staticmethod(memory.reset_peak_memory_stats)
    empty_cache = staticmethod(memory.empty_cache)
    planning_overheads = staticmethod(memory.planning_overheads)
    mem_get_info = staticmethod(memory.mem_get_info)


def _is_emu(t: Any) -> bool:
    return isinstance(t, EmuTensor)
