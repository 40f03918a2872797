"""The master->model copy written by the optimizer step itself: :class:`StepCopies`, the
low-precision destinations a one-pass step (roundpipe.optim's Adam with its compiled kernels)
writes while the masters are in cache, and what the model's master->model copy then skips.
See [Note: the copy in the step].

Threads: built on the main thread at wrap time; everything else on the optimizer thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from roundpipe.devices.pinned import PinnedAllocator, pinned_empty

__all__ = ["StepCopies", "LOW_DTYPES"]

# [Note: the copy in the step]
# Without it, a step reads every master twice: Adam reads and writes it (with the gradient and
# both moments), then the master->model copy reads it again to cast it into the model's
# low-precision parameter. A one-pass step writes the cast while each piece of the master is
# still in cache, so the copy has nothing left to do. Where it writes depends on who may be
# reading the model's parameters while the step runs ([Note: staleness] in runtime/model.py):
#   * a synchronous step (model.step(fn, is_async=False)): nobody (the main thread waits for
#     the step, and no forward_backward runs), so the step writes the parameters in place and
#     the copy launched after it skips them;
#   * an asynchronous step (the default): the next forward_backward computes with the
#     parameters of the step before while this one runs, so the step writes a second buffer of
#     each parameter ("the next weights", allocated at the first such step, pinned like the
#     model's parameters on an accelerator pool; 2 bytes per fp16/bf16 parameter, in the memory
#     plan's host terms). The copy launched by the next model.step (or by synchronize()), which
#     runs once that forward_backward returned, swaps it in: the parameter's .data becomes the
#     written buffer and its old storage the buffer the next step writes. The parameter
#     objects stay the same (as the pinned pool re-points them, [Note: the pinned pool]).
# The copy swaps or skips a parameter only if the master is exactly as the step left it: the
# step records the master's version counter after writing, and any later in-place change of
# the master (a load, a refresh from the model, user code in the step function after
# opt.step(), a step that did not write this parameter) bumps it, and the copy then casts as
# always. A step is armed (the mode set) only while a RoundPipe step function runs on the
# optimizer thread; an optimizer stepped anywhere else writes no copy.

#: the dtypes a step may write the copy in (the model's parameter dtype)
LOW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(eq=False)
class _Entry:
    param: nn.Parameter
    master: nn.Parameter
    back: torch.Tensor | None = None  # the next weights (async mode), allocated at first use
    writing: torch.Tensor | None = None  # what target() handed out this step
    written: tuple[int, bool] | None = None  # (master's version, wrote the back buffer)


class StepCopies:
    """The low-precision destinations of a model's held masters for a one-pass step (see
    [Note: the copy in the step]). ``pinned``: the allocator of the model's pinned pool (None:
    a CPU pool), for the next weights."""

    def __init__(
        self,
        pairs: Sequence[tuple[nn.Parameter, nn.Parameter]],
        pinned: PinnedAllocator | None = None,
    ) -> None:
        self._entries = {id(m): _Entry(p, m) for p, m in pairs}
        self._pinned = pinned
        self._in_place: bool | None = None  # None: not armed

    @contextlib.contextmanager
    def armed(self, in_place: bool) -> Iterator[None]:
        """Optimizer thread, around a step function: the step may write the copy, in the
        parameters themselves (``in_place``, a synchronous step) or in the next weights."""
        self._in_place = in_place
        try:
            yield
        finally:
            self._in_place = None
            for entry in self._entries.values():
                entry.writing = None

    def target(self, master: torch.Tensor) -> torch.Tensor | None:
        """Optimizer thread, in an armed step: the tensor to write ``master``'s cast into (a
        contiguous detached tensor of the parameter's shape and dtype), or None (not armed, not
        this model's master, or a parameter the step cannot write: not contiguous, not in host
        memory, another shape). Call :meth:`wrote` once it holds the cast of the master's new
        values."""
        if self._in_place is None:
            return None
        entry = self._entries.get(id(master))
        if entry is None:
            return None
        if not _writable(entry):
            return None
        if self._in_place:
            entry.writing = entry.param.detach()
        else:
            if entry.back is None:
                self._allocate_back()
            entry.writing = entry.back
        assert entry.writing is not None
        return entry.writing

    def wrote(self, master: torch.Tensor) -> None:
        """Optimizer thread: the tensor :meth:`target` gave for ``master`` now holds the cast
        of ``master``'s values as they are now (their version is recorded)."""
        entry = self._entries[id(master)]
        assert entry.writing is not None, "wrote() without target(); please report"
        entry.written = (master._version, entry.writing is entry.back)

    def install(self, pairs: Sequence[tuple[nn.Parameter, nn.Parameter, bool]]) -> set[int]:
        """Optimizer thread, in the master->model copy of one layer: swap in the next weights
        a step wrote (or keep the parameters a synchronous step wrote); returns the ids of the
        parameters that hold their masters' values now, which the copy skips."""
        done: set[int] = set()
        for p, master, held in pairs:
            entry = self._entries.get(id(master)) if held else None
            if entry is None or entry.written is None:
                continue
            version, to_back = entry.written
            entry.written = None
            if version != master._version:
                continue  # the master changed after the step wrote its copy: cast it again
            if to_back:
                assert entry.back is not None
                with torch.no_grad():
                    front = p.data
                    p.data = entry.back
                entry.back = front
            done.add(id(p))
        return done

    def _allocate_back(self) -> None:
        """The next weights of every entry that has none, in one pool (pinned where the
        model's parameters are)."""
        missing = [e for e in self._entries.values() if e.back is None and _writable(e)]
        if self._pinned is not None:
            specs = [(e.param.shape, e.param.dtype) for e in missing]
            for e, t in zip(missing, pinned_empty(specs, self._pinned)):
                e.back = t
        else:
            for e in missing:
                e.back = torch.empty(e.param.shape, dtype=e.param.dtype)

    @property
    def next_weights_bytes(self) -> int:
        """Host bytes the next weights take now (0 before the first asynchronous one-pass
        step). Any thread (a snapshot)."""
        return sum(
            e.back.numel() * e.back.element_size()
            for e in self._entries.values()
            if e.back is not None
        )


def _writable(entry: _Entry) -> bool:
    p, master = entry.param, entry.master
    return (
        p.dtype in LOW_DTYPES
        and p.device.type == "cpu"
        and p.is_contiguous()
        and p.shape == master.shape
        and master.is_contiguous()
    )
