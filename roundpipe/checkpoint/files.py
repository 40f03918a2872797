"""The files of a checkpoint: safetensors shards written and read without an intermediate copy,
the tagged JSON that holds everything that is not a tensor, and the directory's life cycle
(a temporary name, renamed when complete; removal by renaming first).

* :class:`ShardWriter`: one safetensors file, written tensor by tensor straight from the
  tensors' memory, with its size and CRC-32 (see [Note: the checkpoint format]).
* :func:`read_header`, :func:`read_into`, :func:`file_crc32`: read a shard's index, read one
  tensor into a tensor that is already there, check a whole file.
* :func:`encode` / :func:`decode`: a tree of dicts, lists, tuples, numbers, strings and tensors
  as JSON, its tensors replaced by keys (the shards hold them).
* :func:`sync_dir`, :func:`remove_dir`: durability of a rename, and a removal a crash cannot
  leave half done under the directory's own name.

Threads: pure functions and objects touched by one thread at a time (the writer thread, or the
main thread while loading).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointFormatError",
    "ShardWriter",
    "TensorEntry",
    "pack",
    "read_header",
    "read_into",
    "file_crc32",
    "encode",
    "decode",
    "tensor_keys",
    "sync_dir",
    "remove_dir",
    "DTYPE_NAMES",
    "CHUNK_BYTES",
]


# [Note: the checkpoint format]
# A checkpoint is a directory. ``manifest.json`` names every other file with its size in bytes
# and its CRC-32, the roundpipe and format versions, the model's tensors (name, dtype, shape)
# and, as tagged JSON (``encode``), everything that is not a tensor: the optimizer's param
# groups and the skeleton of its state, the scheduler, the scaler, the RNG states, the user's
# ``extra``. The tensors are in safetensors files (the standard layout: an 8-byte little-endian
# header length, a JSON header of dtype, shape and byte offsets per tensor, then the bytes), one
# group of shards per kind of state (model, masters, optimizer, gradients, one small file per
# data-parallel rank), each shard closed at ``max_shard_bytes``. Any safetensors reader opens
# them; roundpipe writes and reads them itself so that a tensor goes from its own memory to the
# file and back without a copy (the state may be most of the host's RAM). CRC-32 (zlib) finds
# truncation and accidental corruption, at about twice the speed of SHA-256 here; it is no
# defence against tampering.
# The directory is written under a temporary name beside its final one (``.NAME.tmp-PID``),
# every file fsynced, ``manifest.json`` last, then renamed to ``NAME`` and the parent directory
# fsynced: a checkpoint that has its name is complete, and a crash at any moment leaves the
# earlier checkpoints as they were. Old checkpoints are removed by renaming them to a hidden
# name first (``remove_dir``).


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be loaded as it is: a file missing, truncated or corrupt, a
    manifest that is not roundpipe's, or state that does not match the model it is loaded
    into. The message names the file or the tensor and what differs; nothing was changed."""


# safetensors' dtype names.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# Bytes written or read per system call (and per progress report).
CHUNK_BYTES = 64 << 20


class TensorEntry:
    """One tensor of a shard's header: its dtype, shape and byte range in the file."""

    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a memoryview of its own memory (a copy only for a tensor
    that is not contiguous or not on the CPU, which roundpipe's state never is)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardWriter:
    """Write one safetensors file: the header for ``tensors`` (name -> tensor, in file order),
    then each tensor's bytes straight from its memory. ``size`` and ``crc32`` describe the file
    once :meth:`write` returned. ``on_bytes(n)`` is called after each chunk (progress)."""

    def __init__(
        self, path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]
    ):
        self.path = path
        self.tensors = tensors
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, t in tensors:
            dtype = DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise TypeError(
                    f"tensor {name!r} has dtype {t.dtype}, which a checkpoint cannot hold "
                    f"(it holds {', '.join(str(d).replace('torch.', '') for d in DTYPE_NAMES)})"
                )
            size = _nbytes(t)
            header[name] = {
                "dtype": dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.header = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.header) + offset
        self.crc32 = 0

    def write(self, on_bytes: Callable[[int], None] | None = None) -> None:
        crc = zlib.crc32(self.header)
        with open(self.path, "wb", buffering=0) as f:
            _write_all(f, memoryview(self.header))
            for _, t in self.tensors:
                data = _as_bytes(t)
                for start in range(0, len(data), CHUNK_BYTES):
                    chunk = data[start : start + CHUNK_BYTES]
                    _write_all(f, chunk)
                    crc = zlib.crc32(chunk, crc)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            os.fsync(f.fileno())
        self.crc32 = crc


def pack(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """A small safetensors file as bytes (a data-parallel rank's state, sent to rank 0)."""
    shard = ShardWriter(Path(), tensors, metadata)
    return b"".join([shard.header, *(bytes(_as_bytes(t)) for _, t in tensors)])


def _write_all(f: Any, data: memoryview) -> None:
    while len(data):
        n = f.write(data)
        data = data[n:]


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """A shard's tensors (name -> entry, byte ranges relative to the data start), its
    metadata, and where its data starts. Raises :class:`CheckpointFormatError` naming the file
    if it is not a safetensors file or its ranges run past its end."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(f"{path}: {size} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise CheckpointFormatError(
                f"{path}: its header says {length} bytes, the file has {size}: truncated"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointFormatError(f"{path}: its header is not JSON ({exc})") from None
    metadata = header.pop("__metadata__", {}) or {}
    entries = {}
    data_start = 8 + length
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype"))
        begin, end = info.get("data_offsets", (0, -1))
        shape = tuple(int(n) for n in info.get("shape", ()))
        if dtype is None or end < begin or data_start + end > size:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} ({info}) does not fit in the file's {size} bytes"
            )
        if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} has {end - begin} bytes for {info}"
            )
        entries[name] = TensorEntry(dtype, shape, begin, end)
    return entries, metadata, data_start


def read_into(
    f: Any, data_start: int, entry: TensorEntry, out: torch.Tensor, on_bytes: Any = None
) -> None:
    """Read one tensor of an open shard into ``out`` (a contiguous CPU tensor of its dtype and
    size), chunk by chunk, without an intermediate copy."""
    view = _as_bytes(out)
    assert len(view) == entry.end - entry.begin and out.is_contiguous(), "please report"
    f.seek(data_start + entry.begin)
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + CHUNK_BYTES])
        if not n:
            raise CheckpointFormatError(f"{f.name}: ends inside tensor data: truncated")
        done += n
        if on_bytes is not None:
            on_bytes(n)


def file_crc32(path: Path, on_bytes: Callable[[int], None] | None = None) -> int:
    """The CRC-32 of a whole file, read in chunks into one reused buffer."""
    crc = 0
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)
            if on_bytes is not None:
                on_bytes(n)


# -- tagged JSON -------------------------------------------------------------------------------

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__", "__dtype__")


def encode(value: Any, tensors: dict[str, torch.Tensor], key: str, where: str) -> Any:
    """``value`` as JSON, each tensor replaced by ``{"__tensor__": its key}`` and added to
    ``tensors`` (keys derived from ``key``). Raises ``TypeError`` naming ``where`` for a value
    a checkpoint cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout is not torch.strided:
            raise TypeError(f"{where}: a {value.layout} tensor cannot be stored in a checkpoint")
        tensors[key] = value
        return {"__tensor__": key}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if isinstance(value, tuple):
        return {
            "__tuple__": [
                encode(v, tensors, f"{key}/{i}", f"{where}[{i}]") for i, v in enumerate(value)
            ]
        }
    if isinstance(value, list):
        return [encode(v, tensors, f"{key}/{i}", f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {
                k: encode(v, tensors, f"{key}/{k}", f"{where}[{k!r}]") for k, v in value.items()
            }
        pairs = []
        for i, (k, v) in enumerate(value.items()):
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"{where}: a dict key of type {type(k).__name__} cannot be stored")
            pairs.append(
                [
                    encode(k, tensors, f"{key}/k{i}", where),
                    encode(v, tensors, f"{key}/{i}", f"{where}[{k!r}]"),
                ]
            )
        return {"__dict__": pairs}
    hint = ""
    if isinstance(value, torch.Generator):
        hint = ": store its state, generator.get_state(), and set_state() it after loading"
    elif callable(getattr(value, "state_dict", None)):
        hint = ": store its state_dict()"
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
        f"cannot hold (it holds tensors, numbers, strings, bools, None, lists, tuples and dicts)"
        + hint
    )


def decode(value: Any, tensor: Callable[[str], Any]) -> Any:
    """The inverse of :func:`encode`; ``tensor(key)`` gives each tensor (or a stand-in for it)."""
    if isinstance(value, list):
        return [decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "__tensor__":
            return tensor(inner)
        if tag == "__tuple__":
            return tuple(decode(v, tensor) for v in inner)
        if tag == "__float__":
            return float(inner)
        if tag == "__dtype__":
            return getattr(torch, inner)
        if tag == "__dict__":
            return {_hashable(decode(k, tensor)): decode(v, tensor) for k, v in inner}
    return {k: decode(v, tensor) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def tensor_keys(value: Any) -> Iterator[str]:
    """The tensor keys an encoded tree refers to."""
    if isinstance(value, list):
        for v in value:
            yield from tensor_keys(v)
    elif isinstance(value, dict):
        if len(value) == 1 and "__tensor__" in value:
            yield value["__tensor__"]
        else:
            for v in value.values():
                yield from tensor_keys(v)


# -- directories -------------------------------------------------------------------------------


def sync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Remove a checkpoint directory: renamed to a hidden name first (one atomic step), so a
    crash during the removal never leaves a partial checkpoint under the name."""
    trash = path.with_name(f".{path.name}.removing-{os.getpid()}")
    os.replace(path, trash)
    sync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)
