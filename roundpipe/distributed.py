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
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils import _pytree as pytree

from roundpipe import optim_queue
from roundpipe.grad_scaler import GradScaler
from roundpipe.main_thread import check_main_thread
from roundpipe.runtime.model import RoundPipe

__all__ = [
    "DataParallel",
    "DataParallelError",
    "Bucket",
    "data_parallel_rank",
    "gather_bytes",
    "init_process_group",
    "plan_buckets",
    "shard",
]


# [Note: data-parallel step]
# Every rank runs the same loop, so every rank launches the same work on its optimizer thread in
# the same order. Only the optimizer thread issues collectives (construction and the found_inf
# agreement launch theirs there and wait), so the collectives of all ranks pair up in launch
# order:
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
    thread only."""

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
        # The current CUDA device is per thread: the optimizer thread must select it itself.
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

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


def _activate(process_group: ProcessGroup | None, device: torch.device | str | None) -> _Group:
    global _ACTIVE, _ACTIVE_USERS
    with _ACTIVE_LOCK:
        if _ACTIVE is not None:
            if _ACTIVE.pg is not process_group:
                raise RuntimeError(
                    "another DataParallel in this process uses a different process group; one "
                    "data-parallel group per process (checkpoints gather over it): pass the same "
                    "process_group, or close() the other DataParallel first"
                )
        else:
            _ACTIVE = _Group(process_group, device)
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
    group = _ACTIVE
    if group is None:
        return [payload]
    if not optim_queue.on_optimizer_thread():
        raise RuntimeError("gather_bytes() runs on the optimizer thread (in launched work)")
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
    if group.rank != 0:
        return None
    return [bytes(p[: int(n.item())].cpu().numpy()) for p, n in zip(parts, sizes)]


# -- DataParallel -----------------------------------------------------------------------------


class DataParallel:
    """Data parallelism for a :class:`roundpipe.RoundPipe`, one process per rank.

    On construction every rank checks that all ranks built the same model, then takes rank
    0's masters, model parameters and buffers (a broadcast). From then on every ``model.step``
    first averages the masters' gradients over the ranks (bucketed async all-reduces on the
    optimizer thread, before ``step_fn``; see [Note: data-parallel step]), so the masters stay
    bitwise identical on every rank. Each rank feeds its own shard (:func:`shard`) and computes
    its loss as the mean over that shard, as in one process.

    Args:
        model: the :class:`RoundPipe` to train.
        process_group: the group of ranks to average over (default: the world).
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
        self._group = _activate(process_group, device)
        self._model = model
        self._masters = [m for _, m in model.optim_named_parameters()]
        self._cap = max(1, int(bucket_cap_mb * 2**20))
        self._buckets = plan_buckets(model.optim_named_parameters(), self._cap)
        self._in_flight = buckets_in_flight
        self._rings: dict[torch.dtype, list[torch.Tensor]] = {}
        self._steps = 0
        self._closed = False
        try:
            _on_optimizer_thread(self._join)
        except BaseException:
            _deactivate()
            raise
        self._hook = model.register_step_pre_hook(self._reduce_gradients)
        # The scalers this model's steps use agree on overflows over the group (those already
        # seen at once, later ones at the launch that first uses them).
        self._scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self._scaler_hook = model.register_step_scaler_hook(self._join_scaler)
        _ATTACHED.add(model)

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
        """Detach from the model (later steps use this rank's own gradients). Main thread;
        waits for the optimizer thread. Idempotent."""
        if self._closed:
            return
        optim_queue.wait_all()
        self._hook.remove()
        self._scaler_hook.remove()
        for scaler in list(self._scalers):
            if scaler.data_parallel is self:
                scaler.join_data_parallel(None)
        _ATTACHED.discard(self._model)
        self._closed = True
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

    def _join_scaler(self, scaler: GradScaler) -> None:
        """Main thread, when a step of the model first uses ``scaler`` (a
        :class:`roundpipe.GradScaler`): it agrees on overflows over this group from then on."""
        scaler.join_data_parallel(self)
        self._scalers.add(scaler)

    def replicas_identical(self) -> bool:
        """Whether every rank's masters and model parameters are bitwise identical (a digest
        compared with one all-reduce, after every launched step). A debugging check: main
        thread; blocks; every rank must call it."""
        _require_open(self)

        def check() -> bool:
            group = self._group
            group.check_usable("replicas_identical()")
            digest = hashlib.sha256()
            for t in self._masters + [p for p in self._model.module.parameters()]:
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
        named = (
            [("master." + n, m) for n, m in model.optim_named_parameters()]
            + [("param." + n, p) for n, p in model.module.named_parameters()]
            + [("buffer." + n, b) for n, b in model.module.named_buffers()]
        )
        layout = repr([(n, tuple(t.shape), str(t.dtype)) for n, t in named] + [self._cap])
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
        except Exception as exc:
            raise group.failed("DataParallel's start (model check and broadcast)", exc) from exc
        if not same:
            raise ValueError(
                f"{group.where()} the ranks built different models (parameter or buffer names, "
                f"shapes or dtypes, or bucket_cap_mb differ); every rank must build the same "
                f"model and DataParallel"
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
                self._reduce(group)
        except Exception as exc:
            raise group.failed(what, exc) from exc

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
            bucket, flat, work = in_flight.popleft()
            if counts is None:
                group.wait(present_work)
                counts = present.tolist()
            group.wait(work)
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

        for bucket in self._buckets:
            if len(in_flight) == self._in_flight:
                finish()
            flat = self._ring(bucket.dtype, used[bucket.dtype])[: bucket.numel]
            used[bucket.dtype] += 1
            for i, offset, n in zip(bucket.index, bucket.offsets, bucket.numels):
                grad = masters[i].grad
                piece = flat[offset : offset + n]
                if grad is None:
                    piece.zero_()
                else:
                    piece.view(grad.shape).copy_(grad)
            in_flight.append((bucket, flat, group.all_reduce(flat)))
        while in_flight:
            finish()
        if counts is None:
            group.wait(present_work)


def _require_open(dp: DataParallel) -> None:
    if dp._closed:
        raise RuntimeError("this DataParallel was closed; create a new one to average again")
