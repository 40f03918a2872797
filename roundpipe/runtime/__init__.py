"""The model runtime: :class:`RoundPipe` wraps a model and runs it in microbatches on a device pool.

* Layers are the children of an ``nn.Sequential`` (any other module is one layer); a stage is a
  run of consecutive layers (``execute_plan``), placed round-robin on the pool's devices.
* The wrapped module keeps its (low-precision) parameters; fp32 masters (``optim_dtype``) are
  what the optimizer updates. Gradients of every microbatch accumulate, in ``optim_dtype``, into
  the masters' ``.grad`` (see [Note: gradient accumulation] in ``grad_router``).
* :mod:`roundpipe.plan` decides the order and the moves; this package executes the plan's
  program, action by action.
* ``step(step_fn)`` runs ``step_fn`` on the optimizer thread, one step behind
  (see [Note: staleness] in ``model``).

Modules, by concern (all internal but ``model``'s :class:`RoundPipe`, ``config``'s
:class:`RoundPipeRunConfig` and ``optimizer_ctx``'s :class:`OptimizerCtx`):

* ``model``: :class:`RoundPipe`, the facade that composes the others.
* ``config``: :class:`RoundPipeRunConfig` and its resolved form, how the call's, the model's
  and the default configs merge.
* ``params``: one record per parameter (name, model param, master), the master->model copy and
  its "params ready" events, the state dict helpers.
* ``stages``: layers, stages and the cached plans a call runs.
* ``call``: one call: its immutable spec and its mutable state, and how they are prepared.
* ``executor``: the dispatch loop that performs a plan's program on the device workers.
* ``stage_ops``: the stage bodies (forward, recompute, backward, ``loss_fn``).
* ``grad_router``: the only way a gradient reaches a master.
* ``rng``: the RNG chains (see [Note: RNG chains]).
* ``call_memory``: what the facade asks of :mod:`roundpipe.memory` for a call (its memory
  plan, the first call's device check); the counting itself is :mod:`roundpipe.memory`'s.
* ``optimizer_ctx``: :class:`OptimizerCtx`, the ``step_fn`` work item, the optimizer pre-hook.

Threads and what they touch (see docs/threads-and-staleness.md, "The threads"):

* main: every public method; the run configs; ``Params.ready`` (replaced, never mutated);
  ``_has_grads``; the call's state before the workers start and after they finish.
* device workers (CPU device 0: the calling thread, during the call): a call's slots, each
  written by one action and read by its dependents after that action's future is done; the
  low-precision parameters (read only, after the stage's "params ready" event).
* optimizer thread: the masters and their ``.grad`` (grad moves, ``step_fn``, clears), and the
  low-precision parameters (written by the master->model copy, which sets the events).
"""

from roundpipe.memory.checks import DeviceMemoryError
from roundpipe.memory.report import MemoryPlan
from roundpipe.memory.trace import StageNotTraceable
from roundpipe.runtime.config import RoundPipeRunConfig
from roundpipe.runtime.model import RoundPipe, UnevenMicrobatchWarning
from roundpipe.runtime.optimizer_ctx import OptimizerCtx

__all__ = [
    "RoundPipe",
    "RoundPipeRunConfig",
    "OptimizerCtx",
    "UnevenMicrobatchWarning",
    "MemoryPlan",
    "DeviceMemoryError",
    "StageNotTraceable",
]
