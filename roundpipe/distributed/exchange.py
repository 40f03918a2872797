"""Bytes between ranks for checkpoints: gathers over the process's active data-parallel group
(:func:`gather_bytes`, :func:`all_gather_bytes`, :func:`union_over_ranks`), and messages to rank 0
through the process group's store (:func:`post_to_rank0`, :func:`collect_on_rank0`), which the
checkpoint's writer threads use where collectives cannot run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from roundpipe.distributed.group import (
    DataParallelError,
    active_group,
    global_rank,
    run_on_optimizer_thread,
)
from roundpipe.threads import optimizer_thread

__all__ = [
    "gather_bytes",
    "all_gather_bytes",
    "union_over_ranks",
    "post_to_rank0",
    "collect_on_rank0",
]


def gather_bytes(payload: bytes, what: str) -> list[bytes] | None:
    """Every rank's ``payload`` on rank 0 (in rank order), None on the other ranks and
    ``[payload]`` without data parallelism. A collective: every rank calls it at the same
    point of its launched work (a checkpoint's work item), on the optimizer thread. Raises
    :class:`DataParallelError` naming ``what`` if it fails."""
    parts = all_gather_bytes(payload, what)
    group = active_group()
    return parts if group is None or group.rank == 0 else None


def all_gather_bytes(payload: bytes, what: str) -> list[bytes]:
    """Every rank's ``payload`` on every rank (in rank order); ``[payload]`` without data
    parallelism. A collective, as :func:`gather_bytes`."""
    group = active_group()
    if group is None:
        return [payload]
    if not optimizer_thread.on_optimizer_thread():
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
    if active_group() is None:
        return list(dict.fromkeys(items))
    payload = "\n".join(items).encode()
    parts = run_on_optimizer_thread(lambda: all_gather_bytes(payload, what))
    return list(dict.fromkeys(line for part in parts for line in part.decode().split("\n") if line))


# [Note: messages to rank 0]
# A sharded checkpoint is written by every rank's writer thread, and rank 0 may write its
# manifest only after every rank's files are complete. The writer threads cannot use
# collectives (only the optimizer thread issues them, in launch order: see
# [Note: data-parallel step] in roundpipe.distributed.data_parallel), so each rank posts a message under a key of its own to the
# process group's key-value store (torch.distributed's rendezvous store, which every rank
# already reaches) and rank 0 blocks in the store's own wait for the keys, bounded by the
# process group's timeout: no polling, and a rank that died makes rank 0's wait fail after
# that timeout instead of hanging.


def _store() -> Any:
    group = active_group()
    if group is None:
        raise RuntimeError("no data-parallel group: messages to rank 0 need a DataParallel")
    ranks = "-".join(str(global_rank(group, r)) for r in range(group.world))
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
