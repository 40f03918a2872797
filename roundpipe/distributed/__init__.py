"""Data parallelism across processes (and machines) on ``torch.distributed``.

Every process (one per GPU or per machine, launched by ``torchrun``) runs the same roundpipe loop
on its shard of each global batch. :class:`DataParallel` attaches to a :class:`RoundPipe`: it
gives every rank rank 0's parameters, and before each step averages the masters' gradients over
the ranks, on the optimizer thread, so the all-reduce overlaps the next iteration's compute as
the step does. A :class:`roundpipe.GradScaler` that a step of the model uses (or that joined
the DataParallel explicitly, :meth:`roundpipe.GradScaler.join_data_parallel`) makes every rank
agree on whether the gradients overflowed. See docs/distributed.md.

Public API (``roundpipe.distributed``):

* :func:`init_process_group`: torch's, with a backend picked for roundpipe and a finite timeout.
* :class:`DataParallel`: attach data parallelism to a model.
* :class:`ShardedState`: a model's state placement (``RoundPipe(state_placement=...)``) that
  shards the masters, their gradients and the optimizer state over the ranks.
* :func:`shard`: this rank's part of a global batch.
* :func:`plan_buckets` / :class:`Bucket`: how gradients are grouped into all-reduce buckets.
* :class:`DataParallelError`: a collective failed (another rank failed, or the timeout passed).
* :func:`data_parallel_rank` and the byte exchange that checkpoints use between ranks
  (:func:`gather_bytes`, :func:`all_gather_bytes`, :func:`union_over_ranks`,
  :func:`post_to_rank0`, :func:`collect_on_rank0`).

One module per concern: :mod:`.group` (the process group, its timeout and broken state, the
process's active group), :mod:`.exchange` (bytes between ranks for checkpoints), :mod:`.buckets`,
:mod:`.sharded` (the sharded state and its stage reducer), :mod:`.data_parallel`.
"""

from roundpipe.distributed.buckets import Bucket, plan_buckets
from roundpipe.distributed.data_parallel import DataParallel
from roundpipe.distributed.exchange import (
    all_gather_bytes,
    collect_on_rank0,
    gather_bytes,
    post_to_rank0,
    union_over_ranks,
)
from roundpipe.distributed.group import (
    DataParallelError,
    data_parallel_rank,
    init_process_group,
    shard,
)
from roundpipe.distributed.sharded import ShardedState

__all__ = [
    "DataParallel",
    "DataParallelError",
    "ShardedState",
    "Bucket",
    "data_parallel_rank",
    "gather_bytes",
    "all_gather_bytes",
    "union_over_ranks",
    "post_to_rank0",
    "collect_on_rank0",
    "init_process_group",
    "plan_buckets",
    "shard",
]
