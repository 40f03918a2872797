"""Data parallelism across processes (and machines) on ``torch.distributed``.

Every process (one per GPU or per machine, launched by ``torchrun``) runs the same roundpipe loop
on its shard of each global batch. :class:`DataParallel` attaches to a :class:`RoundPipe`: it
gives every rank rank 0's parameters, and before each step averages the masters' gradients over
the ranks, on the optimizer thread, so the all-reduce overlaps the next iteration's compute as
the step does. A :class:`roundpipe.GradScaler` that a step of the model uses (or that joined
the DataParallel explicitly, :meth:`roundpipe.GradScaler.join_data_parallel`) makes every rank
agree on whether the gradients overflowed. See [Note: data-parallel step] and docs/distributed.md.

Public API (``roundpipe.distributed``):

* :func:`init_process_group`: torch's, with a backend picked for roundpipe and a finite timeout.
* :class:`DataParallel`: attach data parallelism to a model.
* :class:`ShardedState`: a model's state placement (``RoundPipe(state_placement=...)``) that
  shards the masters, their gradients and the optimizer state over the ranks (see
  [Note: sharded state]).
* :func:`shard`: this rank's part of a global batch.
* :func:`plan_buckets` / :class:`Bucket`: how gradients are grouped into all-reduce buckets.
* :class:`DataParallelError`: a collective failed (another rank failed, or the timeout passed).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import hashlib
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils import _pytree as pytree

from roundpipe import optim_queue
from roundpipe.grad_scaler import GradScaler
from roundpipe.main_thread import check_main_thread
from roundpipe.optim.master_file import MastersOnDisk
from roundpipe.runtime.model import RoundPipe
from roundpipe.runtime.placement import MasterPlacement, shard_by_bytes
from roundpipe.workers import Future

__all__ = [
    "DataParallel",
    "DataParallelError",
    "ShardedState",
    "Bucket",
    "data_parallel_rank",
    "gather_bytes",
    "all_gather_bytes",
    "union_over_ranks",
    "post_to_rank0",
    "collect_on_rank0",
    "init_process_group",
    "plan_buckets",
    "shard",
]


# [Note: data-parallel step]
# Every rank runs the same loop, so every rank launches the same work on its optimizer thread in
# the same order. Only the optimizer thread issues collectives on the group (construction and
# the found_inf agreement launch theirs there and wait; sharded state's stage reducer has a
# process group of its own, see [Note: sharded state]), so the collectives of all ranks pair up
# in launch order:
#   (a) at construction: a check that every rank built the same model, then a broadcast of rank
#       0's masters, model parameters and buffers;
#   (b) per step, in the step work item, before step_fn: the masters' gradients, bucketed
#       (``plan_buckets``), summed with async all-reduces (a few buckets in flight, each in a
#       reused flat buffer), divided by the world size and copied back. A gradient that some rank
#       lacks (None) counts as zeros there; one that every rank lacks stays None. Then every
#       rank holds the same averaged gradient, bit for bit (an all-reduce gives every rank the
#       same result);
#   (c) per scaler.unscale_/step: the inf/NaN flag, all-reduced with MAX, so every rank skips the
#       same steps and the update rule produces the same scale everywhere.
# Identical masters, gradients and flags make identical steps: the masters stay bitwise equal
# across ranks. Nothing changes for the threads: (b) runs where step_fn runs, so the staleness
# of [Note: staleness] and the scaler's double buffer hold as in one process.
# Failures: a collective that fails (a peer's connection closed, or the process group's timeout
# passed) raises DataParallelError on the optimizer thread, reported on the main thread at the
# next dependent call like any step failure; the group is then marked broken and every later
# collective raises at once instead of waiting for a timeout again.


# [Note: sharded state]
# With RoundPipe(..., state_placement=ShardedState()) each rank holds the masters of a
# contiguous run of the trainable parameters, whole parameters balanced by bytes
# (shard_by_bytes; decided at construction, the same on every rank); the optimizer built on
# model.optim_parameters() holds the optimizer state of that run only. The other parameters
# have stand-ins (see [Note: state placement] in roundpipe.runtime.placement). The data-parallel
# step changes in two places of [Note: data-parallel step]:
#   (b') the gradients: every rank still computes all of its gradients (its microbatches touch
#        every parameter), but each forward_backward hands each stage's sums, as the stage
#        finishes, to the DataParallel's _StageReducer instead of the masters: a thread with a
#        process group of its own (its collectives never interleave with the optimizer
#        thread's), which sums them onto their owners with one dist.reduce per bucket of one
#        owner's parameters (gloo's reduce_scatter needs one collective over every owner's
#        chunk; a reduce per bucket moves the same bytes), each bucket carrying one count per
#        parameter (how many ranks had a gradient: none, and it stays None). A stage is
#        handed over only once every stage above it is reduced (back-pressure: the one being
#        reduced and the one the backward fills are all a rank holds), so stages arrive in
#        descending order whatever the order the workers finish them in; a failed call hands
#        the stages it did not as no gradients (its waiting hand-overs are woken), so every
#        rank reduces the same stages in the same order. A rank keeps its owned sums and drops
#        the rest at once (host gradients 4/N bytes per parameter, plus two stages); the call's
#        gradient moves, behind a running step on the optimizer thread, add the sums into the
#        masters' .grad. In the step work item, before step_fn, each owner divides by the
#        world size; gradients that reached .grad another way (a differentiable forward() and
#        backward()) are summed onto their owners there first, with the owners' sums so far;
#   (d)  the weights: the master->model copy (Params.copy_masters_to_model, launched by step
#        as today, so at the same point of [Note: staleness]) runs through
#        ShardedState.copy_layer: per layer, each owner casts its masters into the model's
#        low-precision parameters and broadcasts them (one flat broadcast per owner and dtype
#        of the layer) into every other rank's, before the layer's "params ready" event.
# The scaler's flag (c) is unchanged: each rank checks the gradients it owns and the MAX over
# the ranks is the one decision. A rank's own sum of two ranks' gradients is a + b on both
# paths, so with 2 ranks the masters equal the replicated run's bit for bit; with more ranks
# that holds where gloo's reduce adds in the order of its all-reduce (it did at 4 ranks in
# tests/test_sharded_state.py). A global gradient norm (DataParallel.clip_grad_norm_)
# all-reduces the per-tensor norms, each filled in by its owner, and reduces them as torch
# does, so it equals torch's norm of all the gradients bit for bit. model.synchronize(),
# model.step() and load_state_dict() copy masters into the model: collectives, so every rank
# calls them at the same point of its loop (as it calls step).


# The models a DataParallel is attached to (main thread).
_ATTACHED: weakref.WeakSet[RoundPipe] = weakref.WeakSet()


class DataParallelError(RuntimeError):
    """A data-parallel collective failed: another rank raised, was killed, or did not reach the
    same collective within the process group's timeout. The process group cannot be used
    afterwards; restart every rank from the last checkpoint."""


_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def _as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}"
        )
    if not seconds > 0:
        raise ValueError(
            f"timeout must be > 0 seconds (a collective that waits forever turns a "
            f"failed rank into a hang), got {seconds}"
        )
    return datetime.timedelta(seconds=seconds)


def _require_distributed() -> None:
    if not dist.is_available():
        raise RuntimeError(
            "this build of torch has no torch.distributed; install a torch build "
            "with distributed support to use roundpipe.distributed"
        )


def init_process_group(
    backend: str | None = None,
    timeout: float | datetime.timedelta = _DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> None:
    """``torch.distributed.init_process_group`` with roundpipe's defaults.

    ``backend`` None: ``"cpu:gloo,cuda:nccl"`` when CUDA is available, else ``"gloo"``.
    ``timeout`` (seconds or a timedelta, default 10 minutes) bounds every collective: a rank
    whose peer failed raises :class:`DataParallelError` after it instead of hanging. Other
    keyword arguments go to torch (``init_method``, ``rank``, ``world_size``, ``store``); under
    ``torchrun`` none are needed, and without torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and without ``init_method``/``store`` it raises
    ``RuntimeError`` naming the torchrun command. Main thread; blocks until every rank has
    joined.
    """
    _require_distributed()
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized; call "
            "roundpipe.distributed.init_process_group() once per process, or skip "
            "it and pass your own group to DataParallel(process_group=...)"
        )
    if kwargs.get("init_method") in (None, "env://") and kwargs.get("store") is None:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ and v.lower() not in kwargs]
        if missing:
            raise RuntimeError(
                f"roundpipe.distributed.init_process_group() found no torchrun environment "
                f"({', '.join(missing)} not set): launch the script with torchrun, e.g. "
                f"`torchrun --standalone --nproc-per-node 2 {_script_name()}`, or pass rank=, "
                f"world_size= and init_method= (or store=) yourself"
            )
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), **kwargs)


# What torch's default env:// rendezvous reads; torchrun sets them for every rank.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.relpath(path) if path else "your_script.py"


def shard(batch: Any, process_group: ProcessGroup | None = None) -> Any:
    """This rank's part of a global batch: every tensor in ``batch`` (a tensor or a pytree of
    them) is split along dim 0 into world-size equal parts, and the part of this rank's index is
    returned (a view). The sizes must divide evenly, so that every rank's mean loss weighs its
    samples as the mean over the global batch does. Any thread; never blocks (no collective).
    """
    rank, world = _rank_and_world(process_group)

    def part(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] % world:
            raise ValueError(
                f"shard(): a global batch of {tuple(x.shape)} does not split evenly over "
                f"{world} ranks along dim 0; use a global batch size that is a multiple of the "
                f"world size (or a DistributedSampler with drop_last=True)"
            )
        n = x.shape[0] // world
        return x[rank * n : (rank + 1) * n]

    return pytree.tree_map(part, batch)


def _rank_and_world(process_group: ProcessGroup | None) -> tuple[int, int]:
    _require_distributed()
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call roundpipe.distributed."
            "init_process_group() first (and launch one process per rank, e.g. with torchrun)"
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


# -- buckets ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors all-reduced together in one flat buffer: ``names[i]`` occupies elements
    ``offsets[i] : offsets[i] + numels[i]``; ``index[i]`` is its position in the planned list."""

    dtype: torch.dtype
    names: tuple[str, ...]
    index: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the bucket's flat buffer. Any thread; never blocks."""
        return self.offsets[-1] + self.numels[-1] if self.names else 0

    def __str__(self) -> str:
        size = self.numel * torch.empty((), dtype=self.dtype).element_size()
        return f"Bucket({str(self.dtype).replace('torch.', '')}, {size} bytes: {', '.join(self.names)})"


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of one dtype and at most ``cap_bytes`` each, in the given
    order (a tensor larger than the cap gets a bucket of its own). Pure function: any thread.
    """
    if not isinstance(cap_bytes, int) or isinstance(cap_bytes, bool) or cap_bytes < 1:
        raise ValueError(f"bucket cap must be a positive number of bytes, got {cap_bytes!r}")
    done: list[Bucket] = []
    open_: dict[torch.dtype, list[tuple[str, int, int]]] = {}

    def close(dtype: torch.dtype) -> None:
        entries = open_.pop(dtype)
        offsets, offset = [], 0
        for _, _, n in entries:
            offsets.append(offset)
            offset += n
        done.append(
            Bucket(
                dtype,
                tuple(e[0] for e in entries),
                tuple(e[1] for e in entries),
                tuple(offsets),
                tuple(e[2] for e in entries),
            )
        )

    for i, (name, t) in enumerate(named_tensors):
        entries = open_.get(t.dtype)
        if (
            entries is not None
            and (sum(e[2] for e in entries) + t.numel()) * t.element_size() > cap_bytes
        ):
            close(t.dtype)
        open_.setdefault(t.dtype, []).append((name, i, t.numel()))
    for dtype in list(open_):
        close(dtype)
    return done


# -- the process group as roundpipe uses it ---------------------------------------------------


class _Group:
    """A process group plus what roundpipe needs around it: the device collectives run on, the
    timeout, and whether a collective failed. ``broken`` is written and read on the optimizer
    thread and on a :class:`_StageReducer`'s thread (one str, set once by :meth:`failed`)."""

    def __init__(
        self, process_group: ProcessGroup | None, device: torch.device | str | None
    ) -> None:
        self.pg = process_group
        self.rank, self.world = _rank_and_world(process_group)
        self.timeout = _group_timeout(process_group)
        if device is None:
            nccl = (
                "cuda:nccl" in dist.get_backend_config(process_group)
                or dist.get_backend(process_group) == "nccl"
            )
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if nccl and torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.broken: str | None = None

    def where(self) -> str:
        return f"[roundpipe data parallel, rank {self.rank} of {self.world}]"

    def device_scope(self) -> Any:
        return _device_scope(self.device)

    def check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise DataParallelError(
                f"{self.where()} {what} was not attempted: an earlier collective failed "
                f"({self.broken}), so the ranks are no longer in step. Restart every rank from "
                f"the last checkpoint (torchrun restarts them with --max-restarts)"
            )

    def failed(self, what: str, exc: BaseException) -> DataParallelError:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        self.broken = f"{what}: {first_line}"
        return DataParallelError(
            f"{self.where()} {what} failed: {first_line}. Another rank most likely failed (an "
            f"exception, a killed process) or did not reach the same collective within the "
            f"process group's timeout of {self.timeout.total_seconds():g} s; every rank must run "
            f"the same loop (the same forward_backward/step calls). The process group cannot be "
            f"used any more: save a checkpoint if you need one, then restart every rank"
        )

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> Any:
        return dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.pg, async_op=True)

    def wait(self, work: Any) -> None:
        # gloo enforces the group's timeout inside the operation; the wait's own bound is for
        # backends that only time out there.
        work.wait(self.timeout)

    def agree(self, value: int) -> bool:
        """Whether every rank passed the same int64 ``value`` (one all-reduce, MAX of v and -v)."""
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self.wait(self.all_reduce(t, dist.ReduceOp.MAX))
        hi, neg_lo = t.tolist()
        return hi == -neg_lo


def _group_timeout(process_group: ProcessGroup | None) -> datetime.timedelta:
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:
        return _DEFAULT_TIMEOUT
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            return backend.options._timeout
        except (RuntimeError, AttributeError):
            continue
    return _DEFAULT_TIMEOUT


def _on_optimizer_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the optimizer thread (the only thread that issues collectives, see
    [Note: data-parallel step]) and return its result; from another thread, launch and wait."""
    if optim_queue.on_optimizer_thread():
        return fn()
    return _wait_result(optim_queue.launch_item(fn))


def _wait_result(item: optim_queue.WorkItem) -> Any:
    # Reported here, once: a wait that leaves the failure unclaimed raises it and leaves it in
    # the optimizer thread's list too, which prints it again at exit as never waited for.
    item.wait()
    return item.result()


# The data-parallel group of this process, shared by every DataParallel in it, for checkpoints
# (data_parallel_rank, gather_bytes). A GradScaler agrees over the DataParallel it joined, not
# over this. Written on the main thread (DataParallel construction and close), read on the
# optimizer thread.
_ACTIVE_LOCK = threading.Lock()
_ACTIVE: _Group | None = None
_ACTIVE_USERS = 0


def _activate(
    process_group: ProcessGroup | None,
    device: torch.device | str | None,
    group: _Group | None = None,
) -> _Group:
    global _ACTIVE, _ACTIVE_USERS
    with _ACTIVE_LOCK:
        if _ACTIVE is not None:
            if _ACTIVE.pg is not process_group or (group is not None and group is not _ACTIVE):
                raise RuntimeError(
                    "another DataParallel in this process uses a different process group; one "
                    "data-parallel group per process (checkpoints gather over it): pass the same "
                    "process_group, or close() the other DataParallel first"
                )
        else:
            _ACTIVE = group if group is not None else _Group(process_group, device)
        _ACTIVE_USERS += 1
        return _ACTIVE


def _deactivate() -> None:
    global _ACTIVE, _ACTIVE_USERS
    with _ACTIVE_LOCK:
        _ACTIVE_USERS -= 1
        if _ACTIVE_USERS == 0:
            _ACTIVE = None


def data_parallel_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` of this process's data-parallel group, None without one (no open
    :class:`DataParallel`). Any thread; never blocks."""
    group = _ACTIVE
    return None if group is None else (group.rank, group.world)


def gather_bytes(payload: bytes, what: str) -> list[bytes] | None:
    """Every rank's ``payload`` on rank 0 (in rank order), None on the other ranks and
    ``[payload]`` without data parallelism. A collective: every rank calls it at the same
    point of its launched work (a checkpoint's work item), on the optimizer thread. Raises
    :class:`DataParallelError` naming ``what`` if it fails."""
    parts = all_gather_bytes(payload, what)
    group = _ACTIVE
    return parts if group is None or group.rank == 0 else None


def all_gather_bytes(payload: bytes, what: str) -> list[bytes]:
    """Every rank's ``payload`` on every rank (in rank order); ``[payload]`` without data
    parallelism. A collective, as :func:`gather_bytes`."""
    group = _ACTIVE
    if group is None:
        return [payload]
    if not optim_queue.on_optimizer_thread():
        raise RuntimeError("all_gather_bytes() runs on the optimizer thread (in launched work)")
    group.check_usable(what)
    try:
        with group.device_scope():
            sizes = [
                torch.zeros(1, dtype=torch.int64, device=group.device) for _ in range(group.world)
            ]
            mine = torch.tensor([len(payload)], dtype=torch.int64, device=group.device)
            group.wait(dist.all_gather(sizes, mine, group=group.pg, async_op=True))
            longest = max(int(n.item()) for n in sizes)
            data = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            data = data.to(group.device)
            parts = [torch.empty_like(data) for _ in range(group.world)]
            group.wait(dist.all_gather(parts, data, group=group.pg, async_op=True))
    except Exception as exc:
        raise group.failed(what, exc) from exc
    return [bytes(p[: int(n.item())].cpu().numpy()) for p, n in zip(parts, sizes)]


def union_over_ranks(items: Sequence[str], what: str) -> list[str]:
    """Every rank's ``items``, each once, in rank order then their own: what the ranks found
    between them (e.g. the problems of a checkpoint whose files they checked a share each).
    ``list(items)`` without data parallelism. A collective: every rank calls it at the same
    point; main thread (it runs on the optimizer thread and waits) or the optimizer thread.
    Raises :class:`DataParallelError` naming ``what`` if it fails."""
    if _ACTIVE is None:
        return list(dict.fromkeys(items))
    payload = "\n".join(items).encode()
    parts = _on_optimizer_thread(lambda: all_gather_bytes(payload, what))
    return list(dict.fromkeys(line for part in parts for line in part.decode().split("\n") if line))


# [Note: messages to rank 0]
# A sharded checkpoint is written by every rank's writer thread, and rank 0 may write its
# manifest only after every rank's files are complete. The writer threads cannot use
# collectives (only the optimizer thread issues them, in launch order: see
# [Note: data-parallel step]), so each rank posts a message under a key of its own to the
# process group's key-value store (torch.distributed's rendezvous store, which every rank
# already reaches) and rank 0 blocks in the store's own wait for the keys, bounded by the
# process group's timeout: no polling, and a rank that died makes rank 0's wait fail after
# that timeout instead of hanging.


def _store() -> Any:
    group = _ACTIVE
    if group is None:
        raise RuntimeError("no data-parallel group: messages to rank 0 need a DataParallel")
    ranks = "-".join(str(_global_rank(group, r)) for r in range(group.world))
    return group, dist.PrefixStore(
        f"roundpipe/{ranks}/", dist.distributed_c10d._get_default_store()
    )


def post_to_rank0(key: str, payload: bytes) -> None:
    """Post ``payload`` under ``key`` (unique to this rank and this use) for rank 0's
    :func:`collect_on_rank0` (see [Note: messages to rank 0]). Any thread; never waits for
    another rank."""
    _, store = _store()
    store.set(key, payload)


def collect_on_rank0(keys: Sequence[str], what: str) -> list[bytes]:
    """Rank 0: wait for every one of ``keys`` to be posted, and return their payloads (in
    order). Any thread; blocks at most the process group's timeout, then raises
    :class:`DataParallelError` naming ``what`` and the keys still missing."""
    group, store = _store()
    try:
        store.wait(list(keys), group.timeout)
    except Exception as exc:
        missing = [k for k in keys if not store.check([k])]
        raise DataParallelError(
            f"{group.where()} {what}: nothing came for {', '.join(missing) or 'some keys'} "
            f"within the process group's timeout of {group.timeout.total_seconds():g} s "
            f"({(str(exc).strip().splitlines() or [type(exc).__name__])[0]}). The rank that "
            f"should have posted it most likely failed or was killed"
        ) from exc
    values = [store.get(k) for k in keys]
    for k in keys:
        store.delete_key(k)
    return values


# -- sharded state ----------------------------------------------------------------------------


class ShardedState(MasterPlacement):
    """A state placement that shards the masters, their gradients (after each step's reduction)
    and the optimizer state over the data-parallel ranks: pass it as
    ``RoundPipe(..., state_placement=ShardedState())`` on every rank, then attach a
    :class:`DataParallel` as usual (see [Note: sharded state]).

    Each rank holds the masters of a contiguous run of the trainable parameters (whole
    parameters, balanced by bytes: :func:`roundpipe.runtime.placement.shard_by_bytes`), and
    ``model.optim_parameters()`` yields those only, so the optimizer built on them holds the
    state of that run only. Each ``forward_backward`` sums each stage's gradients onto their
    owners as the backward produces them. Host bytes per trainable parameter on a rank,
    fp16/bf16 weights with fp32 masters and Adam: 2 (weights) + 16/N (its gradients, masters
    and Adam's moments), plus the stages' sums on their way, against 18 replicated.

    With ``masters_dir``, each rank keeps its share of the masters in a file there
    (:class:`roundpipe.MastersOnDisk`); with Adam's state in files too
    (``roundpipe.optim.AdamW(..., state_dir=...)``) a rank holds 2 + 4/N bytes per parameter
    plus the sums on their way and two bounded buffers.

    Args:
        process_group: the ranks to shard over (default: the world); the same group as the
            :class:`DataParallel` that will attach.
        device: where collectives run; default as :class:`DataParallel`'s.
        masters_dir: a directory on a fast local disk for this rank's masters (default None:
            in RAM); ``copy_buffer_bytes``: the buffer the master->model copy streams them
            through (default :class:`roundpipe.MastersOnDisk`'s).

    Threads: construct it on the main thread (torch.distributed must be initialized); the
    weight broadcast (:meth:`copy_layer`) runs on the optimizer thread. The owners are fixed
    at the model's construction; ``attached`` is written by :class:`DataParallel` on the main
    thread.
    """

    name = "sharded over data-parallel ranks"

    def __init__(
        self,
        process_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        masters_dir: str | os.PathLike[str] | None = None,
        copy_buffer_bytes: int | None = None,
    ) -> None:
        check_main_thread("ShardedState", owner="roundpipe.distributed")
        self._files = None if masters_dir is None else MastersOnDisk(masters_dir, copy_buffer_bytes)
        if self._files is not None:
            self.copy_buffer_bytes = self._files.copy_buffer_bytes
        self._group = _Group(process_group, device)
        self._owners: list[int] | None = None
        self._owner_of: dict[int, int] = {}
        self.attached = False

    @property
    def world_size(self) -> int:
        """Ranks the state is sharded over. Any thread; never blocks."""
        return self._group.world

    @property
    def rank(self) -> int:
        """This process's rank in the group. Any thread; never blocks."""
        return self._group.rank

    @property
    def masters_dir(self) -> str | None:
        """The directory this rank's masters are in files under (None: in RAM)."""
        return None if self._files is None else self._files.directory

    def make_masters(self, params: Any) -> list[nn.Parameter]:
        """Construction: this rank's masters, in RAM or in a file under ``masters_dir``."""
        if self._files is not None:
            return self._files.make_masters(params)
        return super().make_masters(params)

    def release(self) -> None:
        if self._files is not None:
            self._files.release()

    @property
    def owners(self) -> list[int]:
        """The owner rank of each trainable parameter, in ``named_parameters()`` order (empty
        before a model was built with this placement). Any thread; never blocks."""
        return list(self._owners or [])

    def assign(self, params: Any, master_bytes: Any) -> list[bool]:
        """Construction of the model, main thread: choose the owners (see the class doc);
        returns which masters this rank holds. A ShardedState serves one model."""
        if self._owners is not None:
            raise RuntimeError(
                "this ShardedState already places another model's state: make one "
                "ShardedState() per RoundPipe"
            )
        owners = shard_by_bytes(list(master_bytes), self._group.world)
        self._owners = owners
        self._owner_of = {id(p): o for p, o in zip(params, owners)}
        return [o == self._group.rank for o in owners]

    def check_step(self) -> None:
        """Main thread, before a step: the gradients reach their owners only through the
        :class:`DataParallel` step."""
        if not self.attached:
            raise RuntimeError(
                "a RoundPipe whose state_placement is ShardedState steps only with a "
                "DataParallel attached (its step sums each gradient onto the rank that holds "
                "the master): call roundpipe.distributed.DataParallel(model) on every rank "
                "before the first step"
            )

    def check_checkpoint(self, what: str) -> None:
        """Main thread, before :mod:`roundpipe.checkpoint` saves or loads: each rank writes
        and reads the state of the parameters it owns, and the ranks' files meet through the
        :class:`DataParallel`'s group, so one must be attached (see
        [Note: sharded checkpoints] in :mod:`roundpipe.checkpoint.state`)."""
        if not self.attached:
            raise RuntimeError(
                f"roundpipe.checkpoint.{what}() of a model with ShardedState needs its "
                f"DataParallel: call roundpipe.distributed.DataParallel(model) on every rank "
                f"first (and {what} on every rank at the same point of the loop)"
            )

    def copy_layer(self, pairs: Any) -> None:
        """Optimizer thread, in the master->model copy: cast the held masters into the
        model's parameters, then broadcast each owner's parameters of the layer to the other
        ranks (see [Note: sharded state] (d)). A collective; raises
        :class:`DataParallelError` if it fails."""
        if self._files is not None:
            self._files.copy_layer(pairs)
        else:
            super().copy_layer(pairs)
        group = self._group
        if group.world == 1:
            return
        runs: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for p, _, _ in pairs:
            runs.setdefault((self._owner_of[id(p)], p.dtype), []).append(p)
        what = "the broadcast of the updated weights (master->model copy)"
        group.check_usable(what)
        try:
            with group.device_scope(), torch.no_grad():
                for (owner, _), params in runs.items():
                    if owner == group.rank:
                        flat = torch._utils._flatten_dense_tensors([p.detach() for p in params])
                        flat = flat.to(group.device)
                    else:
                        numel = sum(p.numel() for p in params)
                        flat = torch.empty(numel, dtype=params[0].dtype, device=group.device)
                    group.wait(
                        dist.broadcast(
                            flat, src=_global_rank(group, owner), group=group.pg, async_op=True
                        )
                    )
                    if owner != group.rank:
                        for p, v in zip(
                            params, torch._utils._unflatten_dense_tensors(flat, params)
                        ):
                            p.copy_(v)
        except Exception as exc:
            raise group.failed(what, exc) from exc


def _device_scope(device: torch.device) -> Any:
    # The current CUDA device is per thread: a thread that runs collectives selects it itself.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _StageReducer:
    """Sums each ``forward_backward``'s stage gradients onto their owners as the backward
    produces them (see [Note: sharded state] (b')): a :class:`GradReducer` that
    :class:`DataParallel` registers for a model with :class:`ShardedState`.

    Stage workers :meth:`submit` a call's stages as they finish, each waiting until every
    stage above it is reduced (back-pressure; an abandoned call wakes them); this object's
    thread reduces them in descending stage order (the order every rank's backward produces
    them in, whatever the timing) over a process group of its own, so that its reduces never
    interleave with the optimizer thread's collectives; per stage, buckets of one owner's
    parameters plus one count per parameter (how many ranks had a gradient) are summed onto
    the owner with ``dist.reduce``. A rank keeps what it owns and drops the rest at once. The
    move launched for the stages (:meth:`install`, optimizer thread, behind a running step)
    adds the sums into the masters' ``.grad``.

    Threads: :meth:`submit` on the stage workers or the main thread (a queue; it waits on
    ``_progress``, a condition this object's thread notifies after each stage, :meth:`wake`
    and :meth:`close` too); everything else of the per-call state on this object's thread; the
    results reach the optimizer thread through each submission's
    :class:`roundpipe.workers.Future`. :meth:`close` on the main thread, with no call running.
    """

    def __init__(self, dp: DataParallel, group: _Group) -> None:
        self._dp = dp
        self._group = group  # its timeout and "broken" state; its collectives are ours
        # The sums are host tensors: with gloo in the backend they are reduced where they are,
        # which also keeps this thread off the optimizer thread's NCCL communicator (two
        # threads' NCCL collectives can deadlock when ranks enqueue them in different orders).
        backend = str(dist.get_backend(group.pg))
        self._device = torch.device("cpu") if "gloo" in backend else group.device
        self._pg = dist.new_group(
            ranks=dist.get_process_group_ranks(group.pg) if group.pg is not None else None,
            timeout=group.timeout,
            backend=dist.get_backend(group.pg),
            use_local_synchronization=group.pg is not None,
        )
        self._index = {id(m): i for i, m in enumerate(dp._masters)}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Reducer thread only: the call in progress, its stages still to reduce (descending),
        # what arrived ahead of its turn, and each stage's submission (future, stages left).
        self._call: Any = None
        self._order: list[int] = []
        self._waiting: dict[int, tuple[list, Any, tuple[Future, list]]] = {}
        self._flats: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        # Published by this thread for the hand-overs that wait on it (submit): the call it
        # works on and the next stage of it that it needs (-1: none left).
        self._progress = threading.Condition()
        self._progress_call: Any = None
        self._progress_next = -1
        self._closed = False
        self._failure: BaseException | None = None  # this thread's own failure (_die)
        self._thread = threading.Thread(
            target=self._run, name=f"roundpipe-grad-reduce-rank{group.rank}", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        call: Any,
        stages: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor | None]]],
        arrived: torch.Event | None,
    ) -> Callable[[], None]:
        # Back-pressure: a stage's sums are handed over only once every stage above it is
        # reduced, so a rank holds at most the stage being reduced and the one the backward
        # fills (see [Note: sharded state] (b')). The highest stage not yet handed never
        # waits (every stage above it was handed), so neither does the call as a whole; a
        # failed call wakes its waiters.
        top = max(stages)
        with self._progress:
            while not (call.abandoned or self._closed) and self._next_needed(call) > top:
                self._progress.wait()
        result = Future()
        with self._progress:
            failure = self._failure
            if failure is None:
                self._queue.put((call, stages, arrived, result))
        if failure is not None:
            result.set_exception(failure)
        dp = self._dp

        def install_reduced_grads() -> None:
            dp._install(result)

        return install_reduced_grads

    def wake(self, call: Any) -> None:
        with self._progress:
            self._progress.notify_all()

    def _next_needed(self, call: Any) -> int:
        """The highest stage of ``call`` not reduced yet (under ``_progress``)."""
        if call is self._progress_call:
            return self._progress_next
        return max((s for s, ps in enumerate(call.params) if ps), default=-1)

    def _publish(self) -> None:
        with self._progress:
            self._progress_call = self._call
            self._progress_next = self._order[0] if self._order else -1
            self._progress.notify_all()

    def close(self) -> None:
        with self._progress:
            self._closed = True
            self._progress.notify_all()
        self._queue.put(None)
        self._thread.join()
        with contextlib.suppress(Exception):  # the group may be broken: nothing to release
            dist.destroy_process_group(self._pg)

    # -- the reducer's thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._arrive(*item)
            except BaseException as exc:  # noqa: B036 -- a bug here: every waiter gets it
                self._die(exc, item[3])
                return
            del item  # its sums are dropped as their stages are reduced (_reduce_next)

    def _die(self, exc: BaseException, result: Future) -> None:
        """This thread failed outside a reduce: settle every submission with ``exc`` (now and
        later, see :meth:`submit`) and release the hand-overs waiting, instead of leaving
        them to wait for a thread that is gone."""
        with self._progress:
            self._failure = exc
            self._closed = True
            self._progress.notify_all()
        for waiting in [result] + [r for _, _, (r, _) in self._waiting.values()]:
            if not waiting.done():
                waiting.set_exception(exc)
        self._waiting = {}
        while True:  # what was queued behind the failure
            item = self._queue.get_nowait() if not self._queue.empty() else None
            if item is None:
                return
            item[3].set_exception(exc)

    def _arrive(
        self,
        call: Any,
        stages: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor | None]]],
        arrived: torch.Event | None,
        result: Future,
    ) -> None:
        if call is not self._call:
            for _, _, (stale, _) in self._waiting.values():  # CallGrads.finish prevents it
                if not stale.done():
                    stale.set_exception(
                        AssertionError("a call's gradients were left unreduced; please report")
                    )
            self._call = call
            self._order = [s for s in reversed(range(len(call.params))) if call.params[s]]
            self._waiting = {}
            self._publish()
        # One submission settles when its last stage is reduced: [sums, stages left].
        done: list = [[], len(stages)]
        for s, pairs in stages.items():
            self._waiting[s] = (pairs, arrived, (result, done))
        stages.clear()
        while self._order and self._order[0] in self._waiting:
            self._reduce_next()

    def _reduce_next(self) -> None:
        """Reduce the next stage in order, drop its sums, then publish the progress."""
        pairs, arrived, (result, done) = self._waiting.pop(self._order.pop(0))
        try:
            if not result.done():  # else an earlier stage of the submission failed
                done[0] += self._reduce_stage(pairs, arrived)
                done[1] -= 1
                if done[1] == 0:
                    result.set_result(done[0])
        except BaseException as exc:  # noqa: B036 -- handed to the optimizer thread
            result.set_exception(exc)
        pairs = []  # this rank's sums of the stage: gone before the next stage is handed over
        self._publish()

    def _flat(self, dtype: torch.dtype, slot: int, numel: int) -> torch.Tensor:
        flat = self._flats.get((dtype, slot))
        if flat is None or flat.numel() < numel:
            flat = self._flats[(dtype, slot)] = torch.empty(numel, dtype=dtype, device=self._device)
        return flat[:numel]

    def _reduce_stage(
        self,
        pairs: list[tuple[torch.nn.Parameter, torch.Tensor | None]],
        arrived: torch.Event | None,
    ) -> list[tuple[int, torch.Tensor]]:
        """One stage's sums: ``(index of the master, this rank's summed gradient)`` for each
        parameter this rank owns and some rank had a gradient of."""
        group, dp = self._group, self._dp
        what = "the gradient reduce of a stage during forward_backward"
        group.check_usable(what)
        if arrived is not None:
            arrived.synchronize()  # the download from the accelerator
        index = [self._index[id(master)] for master, _ in pairs]
        named = [(str(i), dp._masters[i]) for i in index]
        buckets, owners = _owner_buckets(named, [dp._owners[i] for i in index], dp._cap)
        sums: list[tuple[int, torch.Tensor]] = []
        # (bucket, owner, data, counts, works): a bucket of several parameters is copied into
        # a reused flat buffer (at most the bucket cap) with one count per parameter after the
        # data; a bucket of one parameter (a tensor over the cap lands alone in one) is summed
        # in place, the sums being this thread's, with its count in a tensor of its own.
        in_flight: collections.deque = collections.deque()

        def finish() -> None:
            bucket, owner, data, counts, works = in_flight.popleft()
            for work in works:
                group.wait(work)
            if owner != group.rank:
                return
            for j, offset, n, count in zip(
                bucket.index, bucket.offsets, bucket.numels, counts.tolist()
            ):
                if count:
                    master = dp._masters[index[j]]
                    value = data[offset : offset + n].view(master.shape)
                    alone = len(bucket.index) == 1 and value.device == master.device
                    sums.append((index[j], value if alone else value.to(master.device, copy=True)))

        try:
            with _device_scope(self._device), torch.no_grad():
                for slot, (bucket, owner) in enumerate(zip(buckets, owners)):
                    if len(in_flight) == dp._in_flight:
                        finish()
                    assert owner is not None  # sharded: every parameter has one
                    dst = dist.get_global_rank(self._pg, owner)
                    present = [pairs[j][1] is not None for j in bucket.index]
                    if len(bucket.index) == 1:
                        grad = pairs[bucket.index[0]][1]
                        master = dp._masters[index[bucket.index[0]]]
                        data = (
                            torch.zeros(master.numel(), dtype=bucket.dtype, device=self._device)
                            if grad is None
                            else grad.to(self._device, bucket.dtype).contiguous().view(-1)
                        )
                        counts = torch.tensor(present, dtype=bucket.dtype, device=self._device)
                        works = [
                            dist.reduce(t, dst=dst, group=self._pg, async_op=True)
                            for t in (data, counts)
                        ]
                    else:
                        n = bucket.numel
                        data = self._flat(bucket.dtype, slot % dp._in_flight, n + len(present))
                        _pack(data, bucket, [pairs[j][1] for j in bucket.index])
                        counts = data[n:]
                        counts.copy_(torch.tensor(present, dtype=bucket.dtype))
                        works = [dist.reduce(data, dst=dst, group=self._pg, async_op=True)]
                    in_flight.append((bucket, owner, data, counts, works))
                while in_flight:
                    finish()
        except Exception as exc:
            raise group.failed(what, exc) from exc
        return sums


def _pack(flat: torch.Tensor, bucket: Bucket, grads: Sequence[torch.Tensor | None]) -> None:
    """Copy ``grads`` (one per parameter of ``bucket``; None: zeros) into ``flat``, at the
    bucket's offsets."""
    for grad, offset, n in zip(grads, bucket.offsets, bucket.numels):
        piece = flat[offset : offset + n]
        if grad is None:
            piece.zero_()
        else:
            piece.view(grad.shape).copy_(grad)


def _global_rank(group: _Group, rank: int) -> int:
    return dist.get_global_rank(group.pg, rank) if group.pg is not None else rank


# -- DataParallel -----------------------------------------------------------------------------


class DataParallel:
    """Data parallelism for a :class:`roundpipe.RoundPipe`, one process per rank.

    On construction every rank checks that all ranks built the same model, then takes rank
    0's masters, model parameters and buffers (a broadcast). From then on every ``model.step``
    first averages the masters' gradients over the ranks (bucketed async all-reduces on the
    optimizer thread, before ``step_fn``; see [Note: data-parallel step]), so the masters stay
    bitwise identical on every rank. Each rank feeds its own shard (:func:`shard`) and computes
    its loss as the mean over that shard, as in one process.

    With a model built with ``state_placement=ShardedState()``, each gradient is instead
    summed onto the rank that holds its master as the backward produces it (bucketed reduces
    per stage, on a reducer thread of this object's), that rank steps its share, and the
    master->model copy broadcasts the updated weights from their owners (see
    [Note: sharded state]): the masters are split over the ranks, the model parameters stay
    bitwise identical on every rank. Use :meth:`clip_grad_norm_` for a global norm.

    Args:
        model: the :class:`RoundPipe` to train.
        process_group: the group of ranks to average over (default: the world; with
            :class:`ShardedState`, its group).
        bucket_cap_mb: the largest all-reduce, in MiB (default 25).
        buckets_in_flight: all-reduces running at once; each has a reused flat buffer of up to
            ``bucket_cap_mb``, so the extra memory is about their product (default 2).
        device: where collectives run; default the current CUDA device for an NCCL group, else
            the CPU.

    Threads: construct it and call :meth:`close` on the main thread (both block); the
    all-reduce runs on the optimizer thread. The main thread touches ``model`` and the fields
    set in ``__init__``; the optimizer thread touches the buffers and step counter.
    """

    def __init__(
        self,
        model: RoundPipe,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        buckets_in_flight: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        check_main_thread("DataParallel", owner="roundpipe.distributed")
        if not callable(getattr(model, "register_step_pre_hook", None)):
            raise TypeError(
                f"DataParallel attaches to a roundpipe.RoundPipe, got {type(model).__name__}"
            )
        if model in _ATTACHED:
            raise RuntimeError("this RoundPipe already has a DataParallel; close() it first")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        if (
            not isinstance(buckets_in_flight, int)
            or isinstance(buckets_in_flight, bool)
            or buckets_in_flight < 1
        ):
            raise ValueError(f"buckets_in_flight must be an int >= 1, got {buckets_in_flight!r}")
        # Steps already launched run without data parallelism: let them finish before the
        # optimizer thread can see the group (its scaler check would otherwise issue a
        # collective that the other ranks, already past their steps, do not).
        optim_queue.wait_all()
        placement = model.state_placement
        self._shard = placement if isinstance(placement, ShardedState) else None
        if self._shard is not None:
            if process_group is not None and process_group is not self._shard._group.pg:
                raise ValueError(
                    "DataParallel(process_group=...) differs from the group of the model's "
                    "ShardedState: pass the same group to both (or neither, for the world)"
                )
            if self._shard.attached:
                raise RuntimeError("this model's ShardedState already has a DataParallel")
            self._group = _activate(self._shard._group.pg, device, group=self._shard._group)
        else:
            self._group = _activate(process_group, device)
        self._model = model
        params = self._params = model.state_access().params
        # Every gradient target: the masters, and with sharded state the stand-ins of the
        # masters other ranks hold (see [Note: sharded state]).
        named = [(r.name, r.master) for r in params.records if r.master is not None]
        self._masters = [m for _, m in named]
        self._held = [r.held for r in params.records if r.master is not None]
        self._cap = max(1, int(bucket_cap_mb * 2**20))
        self._owners: list[int | None] = (
            list(self._shard.owners) if self._shard is not None else [None] * len(named)
        )
        self._buckets, self._bucket_owners = _owner_buckets(named, self._owners, self._cap)
        self._in_flight = buckets_in_flight
        self._rings: dict[torch.dtype, list[torch.Tensor]] = {}
        self._steps = 0
        self._closed = False
        try:
            _on_optimizer_thread(self._join)
        except BaseException:
            _deactivate()
            raise
        # Sharded over several ranks, each call's gradients reach their owners as its backward
        # produces them (see [Note: sharded state] (b')); the owners' sums in .grad that no
        # other gradient was added to since, by master index: (tensor, its version). Optimizer
        # thread.
        self._reduced: dict[int, tuple[torch.Tensor, int]] = {}
        self._reducer: _StageReducer | None = None
        self._unregister_reducer: Callable[[], None] | None = None
        if self._shard is not None and self._group.world > 1:
            self._reducer = _StageReducer(self, self._group)
            self._unregister_reducer = model.register_grad_reducer(self._reducer)
        self._hook = model.register_step_pre_hook(self._reduce_gradients)
        # The scalers this model's steps use agree on overflows over the group (those already
        # seen at once, later ones at the launch that first uses them).
        self._scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self._scaler_hook = model.register_step_scaler_hook(self._join_scaler)
        _ATTACHED.add(model)
        if self._shard is not None:
            self._shard.attached = True

    @property
    def rank(self) -> int:
        """This process's rank in the group. Any thread; never blocks."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """How many ranks average their gradients. Any thread; never blocks."""
        return self._group.world

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in all-reduce order. Any thread; never blocks."""
        return list(self._buckets)

    def close(self) -> None:
        """Detach from the model (later steps use this rank's own gradients; a model with
        :class:`ShardedState` refuses to step until a DataParallel attaches again). Main
        thread; waits for the optimizer thread. Idempotent."""
        if self._closed:
            return
        optim_queue.wait_all()
        self._hook.remove()
        self._scaler_hook.remove()
        if self._reducer is not None:
            assert self._unregister_reducer is not None
            self._unregister_reducer()
            self._reducer.close()
        for scaler in list(self._scalers):
            if scaler.data_parallel is self:
                scaler.join_data_parallel(None)
        _ATTACHED.discard(self._model)
        self._closed = True
        if self._shard is not None:
            self._shard.attached = False
        _deactivate()

    def agree_found_inf(
        self, found_per_device: dict[torch.device, torch.Tensor], like: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """For a :class:`roundpipe.GradScaler` that joined this DataParallel (see
        [Note: data-parallel step] (c)): the per-device inf/NaN flags become one flag, the MAX
        over devices and ranks, on ``like``'s device. Thread that runs the scaler's back side;
        blocks for one all-reduce on the optimizer thread.

        Args:
            found_per_device: this rank's inf/NaN flags, one per device.
            like: a tensor on the device the agreed flag is returned on.
        """
        group = self._group
        local = torch.zeros((), dtype=torch.float32, device=like.device)
        for flag in found_per_device.values():
            local = torch.maximum(local, flag.to(like.device))

        def reduce() -> torch.Tensor:
            group.check_usable("the inf/NaN check of scaler.step")
            try:
                with group.device_scope():
                    t = local.to(group.device, copy=True).reshape(1)
                    group.wait(group.all_reduce(t, dist.ReduceOp.MAX))
                    return t.reshape(()).to(like.device)
            except Exception as exc:
                raise group.failed("the all-reduce of the scaler's inf/NaN flag", exc) from exc

        agreed = _on_optimizer_thread(reduce)
        # After the gradient all-reduce every rank has the same gradients, so the same devices.
        return {like.device: agreed} if found_per_device else {}

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, foreach: bool | None = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the masters of every rank, for use inside
        ``step_fn``: the norm is the global one. Replicated, every rank holds every averaged
        gradient and this is torch's clip of this rank's masters. With :class:`ShardedState`
        each rank takes the norm of each gradient it owns, one all-reduce gives every rank all
        of them (a vector with one entry per parameter, zeros where another rank owns it), and
        every rank takes their norm as torch does (``torch.linalg.vector_norm`` of the stacked
        per-tensor norms, in parameter order) and clips its own gradients by it
        (``torch.nn.utils.clip_grads_with_norm_``): the same total, bit for bit, as torch's
        clip of all the gradients in one process. Returns the total norm (a 0-d tensor).
        Optimizer thread (inside ``step_fn``; every rank calls it at the same point); blocks
        for one all-reduce when sharded.
        """
        if not optim_queue.on_optimizer_thread():
            raise RuntimeError(
                "DataParallel.clip_grad_norm_() runs inside step_fn (on the optimizer thread, "
                "where the averaged gradients are): model.step(lambda: (dp.clip_grad_norm_(1.0), "
                "opt.step(), opt.zero_grad()))"
            )
        held = [m for m in self._params.masters.values() if m.grad is not None]
        group = self._group
        if self._shard is None or group.world == 1:
            return torch.nn.utils.clip_grad_norm_(held, max_norm, norm_type, foreach=foreach)
        norm_type = float(norm_type)
        n = len(self._masters)
        # [norm of each gradient | 1 where it exists], filled at the owner, summed over ranks.
        mine = [i for i, m in enumerate(self._masters) if self._held[i] and m.grad is not None]
        grads = [g for g in (self._masters[i].grad for i in mine) if g is not None]
        norms: Sequence[torch.Tensor]
        if foreach:
            norms = torch._foreach_norm(grads, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        dtype = grads[0].dtype if grads else torch.float32
        vec = torch.zeros(2 * n, dtype=dtype)
        for i, v in zip(mine, norms):
            vec[i], vec[n + i] = v, 1
        group.check_usable("clip_grad_norm_()")
        try:
            with group.device_scope():
                t = vec.to(group.device)
                group.wait(group.all_reduce(t))
                vec = t.cpu()
        except Exception as exc:
            raise group.failed("the all-reduce of clip_grad_norm_()'s norms", exc) from exc
        present = vec[n:] > 0
        total = torch.linalg.vector_norm(torch.stack(list(vec[:n][present])), norm_type)
        if held:
            torch.nn.utils.clip_grads_with_norm_(held, max_norm, total, foreach=foreach)
        return total

    def _join_scaler(self, scaler: GradScaler) -> None:
        """Main thread, when a step of the model first uses ``scaler`` (a
        :class:`roundpipe.GradScaler`): it agrees on overflows over this group from then on."""
        scaler.join_data_parallel(self)
        self._scalers.add(scaler)

    def replicas_identical(self) -> bool:
        """Whether every rank's masters and model parameters are bitwise identical (a digest
        compared with one all-reduce, after every launched step; with :class:`ShardedState`,
        whose masters differ by rank, the model parameters only). A debugging check: main
        thread; blocks; every rank must call it."""
        _require_open(self)

        def check() -> bool:
            group = self._group
            group.check_usable("replicas_identical()")
            digest = hashlib.sha256()
            held = [] if self._shard is not None else self._masters
            for t in held + [p for p in self._model.module.parameters()]:
                digest.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            value = int.from_bytes(digest.digest()[:8], "little", signed=True) >> 1
            try:
                with group.device_scope():
                    return group.agree(value)
            except Exception as exc:
                raise group.failed("the replica check", exc) from exc

        return _on_optimizer_thread(check)

    # -- optimizer thread ---------------------------------------------------------------------
    def _join(self) -> None:
        """Construction, on the optimizer thread: check that every rank built the same model,
        then broadcast rank 0's state (see [Note: data-parallel step] (a))."""
        group, model = self._group, self._model
        # Sharded, the masters differ by rank: each rank takes its own from rank 0's params.
        masters = [] if self._shard is not None else list(model.optim_named_parameters())
        named = (
            [("master." + n, m) for n, m in masters]
            + [("param." + n, p) for n, p in model.module.named_parameters()]
            + [("buffer." + n, b) for n, b in model.module.named_buffers()]
        )
        layout = repr(
            [(n, tuple(t.shape), str(t.dtype)) for n, t in named] + [self._cap, self._owners]
        )
        fingerprint = (
            int.from_bytes(hashlib.sha256(layout.encode()).digest()[:8], "little", signed=True) >> 1
        )
        group.check_usable("DataParallel()")
        try:
            with group.device_scope(), torch.no_grad():
                same = group.agree(fingerprint)
                if same:
                    src = dist.get_global_rank(group.pg, 0) if group.pg is not None else 0
                    for bucket in plan_buckets(named, self._cap):
                        tensors = [named[i][1] for i in bucket.index]
                        flat = torch._utils._flatten_dense_tensors(
                            [t.detach() for t in tensors]
                        ).to(group.device)
                        group.wait(dist.broadcast(flat, src=src, group=group.pg, async_op=True))
                        for t, v in zip(
                            tensors, torch._utils._unflatten_dense_tensors(flat, tensors)
                        ):
                            t.copy_(v)
                    if self._shard is not None:
                        for rec in self._params.records:
                            if rec.master is not None and rec.held:
                                rec.master.copy_(rec.param)
                    self._params.placement.release()  # masters in files: pages written
        except Exception as exc:
            raise group.failed("DataParallel's start (model check and broadcast)", exc) from exc
        if not same:
            raise ValueError(
                f"{group.where()} the ranks built different models (parameter or buffer names, "
                f"shapes or dtypes, bucket_cap_mb, or the state placement differ); every rank "
                f"must build the same model and DataParallel"
            )

    def _ring(self, dtype: torch.dtype, slot: int) -> torch.Tensor:
        ring = self._rings.get(dtype)
        if ring is None:
            size = max(b.numel for b in self._buckets if b.dtype == dtype)
            ring = self._rings[dtype] = [
                torch.empty(size, dtype=dtype, device=self._group.device)
                for _ in range(self._in_flight)
            ]
        return ring[slot % len(ring)]

    def _reduce_gradients(self) -> None:
        """Optimizer thread, in the step work item before ``step_fn``: average every master's
        gradient over the ranks (see [Note: data-parallel step] (b))."""
        group = self._group
        what = f"the gradient all-reduce of step {self._steps} (counted from 0)"
        self._steps += 1
        group.check_usable(what)
        for m in self._masters:
            # Before any collective: every rank (same model) raises here alike, still in step.
            if m.grad is not None and m.grad.layout is not torch.strided:
                raise ValueError(
                    f"DataParallel averages dense gradients only; a master has a "
                    f"{m.grad.layout} gradient"
                )
        if not self._masters:
            return
        try:
            with group.device_scope(), torch.no_grad():
                if self._reducer is not None:
                    self._reduce_rest(group)
                else:
                    self._reduce(group)
        except Exception as exc:
            raise group.failed(what, exc) from exc

    def _install(self, result: Future) -> None:
        """Optimizer thread, the move of stages a :class:`_StageReducer` summed (behind a
        running step): add this rank's sums into its masters' ``.grad``."""
        sums = result.result()  # the reducer's DataParallelError, if it failed
        for i, value in sums:
            master = self._masters[i]
            if master.grad is None:
                master.grad = value
                self._reduced[i] = (value, value._version)
            else:
                pure = self._is_reduced(i)
                master.grad.add_(value)
                if pure:
                    self._reduced[i] = (master.grad, master.grad._version)

    def _is_reduced(self, i: int) -> bool:
        """Whether master ``i``'s ``.grad`` holds sums over the ranks only (optimizer thread)."""
        entry = self._reduced.get(i)
        grad = self._masters[i].grad
        return entry is not None and grad is entry[0] and grad._version == entry[1]

    def _reduce_rest(self, group: _Group) -> None:
        """The step's part of a sharded reduction whose calls summed their gradients as they
        ran (see [Note: sharded state] (b')): gradients that reached ``.grad`` another way (a
        differentiable ``forward()`` and ``backward()``) are summed onto their owners as in
        :meth:`_reduce`, with the owner's sums so far; then each owner divides by the world
        size."""
        masters = self._masters
        reduced = [self._is_reduced(i) for i in range(len(masters))]
        local = torch.tensor(
            [m.grad is not None and not r for m, r in zip(masters, reduced)],
            dtype=torch.float32,
            device=group.device,
        )
        group.wait(group.all_reduce(local))
        counts = local.tolist()
        rest = [
            (bucket, owner)
            for bucket, owner in zip(self._buckets, self._bucket_owners)
            if any(counts[i] for i in bucket.index)
        ]
        in_flight: collections.deque = collections.deque()
        done: set[int] = set()

        def finish() -> None:
            bucket, owner, flat, work = in_flight.popleft()
            group.wait(work)
            if owner != group.rank:
                return
            flat.div_(group.world)
            for i, offset, n in zip(bucket.index, bucket.offsets, bucket.numels):
                done.add(i)
                master = masters[i]
                if counts[i] == 0 and not reduced[i]:
                    continue  # no rank has a gradient: it stays None, as in one process
                value = flat[offset : offset + n].view(master.shape)
                if master.grad is None:
                    master.grad = value.to(master.device, copy=True)
                else:
                    master.grad.copy_(value)

        for slot, (bucket, owner) in enumerate(rest):
            if len(in_flight) == self._in_flight:
                finish()
            flat = self._ring(bucket.dtype, slot)[: bucket.numel]
            _pack(flat, bucket, [masters[i].grad for i in bucket.index])
            assert owner is not None  # sharded: every parameter has one
            work = dist.reduce(flat, dst=_global_rank(group, owner), group=group.pg, async_op=True)
            in_flight.append((bucket, owner, flat, work))
        while in_flight:
            finish()
        for i, (master, held) in enumerate(zip(masters, self._held)):
            if not held:
                master.grad = None  # its owner has the sum
            elif reduced[i] and i not in done:
                master.grad.div_(group.world)  # type: ignore[union-attr]
        self._reduced.clear()

    def _reduce(self, group: _Group) -> None:
        masters = self._masters
        present = torch.tensor(
            [m.grad is not None for m in masters], dtype=torch.float32, device=group.device
        )
        present_work = group.all_reduce(present)
        counts: list[float] | None = None
        in_flight: collections.deque = collections.deque()
        used: dict[torch.dtype, int] = collections.defaultdict(int)

        def finish() -> None:
            nonlocal counts
            bucket, owner, flat, work = in_flight.popleft()
            if counts is None:
                group.wait(present_work)
                counts = present.tolist()
            group.wait(work)
            if owner not in (None, group.rank):
                return  # summed onto its owner (see [Note: sharded state] (b'))
            flat.div_(group.world)
            for i, offset, n in zip(bucket.index, bucket.offsets, bucket.numels):
                master = masters[i]
                if counts[i] == 0:
                    continue  # no rank has a gradient: it stays None, as in one process
                value = flat[offset : offset + n].view(master.shape)
                if master.grad is None:
                    master.grad = value.to(master.device, copy=True)
                else:
                    master.grad.copy_(value)

        for bucket, owner in zip(self._buckets, self._bucket_owners):
            if len(in_flight) == self._in_flight:
                finish()
            flat = self._ring(bucket.dtype, used[bucket.dtype])[: bucket.numel]
            used[bucket.dtype] += 1
            _pack(flat, bucket, [masters[i].grad for i in bucket.index])
            if owner is None:
                work = group.all_reduce(flat)
            else:
                work = dist.reduce(
                    flat, dst=_global_rank(group, owner), group=group.pg, async_op=True
                )
            in_flight.append((bucket, owner, flat, work))
        while in_flight:
            finish()
        if counts is None:
            group.wait(present_work)
        for master, held in zip(masters, self._held):
            if not held:
                master.grad = None  # its owner has the sum


def _owner_buckets(
    named: Sequence[tuple[str, torch.Tensor]], owners: Sequence[int | None], cap_bytes: int
) -> tuple[list[Bucket], list[int | None]]:
    """The gradient buckets and each one's owner (None: all-reduced): :func:`plan_buckets` over
    each owner's tensors, so that a bucket is summed onto one rank; ``index`` stays the
    position in ``named``."""
    buckets: list[Bucket] = []
    bucket_owners: list[int | None] = []
    for owner in dict.fromkeys(owners):
        positions = [i for i, o in enumerate(owners) if o == owner]
        for b in plan_buckets([named[i] for i in positions], cap_bytes):
            buckets.append(dataclasses.replace(b, index=tuple(positions[j] for j in b.index)))
            bucket_owners.append(owner)
    return buckets, bucket_owners


def _require_open(dp: DataParallel) -> None:
    if dp._closed:
        raise RuntimeError("this DataParallel was closed; create a new one to average again")
