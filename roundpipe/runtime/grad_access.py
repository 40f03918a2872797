"""Who may touch gradients, and when: the ``.grad`` of RoundPipe's master parameters is guarded
so that no thread but the optimizer thread touches it while launched work may be using it, and
reading the wrapped model's own parameters' ``.grad`` (always None: the gradients live on the
masters) warns where the code meant the masters.

See [Note: guarded master gradients] and [Note: gradients of the wrapped model].
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from roundpipe.threads import optimizer_thread
from roundpipe.threads.optimizer_thread import caller_must_wait
from roundpipe.user_frame import user_stacklevel

__all__ = ["MasterParameter", "WrappedParameter", "guard_wrapped_params"]


# [Note: guarded master gradients]
# The masters' ``.grad`` belongs to the optimizer thread: gradient moves write it, the step
# function reads and clears it. A user's loop that touches it on the main thread while a launched
# step may run (``opt.zero_grad()`` before ``forward_backward`` or right after ``model.step``, a
# clip on the masters, a logged gradient norm) raced with the step: torch's optimizers found a
# gradient gone between two reads (``'NoneType' object has no attribute 'is_sparse'`` in
# ``_init_group``), freed a tensor a kernel still read, or stepped nothing, silently. So every
# master is a :class:`MasterParameter`, whose Python-level ``grad`` (what every optimizer,
# ``zero_grad``, ``clip_grad_norm_`` and user code go through) first waits, on any thread but the
# optimizer thread, until everything launched so far has run, and warns that the access costs
# the step's overlap. On the optimizer thread, and whenever nothing launched is pending, the
# access is torch's own plus two integer compares. The guard waits without reporting failures:
# a failed step is reported by the loop's next roundpipe call, as docs/errors.md says.
# Cost: any Tensor subclass makes each Python-level attribute access about 75 ns slower (torch's
# __torch_function__ check), and the guarded .grad about 230 ns (2-core CPU, torch 2.13). A step
# costs 1-3 us more per parameter tensor: within noise for tensors of 256K elements (torch's
# for-loop, foreach and fused AdamW, roundpipe's AdamW; 64 tensors), 1.05-1.3x on a 2-6 ms step
# over 200 tensors of 64 elements.

_GRAD: Any = torch._C.TensorBase.grad  # the C getset descriptor every Tensor's .grad is
_get_grad, _set_grad, _del_grad = _GRAD.__get__, _GRAD.__set__, _GRAD.__delete__


def _wait_for_launched_work(what: str) -> None:
    """A thread other than the optimizer thread is about to ``what`` a master's ``.grad``
    while launched work is pending: wait until all of it ran, and say what that costs."""
    optimizer_thread.wait_all()
    warnings.warn(
        f"the gradient of a RoundPipe master parameter was {what} on thread "
        f"{threading.current_thread().name!r} while work launched on the optimizer thread (a "
        "step, gradient moves) had not finished: roundpipe waited for that work first, so the "
        "step no longer overlaps the next forward_backward. Zero, clip or read the masters' "
        "gradients inside the step function instead, e.g. model.step(lambda: (opt.step(), "
        "opt.zero_grad())); see docs/threads-and-staleness.md",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


class MasterParameter(nn.Parameter):
    """An fp32 master parameter of a :class:`RoundPipe` (``model.optim_parameters()``): an
    ``nn.Parameter`` whose ``.grad`` is guarded (see [Note: guarded master gradients]).

    Getting, setting or deleting ``.grad`` on the optimizer thread, or while nothing launched
    is pending, is torch's own access. On any other thread while launched work is pending, it
    first blocks until that work ran (and warns once per call site). Everything else is
    ``nn.Parameter``'s: a deep copy is a ``MasterParameter``, a pickled one (``torch.save``)
    loads as a plain ``nn.Parameter``.
    """

    @property
    def grad(self) -> torch.Tensor | None:
        if caller_must_wait():
            _wait_for_launched_work("read")
        return _get_grad(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if caller_must_wait():
            _wait_for_launched_work("set")
        _set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        if caller_must_wait():
            _wait_for_launched_work("deleted")
        _del_grad(self)


# [Note: gradients of the wrapped model]
# RoundPipe moves every gradient of the wrapped model's parameters into the masters during
# backward, so the model parameters' .grad is None whenever user code can look. A loop written
# for plain PyTorch then fails silently: clip_grad_norm_(model.parameters(), 1.0) after
# forward_backward clips nothing and returns 0, model.zero_grad() clears nothing (the masters
# keep accumulating), a logged gradient norm is 0. So while a RoundPipe wraps them, the trainable
# parameters it has masters for are WrappedParameters (their class is swapped at wrap time, as
# torch's lazy modules swap theirs, and swapped back when the RoundPipe is collected): reading a
# None .grad outside roundpipe's own code warns, naming the right place (inside the step
# function, where model.parameters() gives the masters). Nothing else changes: autograd's hooks
# and accumulation are C++ and never see the property, functional_call swaps module attributes,
# state_dict() detaches (keep_vars=True gives these objects), a pickled one loads as a plain
# nn.Parameter and a deep copy is a plain nn.Parameter (a copy is not wrapped).

_ROUNDPIPE_PREFIX = __name__.partition(".")[0] + "."
# id(param) -> how many live RoundPipes wrap it (a module may be wrapped again); guarded by the
# lock. Written at wrap time and when a RoundPipe is collected.
_WRAP_COUNTS: dict[int, int] = {}
_WRAP_LOCK = threading.Lock()


_INTERNAL = threading.local()  # .on: this thread's .grad reads are roundpipe's own


@contextlib.contextmanager
def internal_grad_reads() -> Iterator[None]:
    """On this thread, reads of a wrapped parameter's ``.grad`` are roundpipe's own (a
    fake-tensor trace copies each parameter's metadata, its ``.grad`` included): no warning."""
    before = getattr(_INTERNAL, "on", False)
    _INTERNAL.on = True
    try:
        yield
    finally:
        _INTERNAL.on = before


def _warn_none_grad() -> None:
    warnings.warn(
        "the .grad of a parameter of a module wrapped by RoundPipe was read, and it is None: "
        "RoundPipe accumulates gradients into the fp32 masters (model.optim_parameters()), "
        "never into the wrapped model's parameters, so clipping, zeroing or reading them here "
        "does nothing. Do it inside the step function, where model.parameters() gives the "
        "masters: model.step(lambda: (scaler.unscale_(opt), torch.nn.utils.clip_grad_norm_("
        "model.parameters(), 1.0), scaler.step(opt), opt.zero_grad())); see README.md, "
        "'Clipping and schedulers'",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


class WrappedParameter(nn.Parameter):
    """A trainable parameter of a module that a live :class:`RoundPipe` wraps (see
    [Note: gradients of the wrapped model]): reading its ``.grad`` when it is None, outside
    roundpipe's own code, warns that the gradients live on the masters. Any thread; never
    blocks. Setting and deleting ``.grad`` are torch's own."""

    @property
    def grad(self) -> torch.Tensor | None:
        value = _get_grad(self)
        if (
            value is None
            and not getattr(_INTERNAL, "on", False)
            and not sys._getframe(1).f_globals.get("__name__", "").startswith(_ROUNDPIPE_PREFIX)
        ):
            _warn_none_grad()
        return value

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        _del_grad(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(
                self.data.clone(memory_format=torch.preserve_format), self.requires_grad
            )
        return memo[id(self)]


def guard_wrapped_params(owner: Any, params: list[nn.Parameter]) -> None:
    """Make ``params`` (the trainable parameters a RoundPipe made masters for) WrappedParameters
    while ``owner`` (what the RoundPipe keeps them in) lives; parameters of another class (a
    subclass of the user's) are left alone. Main thread, at wrap time; never blocks."""
    swapped = []
    with _WRAP_LOCK:
        for p in params:
            if type(p) is nn.Parameter or type(p) is WrappedParameter:
                _WRAP_COUNTS[id(p)] = _WRAP_COUNTS.get(id(p), 0) + 1
                p.__class__ = WrappedParameter
                swapped.append(p)
    if swapped:
        weakref.finalize(owner, _unwrap, swapped)


def _unwrap(params: list[nn.Parameter]) -> None:
    with _WRAP_LOCK:
        for p in params:
            left = _WRAP_COUNTS.pop(id(p), 1) - 1
            if left > 0:
                _WRAP_COUNTS[id(p)] = left
            elif type(p) is WrappedParameter:
                p.__class__ = nn.Parameter  # type: ignore[assignment]
