"""The model runtime: :class:`RoundPipe` wraps a model and runs it in microbatches on a device pool.

* Layers are the children of an ``nn.Sequential`` (any other module is one layer); a stage is a
  run of consecutive layers (``execute_plan``), placed round-robin on the pool's devices.
* The wrapped module keeps its (low-precision) parameters; fp32 masters (``optim_dtype``) are
  what the optimizer updates. Gradients of every microbatch accumulate, in ``optim_dtype``, into
  the masters' ``.grad`` (see [Note: gradient accumulation] in ``grads``).
* :mod:`roundpipe.schedule` decides the order, this package executes it: each device worker gets
  its actions, each action is a future that its dependents wait on.
* ``step(step_fn)`` runs ``step_fn`` on the optimizer thread, one step behind
  (see [Note: staleness] in ``model``).

Modules, by concern:

* ``config``: :class:`RoundPipeRunConfig` and how the call's, the model's and the default
  configs merge.
* ``optimizer_ctx``: :class:`OptimizerCtx`, the ``step_fn`` wrapper, the optimizer pre-hook.
* ``params``: one record per parameter (name, model param, master), the master->model copy and
  its "params ready" events, the state dict helpers.
* ``plan``: layers, stages and the cached plan a call runs.
* ``call``: one call's state (``_Call``, ``_Slot``), preparing it, its RNG chain bookkeeping.
* ``execute``: running a plan's actions on the device workers.
* ``grads``: gradient buffers, grad moves to the masters, grad hooks.
* ``model``: :class:`RoundPipe`, which composes them.

Threads and what they touch (see docs/threads-and-staleness.md, "The threads"):

* main: every public method; the run configs; ``_Params.ready`` (replaced, never mutated);
  ``_has_grads``; the per-call state before the workers start and after they finish.
* device workers (CPU device 0: the calling thread, during the call): a call's ``_Call`` slots,
  each written by one action and read by its dependents after that action's future is done; the
  low-precision parameters (read only, after the stage's "params ready" event).
* optimizer thread: the masters and their ``.grad`` (grad moves, ``step_fn``, clears), and the
  low-precision parameters (written by the master->model copy, which sets the events).
"""

from roundpipe.runtime.config import RoundPipeRunConfig
from roundpipe.runtime.model import RoundPipe, _check_main_thread
from roundpipe.runtime.optimizer_ctx import OptimizerCtx, _check_optimizer_params

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx"]
