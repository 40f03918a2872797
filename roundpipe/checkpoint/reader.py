"""``roundpipe.checkpoint.load``: put a checkpoint back, checked in full before anything changes.

Order: find the checkpoint (the newest complete one of a directory of checkpoints), read its
manifest, check its files (each present, of its size and checksum) and versions, check that
it fits the model, the optimizer, the scheduler and the scaler given, read what goes into new
tensors (the gradients, the optimizer's and the scheduler's state, this rank's RNG state and
``extra``); only then, on the optimizer thread behind every launched item and every checkpoint
still being written, read the model's tensors and the masters in place and load the optimizer
and the scheduler; then, on the main thread, the scaler and the RNG states.

Threads: :func:`load` and :func:`latest` on the main thread.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from roundpipe.checkpoint import named
from roundpipe.checkpoint.files import (
    DTYPE_NAMES,
    CheckpointFormatError,
    decode,
    read_header,
    read_into,
    tensor_keys,
)
from roundpipe.checkpoint.manifest import (
    MANIFEST,
    Checkpoint,
    checksum_share,
    list_checkpoints,
    read_manifest,
    verify_files,
    version_problems,
)
from roundpipe.checkpoint.progress import listener as progress_listener
from roundpipe.checkpoint.state import (
    check_components,
    check_model,
    check_optimizer,
    check_state_kind,
    refuse,
    restore_on_main_thread,
    restore_on_optimizer_thread,
)
from roundpipe.distributed import exchange
from roundpipe.distributed import group as dp_group
from roundpipe.main_thread import check_main_thread
from roundpipe.threads import optimizer_thread

__all__ = ["load", "latest"]


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``root`` (highest sequence), None if there is none
    (or no ``root``). Temporary directories of unfinished saves are never returned. Any
    thread; reads the manifests."""
    found = list_checkpoints(Path(root))
    return found[-1].path if found else None


def load(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: Any = None,
    scheduler: Any = None,
    strict: bool = True,
    progress: bool | Any = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`roundpipe.checkpoint.save` into ``model`` and the
    parts given; returns the ``extra`` dict saved with it (this rank's, under data
    parallelism). ``path`` is a checkpoint directory, or a directory of them (the newest
    complete one is loaded).

    Everything is checked before anything changes: the manifest; every file present, of the
    size and CRC-32 it was written with; the checkpoint's format and roundpipe version not
    newer than this one; the model's tensors and masters (names, shapes, dtypes) and the
    optimizer's param groups as in the checkpoint; with ``strict`` (default), a scaler,
    scheduler and optimizer given exactly where the checkpoint has their state. A refusal
    raises :class:`CheckpointFormatError` naming each file missing, truncated or corrupt, or
    each tensor that differs, and leaves the model, its masters, the optimizer and the rest as
    they were. The resumed run continues bit for bit as the saved one would have (same device
    pool and world size).

    A checkpoint taken with sharded state (:class:`roundpipe.distributed.ShardedState`) on N
    ranks loads on M sharded ranks or on one process with every master, and a checkpoint with
    every master loads on M sharded ranks: each process reads the masters and optimizer state
    (matched by parameter name) of the parameters it holds, from whichever files hold them (see
    [Note: sharded checkpoints] in :mod:`roundpipe.checkpoint.state`). A sharded model loads
    on every rank, after its :class:`roundpipe.distributed.DataParallel` is attached.

    ``progress``: a progress bar (tqdm, if installed) for a checkpoint of 64 MiB or more, or a
    callable given ``(bytes done, bytes total)``. Main thread; waits for the optimizer thread
    (and a checkpoint still being written) first, and re-raises a failure of the model's
    launched work before loading.
    """
    check_main_thread("load", owner="roundpipe.checkpoint")
    if not callable(getattr(model, "state_access", None)):
        raise TypeError(f"load() takes a roundpipe.RoundPipe, got {type(model).__name__}")
    model.state_access().params.placement.check_checkpoint("load")
    ckpt = _find(Path(path))
    where = f"checkpoint {ckpt.path}"
    refuse(version_problems(ckpt), where)
    m = ckpt.manifest
    files = m.get("files", {})
    total = sum(info["bytes"] for info in files.values())
    # Sharded, the ranks load together and each checks the checksums of a share of the files.
    placement = model.state_access().params.placement
    share = (placement.rank, placement.world_size) if placement.world_size > 1 else None
    checked = sum(files[n]["bytes"] for n in checksum_share(ckpt, *share)) if share else total
    listener = progress_listener(progress, f"loading {ckpt.path.name}", checked + total)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if listener is not None:
            listener(done[0], checked + total)

    def agree(problems: list[str]) -> list[str]:
        return exchange.union_over_ranks(problems, "the checks of the checkpoint's files")

    try:
        verify_files(ckpt, advance, share, agree if share else None)
        access = model.state_access()
        tree = m.get("state", {})
        problems = check_model(m["model"], access, where)
        if strict:
            problems += check_components(tree, optimizer, scheduler, scaler, where)
        sharded_here = access.params.placement.world_size > 1
        by_name = None
        if optimizer is not None and ("optimizer_by_name" in tree or sharded_here):
            by_name, found = _named_optimizer_state(tree, optimizer, access, where)
            problems += found
        else:
            problems += check_optimizer(tree, optimizer, decode, where)
        if sharded_here and tree.get("pending_grads"):
            problems.append(
                f"{where} was saved between forward_backward and step; a model with "
                f"ShardedState resumes from a checkpoint saved after scaler.update() (or load "
                f"this one with the placement and ranks it was saved with)"
            )
        problems += _check_tensors(ckpt, m["model"], access)
        refuse(problems, where)
        access.params.synchronize()  # the model's own failures first, as load_state_dict

        reader = _Reader(ckpt, advance)
        try:
            held = access.params.masters
            grads = {
                name: reader.load(f"grads/{name}")
                for name in tree.get("grad_names", [])
                if name in held
            }
            if by_name is not None:
                optimizer_state = named.resolve(by_name, reader.load)
            elif optimizer is not None and "optimizer" in tree:
                optimizer_state = decode(tree["optimizer"], reader.load)
            else:
                optimizer_state = None
            scheduler_state = (
                decode(tree["scheduler"], reader.load)
                if scheduler is not None and "scheduler" in tree
                else None
            )
            scaler_state = decode(tree["scaler"], reader.load) if "scaler" in tree else None
            rank_state = _rank_state(ckpt)
            # Everything that changes the model runs behind whatever was launched (a write
            # still holding the masters included: see [Note: holds] in roundpipe.threads.optimizer_thread).
            item = optimizer_thread.launch_work(
                restore_on_optimizer_thread,
                (
                    access,
                    reader.read,
                    m["model"],
                    grads,
                    optimizer,
                    optimizer_state,
                    scheduler,
                    scheduler_state,
                ),
                owners=(model,),
            )
            item.wait()
        finally:
            reader.close()
        restore_on_main_thread(
            access,
            scaler,
            scaler_state,
            rank_state["rng"],
            bool(tree.get("pending_grads", False)),
        )
        return rank_state["extra"]
    finally:
        close = getattr(listener, "close", None)
        if close is not None:
            close()


def _find(path: Path) -> Checkpoint:
    """The checkpoint ``path`` names: itself (it has a manifest, or shards: an incomplete
    one, refused by name), or the newest complete one in it."""
    if (path / MANIFEST).exists() or not path.is_dir() or any(path.glob("*.safetensors")):
        return read_manifest(path)
    found = list_checkpoints(path)
    if not found:
        incomplete = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise FileNotFoundError(
            f"no complete roundpipe checkpoint in {path}"
            + (f" (directories without a manifest: {', '.join(incomplete)})" if incomplete else "")
        )
    return found[-1]


def _named_optimizer_state(
    tree: dict[str, Any], optimizer: Any, access: Any, where: str
) -> tuple[dict[str, Any] | None, list[str]]:
    """The state dict of ``optimizer`` (its tensors as :class:`named.Key`, read later) out of
    the checkpoint's optimizer state by master name, with this process's share only (see
    [Note: sharded checkpoints] in :mod:`roundpipe.checkpoint.state`); or the problems."""
    if "optimizer_by_name" in tree:
        saved = decode(tree["optimizer_by_name"], named.Key)
    elif "optimizer" in tree:
        if "optimizer_params" not in tree:
            return None, [
                f"{where} names its optimizer state by number only (an older roundpipe wrote "
                f"it): load it into a model with the placement it was saved with"
            ]
        saved = named.by_name(decode(tree["optimizer"], named.Key), tree["optimizer_params"])
    else:
        return None, []
    try:
        names = named.param_names(optimizer, access.params.masters)
    except ValueError as exc:
        return None, [str(exc)]
    found = named.problems(saved, optimizer, names, where)
    if found:
        return None, found
    state = named.for_optimizer(named.keep(saved, names), optimizer, names)
    found = check_state_kind(state, optimizer, where)
    return (None, found) if found else (state, [])


def _check_tensors(ckpt: Checkpoint, description: dict[str, Any], access: Any) -> list[str]:
    """Every tensor the load will read in place is in the files, of the model's dtype and
    shape; every tensor a decoded state refers to is in the files."""
    problems = []
    live = access.module.state_dict(keep_vars=True)
    wanted = [(f"model/{row[0]}", live.get(row[0])) for row in description["tensors"]]
    wanted += [(f"masters/{n}", m) for n, m in access.params.masters.items()]
    for key, t in wanted:
        found = ckpt.tensors.get(key)
        if found is None:
            problems.append(f"tensor {key!r} is not in the checkpoint's files")
            continue
        entry = found[1]
        if t is not None and (entry.dtype != t.dtype or tuple(entry.shape) != tuple(t.shape)):
            problems.append(
                f"tensor {key!r} is {DTYPE_NAMES.get(entry.dtype)} {entry.shape} in "
                f"{found[0].name}, {DTYPE_NAMES.get(t.dtype)} {tuple(t.shape)} in this model"
            )
    tree = ckpt.manifest.get("state", {})
    for key in tensor_keys(tree):
        if key not in ckpt.tensors:
            problems.append(f"tensor {key!r} is not in the checkpoint's files")
    return problems


def _rank_state(ckpt: Checkpoint) -> dict[str, Any]:
    """This rank's RNG state and ``extra`` (rank 0's if the checkpoint has fewer ranks)."""
    ranks = ckpt.manifest.get("ranks", [])
    dp = dp_group.data_parallel_rank()
    rank = 0 if dp is None or dp[0] >= len(ranks) else dp[0]
    file = ckpt.path / ranks[rank]
    entries, metadata, start = read_header(file)
    tensors = {}
    with open(file, "rb", buffering=0) as f:
        for key, entry in entries.items():
            t = torch.empty(entry.shape, dtype=entry.dtype)
            read_into(f, start, entry, t)
            tensors[key] = t
    try:
        tree = json.loads(metadata["state"])
    except (KeyError, ValueError):
        raise CheckpointFormatError(f"{file} holds no rank state") from None
    return decode(tree, tensors.__getitem__)


class _Reader:
    """Reads tensors of a verified checkpoint: in place (:meth:`read`, any thread) or into new
    tensors (:meth:`load`). Keeps each shard open until :meth:`close`."""

    def __init__(self, ckpt: Checkpoint, advance: Any) -> None:
        self._ckpt = ckpt
        self._advance = advance
        self._open: dict[Path, Any] = {}

    def _file(self, path: Path) -> Any:
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = open(path, "rb", buffering=0)  # noqa: SIM115 -- closed by close()
        return f

    def read(self, key: str, into: torch.Tensor) -> None:
        path, entry, start = self._ckpt.tensors[key]
        if into.is_contiguous() and into.device.type == "cpu":
            read_into(self._file(path), start, entry, into, self._advance)
        else:
            value = self.load(key)
            with torch.no_grad():
                into.copy_(value)

    def load(self, key: str) -> torch.Tensor:
        path, entry, start = self._ckpt.tensors[key]
        t = torch.empty(entry.shape, dtype=entry.dtype)
        read_into(self._file(path), start, entry, t, self._advance)
        return t

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
