"""Gradients: where each microbatch's parameter gradients go until they reach the masters' ``.grad``
(see [Note: gradient accumulation]).

* Per call, per stage, one buffer per trainable parameter in the master's dtype
  (:func:`_sum_into`), handed to the optimizer thread after the stage's last microbatch
  (:func:`_launch_moves`, :func:`_move_grads`).
* A fused plan's backward accumulates into the model params' ``.grad``; their grad hooks
  (:func:`_register_grad_hooks`) take it at once into the call's buffers (:class:`_GradSink`,
  found through the model's :class:`_SinkSlot`; see [Note: fused stages] in
  :mod:`roundpipe.runtime.execute`), or, outside a fused call (a differentiable ``forward()``
  and ``backward()``), launch one move per gradient (:func:`_accumulate_grad`,
  :class:`_PendingMoves`).

Threads: a call's buffers belong to the stage's worker until their move is launched, then to the
optimizer thread; the masters' ``.grad`` to the optimizer thread.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe import optim_thread
from roundpipe.devices import Backend
from roundpipe.runtime.params import _ParamRecord

if TYPE_CHECKING:
    from roundpipe.runtime.call import _Call

__all__: list = []  # private to roundpipe.runtime


# [Note: gradient accumulation]
# Gradients accumulate in optim_dtype. In forward_backward the worker of a stage sums the
# microbatch gradients of each of its params into a buffer of the master's dtype and layout
# (microbatch 0 copied, the others added, in microbatch order: one worker runs a stage's actions
# in order, so the sum is bitwise the same for any number of workers). After the last microbatch
# it launches one grad move per param on the optimizer thread: the buffer becomes master.grad if
# that is None (no copy), else it is added to it. One move per param and call, instead of one per
# microbatch, keeps the optimizer thread free for the step that runs concurrently (async mode):
# the moves queue behind that step, and only they remain when it ends.
# The buffer is owned by the worker until the move is launched, then by the optimizer thread.
# On an accelerator the buffer lives on the device and is downloaded once; with
# RoundPipeRunConfig(device_grad_dtype=...) it has that dtype there (the stage's low-precision
# dtype halves or quarters it against fp32) and the masters receive it converted.


def _move_grads(pairs: List[Tuple[nn.Parameter, torch.Tensor]],
                arrived: Optional[torch.Event] = None) -> None:
    """Grad move (optimizer thread): hand a stage's summed gradients of a call (master dtype,
    tensors nobody else holds) to the masters; first wait for their download (``arrived``, a
    device event) from an accelerator."""
    if arrived is not None:
        arrived.synchronize()
    for master, grad in pairs:
        if master.grad is not None:
            master.grad.add_(grad)
        elif grad.dtype == master.dtype:
            master.grad = grad
        else:  # summed on the device in device_grad_dtype
            master.grad = grad.to(master.dtype)


def _accumulate_grad(master: nn.Parameter, grad: torch.Tensor) -> None:
    """Grad move (optimizer thread) of a gradient that autograd accumulated into a model
    parameter (differentiable forward); copied first, it may be any dtype or layout."""
    if master.grad is None:
        master.grad = torch.empty_like(master).copy_(grad)
    else:
        master.grad.add_(grad)


def _clear_grads(masters: List[nn.Parameter]) -> None:
    for m in masters:
        m.grad = None


def _storage_counts(tensors: List[Any]) -> Dict[int, int]:
    """How many of ``tensors`` (the same object counted each time it occurs) use each storage."""
    counts: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    return counts


def _can_adopt(g: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``g`` has the buffer's ``dtype`` and the master's layout, alone in a storage of
    exactly its size (autograd often returns a transposed view instead), so that it can become
    the accumulation buffer itself. Whether another tensor shares that storage is the caller's."""
    return (g.dtype == dtype and g.shape == master.shape
            and g.is_contiguous() and g.storage_offset() == 0 and not g.requires_grad
            and g.numel() > 0
            and g.untyped_storage().nbytes() == g.numel() * g.element_size())


def _sum_into(buffers: List[Optional[torch.Tensor]], i: int, g: torch.Tensor,
              master: torch.Tensor, alone: bool, dtype: Optional[torch.dtype] = None) -> bool:
    """Add microbatch gradient ``g`` into ``buffers[i]`` (see [Note: gradient accumulation]), a
    buffer of ``dtype`` (None: the master's): the first one is adopted when nobody else holds it
    (``alone``) and it fits, as AccumulateGrad steals, else copied. Returns whether ``g`` was
    adopted."""
    if buffers[i] is not None:
        buffers[i].add_(g)
        return False
    dtype = master.dtype if dtype is None else dtype
    if alone and _can_adopt(g, master, dtype):
        buffers[i] = g
        return True
    buffers[i] = torch.empty_like(master, device=g.device, dtype=dtype).copy_(g)
    return False


def _launch_moves(call: "_Call", stages: Sequence[int], backend: Backend) -> None:
    """After a stage's last microbatch: hand its summed gradients to the masters, in one work
    item (the optimizer thread wakes once, not per param)."""
    pairs = []
    for s in stages:
        buffers = call.grad_buffers[s]
        pairs += [(rec.master, buffers[i])
                  for i, rec in enumerate(call.stage_params[s]) if buffers[i] is not None]
        buffers[:] = [None] * len(buffers)
    arrived = None
    if pairs and call.plan.stage_major:  # summed on the device: one download per stage
        host, arrived = backend.download([g for _, g in pairs])
        pairs = [(master, g) for (master, _), g in zip(pairs, host)]
    if pairs:
        call.move_items.append(optim_thread._launch(_move_grads, pairs, arrived))


def _stash_grads(stage_params: List[List[_ParamRecord]]
                 ) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """Main thread, before a fused call: set aside any ``.grad`` left on a model param (e.g. by a
    plain backward before wrapping). The fused backward accumulates into ``.grad`` and its hooks
    take all of it (see [Note: fused stages] in execute.py); the call gives these back when it
    ends."""
    stashed = []
    for records in stage_params:
        for p in (rec.param for rec in records):
            if p.grad is not None:
                stashed.append((p, p.grad))
                p.grad = None
    return stashed


class _GradSink:
    """The per-stage gradient buffers of a fused call, as the grad hooks see them during its
    backwards (see [Note: fused stages] in execute.py). Touched by the one thread that runs the
    call."""

    def __init__(self, grad_buffers: List[List[Optional[torch.Tensor]]],
                 stage_params: List[List[_ParamRecord]]) -> None:
        self._buffers = grad_buffers
        # Each trainable param's buffer, found by its master (what its grad hook holds).
        self._where = {rec.master: (s, i) for s, records in enumerate(stage_params)
                       for i, rec in enumerate(records)}
        # Every trainable param of the call: what its backward computes gradients for.
        self.params = [rec.param for records in stage_params for rec in records]
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
        if _sum_into(self._buffers[s], i, grad, master, alone=ptr not in self._adopted):
            self._adopted.add(ptr)
        return True

    def input_grad(self, leaf: Any) -> Optional[torch.Tensor]:
        """The grad a fused backward accumulated into a stage-0 input leaf; copied if it shares
        storage with an adopted buffer, which later microbatches add into."""
        if not isinstance(leaf, torch.Tensor) or leaf.grad is None:
            return None
        g = leaf.grad
        return g.clone() if g.untyped_storage().data_ptr() in self._adopted else g


class _SinkSlot:
    """The grad sink of a model's fused backward while one runs, else None. Set and cleared by
    the thread that runs the call; read by the grad hooks, which autograd runs on that thread
    or on its own device threads (so this is no thread-local)."""

    sink: Optional[_GradSink] = None

    @contextlib.contextmanager
    def catching(self, sink: Optional[_GradSink]) -> Iterator[None]:
        self.sink = sink
        try:
            yield
        finally:
            self.sink = None


class _PendingMoves:
    """Grad moves launched by the hooks of one backward pass. The first hook of a pass queues an
    engine callback that waits for them all, so ``backward()`` returns only once the masters
    hold the gradients (as ``forward_backward`` does). Touched on the backward's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: List[Any] = []

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


def _make_grad_hook(master: nn.Parameter, moves: _PendingMoves,
                    slot: _SinkSlot) -> Callable[[torch.Tensor], None]:
    def move_grad_to_master(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if grad is None:
            return
        sink = slot.sink
        if sink is not None and sink.take(master, grad):  # a fused forward_backward's backward
            return
        moves.add(optim_thread._launch(_accumulate_grad, master, grad))

    return move_grad_to_master


def _register_grad_hooks(records: List[_ParamRecord], slot: _SinkSlot) -> None:
    """Main thread, once per model: a post-accumulate-grad hook on every param with a master."""
    moves = _PendingMoves()
    for rec in records:
        if rec.master is not None:
            p = rec.param
            # A module wrapped again: its parameters' gradients belong to the new masters.
            old = getattr(p, "_roundpipe_grad_hook", None)
            if old is not None:
                old.remove()
            p._roundpipe_grad_hook = p.register_post_accumulate_grad_hook(
                _make_grad_hook(rec.master, moves, slot))
