"""DataParallel: attach data parallelism to a RoundPipe; average (or, with sharded state, sum
onto their owners) the gradients before each step, agree on overflows, clip globally. See
[Note: data-parallel step]."""

from __future__ import annotations

import collections
import hashlib
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from roundpipe.distributed.buckets import Bucket, owner_buckets, pack, plan_buckets
from roundpipe.distributed.group import (
    Group,
    activate,
    deactivate,
    global_rank,
    run_on_optimizer_thread,
)
from roundpipe.distributed.sharded import ShardedState, StageReducer
from roundpipe.main_thread import check_main_thread
from roundpipe.memory.host import DATA_PARALLEL_BUCKET_BYTES, DATA_PARALLEL_IN_FLIGHT
from roundpipe.runtime.call_memory import attach_data_parallel, data_parallel_buckets
from roundpipe.runtime.model import RoundPipe
from roundpipe.scaler.grad_scaler import GradScaler
from roundpipe.threads import optimizer_thread
from roundpipe.threads.workers import Future

__all__ = ["DataParallel"]


# [Note: data-parallel step]
# Every rank runs the same loop, so every rank launches the same work on its optimizer thread in
# the same order. Only the optimizer thread issues collectives on the group (construction and
# the found_inf agreement launch theirs there and wait; sharded state's stage reducer has a
# process group of its own, see [Note: sharded state] in
# roundpipe.distributed.sharded), so the collectives of all ranks pair up
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
    master->model copy broadcasts the updated weights from their owners (see [Note: sharded
    state] in :mod:`roundpipe.distributed.sharded`): the masters are split over the ranks, the
    model parameters stay bitwise identical on every rank. Use :meth:`clip_grad_norm_` for a global norm.

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
        bucket_cap_mb: float = DATA_PARALLEL_BUCKET_BYTES / 2**20,
        buckets_in_flight: int = DATA_PARALLEL_IN_FLIGHT,
        device: torch.device | str | None = None,
    ) -> None:
        check_main_thread("DataParallel", owner="roundpipe.distributed")
        if not callable(getattr(model, "register_step_pre_hook", None)):
            raise TypeError(
                f"DataParallel attaches to a roundpipe.RoundPipe, got {type(model).__name__}"
            )
        if data_parallel_buckets(model) is not None:
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
        optimizer_thread.wait_all()
        placement = model.state_placement
        self._shard = placement if isinstance(placement, ShardedState) else None
        if self._shard is not None:
            if process_group is not None and process_group is not self._shard.group.pg:
                raise ValueError(
                    "DataParallel(process_group=...) differs from the group of the model's "
                    "ShardedState: pass the same group to both (or neither, for the world)"
                )
            if self._shard.attached:
                raise RuntimeError("this model's ShardedState already has a DataParallel")
            self._group = activate(self._shard.group.pg, device, group=self._shard.group)
        else:
            self._group = activate(process_group, device)
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
        self._buckets, self._bucket_owners = owner_buckets(named, self._owners, self._cap)
        self._in_flight = buckets_in_flight
        self._rings: dict[torch.dtype, list[torch.Tensor]] = {}
        self._steps = 0
        self._closed = False
        try:
            run_on_optimizer_thread(self._join)
        except BaseException:
            deactivate()
            raise
        # Sharded over several ranks, each call's gradients reach their owners as its backward
        # produces them (see [Note: sharded state] (b')); the owners' sums in .grad that no
        # other gradient was added to since, by master index: (tensor, its version). Optimizer
        # thread.
        self._reduced: dict[int, tuple[torch.Tensor, int]] = {}
        self._reducer: StageReducer | None = None
        self._unregister_reducer: Callable[[], None] | None = None
        if self._shard is not None and self._group.world > 1:
            self._reducer = StageReducer(
                self._group, self._masters, self._owners, self._cap, self._in_flight, self._install
            )
            self._unregister_reducer = model.register_grad_reducer(self._reducer)
        self._hook = model.register_step_pre_hook(self._reduce_gradients)
        # The scalers this model's steps use agree on overflows over the group (those already
        # seen at once, later ones at the launch that first uses them).
        self._scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        self._scaler_hook = model.register_step_scaler_hook(self._join_scaler)
        attach_data_parallel(model, (self._cap, self._in_flight))
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
        optimizer_thread.wait_all()
        self._hook.remove()
        self._scaler_hook.remove()
        if self._reducer is not None:
            assert self._unregister_reducer is not None
            self._unregister_reducer()
            self._reducer.close()
        for scaler in list(self._scalers):
            if scaler.data_parallel is self:
                scaler.join_data_parallel(None)
        attach_data_parallel(self._model, None)
        self._closed = True
        if self._shard is not None:
            self._shard.attached = False
        deactivate()

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

        agreed = run_on_optimizer_thread(reduce)
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
        if not optimizer_thread.on_optimizer_thread():
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

        return run_on_optimizer_thread(check)

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
            if m.grad is not None and m.grad.dtype != m.dtype:
                raise ValueError(
                    f"DataParallel sums the gradients in the masters' dtype; a master has a "
                    f"{m.grad.dtype} gradient (roundpipe.optim.Adam(grad_dtype=...)): leave "
                    f"grad_dtype=None under DataParallel, see "
                    f"[Note: gradients in their summed dtype] in roundpipe/runtime/grad_router.py"
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
        """Optimizer thread, the move of stages a :class:`StageReducer` summed (behind a
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

    def _reduce_rest(self, group: Group) -> None:
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
            pack(flat, bucket, [masters[i].grad for i in bucket.index])
            assert owner is not None  # sharded: every parameter has one
            work = dist.reduce(flat, dst=global_rank(group, owner), group=group.pg, async_op=True)
            in_flight.append((bucket, owner, flat, work))
        while in_flight:
            finish()
        for i, (master, held) in enumerate(zip(masters, self._held)):
            if not held:
                master.grad = None  # its owner has the sum
            elif reduced[i] and i not in done:
                master.grad.div_(group.world)  # type: ignore[union-attr]
        self._reduced.clear()

    def _reduce(self, group: Group) -> None:
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
            pack(flat, bucket, [masters[i].grad for i in bucket.index])
            if owner is None:
                work = group.all_reduce(flat)
            else:
                work = dist.reduce(
                    flat, dst=global_rank(group, owner), group=group.pg, async_op=True
                )
            in_flight.append((bucket, owner, flat, work))
        while in_flight:
            finish()
        if counts is None:
            group.wait(present_work)
        for master, held in zip(masters, self._held):
            if not held:
                master.grad = None  # its owner has the sum


def _require_open(dp: DataParallel) -> None:
    if dp._closed:
        raise RuntimeError("this DataParallel was closed; create a new one to average again")
