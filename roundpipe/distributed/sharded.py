"""ShardedState: the masters, their gradients and the optimizer state sharded over the
data-parallel ranks, and the stage reducer that sums each stage's gradients onto their owners as
the backward produces them. See [Note: sharded state]."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from roundpipe.distributed.buckets import owner_buckets, pack
from roundpipe.distributed.group import Group, device_scope, global_rank
from roundpipe.main_thread import check_main_thread
from roundpipe.optim.master_file import MastersOnDisk
from roundpipe.runtime.placement import MasterPlacement, shard_by_bytes
from roundpipe.threads.workers import Future

__all__ = ["ShardedState", "StageReducer"]


# [Note: sharded state]
# With RoundPipe(..., state_placement=ShardedState()) each rank owns some trainable parameters,
# whole ones balanced by bytes (shard_by_bytes: decided at construction, the same on every rank).
# The rest have stand-ins ([Note: state placement] in roundpipe.runtime.placement).
#
#   state            where it lives                     host bytes per parameter (Adam, fp32)
#   low-precision    every rank, bitwise identical      2
#   masters, .grad   the owner                          (4 + 4) / N
#   optimizer state  the owner (built on its masters)   8 / N
#
# Two parts of [Note: data-parallel step] (roundpipe.distributed.data_parallel) change:
#   (b') the gradients. Every rank computes all of its gradients. Each forward_backward hands
#        each stage's sums, as the stage finishes, to the StageReducer instead of the masters.
#        The reducer is a thread with a process group of its own, so its collectives never
#        interleave with the optimizer thread's. It sums them onto their owners with one
#        dist.reduce per bucket of one owner's parameters (gloo's reduce_scatter would need one
#        collective over every owner's chunk; a reduce per bucket moves the same bytes). Each
#        bucket carries one count per parameter: how many ranks had a gradient (none: it stays
#        None).
#        - Order: a stage is handed over only once every stage above it is reduced, so stages
#          arrive in descending order whatever order the workers finish them in, and a rank
#          holds two stages' sums at most (the one being reduced, the one the backward fills).
#          A failed call hands the stages it did not reach as no gradients (its waiting
#          hand-overs are woken), so every rank reduces the same stages in the same order.
#        - A rank keeps its owned sums and drops the rest at once. The call's gradient moves,
#          behind a running step on the optimizer thread, add the sums into the masters' .grad.
#        - In the step work item, before step_fn, each owner divides by the world size.
#          Gradients that reached .grad another way (a differentiable forward() and backward())
#          are summed onto their owners there first, with the owners' sums so far.
#   (d)  the weights. The master->model copy (Params.copy_masters_to_model, launched by step as
#        before, so at the same point of [Note: staleness]) runs through
#        ShardedState.copy_layer: per layer, each owner casts its masters into the model's
#        low-precision parameters and broadcasts them (one flat broadcast per owner and dtype)
#        into every other rank's, before the layer's "params ready" event.
#
# Unchanged or equal:
#   - the scaler's flag (c): each rank checks the gradients it owns; the MAX over the ranks is
#     the one decision.
#   - bitwise results: a rank's sum of two ranks' gradients is a + b on both paths, so with 2
#     ranks the masters equal the replicated run's; with more, where gloo's reduce adds in the
#     order of its all-reduce (it did at 4 ranks in tests/test_sharded_state.py).
#   - DataParallel.clip_grad_norm_ all-reduces the per-tensor norms, each filled in by its
#     owner, and reduces them as torch does: torch's norm of all the gradients, bit for bit.
#   - model.synchronize(), model.step() and load_state_dict() copy masters into the model:
#     collectives, so every rank calls them at the same point of its loop (as it calls step).


class ShardedState(MasterPlacement):
    """A state placement that shards the masters, their gradients (after each step's reduction)
    and the optimizer state over the data-parallel ranks: pass it as
    ``RoundPipe(..., state_placement=ShardedState())`` on every rank, then attach a
    :class:`DataParallel` as usual (see [Note: sharded state]).

    Each rank holds the masters of a share of the trainable parameters (whole parameters,
    balanced by bytes: :func:`roundpipe.runtime.placement.shard_by_bytes`), and
    ``model.optim_parameters()`` yields those only, so the optimizer built on them holds the
    state of that share only. Each ``forward_backward`` sums each stage's gradients onto their
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
        self._group = Group(process_group, device)
        self._owners: list[int] | None = None
        self._owner_of: dict[int, int] = {}
        self.attached = False

    @property
    def group(self) -> Group:
        """The process group the state is sharded over (with its timeout and broken state), the
        one the :class:`roundpipe.distributed.DataParallel` attached to the model uses. Any
        thread; never blocks."""
        return self._group

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

    def copy_layer(self, pairs: Any, done: AbstractSet[int] = frozenset()) -> None:
        """Optimizer thread, in the master->model copy: cast the held masters into the
        model's parameters, then broadcast each owner's parameters of the layer to the other
        ranks (see [Note: sharded state] (d)). A collective; raises
        :class:`DataParallelError` if it fails."""
        if self._files is not None:
            self._files.copy_layer(pairs, done)
        else:
            super().copy_layer(pairs, done)
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
                            flat, src=global_rank(group, owner), group=group.pg, async_op=True
                        )
                    )
                    if owner != group.rank:
                        for p, v in zip(
                            params, torch._utils._unflatten_dense_tensors(flat, params)
                        ):
                            p.copy_(v)
        except Exception as exc:
            raise group.failed(what, exc) from exc


class StageReducer:
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
    :class:`roundpipe.threads.workers.Future`. :meth:`close` on the main thread, with no call running.
    """

    def __init__(
        self,
        group: Group,
        masters: Sequence[torch.Tensor],
        owners: Sequence[int | None],
        cap_bytes: int,
        in_flight: int,
        install: Callable[[Future], None],
    ) -> None:
        # What it needs of the DataParallel that made it: every gradient target (the masters
        # and the stand-ins of those other ranks hold), their owners, the bucket cap, how many
        # reduces may run at once, and the move that adds a submission's sums into .grad.
        self._masters = list(masters)
        self._owners = list(owners)
        self._cap = cap_bytes
        self._in_flight = in_flight
        self._install = install
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
        self._index = {id(m): i for i, m in enumerate(self._masters)}
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
        install = self._install

        def install_reduced_grads() -> None:
            install(result)

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
        group = self._group
        what = "the gradient reduce of a stage during forward_backward"
        group.check_usable(what)
        if arrived is not None:
            arrived.synchronize()  # the download from the accelerator
        index = [self._index[id(master)] for master, _ in pairs]
        named = [(str(i), self._masters[i]) for i in index]
        buckets, owners = owner_buckets(named, [self._owners[i] for i in index], self._cap)
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
                    master = self._masters[index[j]]
                    value = data[offset : offset + n].view(master.shape)
                    alone = len(bucket.index) == 1 and value.device == master.device
                    sums.append((index[j], value if alone else value.to(master.device, copy=True)))

        try:
            with device_scope(self._device), torch.no_grad():
                for slot, (bucket, owner) in enumerate(zip(buckets, owners)):
                    if len(in_flight) == self._in_flight:
                        finish()
                    assert owner is not None  # sharded: every parameter has one
                    dst = dist.get_global_rank(self._pg, owner)
                    present = [pairs[j][1] is not None for j in bucket.index]
                    if len(bucket.index) == 1:
                        grad = pairs[bucket.index[0]][1]
                        master = self._masters[index[bucket.index[0]]]
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
                        data = self._flat(bucket.dtype, slot % self._in_flight, n + len(present))
                        pack(data, bucket, [pairs[j][1] for j in bucket.index])
                        counts = data[n:]
                        counts.copy_(torch.tensor(present, dtype=bucket.dtype))
                        works = [dist.reduce(data, dst=dst, group=self._pg, async_op=True)]
                    in_flight.append((bucket, owner, data, counts, works))
                while in_flight:
                    finish()
        except Exception as exc:
            raise group.failed(what, exc) from exc
        return sums
