"""Where the masters, their gradients and the optimizer state live: one placement per model,
chosen at construction (``RoundPipe(..., state_placement=...)``), which the master->model
copy, the data-parallel gradient reduction, checkpoints and the memory plan read; no other
code branches on it. See [Note: state placement].

* :class:`MasterPlacement` (the default, ``state_placement=None``): every master in this
  process's host RAM.
* :class:`roundpipe.distributed.ShardedState`: each data-parallel rank holds the masters (and
  so their gradients after the step's reduction, and the optimizer state) of its share of the
  parameters; built on this class's interface.
* :class:`roundpipe.MastersOnDisk`: every master in a file on a fast disk, streamed through a
  bounded buffer (see [Note: masters on disk] in :mod:`roundpipe.optim.master_file`).
* :func:`shard_by_bytes`: the owner of each parameter, balanced by bytes (pure).

Threads: a placement is configured on the main thread at construction (:meth:`assign`); its
:meth:`copy_layer` runs on the optimizer thread (the master->model copy).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch
from torch import nn

from roundpipe.runtime.grad_access import MasterParameter

__all__ = ["MasterPlacement", "shard_by_bytes"]


# [Note: state placement]
# A placement decides, at construction, which trainable parameters have a master in this
# process (``assign``); the others get a stand-in: a MasterParameter of the right shape and
# dtype over one element of storage (an expanded scalar), never handed to the optimizer
# (``optim_parameters()`` yields the held masters only), whose ``.grad`` collects this
# process's gradient of the parameter until the data-parallel step hands it to its owner and
# drops it. The master->model copy runs through ``copy_layer``: in RAM a local cast; sharded,
# each owner casts its masters into the model's low-precision parameters and broadcasts them
# to the other ranks (see [Note: sharded state] in roundpipe.distributed.sharded).


class MasterPlacement:
    """Every master in this process's host RAM (the default placement).

    A subclass decides which masters this process holds (:meth:`assign`) and how the
    low-precision parameters get the updated values (:meth:`copy_layer`)."""

    #: shown in reports and errors
    name = "host RAM"
    #: host bytes the master->model copy streams masters kept in files through (0: in RAM)
    copy_buffer_bytes = 0

    @property
    def world_size(self) -> int:
        """Over how many processes the state is spread (1: all here). Any thread."""
        return 1

    @property
    def rank(self) -> int:
        """This process's place among them (0 of 1 here). Any thread."""
        return 0

    @property
    def masters_dir(self) -> str | None:
        """The directory the held masters live in files under (None: in RAM). Any thread."""
        return None

    def assign(self, params: Sequence[nn.Parameter], master_bytes: Sequence[int]) -> list[bool]:
        """Construction, main thread: for each trainable parameter (in ``named_parameters()``
        order, with the bytes its master takes), whether this process holds its master."""
        return [True] * len(params)

    def make_masters(
        self, params: Sequence[tuple[nn.Parameter, torch.dtype]]
    ) -> list[nn.Parameter]:
        """Construction, main thread: the masters this process holds, one per ``(param,
        dtype)``, holding the param's values in that dtype (a model of shapes only, on the meta
        device, gets masters of shapes only)."""
        masters: list[nn.Parameter] = []
        for p, dtype in params:
            if p.is_meta:
                value = torch.empty_like(p, dtype=dtype, device="meta")
            else:
                value = p.detach().to(device="cpu", dtype=dtype, copy=True)
            masters.append(MasterParameter(value))
        return masters

    def copy_layer(
        self,
        pairs: Sequence[tuple[nn.Parameter, nn.Parameter, bool]],
        done: AbstractSet[int] = frozenset(),
    ) -> None:
        """Optimizer thread, inside the master->model copy: the new values of one layer's
        parameters, from ``(param, master, held)`` triples (``held``: this process holds the
        master; else ``master`` is a stand-in). ``done``: ids of the parameters that hold
        their masters' values already (the step wrote them, see [Note: the copy in the step]
        in roundpipe.runtime.step_copy): not cast again."""
        with torch.no_grad():
            for p, master, held in pairs:
                if held and id(p) not in done:
                    p.copy_(master)

    def release(self) -> None:
        """Optimizer thread, after work read or wrote the masters in bulk by value (a
        checkpoint's save or load, a refresh from the model): give back what that took."""

    def check_step(self) -> None:
        """Main thread, before a step is launched: raise if this placement cannot step now."""

    def check_checkpoint(self, what: str) -> None:
        """Main thread, before :mod:`roundpipe.checkpoint` saves or loads (``what``) a model
        with this placement: raise if it cannot."""


def shard_by_bytes(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each item (a parameter's master bytes, in order), whole items,
    balanced by bytes: largest first, each to the rank that holds the fewest bytes so far (then
    the fewest items, then the lowest rank), so the largest share exceeds the fair one
    (``total / world_size``) by at most the last item it took, and every rank gets an item.
    A rank's items need not be adjacent: a model of four equal large layers and a small head
    over 2 ranks splits two layers against two layers and the head, where contiguous runs
    would give one rank three layers. Deterministic (the same on every rank). Pure function:
    any thread.

    Raises ``ValueError`` when there are fewer items than ranks."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if len(sizes) < world_size:
        raise ValueError(
            f"cannot shard {len(sizes)} trainable parameters over {world_size} ranks (every rank "
            f"must own at least one): use fewer ranks, or keep the state on every rank "
            f"(state_placement=None)"
        )
    owners = [0] * len(sizes)
    # (bytes held, items held, rank): the least loaded rank first.
    ranks = [(0, 0, r) for r in range(world_size)]
    heapq.heapify(ranks)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        held, count, rank = heapq.heappop(ranks)
        owners[i] = rank
        heapq.heappush(ranks, (held + sizes[i], count + 1, rank))
    return owners
