"""``roundpipe.checkpoint.save``: a whole-state checkpoint in one call, written behind the compute.

The call takes what lives on the main thread and launches one work item on the optimizer
thread, which completes the state in launch order and hands it, without a copy, to the writer
thread (see [Note: a consistent checkpoint] in :mod:`roundpipe.checkpoint.state`). The writer
writes the shards, releases each part of the state as soon as its files are written (the next
step waits for it on the optimizer thread, never the main thread), then the per-rank files,
the HuggingFace directory if asked, the manifest, and renames the directory into place (see
[Note: the checkpoint format] in :mod:`roundpipe.checkpoint.files`). :class:`PendingCheckpoint`
is the call's handle.

Threads: :func:`save` and :func:`wait` on the main thread; the write on the writer thread
(one per process, a :class:`roundpipe.threads.workers.WorkerThread`, started by the first save and
drained at interpreter exit after the optimizer thread has handed it everything).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from roundpipe.checkpoint import hf_export, named
from roundpipe.checkpoint.files import ShardWriter, file_crc32, remove_dir, sync_dir
from roundpipe.checkpoint.manifest import (
    FORMAT_VERSION,
    fsync_tree,
    list_checkpoints,
    write_manifest,
)
from roundpipe.checkpoint.progress import listener as progress_listener
from roundpipe.checkpoint.state import GROUPS, TOUCHES, Capture, Completed, take_on_main_thread
from roundpipe.distributed import exchange
from roundpipe.distributed import group as dp_group
from roundpipe.main_thread import check_main_thread
from roundpipe.threads import optimizer_thread
from roundpipe.threads.workers import Future, WorkerThread

__all__ = ["PendingCheckpoint", "save", "wait", "DEFAULT_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 4 << 30

_WRITER = WorkerThread(
    name="roundpipe-checkpoint-writer",
    closed_message="the roundpipe checkpoint writer has shut down (the interpreter is exiting); "
    "no checkpoint can be written any more",
)
_LOCK = threading.Lock()  # guards _PENDING, _LAST_SEQUENCE, _EXIT_HOOK
_PENDING: list[PendingCheckpoint] = []
_LAST_SEQUENCE: dict[str, int] = {}
_EXIT_HOOK = {"registered": False}


class PendingCheckpoint:
    """The handle of one :func:`save`: the checkpoint's final ``path``, its progress
    (``bytes_written`` of ``bytes_total``, 0 until the optimizer thread has handed the state
    over), :meth:`done` and :meth:`wait`.

    Written by the writer thread (the byte counts, the future) and by the optimizer thread
    (``bytes_total``, the hand-over); read by any thread. On a data-parallel rank other than 0,
    which writes nothing, it is done when the rank's state has been sent to rank 0; with
    sharded state, when the rank's own files are written and posted to rank 0 (rank 0's is
    done when the checkpoint is complete). Made by :func:`save`, never by hand.
    """

    def __init__(self, path: Path, sequence: int, owners: tuple) -> None:
        self.path = path
        self.sequence = sequence
        self.bytes_written = 0
        self.bytes_total = 0
        self.writes = False  # whether this process writes the files (rank 0)
        self._owners = owners
        self._item: optimizer_thread.WorkItem | None = None
        self._written = Future()
        self._failure: optimizer_thread.WorkItem | None = None
        self._listeners: list[Callable[[int, int], None]] = []
        self._listeners_lock = threading.Lock()

    def _attach(self, item: optimizer_thread.WorkItem) -> None:
        """Main thread, at the save: the work item that hands the state over."""
        self._item = item

    def done(self) -> bool:
        """Whether the checkpoint is complete (or failed). Any thread; never blocks."""
        return self._written.done()

    def wait(self, progress: bool | Callable[[int, int], None] = False) -> Path:
        """Block until the checkpoint is complete; returns its path. Re-raises the failure of
        its work item or of its write (once: if a model call reported it already, raises
        ``RuntimeError`` saying so). ``progress``: True shows a progress bar (with tqdm, if
        installed) of the bytes written; a callable gets ``(bytes_written, bytes_total)``
        after each chunk. Main thread (any thread but the writer and the optimizer thread)."""
        listener = progress_listener(progress, f"writing {self.path.name}", self.bytes_total)
        if listener is not None:
            with self._listeners_lock:
                self._listeners.append(listener)
        try:
            item = self._item
            if item is not None and not item.wait():  # raises the hand-over's failure, once
                raise RuntimeError(
                    f"checkpoint {self.path} was not written: taking its state failed (the "
                    f"error was reported earlier, by a call of the model)"
                ) from item.exception()
            self._written.exception()
            failure = self._failure
            if failure is not None:
                if failure.wait():
                    raise AssertionError(
                        "a failed checkpoint write reported success; please report"
                    )
                raise RuntimeError(
                    f"writing checkpoint {self.path} failed (the error was reported earlier, by "
                    f"a call of the model); the checkpoints written before it are untouched"
                ) from failure.exception()
            return self.path
        finally:
            if listener is not None:
                with self._listeners_lock:
                    self._listeners.remove(listener)
                close = getattr(listener, "close", None)
                if close is not None:
                    close()

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self.bytes_written}/{self.bytes_total} bytes"
        return f"PendingCheckpoint({str(self.path)!r}, {state})"

    # -- writer thread --------------------------------------------------------------------
    def _advance(self, n: int) -> None:
        """Writer thread: ``n`` more bytes are written."""
        self.bytes_written += n
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(self.bytes_written, self.bytes_total)

    def _finish(self, exc: BaseException | None) -> None:
        """Writer (or optimizer) thread: settle the handle; a failure goes to the owners' next
        report too (see [Note: error reporting] in :mod:`roundpipe.threads.optimizer_thread`)."""
        if exc is not None:
            optimizer_thread.add_note(
                exc,
                f"[roundpipe checkpoint writer] writing {self.path} failed; the checkpoints "
                f"written before it are untouched",
            )
            self._failure = optimizer_thread.record_failure(exc, self._owners)
        with _LOCK:
            if self in _PENDING:
                _PENDING.remove(self)
        self._written.set_result(None)

    def _fail_in_fork_child(self) -> None:
        """In a fork child, where the writer thread does not exist: settle as failed."""
        self._listeners_lock = threading.Lock()
        if not self._written.done():
            self._finish(
                optimizer_thread.ForkedWithPendingWork(
                    f"checkpoint {self.path} was being written when this process was forked; "
                    f"the write goes on in the parent only"
                )
            )


def save(
    root: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    name: str | None = None,
    keep_last: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    hf: bool = False,
    hf_dtype: torch.dtype = torch.float32,
    hf_dir: str = "hf",
) -> PendingCheckpoint:
    """Save everything an exact resume needs into a new checkpoint directory in ``root``,
    written while training goes on; returns its :class:`PendingCheckpoint`.

    The checkpoint is the state the loop's next call would see: the model's parameters as the
    next iteration computes with them, its buffers, the masters (and their gradients, if some
    were accumulated since the last step), ``optimizer``'s, ``scheduler``'s and ``scaler``'s
    state, the RNG state of every generator the run draws from (torch's CPU and device
    generators, Python's ``random``, numpy's if imported), and ``extra`` (a dict of tensors,
    numbers, strings, lists and dicts: the data position, the iteration). Call it anywhere in
    the loop, except between ``model.step()`` and ``scaler.update()``; steps that are still
    running are taken into account (see [Note: a consistent checkpoint]).

    Nothing is copied: the state is written from where it lives by the writer thread while the
    next iterations compute; a later step waits on the optimizer thread until the parts it
    would change are written. The directory is ``root/name`` (default ``ckpt-NNNNNN``, numbered
    on from the checkpoints in ``root``), written under a temporary name and renamed when
    complete, so a crash never damages an earlier checkpoint; ``keep_last=N`` then removes all
    but the newest N in ``root``. Shards hold at most ``max_shard_bytes`` each (a larger tensor
    gets one of its own). ``hf=True`` (a model made by :func:`roundpipe.hf.wrap`) also writes
    ``hf/``, a directory that transformers' (or, for a LoRA model, peft's) ``from_pretrained``
    loads, with the weights in ``hf_dtype`` (default fp32: the masters themselves; another
    dtype makes a copy of the trained weights in it). ``hf_dir="."`` writes those files into
    the checkpoint directory itself, so that ``from_pretrained(checkpoint)`` loads it as it
    loads a transformers Trainer's checkpoint (roundpipe's own shards are then named
    ``roundpipe-model-...``, apart from transformers' ``model-...``).

    Under data parallelism (an open :class:`roundpipe.distributed.DataParallel`) every rank
    calls it at the same point; rank 0 writes the replicated state and every rank's RNG state
    and ``extra`` (``root`` must be a directory rank 0 writes and every rank reads). With
    sharded state (:class:`roundpipe.distributed.ShardedState`) each rank also writes the
    masters and optimizer state it holds, in files of its own (``root`` must be a directory
    every rank writes), and rank 0 the manifest once every rank's files are complete (see
    [Note: sharded checkpoints] in :mod:`roundpipe.checkpoint.state`).

    Main thread; blocks only to take the small main-thread state (the buffers are copied, the
    rest is not). Raises at once for misuse (``TypeError``/``ValueError`` for what a checkpoint
    cannot hold, ``FileExistsError`` for a name taken, ``RuntimeError`` between a step and
    ``scaler.update()``); a failure of the write is re-raised by :meth:`PendingCheckpoint.wait`
    or, if nobody waits, by the model's next call.
    """
    check_main_thread("save", owner="roundpipe.checkpoint")
    if not callable(getattr(model, "state_access", None)):
        raise TypeError(f"save() takes a roundpipe.RoundPipe, got {type(model).__name__}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be an int >= 1 (or None: keep all), got {keep_last!r}")
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    placement = model.state_access().params.placement
    placement.check_checkpoint("save")
    if hf and placement.world_size > 1:
        raise ValueError(
            "save(hf=True) needs every master in one process; with ShardedState each rank has "
            "its share. Save without hf=, then load the checkpoint into the model on one "
            "process (the default placement) and save it there with hf=True"
        )
    export = hf_export.prepare(model, hf_dtype, hf_dir) if hf else None
    root_path = Path(root)
    if root_path.exists() and not root_path.is_dir():
        raise NotADirectoryError(f"save() writes checkpoints into a directory; {root} is a file")
    dp = dp_group.data_parallel_rank()
    capture = take_on_main_thread(
        model, optimizer, scheduler, scaler, extra, dp[0] if dp else 0, dp[1] if dp else 1
    )
    path, sequence = _reserve(root_path, name)
    owners = tuple(o for o in (model, scaler) if o is not None)
    handle = PendingCheckpoint(path, sequence, owners)
    with _LOCK:
        _PENDING.append(handle)
    job = _Job(handle, capture, export, keep_last, max_shard_bytes)
    handle._attach(optimizer_thread.launch_work(job.hand_over, owners=owners, touches=()))
    _ensure_exit_hook()
    return handle


def wait(progress: bool = False) -> None:
    """Block until every checkpoint saved so far in this process is complete; re-raises the
    first failure. Main thread."""
    with _LOCK:
        pending = list(_PENDING)
    for handle in pending:
        handle.wait(progress)


def _reserve(root: Path, name: str | None) -> tuple[Path, int]:
    """The next checkpoint's path in ``root``, numbered on from every checkpoint there and
    every one this process has started; ``FileExistsError`` for a name already taken."""
    key = str(root.resolve())
    with _LOCK:
        sequence = (
            max([c.sequence for c in list_checkpoints(root)] + [_LAST_SEQUENCE.get(key, 0)]) + 1
        )
        _LAST_SEQUENCE[key] = sequence
        taken = {h.path for h in _PENDING}
    if name is None:
        name = f"ckpt-{sequence:06d}"
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"name must be a plain directory name not starting with '.', got {name!r}")
    path = root / name
    if path.exists() or path in taken:
        raise FileExistsError(
            f"checkpoint {path} exists already: give save() a new name= (or remove it first)"
        )
    return path, sequence


def _ensure_exit_hook() -> None:
    """At interpreter exit, before the optimizer thread drains (atexit runs hooks in reverse):
    wait until it has handed over every checkpoint, then write them all."""
    with _LOCK:
        if _EXIT_HOOK["registered"]:
            return
        _EXIT_HOOK["registered"] = True
    _WRITER.enqueue(lambda: None)  # started now, so this hook runs before its own drain
    atexit.register(_drain_at_exit)


def _drain_at_exit() -> None:
    optimizer_thread.wait_all()
    _WRITER.shutdown()


class _Job:
    """One checkpoint's work: :meth:`hand_over` on the optimizer thread, :meth:`write` on the
    writer thread."""

    def __init__(
        self,
        handle: PendingCheckpoint,
        capture: Capture,
        export: hf_export.HFExport | None,
        keep_last: int | None,
        max_shard_bytes: int,
    ) -> None:
        self.handle = handle
        self.capture: Capture | None = capture
        self.export = export
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes
        self.tmp_pid = os.getpid()  # sharded: rank 0's, whose temporary directory all share

    def hand_over(self) -> None:
        """Optimizer thread, in launch order: complete the state, hold what the writer reads,
        queue the write (see [Note: a consistent checkpoint])."""
        capture, self.capture = self.capture, None
        assert capture is not None, "a checkpoint handed over twice; please report"
        where = f"checkpoint {self.handle.path.name}"
        sharded = capture.shard_rank is not None
        try:
            if sharded:  # every rank writes (see [Note: sharded checkpoints])
                completed = capture.complete(lambda data: exchange.all_gather_bytes(data, where))
                first = json.loads(
                    exchange.all_gather_bytes(
                        json.dumps([str(self.handle.path), os.getpid()]).encode(), where
                    )[0]
                )
                self.handle.path = Path(first[0])  # rank 0's name for it
                self.tmp_pid = int(first[1])
                if capture.shard_rank != 0:
                    completed.rank_files = None
            else:
                completed = capture.complete(lambda data: exchange.gather_bytes(data, where))
        except BaseException:
            self.handle._finish(None)  # the item's own failure is what wait() raises
            raise
        if completed.rank_files is None and not sharded:  # a replicated rank other than 0
            self.handle._finish(None)
            return
        self.handle.writes = True
        self.handle.bytes_total = sum(
            t.numel() * t.element_size() for group in completed.groups.values() for _, t in group
        )
        parts = {TOUCHES[g] for g, tensors in completed.groups.items() if tensors}
        if self.export is not None:
            parts.add("masters")
        hold = optimizer_thread.hold(parts)
        try:
            _WRITER.enqueue(lambda: self.write(completed, capture, hold))
        except BaseException:
            hold.release()
            self.handle._finish(None)
            raise

    def write(self, completed: Completed, capture: Capture, hold: optimizer_thread.Hold) -> None:
        """Writer thread: the files, the manifest, the rename, the pruning; never raises (the
        failure goes to the handle and the owners)."""
        handle = self.handle
        final = handle.path
        tmp = final.with_name(f".{final.name}.tmp-{self.tmp_pid}")
        rank = capture.shard_rank
        if rank is not None and rank != 0:
            self._write_share(completed, capture, hold, tmp, rank)
            return
        try:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                _remove_stale(final.parent)
                tmp.mkdir(exist_ok=rank is not None)  # sharded: another rank may have made it
                files: dict[str, dict[str, int]] = {}
                index: dict[str, str] = {}
                # Beside an HF export in the directory itself, roundpipe's shards get names
                # of their own (transformers' save_pretrained removes "model-NNNNN-of-NNNNN"
                # files it did not write).
                mark = "roundpipe-" if self.export is not None and self.export.in_root else ""
                for group in GROUPS:
                    prefix = mark + (
                        group if rank is None or group == "model" else f"{group}-rank{rank:05d}"
                    )
                    for fname, shard in self._shards(prefix, completed.groups[group], tmp):
                        shard.write(handle._advance)
                        files[fname] = {"bytes": shard.size, "crc32": shard.crc32}
                        index.update((key, fname) for key, _ in shard.tensors)
                        if group == "masters":  # masters in files: drop the pages read
                            capture.access.params.placement.release()
                    if group != "masters" or self.export is None:
                        hold.release([TOUCHES[group]])
                hf_info = None
                if self.export is not None:
                    where = tmp / self.export.directory
                    hf_export.export(self.export, where)
                    capture.access.params.placement.release()  # the masters it read
                    fsync_tree(where)
                    for file in sorted(where.rglob("*")):
                        rel = str(file.relative_to(tmp))
                        if file.is_file() and rel not in files:
                            files[rel] = {"bytes": file.stat().st_size, "crc32": file_crc32(file)}
                    hf_info = {
                        "dir": self.export.directory,
                        "dtype": str(self.export.dtype).replace("torch.", ""),
                    }
            finally:
                hold.release()
            assert completed.rank_files is not None
            ranks = []
            for r, data in enumerate(completed.rank_files):
                fname = f"rank-{r:05d}.safetensors"
                files[fname] = {"bytes": len(data), "crc32": _write_blob(tmp / fname, data)}
                ranks.append(fname)
            if rank is not None:
                self._join_shares(completed, files, index, len(ranks))
            write_manifest(
                tmp,
                {
                    "name": final.name,
                    "sequence": handle.sequence,
                    "world_size": len(ranks),
                    "ranks": ranks,
                    "sharded": rank is not None,
                    **({"format_version": FORMAT_VERSION} if rank is not None else {}),
                    "model": capture.description,
                    "state": completed.tree,
                    "files": files,
                    "tensors": index,
                    "hf": hf_info,
                },
            )
            sync_dir(tmp)
            os.replace(tmp, final)  # complete: it has its name (see [Note: the checkpoint format])
            sync_dir(final.parent)
            if self.keep_last is not None:
                for old in list_checkpoints(final.parent)[: -self.keep_last]:
                    remove_dir(old.path)
        except BaseException as exc:  # noqa: B036 -- handed to the handle and the owners
            with contextlib.suppress(OSError):
                if tmp.exists():
                    remove_dir(tmp)
            handle._finish(exc)
        else:
            handle._finish(None)

    def _share_key(self, rank: int) -> str:
        return f"checkpoint/{self.handle.path}/{self.tmp_pid}/{self.handle.sequence}/rank{rank}"

    def _write_share(
        self,
        completed: Completed,
        capture: Capture,
        hold: optimizer_thread.Hold,
        tmp: Path,
        rank: int,
    ) -> None:
        """Writer thread of a sharded rank other than 0: its masters, gradients and optimizer
        state into files of its own in the checkpoint's temporary directory, then their sizes,
        checksums and tensors (or the failure) posted to rank 0 (see
        [Note: sharded checkpoints]); never raises."""
        handle = self.handle
        message: dict[str, Any] = {"error": None}
        try:
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                files: dict[str, dict[str, int]] = {}
                index: dict[str, str] = {}
                for group in GROUPS:
                    prefix = f"{group}-rank{rank:05d}"
                    for fname, shard in self._shards(prefix, completed.groups[group], tmp):
                        shard.write(handle._advance)
                        files[fname] = {"bytes": shard.size, "crc32": shard.crc32}
                        index.update((key, fname) for key, _ in shard.tensors)
                        if group == "masters":  # masters in files: drop the pages read
                            capture.access.params.placement.release()
                    hold.release([TOUCHES[group]])
                sync_dir(tmp)
            finally:
                hold.release()
            message.update(files=files, tensors=index, state=completed.tree)
        except BaseException as exc:  # noqa: B036 -- posted to rank 0 and handed to the handle
            message["error"] = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                exchange.post_to_rank0(self._share_key(rank), json.dumps(message).encode())
            handle._finish(exc)
            return
        try:
            exchange.post_to_rank0(self._share_key(rank), json.dumps(message).encode())
        except BaseException as exc:  # noqa: B036 -- handed to the handle and the owners
            handle._finish(exc)
        else:
            handle._finish(None)

    def _join_shares(
        self, completed: Completed, files: dict[str, Any], index: dict[str, str], world: int
    ) -> None:
        """Writer thread of rank 0, sharded: wait for every other rank's files (see
        [Note: messages to rank 0] in roundpipe.distributed.exchange), and add them to the manifest's
        ``files``, ``index`` and state."""
        what = f"checkpoint {self.handle.path.name}: the files of every rank"
        messages = exchange.collect_on_rank0([self._share_key(r) for r in range(1, world)], what)
        tree = completed.tree
        optimizers = [tree.get("optimizer_by_name")]
        for r, raw in enumerate(messages, start=1):
            message = json.loads(raw)
            if message["error"] is not None:
                raise RuntimeError(
                    f"rank {r} could not write its share of checkpoint {self.handle.path.name} "
                    f"({message['error']}); the checkpoint is not written, the earlier ones are "
                    f"untouched"
                )
            files.update(message["files"])
            index.update(message["tensors"])
            tree["grad_names"] = tree["grad_names"] + message["state"]["grad_names"]
            optimizers.append(message["state"].get("optimizer_by_name"))
        if optimizers[0] is not None:
            tree["optimizer_by_name"] = named.merge(optimizers)  # type: ignore[arg-type]

    def _shards(
        self, group: str, tensors: list[tuple[str, torch.Tensor]], directory: Path
    ) -> Iterable[tuple[str, ShardWriter]]:
        """The group's tensors in shards of at most ``max_shard_bytes`` (in order)."""
        runs: list[list[tuple[str, torch.Tensor]]] = []
        size = 0
        for key, t in tensors:
            n = t.numel() * t.element_size()
            if not runs or (size + n > self.max_shard_bytes and runs[-1]):
                runs.append([])
                size = 0
            runs[-1].append((key, t))
            size += n
        for i, run in enumerate(runs):
            fname = f"{group}-{i + 1:05d}-of-{len(runs):05d}.safetensors"
            yield fname, ShardWriter(directory / fname, run, {"format": "pt"})


def _write_blob(path: Path, data: bytes) -> int:
    import zlib

    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(data)


def _remove_stale(root: Path) -> None:
    """Temporary directories of writes that did not finish in processes that are gone, and
    removals a crash interrupted (see [Note: the checkpoint format])."""
    for child in root.iterdir():
        name = child.name
        if not name.startswith(".") or not child.is_dir():
            continue
        if ".removing-" in name:
            _rmtree(child)
        elif ".tmp-" in name:
            pid = name.rpartition(".tmp-")[2]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                _rmtree(child)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _after_fork_in_child() -> None:
    """In a fork child (see [Note: fork] in roundpipe.threads.optimizer_thread): fresh locks (the parent's
    may have been held by a thread that is gone), and every pending checkpoint fails there."""
    global _LOCK
    _LOCK = threading.Lock()
    _EXIT_HOOK["registered"] = False
    for handle in list(_PENDING):
        handle._fail_in_fork_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
