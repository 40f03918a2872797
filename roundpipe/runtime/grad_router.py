"""The gradient router: the only way a gradient reaches a master's ``.grad`` (see
[Note: gradient accumulation]).

* Per call (:class:`CallGrads`): per stage, one buffer per trainable parameter (the master's
  dtype, or ``device_grad_dtype`` on an accelerator), summed microbatch by microbatch
  (:func:`sum_into`), then handed to the optimizer thread in one work item per stage
  (:meth:`CallGrads.move`), downloaded first from an accelerator (:meth:`CallGrads.download`).
* Per model (:class:`GradHooks`): a fused plan's backward accumulates into the model params'
  ``.grad``, and their post-accumulate hooks take it at once into the call's buffers (a
  :class:`GradSink`); outside a fused call (a differentiable ``forward()`` and ``backward()``)
  they launch one move per gradient (:class:`PendingMoves`).
* On the optimizer thread: :func:`move_grads`, :func:`accumulate_grad`, :func:`clear_grads`.
* A :class:`GradReducer` (sharded data parallelism) takes a call's stage sums instead of the
  masters: it sums them over the processes as the backward produces them, and its move then
  hands each process the sums of the masters it holds (see [Note: gradient accumulation]).

Threads: a call's buffers belong to the stage's worker until their move is launched, then to the
optimizer thread; the masters' ``.grad`` to the optimizer thread.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from roundpipe.devices import StreamingBackend
from roundpipe.runtime.params import ParamRecord
from roundpipe.scaler import finite_check
from roundpipe.threads import optimizer_thread

# What a gradient move or clear changes (see [Note: holds] in roundpipe.threads.optimizer_thread).
TOUCHES_GRADS = ("grads",)

__all__ = [
    "TOUCHES_GRADS",
    "CallGrads",
    "GradHooks",
    "GradReducer",
    "GradSink",
    "move_grads",
    "accumulate_grad",
    "clear_grads",
    "grad_dtype_of",
    "torch_has_grad_dtype",
    "sum_into",
    "storage_counts",
    "stash_grads",
]


# [Note: gradient accumulation]
# Gradients accumulate in optim_dtype. In forward_backward the worker of a stage sums the
# microbatch gradients of each of its params into a buffer of the master's dtype and layout
# (microbatch 0 copied, the others added, in microbatch order: one worker runs a stage's actions
# in order, so the sum is bitwise the same for any number of workers). After the last microbatch
# one work item hands the stage's sums to the optimizer thread: each buffer becomes master.grad
# if that is None (no copy), else it is added to it. One item per stage and call, instead of one
# per microbatch, keeps the optimizer thread free for the step that runs concurrently (async
# mode): the moves queue behind that step, and only they remain when it ends.
# The buffer is owned by the worker until the move is launched, then by the optimizer thread.
# On an accelerator the buffer lives on the device and the plan's D action downloads it once;
# with RoundPipeRunConfig(device_grad_dtype=...) it has that dtype there (the stage's
# low-precision dtype halves or quarters it against fp32) and the masters receive it converted.
# With a GradReducer (the model's, registered by roundpipe.distributed for sharded state), the
# stage's sums go to the reducer instead, every trainable param of the stage included (None where
# this process has no gradient: other processes may have one), and the launched move is the
# reducer's install of what it summed; the call hands the reducer, at its end, every stage it
# did not (as no gradients), so that every process hands over the same stages, whatever failed.


# [Note: gradients in their summed dtype]
# A master's gradient is in the master's dtype, unless the optimizer asked for another:
# roundpipe.optim.Adam(grad_dtype=torch.bfloat16) sets each master's grad_dtype (torch's
# attribute, 2.10 and newer), and the moves then hand the device's sums over in it. With
# RoundPipeRunConfig(device_grad_dtype=torch.bfloat16) the downloaded bf16 sums become .grad
# as they are: no fp32 copy (4 bytes a parameter of host RAM, and a pass over them), and the
# step reads 2 bytes a parameter instead of 4, with the same results, since Adam's kernels read
# each bf16 value as the fp32 value it is ([Note: low-precision gradients] in
# roundpipe/optim/_step_kernels.cpp). Exact as long as one call's sums are all a step sees:
# the sums of several calls before one step are added in that dtype on the host, as the
# device adds the microbatches'. The data-parallel reduction sums in the masters' dtype, so
# DataParallel refuses such masters.
def torch_has_grad_dtype() -> bool:
    """Whether this torch's tensors have ``grad_dtype`` (2.10 and newer), which a master needs
    to hold its gradient in another dtype (see [Note: gradients in their summed dtype])."""
    return hasattr(torch.empty(0), "grad_dtype")


def grad_dtype_of(master: torch.Tensor) -> torch.dtype:
    """The dtype ``master``'s ``.grad`` must have: its ``grad_dtype`` where torch has it and it
    is set, else its own (see [Note: gradients in their summed dtype])."""
    dtype = getattr(master, "grad_dtype", None)
    return master.dtype if dtype is None else dtype


def move_grads(
    pairs: list[tuple[nn.Parameter, torch.Tensor]],
    arrived: torch.Event | None = None,
    nonfinite_flag: torch.Tensor | None = None,
) -> None:
    """Optimizer thread: hand a stage's summed gradients of a call (tensors nobody else holds)
    to the masters; first wait for their download (``arrived``) from an accelerator, with
    ``nonfinite_flag``, the device's inf/NaN check of them (see [Note: checked on the device]
    in :mod:`roundpipe.scaler.finite_check`)."""
    if arrived is not None:
        arrived.synchronize()
    found, largest = None, None
    if nonfinite_flag is not None:  # [inf/NaN found (1.0 or 0.0), the largest magnitude]
        found_value, largest_value = nonfinite_flag.tolist()
        found = bool(found_value)
        largest = None if found else largest_value
    for master, grad in pairs:
        if master.grad is not None:
            before = finite_check.nonfinite(master.grad)
            before_largest = finite_check.bound(master.grad)
            master.grad.add_(grad)
            if before or found:  # a known inf/NaN stays known
                finite_check.mark(master.grad, True)
            elif finite_check.sum_stays_finite(before_largest, largest, master.grad.dtype):
                assert before_largest is not None and largest is not None
                finite_check.mark(master.grad, False, before_largest + largest)
            else:  # finite + finite may overflow: unknown, the host checks it
                finite_check.mark(master.grad, None)
        else:
            dtype = grad_dtype_of(master)
            if grad.dtype != dtype:  # summed on the device in device_grad_dtype
                grad = grad.to(dtype)
            master.grad = grad
            finite_check.mark(grad, found, largest)


def accumulate_grad(master: nn.Parameter, grad: torch.Tensor) -> None:
    """Optimizer thread: a gradient that autograd accumulated into a model parameter
    (differentiable forward); copied first, it may be any dtype or layout."""
    if master.grad is None:
        master.grad = torch.empty_like(master, dtype=grad_dtype_of(master)).copy_(grad)
    else:
        master.grad.add_(grad)


def clear_grads(masters: Sequence[nn.Parameter]) -> None:
    """Optimizer thread: drop the masters' gradients."""
    for m in masters:
        m.grad = None


def storage_counts(tensors: Sequence[Any]) -> dict[int, int]:
    """How many of ``tensors`` (the same object counted each time it occurs) use each storage."""
    counts: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    return counts


def _can_adopt(g: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``g`` has the buffer's ``dtype`` and the master's layout, alone in a storage of
    exactly its size (autograd often returns a transposed view instead), so that it can become
    the accumulation buffer itself. Whether another tensor shares that storage is the caller's."""
    return (
        g.dtype == dtype
        and g.shape == master.shape
        and g.is_contiguous()
        and g.storage_offset() == 0
        and not g.requires_grad
        and g.numel() > 0
        and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    )


def sum_into(
    buffers: list[torch.Tensor | None],
    i: int,
    g: torch.Tensor,
    master: torch.Tensor,
    alone: bool,
    dtype: torch.dtype | None = None,
) -> bool:
    """Add microbatch gradient ``g`` into ``buffers[i]`` (see [Note: gradient accumulation]), a
    buffer of ``dtype`` (None: the master's): the first one is adopted when nobody else holds it
    (``alone``) and it fits, as AccumulateGrad steals, else copied. Returns whether ``g`` was
    adopted."""
    buf = buffers[i]
    if buf is not None:
        buf.add_(g)
        return False
    dtype = master.dtype if dtype is None else dtype
    if alone and _can_adopt(g, master, dtype):
        buffers[i] = g
        return True
    buffers[i] = torch.empty_like(master, device=g.device, dtype=dtype).copy_(g)
    return False


class GradReducer(Protocol):
    """Sums a call's stage gradients over processes as its backward produces them (see
    [Note: gradient accumulation]); :class:`roundpipe.distributed.DataParallel` registers one
    for sharded state (``RoundPipe.register_grad_reducer``)."""

    def submit(
        self,
        call: CallGrads,
        stages: dict[int, list[tuple[nn.Parameter, torch.Tensor | None]]],
        arrived: torch.Event | None,
    ) -> Callable[[], None]:
        """A stage worker (or the main thread, at the call's end): take ``stages``' summed
        gradients (per stage, every trainable param's master and its sum, None where there is
        none; the tensors nobody else holds, complete once ``arrived`` is). Returns the move to
        launch on the optimizer thread. May block while the reducer is behind the call's
        backward (bounding the sums in flight), never after ``call.abandon()``."""
        ...

    def wake(self, call: CallGrads) -> None:
        """Any thread: ``call`` was abandoned; a :meth:`submit` of it waiting returns."""
        ...


class CallGrads:
    """One call's gradient buffers, per stage, and the moves it launched (see
    [Note: gradient accumulation]). ``params``: per stage, its trainable parameter records.
    ``dtype``: the buffers' dtype on an accelerator (None: the masters'). ``reducer``: where
    a training call's stage sums go instead of the masters (None: the masters)."""

    def __init__(
        self,
        params: Sequence[Sequence[ParamRecord]],
        dtype: torch.dtype | None,
        owner: Any,
        reducer: GradReducer | None = None,
    ):
        self.params = params
        self.dtype = dtype
        self.owner = owner  # the model whose moves these are (see [Note: error reporting])
        self.reducer = reducer
        self.buffers: list[list[torch.Tensor | None]] = [[None] * len(ps) for ps in params]
        self.moves: list[Any] = []  # the launched work items, waited for by the main thread
        # Which stages went to the reducer: written by the stage's worker, read by the main
        # thread once the call's actions ended (finish).
        self.handed = [False] * len(params)
        # Set once an action of the call failed or it was cancelled: a hand-over waiting for
        # the reducer stops waiting (the stages above it may never come). Any thread.
        self.abandoned = False

    def abandon(self) -> None:
        """Any thread: the call failed or was cancelled (see ``abandoned``)."""
        self.abandoned = True
        if self.reducer is not None:
            self.reducer.wake(self)

    def add(self, s: int, grads: Sequence[torch.Tensor | None], others: Sequence[Any]) -> None:
        """Stage worker: sum one microbatch's parameter gradients of stage ``s`` (aligned with
        ``params[s]``); ``others``: every other tensor of the autograd call that produced them
        (its input grads and grad_outputs), which a gradient must not share storage with to be
        adopted (autograd may pass a grad_output through unchanged)."""
        shared = storage_counts(list(others) + list(grads))
        buffers = self.buffers[s]
        for i, (rec, g) in enumerate(zip(self.params[s], grads)):
            if g is not None:
                assert rec.master is not None
                alone = shared[g.untyped_storage().data_ptr()] == 1
                sum_into(buffers, i, g, rec.master, alone, self.dtype)

    def take(self, stages: Sequence[int]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Stage worker, after the stages' last microbatch: their (master, summed gradient)
        pairs; the buffers are the optimizer thread's from here on."""
        pairs = []
        for s in stages:
            buffers = self.buffers[s]
            for i, rec in enumerate(self.params[s]):
                g = buffers[i]
                if g is not None:
                    assert rec.master is not None
                    pairs.append((rec.master, g))
            buffers[:] = [None] * len(buffers)
        return pairs

    def move(self, stages: Sequence[int]) -> None:
        """Stage worker: launch the move of host-side sums (a CPU pool) to the masters."""
        if self.reducer is not None:
            self._hand(self._take_stages(stages), None)
            return
        pairs = self.take(stages)
        if pairs:
            self.moves.append(_launch_move(self.owner, move_grads, pairs))

    def download(self, stages: Sequence[int], backend: StreamingBackend) -> None:
        """Stage worker, the plan's D: download the sums on the accelerator once, then launch
        their move, which waits for the download on the optimizer thread."""
        if self.reducer is not None:
            taken = self._take_stages(stages)
            arrived = None
            if any(g is not None for pairs in taken.values() for _, g in pairs):
                host, _, arrived = backend.download_grads(
                    [g for pairs in taken.values() for _, g in pairs]
                )
                downloaded = iter(host)
                taken = {s: [(m, next(downloaded)) for m, _ in pairs] for s, pairs in taken.items()}
            self._hand(taken, arrived)
            return
        pairs = self.take(stages)
        if pairs:
            host, flag, arrived = backend.download_grads([g for _, g in pairs])
            moved = [(master, g) for (master, _), g in zip(pairs, host) if g is not None]
            self.moves.append(_launch_move(self.owner, move_grads, moved, arrived, flag))

    def finish(self) -> None:
        """Main thread, once the call's actions ended, whatever happened: hand the reducer the
        stages the call did not (a failed call), as no gradients, so that every process hands
        it the same stages (see [Note: gradient accumulation]); their sums are not installed."""
        if self.reducer is None:
            return
        missing = [s for s, ps in enumerate(self.params) if ps and not self.handed[s]]
        for s in missing:
            self.buffers[s] = [None] * len(self.params[s])  # a failed call's sums are dropped
        taken = self._take_stages(missing)
        if taken:
            # Nothing of them is installed (the call's gradients are discarded); a failure of
            # their collectives marks the group broken, which the next collective reports.
            self.reducer.submit(self, taken, None)

    def _take_stages(
        self, stages: Sequence[int]
    ) -> dict[int, list[tuple[nn.Parameter, torch.Tensor | None]]]:
        """Stage worker: the stages' (master, sum or None) of every trainable param, for the
        reducer; the buffers are the reducer's from here on."""
        taken: dict[int, list[tuple[nn.Parameter, torch.Tensor | None]]] = {}
        for s in stages:
            if not self.params[s] or self.handed[s]:
                continue
            buffers = self.buffers[s]
            pairs = []
            for i, rec in enumerate(self.params[s]):
                assert rec.master is not None
                pairs.append((rec.master, buffers[i]))
            taken[s] = pairs
            buffers[:] = [None] * len(buffers)
            self.handed[s] = True
        return taken

    def _hand(
        self,
        taken: dict[int, list[tuple[nn.Parameter, torch.Tensor | None]]],
        arrived: torch.Event | None,
    ) -> None:
        if taken:
            assert self.reducer is not None
            install = self.reducer.submit(self, taken, arrived)
            self.moves.append(_launch_move(self.owner, install))


def _launch_move(owner: Any, fn: Callable, *args: Any) -> optimizer_thread.WorkItem:
    """A gradient move, owned by its model; it touches the masters' gradients only, so it
    passes a checkpoint's hold on the masters (see [Note: holds] in roundpipe.threads.optimizer_thread)."""
    return optimizer_thread.launch_work(fn, args, owners=(owner,), touches=TOUCHES_GRADS)


def stash_grads(params: Sequence[Sequence[ParamRecord]]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Main thread, before a fused call: set aside any ``.grad`` left on a model param (e.g. by a
    plain backward before wrapping). The fused backward accumulates into ``.grad`` and its hooks
    take all of it (see [Note: fused stages] in stage_ops.py); the call gives these back when it
    ends."""
    stashed = []
    for records in params:
        for p in (rec.param for rec in records):
            if p.grad is not None:
                stashed.append((p, p.grad))
                p.grad = None
    return stashed


class GradSink:
    """The per-stage gradient buffers of a fused call, as the grad hooks see them during its
    backwards (see [Note: fused stages] in stage_ops.py). Touched by the one thread that runs
    the call."""

    def __init__(self, grads: CallGrads) -> None:
        self._grads = grads
        # Each trainable param's buffer, found by its master (what its grad hook holds).
        self._where = {
            rec.master: (s, i)
            for s, records in enumerate(grads.params)
            for i, rec in enumerate(records)
        }
        # Every trainable param of the call: what its backward computes gradients for.
        self.params: list[torch.Tensor] = [rec.param for records in grads.params for rec in records]
        self._adopted: set = set()  # storages that became buffers

    def take(self, master: nn.Parameter, grad: torch.Tensor) -> bool:
        """Sum ``grad`` (the just accumulated ``.grad`` of ``master``'s param) into its buffer;
        False if the param is not one of the call's."""
        where = self._where.get(master)
        if where is None:
            return False
        s, i = where
        ptr = grad.untyped_storage().data_ptr()
        # AccumulateGrad made the .grad the param's own; two params' grads may still be views
        # of one storage (a custom backward), so each storage is adopted at most once.
        if sum_into(self._grads.buffers[s], i, grad, master, alone=ptr not in self._adopted):
            self._adopted.add(ptr)
        return True

    def input_grad(self, leaf: Any) -> torch.Tensor | None:
        """The grad a fused backward accumulated into a stage-0 input leaf; copied if it shares
        storage with an adopted buffer, which later microbatches add into."""
        if not isinstance(leaf, torch.Tensor) or leaf.grad is None:
            return None
        g = leaf.grad
        return g.clone() if g.untyped_storage().data_ptr() in self._adopted else g


class PendingMoves:
    """Grad moves launched by the hooks of one backward pass. The first hook of a pass queues an
    engine callback that waits for them all, so ``backward()`` returns only once the masters
    hold the gradients (as ``forward_backward`` does). Touched on the backward's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Any] = []

    def add(self, item: Any) -> None:
        with self._lock:
            first = not self._items
            self._items.append(item)
        if first:
            torch.autograd.Variable._execution_engine.queue_callback(self._wait)

    def _wait(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for item in items:
            item.wait()


# The hook each model parameter has, by id(param): the newest RoundPipe's (main thread).
_HOOK_HANDLES: dict[int, Any] = {}


class GradHooks:
    """A model's post-accumulate-grad hooks on its params with a master, registered once, on
    first need (:meth:`ensure`). ``sink``: the grad sink of a fused backward while one runs,
    else None; set by the thread that runs the call (:meth:`catching`), read by the hooks,
    which autograd runs on that thread or on its own device threads (so it is no
    thread-local)."""

    def __init__(self, records: Sequence[ParamRecord], owner: Any) -> None:
        self._records = records
        self.owner = (
            owner  # the model (see [Note: error reporting] in roundpipe.threads.optimizer_thread)
        )
        self._registered = False
        self.sink: GradSink | None = None
        self._moves = PendingMoves()
        # Where training calls hand their stage sums (register_grad_reducer); main thread.
        self.reducer: GradReducer | None = None

    def ensure(self) -> None:
        """Main thread: register the hooks, once."""
        if self._registered:
            return
        self._registered = True
        for rec in self._records:
            if rec.master is not None:
                p = rec.param
                # A module wrapped again: its parameters' gradients belong to the new masters.
                old = _HOOK_HANDLES.pop(id(p), None)
                if old is not None:
                    old.remove()
                else:
                    weakref.finalize(p, _HOOK_HANDLES.pop, id(p), None)
                _HOOK_HANDLES[id(p)] = p.register_post_accumulate_grad_hook(self._hook(rec.master))

    @contextlib.contextmanager
    def catching(self, sink: GradSink) -> Iterator[None]:
        self.sink = sink
        try:
            yield
        finally:
            self.sink = None

    def _hook(self, master: nn.Parameter) -> Callable[[torch.Tensor], None]:
        # Weak: a hook lives on the C++ side of its parameter, where the collector cannot see
        # it, so a strong reference would keep the model (and its masters) alive for as long
        # as the wrapped module's parameters, a cycle that is never collected.
        hooks_ref, master_ref = weakref.ref(self), weakref.ref(master)

        def move_grad_to_master(param: torch.Tensor) -> None:
            hooks, target = hooks_ref(), master_ref()
            if hooks is None or target is None:
                return  # its model is gone: the module trains as a plain module again
            grad, param.grad = param.grad, None
            if grad is None:
                return
            sink = hooks.sink
            if sink is not None and sink.take(target, grad):  # a fused forward_backward's
                return
            hooks._moves.add(_launch_move(hooks.owner, accumulate_grad, target, grad))

        return move_grad_to_master
