"""The data-parallel process group as roundpipe uses it: :func:`init_process_group`, a batch's
shard of this rank (:func:`shard`), :class:`Group` (a process group with its device, timeout and
broken state), the process's active group that checkpoints gather over, and
:class:`DataParallelError`.

Only the optimizer thread (and a :class:`roundpipe.distributed.sharded.StageReducer`'s own
thread, on a group of its own) issues collectives: see [Note: data-parallel step] in
:mod:`roundpipe.distributed.data_parallel`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils import _pytree as pytree

from roundpipe.threads import optimizer_thread

__all__ = [
    "DataParallelError",
    "Group",
    "init_process_group",
    "shard",
    "device_scope",
    "global_rank",
    "run_on_optimizer_thread",
    "activate",
    "deactivate",
    "active_group",
    "data_parallel_rank",
]


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


class Group:
    """A process group plus what roundpipe needs around it: the device collectives run on, the
    timeout, and whether a collective failed. ``broken`` is written and read on the optimizer
    thread and on a :class:`StageReducer`'s thread (one str, set once by :meth:`failed`)."""

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
        return device_scope(self.device)

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


def run_on_optimizer_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the optimizer thread (the only thread that issues collectives, see
    [Note: data-parallel step]) and return its result; from another thread, launch and wait."""
    if optimizer_thread.on_optimizer_thread():
        return fn()
    return _wait_result(optimizer_thread.launch_item(fn))


def _wait_result(item: optimizer_thread.WorkItem) -> Any:
    # Reported here, once: a wait that leaves the failure unclaimed raises it and leaves it in
    # the optimizer thread's list too, which prints it again at exit as never waited for.
    item.wait()
    return item.result()


# The data-parallel group of this process, shared by every DataParallel in it, for checkpoints
# (data_parallel_rank, gather_bytes). A GradScaler agrees over the DataParallel it joined, not
# over this. Written on the main thread (DataParallel construction and close), read on the
# optimizer thread.
_ACTIVE_LOCK = threading.Lock()
_ACTIVE: Group | None = None
_ACTIVE_USERS = 0


def activate(
    process_group: ProcessGroup | None,
    device: torch.device | str | None,
    group: Group | None = None,
) -> Group:
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
            _ACTIVE = group if group is not None else Group(process_group, device)
        _ACTIVE_USERS += 1
        return _ACTIVE


def deactivate() -> None:
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


def active_group() -> Group | None:
    """This process's data-parallel group (that of its open :class:`DataParallel`), None
    without one. Any thread; never blocks."""
    return _ACTIVE


def global_rank(group: Group, rank: int) -> int:
    return dist.get_global_rank(group.pg, rank) if group.pg is not None else rank


def device_scope(device: torch.device) -> Any:
    # The current CUDA device is per thread: a thread that runs collectives selects it itself.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
