"""``manifest.json``: what a checkpoint directory holds, written last; and the checks that read
it back before a load changes anything (see [Note: the checkpoint format] in
:mod:`roundpipe.checkpoint.files`).

* :func:`write_manifest` / :func:`read_manifest`: the file itself.
* :func:`verify_files`: every file named, present, of its size and CRC-32, with the tensors
  the manifest indexes where it says they are.
* :func:`version_problems`: a checkpoint of a newer format or roundpipe than this one.
* :func:`list_checkpoints`: the complete checkpoints of a directory, oldest first.

Threads: any; nothing here is shared.
"""

from __future__ import annotations

import json
import os
import platform
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from roundpipe.checkpoint.files import (
    CheckpointFormatError,
    TensorEntry,
    file_crc32,
    read_header,
    sync_dir,
)

__all__ = [
    "MANIFEST",
    "FORMAT",
    "FORMAT_VERSION",
    "UNSHARDED_FORMAT_VERSION",
    "Checkpoint",
    "write_manifest",
    "read_manifest",
    "verify_files",
    "checksum_share",
    "version_problems",
    "list_checkpoints",
    "fsync_tree",
    "roundpipe_version",
]

MANIFEST = "manifest.json"
FORMAT = "roundpipe checkpoint"
# Raised when a change to the files means an older roundpipe could not read them. 2: sharded
# checkpoints (each rank's masters and optimizer state by name, see [Note: sharded checkpoints]
# in roundpipe.checkpoint.state), which an older roundpipe would misread; every other
# checkpoint is still written as 1, which older versions read.
FORMAT_VERSION = 2
UNSHARDED_FORMAT_VERSION = 1


def roundpipe_version() -> str:
    import roundpipe  # the package's own version, set in roundpipe/__init__.py

    return str(roundpipe.__version__)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` into ``directory`` (the last file of a checkpoint), fsynced;
    ``manifest`` may set ``format_version`` (default :data:`UNSHARDED_FORMAT_VERSION`)."""
    manifest = {
        "format": FORMAT,
        "format_version": UNSHARDED_FORMAT_VERSION,
        "roundpipe_version": roundpipe_version(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **manifest,
    }
    manifest["crc32"] = _body_crc32(manifest)
    data = json.dumps(manifest, indent=1).encode()
    with open(directory / MANIFEST, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _body_crc32(manifest: dict[str, Any]) -> int:
    """The CRC-32 of the manifest without its own ``crc32`` entry, as JSON written the one way
    (a flipped bit in a value that is still valid JSON is caught too)."""
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, indent=1).encode())


class Checkpoint:
    """A checkpoint directory and its parsed manifest. ``tensors``: key -> (file, entry, data
    start), filled by :func:`verify_files`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.tensors: dict[str, tuple[Path, TensorEntry, int]] = {}

    @property
    def sequence(self) -> int:
        return int(self.manifest.get("sequence", 0))

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, sequence {self.sequence})"


def read_manifest(path: Path) -> Checkpoint:
    """The checkpoint in ``path``; :class:`CheckpointFormatError` naming what is wrong if it
    has no manifest (an incomplete write never has one) or one that is not roundpipe's."""
    file = path / MANIFEST
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    if not file.exists():
        raise CheckpointFormatError(
            f"{path} has no {MANIFEST}: it is not a complete roundpipe checkpoint (a save that "
            f"did not finish never has one; load the directory that holds the checkpoints to "
            f"get the newest complete one); nothing was loaded"
        )
    try:
        manifest = json.loads(file.read_text())
    except ValueError as exc:
        raise CheckpointFormatError(
            f"{file} is not valid JSON ({exc}): corrupt; nothing was loaded"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointFormatError(
            f"{file} is not a roundpipe checkpoint manifest; nothing was loaded"
        )
    if "crc32" in manifest and manifest["crc32"] != _body_crc32(manifest):
        raise CheckpointFormatError(
            f"{file} does not match its checksum: its contents changed after it was written; "
            f"nothing was loaded"
        )
    return Checkpoint(path, manifest)


def version_problems(ckpt: Checkpoint) -> list[str]:
    """A checkpoint this roundpipe cannot read: a newer format, or a newer roundpipe (whose
    state this version may not know how to restore)."""
    m = ckpt.manifest
    problems = []
    if int(m.get("format_version", 0)) > FORMAT_VERSION:
        problems.append(
            f"it is in checkpoint format {m.get('format_version')}, written by roundpipe "
            f"{m.get('roundpipe_version')}; this roundpipe {roundpipe_version()} reads format "
            f"{FORMAT_VERSION} and older: upgrade roundpipe"
        )
    elif _version_tuple(str(m.get("roundpipe_version", "0"))) > _version_tuple(roundpipe_version()):
        problems.append(
            f"it was written by roundpipe {m.get('roundpipe_version')}, newer than this "
            f"roundpipe {roundpipe_version()}: upgrade roundpipe to load it"
        )
    return problems


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def checksum_share(ckpt: Checkpoint, rank: int, world: int) -> list[str]:
    """The files whose checksums process ``rank`` of ``world`` checks when they load the
    checkpoint together (every ``world``-th by name, from the ``rank``-th): each file is read
    by one of them. Pure."""
    return sorted(ckpt.manifest.get("files", {}))[rank::world]


def verify_files(
    ckpt: Checkpoint,
    on_bytes: Callable[[int], None] | None = None,
    share: tuple[int, int] | None = None,
    agree: Callable[[list[str]], list[str]] | None = None,
) -> None:
    """Every file the manifest names: present, of its size, of its CRC-32; every tensor the
    manifest indexes found in its shard. Raises :class:`CheckpointFormatError` listing each
    file missing, truncated or mismatched (by name). Reads every byte once.

    Processes that load one checkpoint together split the reading: with ``share`` (``(rank,
    world)``) this one checks the checksums of :func:`checksum_share`'s files only (every
    size still), and ``agree`` turns its problems into those of all of them (a collective),
    so that every process refuses the same damaged checkpoint alike."""
    problems = []
    files = ckpt.manifest.get("files", {})
    mine = set(checksum_share(ckpt, *share)) if share is not None else set(files)
    for name, info in files.items():
        file = ckpt.path / name
        if not file.exists():
            problems.append(f"{name} is missing" + _whose(name, ckpt.manifest))
            continue
        size = file.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            problems.append(f"{name} has {size} bytes, the manifest says {info['bytes']}: {what}")
            continue
        if name not in mine:
            continue
        crc = file_crc32(file, on_bytes)
        if crc != info["crc32"]:
            problems.append(
                f"{name} does not match its checksum (CRC-32 {crc:08x}, the manifest says "
                f"{info['crc32']:08x}): its contents changed after it was written (a bit flip, "
                f"an edit)"
            )
    if agree is not None:
        problems = agree(problems)
    if problems:
        raise CheckpointFormatError(
            f"checkpoint {ckpt.path} is damaged; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    shards: dict[str, tuple[dict[str, TensorEntry], int]] = {}
    for key, name in ckpt.manifest.get("tensors", {}).items():
        if name not in files:
            raise CheckpointFormatError(f"{ckpt.path}: tensor {key!r} is in {name}, not listed")
        if name not in shards:
            entries, _, start = read_header(ckpt.path / name)
            shards[name] = entries, start
        entries, start = shards[name]
        entry = entries.get(key)
        if entry is None:
            raise CheckpointFormatError(f"{ckpt.path / name} lacks tensor {key!r}")
        ckpt.tensors[key] = (ckpt.path / name, entry, start)


def _whose(name: str, manifest: dict[str, Any]) -> str:
    """Which rank wrote a file of a sharded checkpoint (see [Note: sharded checkpoints] in
    roundpipe.checkpoint.state), and how to get it back."""
    _, mark, rest = name.partition("-rank")
    if not manifest.get("sharded") or not mark or not rest[:5].isdigit():
        return ""
    rank = int(rest[:5])
    return (
        f" (rank {rank} of the {manifest.get('world_size')} that saved it wrote it, with its "
        f"share of the masters and optimizer state: copy it from where rank {rank} wrote the "
        f"checkpoint, if that was another machine's disk, or load an earlier checkpoint)"
    )


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints directly in ``root`` (a directory with a roundpipe manifest
    under a name that does not start with a dot), oldest (lowest sequence) first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not (child / MANIFEST).is_file():
            continue
        try:
            found.append(read_manifest(child))
        except CheckpointFormatError:
            continue
    return sorted(found, key=lambda c: (c.sequence, c.path.name))


def fsync_tree(directory: Path) -> None:
    """fsync every file in ``directory`` (recursively) and the directories themselves: for
    files another library wrote (the HuggingFace export)."""
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(Path(dirpath))
