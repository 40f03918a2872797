"""The model runtime: :class:`RoundPipe` wraps a model and runs it in microbatches on a device pool.

* Layers are the children of an ``nn.Sequential`` (any other module is one layer); a stage is a
  run of consecutive layers (``execute_plan``), placed round-robin on the pool's devices.
* The wrapped module keeps its (low-precision) parameters; fp32 masters (``optim_dtype``) are
  what the optimizer updates. Gradients of every microbatch accumulate, in ``optim_dtype``, into
  the masters' ``.grad`` (see [Note: gradient accumulation]).
* :mod:`roundpipe.schedule` decides the order, this module executes it: each device worker gets
  its actions, each action is a future that its dependents wait on.
* ``step(step_fn)`` runs ``step_fn`` on the optimizer thread, one step behind
  (see [Note: staleness]).

Threads and what they touch (see docs/threads-and-staleness.md, "The threads"):

* main: every public method; the run configs; ``_ready`` (replaced, never mutated);
  ``_has_grads``; the per-call state before the workers start and after they finish.
* device workers (CPU device 0: the calling thread, during the call): a call's ``_Call`` slots, each written by one action and read by its dependents
  after that action's future is done; the low-precision parameters (read only, after the stage's
  "params ready" event).
* optimizer thread: the masters and their ``.grad`` (grad moves, ``step_fn``, clears), and the
  low-precision parameters (written by the master->model copy, which sets the events).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as _checkpoint_module
from torch.utils.checkpoint import checkpoint

from roundpipe import optim_thread
from roundpipe.autocast import (AutocastState, RNGState, autocast_context, chain_starts,
                                resolve_autocast, restore_global, rng_scope, uses_rng)
from roundpipe.devices import DevicePool, Future, Resident, caller_as_worker, on_device_worker
from roundpipe.microbatch import merge_outputs, split_inputs, split_label
from roundpipe.optim_thread import add_note
from roundpipe.schedule import Action, ActionKind, Plan, build_plan, partition

__all__ = ["RoundPipe", "RoundPipeRunConfig", "OptimizerCtx"]


# [Note: staleness]
# model.step(step_fn) (async, the default) launches on the optimizer thread, in this order:
#   (a) the master->model copy: the current masters (produced by the previous step) are copied
#       into the low-precision params layer by layer, each layer's "params ready" event set after
#       its copy; workers wait on those events before reading a stage's params;
#   (b) step_fn, inside OptimizerCtx.
# and returns without waiting. The next forward_backward computes while the step runs; its grad
# moves queue behind the step (the optimizer thread is FIFO) and forward_backward waits for them,
# so a forward_backward never returns while a step is in flight. Hence iteration k computes with
# the params produced by step k-2 (iterations 0 and 1 with the initial ones), and step k applies
# iteration k's gradients to the newest masters: ZeRO-Offload's delayed parameter update.
# step(step_fn, is_async=False) launches step_fn, then the copy, then waits: zero-stale.
# The low-precision params are never written while a worker reads them: the copy of step k runs
# after forward_backward k returned, and forward_backward k+1 waits for the events.


# -- run config -------------------------------------------------------------------------------


@dataclasses.dataclass
class RoundPipeRunConfig:
    """How a call runs. Every field ``None`` = inherit: call-level config, then the model-level
    config, then the default.

    * ``num_microbatch`` (default 1).
    * ``autocast``: None (the caller's autocast state at the call), False (off), or a dtype (on,
      with that dtype); active in every stage forward, recompute and ``loss_fn``, never backward.
    * ``requires_grad``: whether ``forward()`` output tracks gradients (default
      ``torch.is_grad_enabled()`` at the call).
    * ``preserve_rng_state``: whether stages run in an RNG chain (see [Note: RNG chains]);
      default: the stages with a dropout module in training mode, and those that a probe of
      their first call finds drawing random numbers.
    * ``recompute`` (default True): keep only stage inputs, recompute in backward.
    * ``split_input`` / ``split_label`` / ``merge_output``: specs (``TensorChunkSpec``, int, a
      pytree of them) or callables, see :mod:`roundpipe.microbatch`.
    * ``output_device`` (default ``"cpu"``): where merged outputs and the loss are returned.
    * ``execute_plan``: the stage partition, layers per stage (default one layer per stage).

    Plain data; build it on any thread, do not mutate one that a call is using.
    """

    num_microbatch: Optional[int] = None
    autocast: Any = None
    requires_grad: Optional[bool] = None
    preserve_rng_state: Optional[bool] = None
    recompute: Optional[bool] = None
    split_input: Any = None
    split_label: Any = None
    merge_output: Any = None
    output_device: Any = None
    execute_plan: Optional[Sequence[int]] = None

    def __post_init__(self) -> None:
        n = self.num_microbatch
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"num_microbatch must be a positive int, got {n!r}")
        if not (self.autocast is None or self.autocast is False
                or isinstance(self.autocast, torch.dtype)):
            raise ValueError(f"autocast must be None (the caller's autocast state), False or a "
                             f"torch.dtype such as torch.bfloat16, got {self.autocast!r}")
        for name in ("requires_grad", "preserve_rng_state", "recompute"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be None, True or False, got {v!r}")
        if self.output_device is not None:
            try:
                torch.device(self.output_device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"output_device {self.output_device!r} is not a device: "
                                 f"{exc}") from None
        if self.execute_plan is not None:
            plan = self.execute_plan
            if (isinstance(plan, (str, bytes)) or not hasattr(plan, "__len__") or len(plan) == 0
                    or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in plan)):
                raise ValueError(f"execute_plan must be a non-empty list of positive ints "
                                 f"(layers per stage), got {plan!r}")


_DEFAULTS = RoundPipeRunConfig(num_microbatch=1, recompute=True, output_device="cpu")


def _merge_configs(*configs: Optional[RoundPipeRunConfig]) -> RoundPipeRunConfig:
    """Field by field, the first non-None among ``configs`` (highest priority first)."""
    values = {}
    for f in dataclasses.fields(RoundPipeRunConfig):
        for cfg in configs:
            if cfg is not None and getattr(cfg, f.name) is not None:
                values[f.name] = getattr(cfg, f.name)
                break
    return RoundPipeRunConfig(**values)


# -- optimizer context ------------------------------------------------------------------------

_OPTIM_TLS = threading.local()
_STEP_TLS = threading.local()


class OptimizerCtx:
    """Inside this context (thread-local), ``model.parameters()`` / ``named_parameters()`` of
    every :class:`RoundPipe` return the fp32 masters instead of the model's parameters::

        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    It is also active on the optimizer thread while a ``step_fn`` runs. Any thread; nestable.
    """

    def __enter__(self) -> "OptimizerCtx":
        _OPTIM_TLS.depth = getattr(_OPTIM_TLS, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPTIM_TLS.depth -= 1


def _in_optimizer_ctx() -> bool:
    return getattr(_OPTIM_TLS, "depth", 0) > 0


_OPTIMIZER_HOOK: Any = None
_OPTIMIZER_HOOK_LOCK = threading.Lock()


def _check_optimizer_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook; acts only while a RoundPipe step_fn runs on this thread."""
    model = getattr(_STEP_TLS, "model", None)
    if model is None:
        return
    lowp = model._lowp_ids
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in lowp:
                raise RuntimeError(
                    f"{type(optimizer).__name__} was built on the model's own (low-precision) "
                    f"parameters, e.g. {model._param_names.get(id(p), '?')!r}, instead of the "
                    f"fp32 masters that RoundPipe accumulates gradients into; build it with "
                    f"`with OptimizerCtx(): opt = {type(optimizer).__name__}(model.parameters(), "
                    f"...)` or on `model.optim_parameters()`")


def _ensure_optimizer_hook() -> None:
    global _OPTIMIZER_HOOK
    with _OPTIMIZER_HOOK_LOCK:
        if _OPTIMIZER_HOOK is None:
            _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(
                _check_optimizer_params)


# Model classes already warned about by _warn_single_stage (each once per process).
_WARNED_SINGLE_STAGE: set = set()


def _warn_single_stage(model: nn.Module) -> None:
    """A model with submodules that is not an nn.Sequential runs as one stage: say so, once per
    model class, with how to make stages. A leaf module (no submodules) is one layer anyway."""
    cls = type(model)
    if cls in _WARNED_SINGLE_STAGE or next(model.children(), None) is None:
        return
    _WARNED_SINGLE_STAGE.add(cls)
    warnings.warn(
        f"RoundPipe runs a {cls.__name__}, which is not an nn.Sequential, as a single stage: it "
        f"is not split over the device pool, each microbatch runs the whole model on one device, "
        f"and recompute re-runs all of it. To make stages, wrap an nn.Sequential whose children "
        f"each take the previous child's output, e.g. nn.Sequential(embedding, *blocks, head) for "
        f"a GPT-style model (docs/devices.md, \"A model that is not an nn.Sequential\"). To "
        f"keep one stage and silence this warning, wrap nn.Sequential(model).",
        UserWarning, stacklevel=3)


# -- internal structures ----------------------------------------------------------------------


class _Cancelled(Exception):
    """An action skipped because a dependency failed; never reaches the user."""


class _ParamsCopyFailed(Exception):
    """A worker found the master->model copy of its stage failed; resolved on the main thread."""

    def __init__(self, ready: "_ParamsReady") -> None:
        super().__init__("master->model parameter copy failed")
        self.ready = ready


class _ParamsReady:
    """Per-layer "params ready" events of one master->model copy.

    Written by the optimizer thread (``error``, ``failed_from``, then the events); read by workers
    and the main thread after waiting on an event. ``item`` is set by the main thread at launch.
    """

    def __init__(self, num_layers: int, done: bool = False) -> None:
        self._events = [threading.Event() for _ in range(num_layers)]
        self.error: Optional[BaseException] = None
        self.failed_from = num_layers
        self.item: Any = None
        if done:
            for e in self._events:
                e.set()

    def set(self, layer: int) -> None:
        self._events[layer].set()

    def fail(self, layer: int, exc: BaseException) -> None:
        self.error, self.failed_from = exc, layer
        for e in self._events[layer:]:
            e.set()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s params are ready; raise if their copy failed."""
        self._events[layer].wait()
        if layer >= self.failed_from:
            raise _ParamsCopyFailed(self)

    def is_set(self, layer: int) -> bool:
        """Whether ``layer``'s params are ready (their copy done and not failed). Never
        blocks."""
        return self._events[layer].is_set() and layer < self.failed_from

    def wait_all(self) -> None:
        for layer in range(len(self._events)):
            self.wait(layer)

    def failed(self) -> bool:
        return all(e.is_set() for e in self._events) and self.error is not None


@dataclasses.dataclass
class _Layer:
    index: int
    name: str
    module: nn.Module

    def describe(self) -> str:
        kind = type(self.module).__name__
        return (f"layer {self.index} ({kind})" if self.name == str(self.index)
                else f"layer {self.index} {self.name!r} ({kind})")


class _Stage:
    """Consecutive layers ``[first, end)``; ``params``: (name, param) of those layers, each once."""

    def __init__(self, index: int, layers: List[_Layer], param_names: Dict[int, str]) -> None:
        self.index = index
        self.layers = layers
        seen: set = set()
        self.params: List[Tuple[str, nn.Parameter]] = []
        for layer in layers:
            for p in layer.module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((param_names[id(p)], p))


class _Slot:
    """What one (stage, microbatch) hands to the actions that depend on it."""

    __slots__ = ("phase", "rng_start", "rng_end", "out", "graph_in", "graph_out", "grad_in",
                 "saved_input")

    def __init__(self) -> None:
        self.phase = "forward"          # pass of a checkpointed stage, for error notes
        self.rng_start: Optional[RNGState] = None   # chain state the forward started from
        self.rng_end: Optional[RNGState] = None     # chain state for the next stage
        self.out: Any = None            # stage output handed to the next stage
        self.graph_in: Any = None       # input leaves of the stage's graph
        self.graph_out: Any = None      # output leaves with their (checkpointed) graph
        self.grad_in: Any = None        # grads w.r.t. this stage's input leaves (aligned)
        self.saved_input: Any = None    # a streamed forward's stage input, for its recompute


@dataclasses.dataclass
class _Call:
    """State of one forward/forward_backward call, shared by main and the workers."""

    plan: Plan
    stages: List[_Stage]
    training: bool
    recompute: bool
    grad_enabled: bool
    inference_mode: bool
    autocast: AutocastState
    chunks: List[Tuple[tuple, dict]]
    sizes: List[int]
    labels: List[Any]
    loss_fn: Optional[Callable]
    return_outputs: bool
    stage_params: List[List[Tuple[str, nn.Parameter]]]
    stage_rng: List[bool]
    stage_drew: List[bool]                     # written by the stage's worker: a generator moved
    rng_probe_keys: List[Optional[Tuple]]      # stages run in the chain only to learn if they draw
    rng_starts: Optional[List[RNGState]]
    rng_after_draw: Optional[RNGState]
    # The generator states of the pool's other devices before the call, restored after it:
    # their stages set them to chain states (see [Note: RNG chains]). Empty on the CPU.
    rng_others: List[Tuple[Any, Optional[torch.Tensor]]]
    ready: _ParamsReady
    cast_dtype: Optional[torch.dtype]
    input_grad: bool                           # some input requires grad (forward_backward)
    slots: Dict[Tuple[int, int], _Slot] = dataclasses.field(default_factory=dict)
    futures: Dict[Tuple, Future] = dataclasses.field(default_factory=dict)
    losses: List[Any] = dataclasses.field(default_factory=list)
    outputs: List[Any] = dataclasses.field(default_factory=list)
    move_items: List[Any] = dataclasses.field(default_factory=list)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    grad_buffers: List[List[Optional[torch.Tensor]]] = dataclasses.field(default_factory=list)
    # Per microbatch, the stage-0 input leaves as the caller's graph has them (None where no
    # grad is wanted); their grads are in slots[(0, m)].grad_in. Written by stage 0's worker.
    input_origins: List[Any] = dataclasses.field(default_factory=list)
    grad_sink: Optional["_GradSink"] = None    # a fused plan's (see [Note: fused stages])
    # A stage-major plan's uploads, by stage, and uploads prefetched for the action that will
    # use them: written and read by the stage's worker only.
    resident: Dict[int, Resident] = dataclasses.field(default_factory=dict)
    prefetched: Dict[Tuple, Resident] = dataclasses.field(default_factory=dict)
    # (param, .grad) a user left on a model param, set aside during a fused call; main thread.
    stashed_grads: List[Tuple[nn.Parameter, torch.Tensor]] = dataclasses.field(
        default_factory=list)


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


# [Note: recompute]
# With recompute on (the default), a FORWARD action runs its stage under non-reentrant
# torch.utils.checkpoint: the graph it keeps holds the stage input and no activation. The
# BACKWARD action's autograd.grad re-runs the stage forward when it first unpacks a saved tensor,
# under the forward's autocast state (captured by checkpoint) and, for a stage in an RNG chain,
# under its start state (an rng_scope as checkpoint's recompute context, holding RNG_LOCK for the
# re-run only; checkpoint's own RNG handling is off, since it would set the global generator
# without the lock). checkpoint stops the re-run as soon as every saved tensor is back; saved
# tensors are packed before an op computes, so the last ops of a stage (a whole Linear stage)
# are not computed again. Re-running the forward in full instead costs up to a third more
# compute than plain PyTorch with checkpoint.


# [Note: fused stages]
# With one device there is nothing to overlap, and the per-stage actions only cost: each
# BACKWARD is its own autograd call, and each action its own future. A training plan on one
# device therefore has one MICROBATCH(m) action per microbatch: every stage forward (each under
# its RNG chain state, and under checkpoint with recompute on, so the memory is the same),
# loss_fn, then one backward through all stages, as plain PyTorch runs a microbatch. Its
# parameter gradients leave autograd through AccumulateGrad into the model params' .grad, where
# the grad hooks take them at once (still in cache) into the call's per-stage buffers (a
# _GradSink, found through the model's _SinkSlot); the sum per param is then what the per-stage actions
# compute, so final parameters stay bitwise the same for any number of devices. The one
# exception is a parameter in two stages (tied weights): one backward sums its two gradients of
# a microbatch before the buffer does, in another order than per-stage backwards, so such a
# model keeps the per-stage plan. Error notes of the fused backward name all stages, or the
# stage whose recompute failed.


# checkpoint ends a recompute early by raising this from inside the stage (see
# [Note: recompute]); like the runtime's own signals it passes through without a location note.
_STOP_RECOMPUTE = getattr(_checkpoint_module, "_StopRecomputationError", None)
_NOT_LAYER_ERRORS = ((_Cancelled, _ParamsCopyFailed)
                     + ((_STOP_RECOMPUTE,) if _STOP_RECOMPUTE is not None else ()))


def _move_grads(pairs: List[Tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Grad move (optimizer thread): hand a stage's summed gradients of a call (master dtype,
    tensors nobody else holds) to the masters."""
    for master, grad in pairs:
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)


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


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _detach(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):  # the common stage output; no tree walk
        return tree.detach()
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _leaves(tree: Any) -> List[Any]:
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


# -- the wrapper ------------------------------------------------------------------------------


class RoundPipe(nn.Module):
    """Runs ``model`` in microbatches on a device pool, with fp32 master parameters and an
    optimizer step that runs on the optimizer thread, one step behind (see [Note: staleness]).

    Args:
        model: an ``nn.Sequential`` (its children are the layers) or any module (one layer; a
            module with submodules warns once per class, naming how to make stages). It keeps
            its parameter objects; after :meth:`synchronize` they hold the newest values.
        optim_dtype: dtype of the masters; None means fp32 for fp16/bf16 params, else the
            param's own dtype.
        name: shown in error notes.
        model_run_config: the model-level :class:`RoundPipeRunConfig`.
        devices: the device pool (``"cpu"``, ``"cpu:2"``, ``"cuda:0,1"``); default
            ``$ROUNDPIPE_DEVICES``, else every CUDA device, else one CPU worker.

    Every public method is for the main thread (the one that runs the training loop), except
    :meth:`optim_parameters`/:meth:`optim_named_parameters` and ``parameters()`` inside
    :class:`OptimizerCtx`, which any thread may call. Attributes by thread: see the module
    docstring.
    """

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None,
                 name: Optional[str] = None,
                 model_run_config: Optional[RoundPipeRunConfig] = None,
                 devices: Any = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe wraps an nn.Module, got {type(model).__name__}")
        if any(isinstance(m, RoundPipe) for m in model.modules()):
            raise TypeError("the module to wrap already contains a RoundPipe: wrap the plain "
                            "module (RoundPipe(model.module)) instead of wrapping twice")
        if model_run_config is not None and not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("model_run_config must be a RoundPipeRunConfig")
        if optim_dtype is not None and not isinstance(optim_dtype, torch.dtype):
            raise ValueError(f"optim_dtype must be None or a torch.dtype, got {optim_dtype!r}")
        self.module = model
        self.name = name
        self.model_run_config = model_run_config or RoundPipeRunConfig()
        self._pool = DevicePool(devices)
        self._pool.backends[0].prepare_host(model)
        if isinstance(model, nn.Sequential):
            children = list(model.named_children())
            if not children:
                raise ValueError("cannot wrap an empty nn.Sequential")
        else:
            children = [("0", model)]
            _warn_single_stage(model)
        self._layers = [_Layer(i, n, m) for i, (n, m) in enumerate(children)]
        self._param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        self._lowp_ids = frozenset(self._param_names)
        self._build_masters(optim_dtype)
        self._cast_dtype = self._low_precision_dtype()
        # Params of each layer to copy from the masters, each param once (in its first layer).
        seen: set = set()
        self._layer_copies: List[List[Tuple[nn.Parameter, nn.Parameter]]] = []
        for layer in self._layers:
            pairs = []
            for p in layer.module.parameters():
                if id(p) in self._master_of and id(p) not in seen:
                    seen.add(id(p))
                    pairs.append((p, self._master_of[id(p)]))
            self._layer_copies.append(pairs)
        self._ready = _ParamsReady(len(self._layers), done=True)
        # Set by roundpipe.distributed.DataParallel: averages the masters' gradients over the
        # ranks, on the optimizer thread, right before each step_fn.
        self._grad_reducer: Optional[Callable[[], None]] = None
        self._has_grads = False
        self._hooks_registered = False
        self._grad_sink = _SinkSlot()  # see [Note: fused stages]
        # Stages (by their layers and training mode) probed for drawing random numbers; main
        # thread. See [Note: RNG chains].
        self._rng_use: Dict[Tuple, bool] = {}
        self._stage_cache: Dict[Tuple[int, ...], List[_Stage]] = {}
        self._plan_cache: Dict[Tuple[int, int, bool, bool], Plan] = {}
        if self.model_run_config.execute_plan is not None:
            self._stages(self.model_run_config.execute_plan)  # validate now
        _ensure_optimizer_hook()

    # -- masters ------------------------------------------------------------------------------
    def _build_masters(self, optim_dtype: Optional[torch.dtype]) -> None:
        self._masters: Dict[str, nn.Parameter] = {}
        self._master_of: Dict[int, nn.Parameter] = {}
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            dtype = optim_dtype
            if dtype is None:
                dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
            master = nn.Parameter(p.detach().to(device="cpu", dtype=dtype, copy=True))
            self._masters[name] = master
            self._master_of[id(p)] = master

    def _low_precision_dtype(self) -> Optional[torch.dtype]:
        dtypes = {p.dtype for p in self.module.parameters() if p.is_floating_point()}
        if len(dtypes) == 1 and next(iter(dtypes)) in (torch.float16, torch.bfloat16):
            return next(iter(dtypes))
        return None

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 master parameters (one per trainable parameter). Any thread; never blocks."""
        return iter(list(self._masters.values()))

    def optim_named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """``(name, master)`` pairs, named like the wrapped module's parameters."""
        return iter(list(self._masters.items()))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The wrapped module's parameters (names without a wrapper prefix); inside
        :class:`OptimizerCtx`, the masters. Decided at the call, not at iteration."""
        if _in_optimizer_ctx():
            sep = "." if prefix else ""
            return iter([(prefix + sep + n, m) for n, m in self._masters.items()])
        return self.module.named_parameters(prefix=prefix, recurse=recurse,
                                            remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """``named_parameters()`` without the names (masters inside :class:`OptimizerCtx`)."""
        return iter([p for _, p in self.named_parameters(recurse=recurse)])

    # -- state dicts --------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The wrapped module's state dict (same keys; the low-precision values the model holds
        now). Main thread; waits for a pending master->model copy, not for the step."""
        _check_main_thread("state_dict")
        self._wait_ready()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module, then refresh the masters from the loaded params.

        For an exact resume, call :meth:`load_master_state_dict` afterwards. Main thread; blocks
        until the optimizer thread has run everything launched before.
        """
        _check_main_thread("load_state_dict")
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the parameter objects "
                             "that RoundPipe's masters shadow; load with assign=False")
        optim_thread.synchronize()
        self._wait_ready()
        result = self.module.load_state_dict(state_dict, strict=strict)
        pairs = [(m, p) for layer in self._layer_copies for p, m in layer]
        optim_thread._launch(_copy_pairs, pairs).wait()
        return result

    def master_state_dict(self) -> Dict[str, torch.Tensor]:
        """``{name: clone of the master}``. Main thread; waits for the optimizer thread."""
        optim_thread.synchronize()
        return {n: m.detach().clone() for n, m in self._masters.items()}

    def load_master_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Copy values into the masters in place (the optimizer keeps referencing them). The
        model params are not touched: :meth:`synchronize` or the next step copies them.
        Main thread; blocks until the optimizer thread has applied it."""
        _check_main_thread("load_master_state_dict")
        missing = sorted(set(self._masters) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._masters))
        if missing or unexpected:
            raise ValueError(f"master state dict does not match the masters: missing "
                             f"{missing}, unexpected {unexpected}")
        pairs = []
        for n, m in self._masters.items():
            v = state_dict[n]
            if tuple(v.shape) != tuple(m.shape):
                raise ValueError(f"master {n!r} has shape {tuple(m.shape)}, the state dict "
                                 f"gives {tuple(v.shape)}")
            pairs.append((m, v))
        optim_thread.synchronize()
        optim_thread._launch(_copy_pairs, pairs).wait()

    # -- config, stages, plans ----------------------------------------------------------------
    def _resolve(self, run_config: Optional[RoundPipeRunConfig]) -> RoundPipeRunConfig:
        if run_config is not None and not isinstance(run_config, RoundPipeRunConfig):
            raise TypeError("run_config must be a RoundPipeRunConfig")
        return _merge_configs(run_config, self.model_run_config, _DEFAULTS)

    def _stages(self, execute_plan: Optional[Sequence[int]]) -> List[_Stage]:
        key = tuple(execute_plan) if execute_plan is not None else ()
        stages = self._stage_cache.get(key)
        if stages is None:
            bounds = partition(len(self._layers), execute_plan)
            stages = [_Stage(s, self._layers[a:b], self._param_names)
                      for s, (a, b) in enumerate(bounds)]
            self._stage_cache[key] = stages
        return stages

    def _plan(self, stages: List[_Stage], num_microbatch: int, training: bool,
              recompute: bool) -> Plan:
        # An accelerator pool streams stage by stage (see [Note: streaming] in schedule.py);
        # one CPU worker fuses each microbatch's stages (see [Note: fused stages]).
        streaming = self._pool.device_type != "cpu"
        fuse = (training and not streaming and len(self._pool) == 1
                and not _shares_params(stages))
        key = (len(stages), num_microbatch, training, fuse, streaming, recompute)
        plan = self._plan_cache.get(key)
        if plan is None:
            plan = self._plan_cache[key] = build_plan(
                len(stages), num_microbatch, len(self._pool), training, fuse,
                stage_major=streaming, recompute=recompute)
        return plan

    def plan(self, run_config: Optional[RoundPipeRunConfig] = None,
             training: bool = True) -> Plan:
        """The plan a call with ``run_config`` would execute (``print`` it to see the order and,
        on an accelerator, each stage's uploads and gradient downloads)."""
        cfg = self._resolve(run_config)
        return self._plan(self._stages(cfg.execute_plan), cfg.num_microbatch, training,
                          bool(cfg.recompute))

    # -- public calls -------------------------------------------------------------------------
    def forward_backward(self, input_args: Sequence[Any] = (),
                         input_kwargs: Optional[Dict[str, Any]] = None, label: Any = None,
                         loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                         return_outputs: bool = False,
                         run_config: Optional[RoundPipeRunConfig] = None) -> Any:
        """Forward and backward of one batch, in microbatches; returns the sum of the microbatch
        losses (detached), or ``(loss, merged_outputs)`` with ``return_outputs``.

        ``input_args``/``input_kwargs`` (split into microbatches) reach the first layer only;
        every later layer gets the previous layer's output as its one argument.

        ``loss_fn(output, label_mb)`` runs once per microbatch on the worker of the last stage
        and must return a single-element tensor. Gradients accumulate into the masters' ``.grad``
        (``optim_dtype``); inputs that require grad get theirs in ``.grad`` (through whatever
        graph produced them), as ``loss.backward()`` would give them. Main thread; blocks until
        every gradient of the call is accumulated, so nothing of it is in flight afterwards (it
        also waits for a step launched before, whose gradient moves come first). If it raises,
        the gradients accumulated since the last step are discarded, so the next iteration
        starts clean.
        """
        _check_main_thread("forward_backward")
        self._report_failures()
        if not callable(loss_fn):
            raise ValueError("forward_backward needs loss_fn(output, label) -> scalar tensor")
        cfg = self._resolve(run_config)
        call = self._prepare(cfg, tuple(input_args), dict(input_kwargs or {}), label, loss_fn,
                             training=True, return_outputs=return_outputs)
        self._has_grads = True
        ok = False
        try:
            self._execute(call)
            self._learn_rng_use(call)
            for item in call.move_items:
                item.wait()
            optim_thread._raise_failures()  # e.g. a step launched before failed
            ok = True
            out_device = torch.device(cfg.output_device)
            # Summed where the losses are when they share a device (one transfer, not M).
            same = len({loss.device for loss in call.losses}) == 1
            total = call.losses[0] if same else call.losses[0].to(out_device)
            for loss in call.losses[1:]:
                total = total + (loss if same else loss.to(out_device))
            total = total.to(out_device)
            if return_outputs:
                merged = _to_device(merge_outputs(call.outputs, call.sizes, cfg.merge_output),
                                    out_device)
            if call.input_grad:  # last: a failure before it leaves the inputs' .grad untouched
                _backward_to_inputs(call)
        except BaseException:
            # Whatever failed (a stage, loss_fn, an earlier step, the merge), the call's
            # gradients are dropped so that retrying the iteration does not add them twice.
            self._discard_grads()
            raise
        finally:
            for p, g in call.stashed_grads:
                p.grad = g
            self._restore_rng(call, ok)
        return (total, merged) if return_outputs else total

    def forward(self, *args: Any, run_config: Optional[RoundPipeRunConfig] = None,
                **kwargs: Any) -> Any:
        """Microbatched inference; differentiable when ``requires_grad`` (default: grad mode at
        the call) is on. Then a ``backward()`` through the output moves the parameter gradients
        into the masters (as forward_backward does) and :meth:`step` may follow. ``run_config``
        (keyword only, not passed to the model) overrides the model-level config for this call,
        e.g. ``model(x, run_config=RoundPipeRunConfig(num_microbatch=1))`` for a small batch.
        Main thread; blocks until the output is computed.

        The arguments (split into microbatches) reach the first layer only, as in
        :meth:`forward_backward`."""
        _check_main_thread("forward")
        self._report_failures()
        cfg = self._resolve(run_config)
        grad = torch.is_grad_enabled() if cfg.requires_grad is None else cfg.requires_grad
        grad = grad and not torch.is_inference_mode_enabled()
        call = self._prepare(cfg, args, kwargs, None, None, training=False, return_outputs=True,
                             grad_enabled=grad)
        if grad:
            self._ensure_grad_hooks()
        ok = False
        try:
            self._execute(call)
            self._learn_rng_use(call)
            ok = True
        finally:
            self._restore_rng(call, ok)
        merged = _to_device(merge_outputs(call.outputs, call.sizes, cfg.merge_output),
                            torch.device(cfg.output_device))
        if grad and any(isinstance(x, torch.Tensor) and x.requires_grad
                        for x in pytree.tree_leaves(merged)):
            self._has_grads = True
        return merged

    def step(self, step_fn: Callable[[], Any], is_async: bool = True) -> None:
        """Run ``step_fn`` on the optimizer thread, inside :class:`OptimizerCtx`.

        Async (default): launch the master->model copy, then ``step_fn``, and return without
        waiting; the next iteration computes with parameters one step older (see
        [Note: staleness]). ``is_async=False``: launch ``step_fn``, then the copy, and wait
        (zero-stale). Main thread. Raises ``RuntimeError`` if no gradients were produced since
        the last step; re-raises an earlier failure of the optimizer thread (and then discards
        the accumulated gradients).
        """
        _check_main_thread("step")
        self._report_failures()
        if not callable(step_fn):
            raise ValueError("step() needs a callable step_fn, e.g. lambda: (opt.step(), "
                             "opt.zero_grad())")
        if not self._has_grads:
            raise RuntimeError(
                "step() called with no gradients since the last step: run forward_backward() (or "
                "a differentiable forward() and backward()) first; each step consumes the "
                "gradients accumulated since the previous one")
        self._has_grads = False
        run = self._wrap_step(step_fn)
        if is_async:
            self._launch_copy()
            optim_thread._launch_step(run)
            return
        optim_thread._launch_step(run)
        self._launch_copy()
        try:
            optim_thread.synchronize()
        except BaseException:
            self._discard_grads()
            raise

    def synchronize(self) -> None:
        """Wait for every launched step, then copy the newest masters into the model's
        parameters (the user's parameter objects hold the newest values afterwards). Main
        thread; blocks; re-raises an optimizer-thread failure."""
        _check_main_thread("synchronize")
        try:
            optim_thread.synchronize()
        except BaseException:
            self._discard_grads()
            raise
        self._launch_copy()
        self._wait_ready()

    # -- internals: steps, copies, grads ------------------------------------------------------
    def _wrap_step(self, step_fn: Callable[[], Any]) -> Callable[[], None]:
        model = self

        def run() -> None:
            _STEP_TLS.model = model
            try:
                with OptimizerCtx():
                    if model._grad_reducer is not None:
                        model._grad_reducer()
                    step_fn()
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                # A failed step did not consume this iteration's gradients: drop them here, in
                # FIFO order, whichever call later reports the failure, so the next step does
                # not apply them twice.
                _clear_grads(list(model._masters.values()))
                add_note(exc, f"[roundpipe{model._name_tag()} step_fn]")
                raise
            finally:
                _STEP_TLS.model = None

        run.__qualname__ = run.__name__ = (
            f"RoundPipe.step({getattr(step_fn, '__qualname__', type(step_fn).__name__)})")
        return run

    def _launch_copy(self) -> _ParamsReady:
        ready = _ParamsReady(len(self._layers))
        ready.item = optim_thread._launch(self._copy_masters_to_model, ready)
        self._ready = ready
        return ready

    def _copy_masters_to_model(self, ready: _ParamsReady) -> None:
        """Optimizer thread: masters -> low-precision params, layer by layer."""
        layer = 0
        try:
            with torch.no_grad():
                for layer, pairs in enumerate(self._layer_copies):
                    for p, master in pairs:
                        p.copy_(master)
                    ready.set(layer)
        except BaseException as exc:  # noqa: B036 -- published to the workers, then re-raised
            ready.fail(layer, exc)
            raise

    def _wait_ready(self) -> None:
        try:
            self._ready.wait_all()
        except _ParamsCopyFailed as exc:
            self._raise_copy_failure(exc.ready)

    def _raise_copy_failure(self, ready: _ParamsReady) -> None:
        if ready.item is not None and ready.item.wait():
            raise AssertionError("params copy reported failed but succeeded; please report")
        raise RuntimeError(
            "copying the masters into the model parameters failed (reported earlier); the model "
            "parameters may be partly updated: call model.synchronize() to copy them again")

    def _discard_grads(self) -> None:
        self._has_grads = False
        optim_thread._launch(_clear_grads, list(self._masters.values())).wait()

    def _report_failures(self) -> None:
        try:
            optim_thread._raise_failures()
        except BaseException:
            self._discard_grads()
            raise
        if self._ready.failed():
            # A failed copy leaves the params partly updated; the next call must not read them.
            self._launch_copy()

    def _ensure_grad_hooks(self) -> None:
        if self._hooks_registered:
            return
        moves = _PendingMoves()
        for p in self.module.parameters():
            master = self._master_of.get(id(p))
            if master is not None:
                # A module wrapped again: its parameters' gradients belong to the new masters.
                old = getattr(p, "_roundpipe_grad_hook", None)
                if old is not None:
                    old.remove()
                p._roundpipe_grad_hook = p.register_post_accumulate_grad_hook(
                    _make_grad_hook(master, moves, self._grad_sink))
        self._hooks_registered = True

    def _name_tag(self) -> str:
        return f" {self.name!r}" if self.name else ""

    def _where(self, stage: Optional[int], mb_index: int, phase: str,
               layer: Optional[_Layer]) -> str:
        """Where an error happened, for its note; ``stage`` None: the fused backward of all."""
        at = f"stage {stage}" if stage is not None else "all stages"
        if layer is not None:
            at += f", {layer.describe()}"
        return f"[roundpipe{self._name_tag()} {at}, microbatch {mb_index}, {phase}]"

    # -- internals: one call ------------------------------------------------------------------
    def _prepare(self, cfg: RoundPipeRunConfig, args: tuple, kwargs: dict, label: Any,
                 loss_fn: Optional[Callable], training: bool, return_outputs: bool,
                 grad_enabled: bool = True) -> _Call:
        stages = self._stages(cfg.execute_plan)
        M = cfg.num_microbatch
        chunks, sizes = split_inputs(args, kwargs, M, cfg.split_input)
        labels = split_label(label, M, sizes, cfg.split_label) if training else [None] * M
        stage_params: List[List[Tuple[str, nn.Parameter]]] = []
        for stage in stages:
            trainable = [(n, p) for n, p in stage.params if p.requires_grad]
            if training or grad_enabled:
                for n, p in trainable:
                    if id(p) not in self._master_of:
                        raise RuntimeError(
                            f"parameter {n!r} (stage {stage.index}) requires grad but has no "
                            f"master: it was frozen when the model was wrapped; freeze it again "
                            f"(requires_grad_(False)) or wrap the module after changing "
                            f"requires_grad")
            stage_params.append(trainable)
        backend0 = self._pool.backends[0]
        stage_rng, probe_keys = [], []
        for s in stages:
            known = uses_rng([l.module for l in s.layers], cfg.preserve_rng_state)
            key = None
            if known is None:  # see [Note: RNG chains]: probe the stage until it is known
                key = tuple((id(l.module), l.module.training) for l in s.layers)
                known = self._rng_use.get(key)
                if known is None:
                    known = True
                else:
                    key = None
            stage_rng.append(known)
            probe_keys.append(key)
        rng_starts = rng_after = None
        rng_others: List[Tuple[Any, Optional[torch.Tensor]]] = []
        if any(stage_rng):
            rng_starts = chain_starts(M, backend0)
            rng_after = RNGState(torch.get_rng_state(), backend0.get_rng_state())
            rng_others = [(b, b.get_rng_state()) for b in self._pool.backends[1:]]
        call = _Call(
            plan=self._plan(stages, M, training, bool(cfg.recompute)), stages=stages,
            training=training,
            recompute=bool(cfg.recompute), grad_enabled=grad_enabled,
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=resolve_autocast(cfg.autocast, self._pool.device_type),
            chunks=chunks, sizes=sizes, labels=labels, loss_fn=loss_fn,
            return_outputs=return_outputs, stage_params=stage_params, stage_rng=stage_rng,
            stage_drew=[False] * len(stages), rng_probe_keys=probe_keys,
            rng_starts=rng_starts, rng_after_draw=rng_after, rng_others=rng_others,
            ready=self._ready,
            cast_dtype=self._cast_dtype,
            input_grad=training and any(isinstance(x, torch.Tensor) and x.requires_grad
                                        for x in pytree.tree_leaves((args, kwargs))))
        call.slots = {(s, m): _Slot() for s in range(len(stages)) for m in range(M)}
        call.futures = {a.key: Future() for a in call.plan.actions()}
        call.losses = [None] * M
        call.grad_buffers = [[None] * len(ps) for ps in stage_params]
        call.outputs = [None] * M
        call.input_origins = [None] * M
        if call.plan.fused:
            self._ensure_grad_hooks()
            call.grad_sink = _GradSink(call, self._master_of)
            call.stashed_grads = _stash_grads(stage_params)
        return call

    def _learn_rng_use(self, call: _Call) -> None:
        """Main thread, after a call succeeded: remember whether each probed stage drew."""
        for key, drew in zip(call.rng_probe_keys, call.stage_drew):
            if key is not None:
                self._rng_use[key] = drew

    def _execute(self, call: _Call) -> None:
        """Hand each worker its actions, run the calling thread's own (see [Note: the calling
        thread runs CPU device 0]), wait for all, re-raise the first real error.

        Interrupted (Ctrl-C) while submitting, running or waiting, it cancels the actions not
        started, waits until no worker touches the call any more, and then re-raises: the workers
        are never left waiting for work that will not come, and nothing of the call lands later."""
        own = self._pool.caller_device
        submitted: List[Action] = []  # handed to worker threads, in submission order
        try:
            for d, actions in enumerate(call.plan.per_device):
                if d == own:
                    continue
                worker = self._pool.worker(d)
                for a in actions:
                    worker.submit(self._run_action, call, a, future=call.futures[a.key])
                    submitted.append(a)
            if own is not None:
                with caller_as_worker(self._pool.device_type):
                    for a in call.plan.per_device[own]:
                        # Ctrl-C propagates, to cancel the call below.
                        call.futures[a.key].run(self._run_action, call, a,
                                                reraise=(KeyboardInterrupt,))
            # A worker runs its actions in order, so its last one done means all of its actions
            # are: wait on those alone rather than waking the main thread (and taking the GIL
            # from the workers) once per action.
            for actions in call.plan.per_device:
                if actions:
                    call.futures[actions[-1].key].exception()
        except BaseException:
            call.cancelled.set()
            started = set(submitted)
            for a in call.plan.actions():
                if a not in started and not call.futures[a.key].done():
                    call.futures[a.key].set_exception(_Cancelled())
            _wait_uninterrupted([call.futures[a.key] for a in submitted])
            raise
        failures = []
        for a in call.plan.actions():
            exc = call.futures[a.key].exception()
            if exc is not None and not isinstance(exc, _Cancelled):
                failures.append((a.time, a.stage, a.mb_index, exc))
        if not failures:
            return
        exc = min(failures, key=lambda f: f[:3])[3]
        if isinstance(exc, _ParamsCopyFailed):
            self._raise_copy_failure(exc.ready)
        raise exc

    def _restore_rng(self, call: _Call, ok: bool) -> None:
        """Leave the global RNG deterministic (see [Note: RNG chains])."""
        if call.rng_starts is None:
            return
        # First the other devices (an emulated device's generator is the CPU's, which device
        # 0's restore below then sets).
        for backend, state in call.rng_others:
            backend.set_rng_state(state)
        backend0 = self._pool.backends[0]
        if ok and call.plan.num_microbatch == 1:
            end = call.slots[(len(call.stages) - 1, 0)].rng_end
            restore_global(end, backend0)
        else:
            restore_global(call.rng_after_draw, backend0)

    # -- internals: actions (device worker threads) -------------------------------------------
    def _run_action(self, call: _Call, action: Action) -> None:
        if call.cancelled.is_set():
            raise _Cancelled()
        for dep in call.plan.dependencies(action):
            if call.futures[dep.key].exception() is not None:
                raise _Cancelled()
        backend = self._pool.backends[action.device]
        with backend.action_context():
            streaming = call.plan.stage_major
            if streaming:
                self._enter_run(call, action, backend)
            if action.kind is ActionKind.BACKWARD:
                if streaming and call.recompute:
                    self._recompute_backward_action(call, action, backend)
                else:
                    self._backward_action(call, action, backend)
            elif action.kind is ActionKind.MICROBATCH:
                self._microbatch_action(call, action, backend)
            elif streaming and call.training and call.recompute \
                    and action.kind is ActionKind.FORWARD:
                self._streamed_forward_action(call, action, backend)
            else:
                self._forward_action(call, action, backend)
            if streaming and call.plan.ends_run(action):
                self._leave_run(call, action, backend)
            if not streaming or call.plan.needs_sync(action):
                backend.finish()

    # [Note: streaming] in schedule.py: a stage is uploaded at the first action of a run that
    # needs it, and dropped at the end of the run (kept from the forward to the backward run
    # when recompute is off, since the backward then walks the forward's graph).
    def _enter_run(self, call: _Call, a: Action, backend: Any) -> None:
        s = a.stage
        if s in call.resident:
            return
        resident = call.prefetched.pop(a.key, None)
        if resident is None:
            for layer in call.stages[s].layers:
                call.ready.wait(layer.index)
            resident = self._upload(call, s, backend, prefetch=False)
        backend.adopt(resident)
        call.resident[s] = resident
        # Copy the device's next upload in while this run computes, if its params are ready
        # (else it is uploaded when its run starts). Not the same stage's: this run may still
        # write its host buffers back (BatchNorm stats) while the copy would read them.
        nxt = call.plan.next_upload(a)
        if nxt is not None and nxt.stage != s \
                and all(call.ready.is_set(l.index) for l in call.stages[nxt.stage].layers):
            call.prefetched[nxt.action.key] = self._upload(call, nxt.stage, backend,
                                                           prefetch=True)

    @staticmethod
    def _upload(call: _Call, s: int, backend: Any, prefetch: bool) -> Resident:
        trainable = [p for _, p in call.stage_params[s]]
        # Training: device leaves, whose gradients stay on the device. A differentiable
        # inference call: a differentiable upload, so a later backward() reaches the host
        # parameters and their grad hooks.
        with torch.set_grad_enabled(not call.training and call.grad_enabled):
            return backend.upload([l.module for l in call.stages[s].layers], trainable,
                                  leaves=call.training, prefetch=prefetch)

    def _leave_run(self, call: _Call, a: Action, backend: Any) -> None:
        if a.kind is ActionKind.FORWARD and call.training and not call.recompute:
            return  # the backward run reads this upload (see _enter_run)
        resident = call.resident.pop(a.stage, None)
        if resident is not None:
            # A recompute's updates of the buffers are dropped: the forward made them.
            backend.release(resident, write_back=not (a.kind is ActionKind.BACKWARD
                                                     and call.recompute))

    def _stage_input(self, call: _Call, s: int, m: int, backend: Any) -> Tuple[tuple, dict]:
        if s == 0:
            args, kwargs = call.chunks[m]
            if call.cast_dtype is not None:
                dtype = call.cast_dtype
                args, kwargs = pytree.tree_map(
                    lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                    else x, (args, kwargs))
        else:
            prev = call.slots[(s - 1, m)]
            args, kwargs = (prev.out,), {}
            prev.out = None
        return backend.to_device((args, kwargs))

    def _chain_in(self, call: _Call, s: int, m: int) -> Optional[RNGState]:
        if call.rng_starts is None:
            return None
        return call.rng_starts[m] if s == 0 else call.slots[(s - 1, m)].rng_end

    def _run_stage(self, call: _Call, stage: _Stage, inp: Tuple[tuple, dict], m: int,
                   phase: str, backend: Any) -> Any:
        args, kwargs = inp
        x: Any = None
        resident = call.resident.get(stage.index)
        for i, layer in enumerate(stage.layers):
            try:
                if i == 0:
                    x = backend.call_layer(layer.module, args, kwargs, resident)
                else:
                    x = backend.call_layer(layer.module, (x,), {}, resident)
            except _NOT_LAYER_ERRORS:
                raise
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                add_note(exc, self._where(stage.index, m, phase, layer))
                raise
        return x

    def _stage_forward(self, call: _Call, s: int, m: int, inp: Tuple[tuple, dict], backend: Any,
                       checkpointed: bool) -> Tuple[Any, Any]:
        """Stage ``s`` forward of microbatch ``m`` (after its params are ready) under the call's
        autocast and the stage's RNG chain state; in training, ``loss_fn`` after the last stage,
        in the same state. Returns (output, loss or None). Grad mode is the caller's."""
        stage, slot = call.stages[s], call.slots[(s, m)]
        for layer in stage.layers:
            call.ready.wait(layer.index)
        chain_in = self._chain_in(call, s, m)
        start = chain_in if call.stage_rng[s] else None
        slot.rng_start = start
        loss = None
        with autocast_context(call.autocast), rng_scope(start, backend) as r:
            if checkpointed:
                out = self._checkpointed_stage(call, stage, inp, m, slot, backend)
            else:
                out = self._run_stage(call, stage, inp, m, "forward", backend)
            if call.training and s == len(call.stages) - 1:
                try:
                    loss = call.loss_fn(out, backend.to_device(call.labels[m]))
                except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                    add_note(exc, self._where(s, m, "loss_fn", None))
                    raise
        slot.rng_end = r.end if start is not None else chain_in
        call.stage_drew[s] = call.stage_drew[s] or r.drew
        return out, loss

    def _check_loss(self, call: _Call, m: int, loss: Any) -> torch.Tensor:
        s = len(call.stages) - 1
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                    else type(loss).__name__)
            exc: Exception = ValueError(
                f"loss_fn must return a single-element tensor (a scalar loss), got {what}; "
                f"reduce it, e.g. with .mean() or .sum()")
            add_note(exc, self._where(s, m, "loss_fn", None))
            raise exc
        if not loss.requires_grad:
            exc = RuntimeError("the loss does not require grad: no parameter is trainable "
                               "and no input requires grad, so there is nothing to train")
            add_note(exc, self._where(s, m, "loss_fn", None))
            raise exc
        return loss

    def _finish_microbatch(self, call: _Call, m: int, loss: torch.Tensor, out: Any) -> None:
        call.losses[m] = loss.detach().reshape(())
        if call.return_outputs:
            call.outputs[m] = _detach(out)

    def _stage0_input(self, call: _Call, m: int, backend: Any
                      ) -> Tuple[List[Any], Tuple[tuple, dict]]:
        """Microbatch ``m``'s input to stage 0 in training, the caller's inputs that require grad
        cut into leaves of the call's graph (their grads end in ``slots[(0, m)].grad_in``)."""
        inp = self._stage_input(call, 0, m, backend)
        if not call.input_grad:
            return [], inp
        call.input_origins[m], in_leaves, inp = _cut_graph(inp, _requires_grad)
        return in_leaves, inp

    def _forward_action(self, call: _Call, a: Action, backend: Any) -> None:
        s, m = a.stage, a.mb_index
        if not call.training:
            inp = self._stage_input(call, s, m, backend)
            with torch.inference_mode(call.inference_mode), \
                    torch.set_grad_enabled(call.grad_enabled):
                out, _ = self._stage_forward(call, s, m, inp, backend, checkpointed=False)
            if s == len(call.stages) - 1:
                call.outputs[m] = out
            else:
                call.slots[(s, m)].out = out
            return
        if s > 0:  # every floating input: the previous stage needs its gradient
            _, in_leaves, inp = _cut_graph(self._stage_input(call, s, m, backend), _is_float)
        else:
            in_leaves, inp = self._stage0_input(call, m, backend)
        with torch.enable_grad():
            out, loss = self._stage_forward(
                call, s, m, inp, backend,
                checkpointed=a.kind is ActionKind.FORWARD and call.recompute)
            if a.kind is ActionKind.FORWARD:  # keep the (checkpointed) graph for BACKWARD
                slot = call.slots[(s, m)]
                slot.graph_in = in_leaves
                slot.graph_out = _leaves(out)
                slot.out = _detach(out)
                return
            loss = self._check_loss(call, m, loss)
            self._grad_and_move(call, s, m, [loss], [torch.ones_like(loss)], in_leaves, backend)
        self._finish_microbatch(call, m, loss, out)

    def _streamed_forward_action(self, call: _Call, a: Action, backend: Any) -> None:
        """FORWARD of a stage-major plan with recompute (see [Note: streaming] in schedule.py):
        no graph is kept, only the stage input; the BACKWARD action re-runs the stage on its own
        upload and takes the gradients there."""
        s, m = a.stage, a.mb_index
        if s > 0:
            inp = self._stage_input(call, s, m, backend)
        else:
            _, inp = self._stage0_input(call, m, backend)
        with torch.no_grad():
            out, _ = self._stage_forward(call, s, m, inp, backend, checkpointed=False)
        slot = call.slots[(s, m)]
        slot.saved_input = inp
        slot.out = out

    def _recompute_backward_action(self, call: _Call, a: Action, backend: Any) -> None:
        """BACKWARD of a stage-major plan with recompute: re-run the stage from its saved input
        under the forward's autocast and RNG start state, on this run's upload, then take the
        gradients. It runs on the worker, not inside autograd."""
        s, m = a.stage, a.mb_index
        after, slot = call.slots[(s + 1, m)], call.slots[(s, m)]
        grads_out, after.grad_in = backend.to_device(after.grad_in), None
        inp, slot.saved_input = slot.saved_input, None
        _, in_leaves, inp = _cut_graph(inp, _requires_grad if s == 0 else _is_float)
        slot.phase = "recompute"
        with torch.enable_grad():
            with autocast_context(call.autocast), rng_scope(slot.rng_start, backend):
                out = self._run_stage(call, call.stages[s], inp, m, "recompute", backend)
            out_leaves = _leaves(out)
            if len(out_leaves) != len(grads_out):
                raise AssertionError(f"stage {s} has {len(out_leaves)} outputs but stage {s + 1} "
                                     f"returned {len(grads_out)} input grads; please report")
            pairs = [(o, g) for o, g in zip(out_leaves, grads_out)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            self._grad_and_move(call, s, m, [o for o, _ in pairs], [g for _, g in pairs],
                                in_leaves, backend)

    def _microbatch_action(self, call: _Call, a: Action, backend: Any) -> None:
        """A fused plan's MICROBATCH(m): see [Note: fused stages]."""
        m, last = a.mb_index, len(call.stages) - 1
        in_leaves, inp = self._stage0_input(call, m, backend)
        with torch.enable_grad():
            for s in range(last + 1):
                out, loss = self._stage_forward(call, s, m, inp, backend,
                                                checkpointed=call.recompute and s < last)
                inp = ((out,), {})
            loss = self._check_loss(call, m, loss)
            for s in range(last):
                call.slots[(s, m)].phase = "recompute"
            sink = call.grad_sink
            wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            with _recompute_guard(call, call.stages), self._grad_sink.catching(sink):
                try:
                    torch.autograd.backward([loss], [torch.ones_like(loss)],
                                            inputs=wrt + sink.params)
                except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                    if not _has_location(exc):  # a recompute error already says where it was
                        add_note(exc, self._where(None, m, "backward", None))
                    raise
        if in_leaves:
            call.slots[(0, m)].grad_in = [sink.input_grad(x) for x in in_leaves]
        if m == call.plan.num_microbatch - 1:
            self._launch_moves(call, range(last + 1), backend)
        self._finish_microbatch(call, m, loss, out)

    def _backward_action(self, call: _Call, a: Action, backend: Any) -> None:
        s, m = a.stage, a.mb_index
        after = call.slots[(s + 1, m)]
        # Stage s+1 may have run on another device: its input grads come over to this one.
        grads_out, after.grad_in = backend.to_device(after.grad_in), None
        with _recompute_guard(call, [call.stages[s]]):
            self._backward_body(call, a, backend, grads_out)

    def _backward_body(self, call: _Call, a: Action, backend: Any, grads_out: List[Any]) -> None:
        s, m = a.stage, a.mb_index
        slot = call.slots[(s, m)]
        in_leaves, out_leaves = slot.graph_in, slot.graph_out
        slot.graph_in = slot.graph_out = None
        if len(out_leaves) != len(grads_out):
            raise AssertionError(f"stage {s} has {len(out_leaves)} outputs but stage {s + 1} "
                                 f"returned {len(grads_out)} input grads; please report")
        pairs = [(o, g) for o, g in zip(out_leaves, grads_out)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        slot.phase = "recompute"  # autograd may re-run the stage now (see [Note: recompute])
        with torch.enable_grad():
            self._grad_and_move(call, s, m, [o for o, _ in pairs], [g for _, g in pairs],
                                in_leaves, backend)

    def _checkpointed_stage(self, call: _Call, stage: _Stage, inp: Tuple[tuple, dict], m: int,
                            slot: _Slot, backend: Any) -> Any:
        """The stage forward under non-reentrant ``torch.utils.checkpoint`` (see
        [Note: recompute]); ``slot.phase`` names the pass in error notes."""
        args, kwargs = inp
        values = tuple(args) + (kwargs,) if kwargs else tuple(args)

        def run(*flat: Any) -> Any:
            # Stage kwargs travel as one trailing positional dict: none meets checkpoint's own.
            a, kw = (flat[:-1], flat[-1]) if kwargs else (flat, {})
            return self._run_stage(call, stage, (a, kw), m, slot.phase, backend)

        def contexts() -> Tuple[Any, Any]:
            # Forward: already inside the stage's RNG scope. Recompute: the same start state.
            return contextlib.nullcontext(), rng_scope(slot.rng_start, backend)

        return checkpoint(run, *values, use_reentrant=False, preserve_rng_state=False,
                          context_fn=contexts)

    def _grad_and_move(self, call: _Call, s: int, m: int, outputs: List[torch.Tensor],
                       grad_outputs: List[torch.Tensor], in_leaves: List[Any],
                       backend: Any) -> None:
        """autograd.grad of ``outputs`` w.r.t. the stage input leaves and trainable params;
        stores the input grads for stage s-1 and sums the param grads into the stage's buffers
        (see [Note: gradient accumulation])."""
        params = call.stage_params[s]
        wrt = [x for x in in_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        resident = call.resident.get(s)
        # On an accelerator the gradients are taken w.r.t. the stage's device copies and summed
        # on the device (see [Note: streaming] in schedule.py).
        targets = resident.leaves if resident is not None else [p for _, p in params]
        inputs = wrt + targets
        if outputs and inputs:
            try:
                grads = list(torch.autograd.grad(outputs, inputs, grad_outputs,
                                                 allow_unused=True))
            except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
                if not _has_location(exc):  # a recompute error already says where it was
                    add_note(exc, self._where(s, m, "backward", None))
                raise
        else:
            grads = [None] * len(inputs)
        if in_leaves:
            by_id = {id(x): g for x, g in zip(wrt, grads[:len(wrt)])}
            call.slots[(s, m)].grad_in = [by_id.get(id(x)) if isinstance(x, torch.Tensor)
                                          else None for x in in_leaves]
        param_grads = grads[len(wrt):]
        # See [Note: gradient accumulation].
        buffers = call.grad_buffers[s]
        shared = _storage_counts(grads[:len(wrt)] + list(param_grads) + list(grad_outputs))
        for i, ((_, p), g) in enumerate(zip(params, param_grads)):
            if g is not None:
                # Adopted only if no other gradient or grad_output of this autograd call shares
                # its storage (autograd may pass a grad_output through unchanged).
                alone = shared[g.untyped_storage().data_ptr()] == 1
                _sum_into(buffers, i, g, self._master_of[id(p)], alone)
        if m == call.plan.num_microbatch - 1:
            self._launch_moves(call, [s], backend)

    def _launch_moves(self, call: _Call, stages: Sequence[int], backend: Any) -> None:
        """After a stage's last microbatch: hand its summed gradients to the masters, in one work
        item (the optimizer thread wakes once, not per param)."""
        pairs = []
        for s in stages:
            buffers = call.grad_buffers[s]
            pairs += [(self._master_of[id(p)], buffers[i])
                      for i, (_, p) in enumerate(call.stage_params[s]) if buffers[i] is not None]
            buffers[:] = [None] * len(buffers)
        if pairs and call.plan.stage_major:  # summed on the device: one download per stage
            host = backend.download([g for _, g in pairs])
            pairs = [(master, g) for (master, _), g in zip(pairs, host)]
        if pairs:
            call.move_items.append(optim_thread._launch(_move_grads, pairs))


def _check_main_thread(method: str) -> None:
    """RoundPipe's calls wait for the device workers and the optimizer thread; made on one of
    those threads they would wait for themselves."""
    if optim_thread.on_optimizer_thread() or on_device_worker():
        where = "the optimizer thread (inside a step function)" if optim_thread.on_optimizer_thread() \
            else "a device worker (inside a stage or loss_fn)"
        raise RuntimeError(
            f"RoundPipe.{method}() was called on {where}, where it would wait for itself; call "
            f"it on the main thread (inside a step function, model.master_state_dict() and "
            f"model.optim_parameters() are the masters' state)")


def _has_location(exc: BaseException) -> bool:
    return any(str(n).startswith("[roundpipe") for n in getattr(exc, "__notes__", ()))


def _wait_uninterrupted(futures: List[Future]) -> None:
    """Wait for every future, through repeated Ctrl-C too: once a call is cancelled its running
    actions end soon, and the caller re-raises the first interrupt afterwards."""
    for fut in futures:
        while True:
            try:
                fut.exception()
                break
            except KeyboardInterrupt:
                continue


def _stash_grads(stage_params: List[List[Tuple[str, nn.Parameter]]]
                 ) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """Main thread, before a fused call: set aside any ``.grad`` left on a model param (e.g. by a
    plain backward before wrapping). The fused backward accumulates into ``.grad`` and its hooks
    take all of it (see [Note: fused stages]); the call gives these back when it ends."""
    stashed = []
    for params in stage_params:
        for _, p in params:
            if p.grad is not None:
                stashed.append((p, p.grad))
                p.grad = None
    return stashed


def _shares_params(stages: List[_Stage]) -> bool:
    """Whether a parameter belongs to two stages (tied weights across stages)."""
    ids = [id(p) for stage in stages for _, p in stage.params]
    return len(ids) != len(set(ids))


def _storage_counts(tensors: List[Any]) -> Dict[int, int]:
    """How many of ``tensors`` (the same object counted each time it occurs) use each storage."""
    counts: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    return counts


def _can_adopt(g: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether ``g`` has the master's dtype and layout (on the host, or summed on the device), alone in a storage of exactly its
    size (autograd often returns a transposed view instead), so that it can become the
    accumulation buffer itself. Whether another tensor shares that storage is the caller's."""
    return (g.dtype == master.dtype and g.shape == master.shape
            and g.is_contiguous() and g.storage_offset() == 0 and not g.requires_grad
            and g.numel() > 0
            and g.untyped_storage().nbytes() == g.numel() * g.element_size())


def _sum_into(buffers: List[Optional[torch.Tensor]], i: int, g: torch.Tensor,
              master: torch.Tensor, alone: bool) -> bool:
    """Add microbatch gradient ``g`` into ``buffers[i]`` (see [Note: gradient accumulation]): the
    first one is adopted when nobody else holds it (``alone``) and it fits, as AccumulateGrad
    steals, else copied into the master's dtype. Returns whether ``g`` was adopted."""
    if buffers[i] is not None:
        buffers[i].add_(g)
        return False
    if alone and _can_adopt(g, master):
        buffers[i] = g
        return True
    buffers[i] = torch.empty_like(master, device=g.device).copy_(g)
    return False


@contextlib.contextmanager
def _recompute_guard(call: _Call, stages: Sequence[_Stage]) -> Iterator[None]:
    """Around a backward that recomputes ``stages``: their forward already updated their
    buffers (BatchNorm running stats) and the recompute must not update them a second time.
    Restored after the backward, which may still read them."""
    buffers = ([b for stage in stages for layer in stage.layers for b in layer.module.buffers()]
               if call.recompute else [])
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


class _GradSink:
    """The per-stage gradient buffers of a fused call, as the grad hooks see them during its
    backwards (see [Note: fused stages]). Touched by the one thread that runs the call."""

    def __init__(self, call: _Call, master_of: Dict[int, nn.Parameter]) -> None:
        self._buffers = call.grad_buffers
        self._where = {id(p): (s, i, master_of[id(p)])
                       for s, params in enumerate(call.stage_params)
                       for i, (_, p) in enumerate(params)}
        # Every trainable param of the call: what its backward computes gradients for.
        self.params = [p for params in call.stage_params for _, p in params]
        self._adopted: set = set()  # storages that became buffers

    def take(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Sum ``grad`` (the param's just accumulated ``.grad``) into its buffer; False if the
        param is not one of the call's."""
        where = self._where.get(id(param))
        if where is None:
            return False
        s, i, master = where
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



def _cut_graph(inp: Tuple[tuple, dict], wants_grad: Callable[[torch.Tensor], bool]
               ) -> Tuple[List[Any], List[Any], Tuple[tuple, dict]]:
    """Make each tensor of a stage input that ``wants_grad`` a fresh leaf that requires grad, so
    the stage's own graph ends there. Returns (each leaf as it was, None where not cut; the new
    leaves; the new input)."""
    args, kwargs = inp
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # no tree walk
        x = args[0]
        if not wants_grad(x):
            return [None], [x], inp
        leaf = x.detach().requires_grad_()
        return [x], [leaf], ((leaf,), {})
    leaves, spec = pytree.tree_flatten(inp)
    origins = [x if isinstance(x, torch.Tensor) and wants_grad(x) else None for x in leaves]
    leaves = [x.detach().requires_grad_() if o is not None else x
              for x, o in zip(leaves, origins)]
    return origins, leaves, pytree.tree_unflatten(leaves, spec)


def _requires_grad(x: torch.Tensor) -> bool:
    return x.requires_grad


def _backward_to_inputs(call: _Call) -> None:
    """Main thread, after the workers: hand the stage-0 input grads to autograd, which
    accumulates them into the inputs' ``.grad`` (and on into whatever graph produced them)."""
    tensors, grads = [], []
    for m, origins in enumerate(call.input_origins):
        grad_in = call.slots[(0, m)].grad_in or []
        for origin, g in zip(origins or [], grad_in):
            if origin is not None and g is not None:
                tensors.append(origin)
                grads.append(g)
    if tensors:
        torch.autograd.backward(tensors, grads)


def _copy_pairs(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def _to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


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
        if sink is not None and sink.take(param, grad):  # a fused forward_backward's backward
            return
        moves.add(optim_thread._launch(_accumulate_grad, master, grad))

    return move_grad_to_master
