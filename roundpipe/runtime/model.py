"""The facade: :class:`RoundPipe`, which composes the runtime's parts (listed in
:mod:`roundpipe.runtime`) into the public calls (``forward_backward``, ``forward``, ``step``,
``synchronize``, the state dicts), and the order of what ``step`` launches (see
[Note: staleness]).

Threads: every public method is for the main thread (checked, ``check_main_thread``); see
the :mod:`roundpipe.runtime` docstring for which thread touches what.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from roundpipe.devices import DevicePool, DeviceSpec
from roundpipe.main_thread import check_main_thread
from roundpipe.memory.checks import check_host_memory, skip_memory_check
from roundpipe.memory.host import host_terms
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.report import MemoryPlan
from roundpipe.microbatch import merge_outputs, split_inputs
from roundpipe.plan import Plan
from roundpipe.runtime.call import CallSpec, CallState, ModelParts, plan_call, prepare_call
from roundpipe.runtime.call_memory import (
    CallArgs,
    check_call_memory,
    data_parallel_buckets,
    memory_plan_of,
    pinned_allocator,
    sharding_terms,
)
from roundpipe.runtime.compiled import compile_options, compiled_layer
from roundpipe.runtime.config import ResolvedRunConfig, RoundPipeRunConfig, resolve_config
from roundpipe.runtime.executor import execute
from roundpipe.runtime.finished_loss import finished
from roundpipe.runtime.grad_router import TOUCHES_GRADS, GradHooks, GradReducer, clear_grads
from roundpipe.runtime.host_model import move_to_host
from roundpipe.runtime.optimizer_ctx import in_optimizer_ctx, wrap_step
from roundpipe.runtime.params import Params, StateAccess, check_state_dict
from roundpipe.runtime.placement import MasterPlacement
from roundpipe.runtime.rng import RngMemo, learn_rng_use, restore_after_call
from roundpipe.runtime.stage_ops import backward_to_inputs
from roundpipe.runtime.stages import ModelStages, model_layers
from roundpipe.scaler.grad_scaler import GradScaler, note_step_launched
from roundpipe.step_check import check_step_fn
from roundpipe.threads import optimizer_thread
from roundpipe.threads.workers import in_fork_child

__all__ = ["RoundPipe", "UnevenMicrobatchWarning"]


# The device types whose backward has run on torch autograd's device threads in this process
# (before a fork: in its parent); main thread.
_DEVICE_BACKWARD_RAN: set[str] = set()


class UnevenMicrobatchWarning(UserWarning):
    """A batch split into microbatches of different sizes, with a ``loss_fn`` that cannot weight
    them (it takes no :class:`roundpipe.microbatch.MicrobatchInfo`)."""


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
# after forward_backward k returned, and forward_backward k+1 waits for the events (on an
# accelerator, the plan's W action before each stage's first upload).


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
        memory_check: before wrapping, raise :class:`roundpipe.HostMemoryError` if the host
            RAM the wrap and training take (masters, their gradients, an Adam-sized optimizer
            state, the pinned pool) exceeds what the host has available; at the first
            ``forward_backward`` on an accelerator pool, raise
            :class:`roundpipe.DeviceMemoryError` if its planned peak exceeds a device's free
            memory. False (or ``ROUNDPIPE_SKIP_MEMORY_CHECK=1``) skips both (docs/memory.md).
        state_placement: where the masters and the optimizer's state live (None: host RAM;
            :class:`roundpipe.MastersOnDisk`, :class:`roundpipe.distributed.ShardedState`).
        compile: run each layer through ``torch.compile`` (see [Note: compiled layers] in
            roundpipe/runtime/compiled.py): False (the default here) never; True with torch's
            defaults (inductor); a dict of ``torch.compile``'s arguments; None: on CUDA where
            torch can build GPU kernels (Triton installed, torch >= 2.5), else eagerly (the
            default of :func:`roundpipe.hf.wrap`, whose layers are known to compile). Layers
            of one class share one compilation; the first iteration pays it.

    Every public method is for the main thread (the one that runs the training loop), except
    :meth:`optim_parameters`/:meth:`optim_named_parameters` and ``parameters()`` inside
    :class:`OptimizerCtx`, which any thread may call. Attributes by thread: see the
    :mod:`roundpipe.runtime` docstring.
    """

    # Whether a two-argument loss_fn on microbatches of different sizes warns
    # (UnevenMicrobatchWarning); False for a subclass whose model weights its loss itself.
    warns_uneven_microbatches = True

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        devices: DeviceSpec | None = None,
        memory_check: bool = True,
        state_placement: MasterPlacement | None = None,
        compile: bool | Mapping[str, Any] | None = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe wraps an nn.Module, got {type(model).__name__}")
        if any(isinstance(m, RoundPipe) for m in model.modules()):
            raise TypeError(
                "the module to wrap already contains a RoundPipe: wrap the plain "
                "module (RoundPipe(model.module)) instead of wrapping twice"
            )
        if model_run_config is not None and not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("model_run_config must be a RoundPipeRunConfig")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise ValueError(
                f"optim_dtype must be None or a floating torch.dtype, got {optim_dtype!r}"
            )
        _check_masters_hold(model, optim_dtype)
        if state_placement is not None and not isinstance(state_placement, MasterPlacement):
            raise TypeError(
                f"state_placement must be None (host RAM) or a MasterPlacement such as "
                f"roundpipe.distributed.ShardedState(), got {type(state_placement).__name__}"
            )
        move_to_host(model, f"RoundPipe{_tag(name)}")  # its home; before anything reads it
        self.module = model
        self.name = name
        self.model_run_config = model_run_config or RoundPipeRunConfig()
        self._pool = DevicePool(devices)
        if self._pool.streaming:  # leave the device threads their cores during a step
            optimizer_thread.use_default_num_threads(len(self._pool))
        self._memory_check = bool(memory_check) and not skip_memory_check()
        layers = model_layers(model)
        options = compile_options(compile, self._pool.device_type)
        if options is not None:
            for layer in layers:
                layer.compiled = compiled_layer(layer.module, options)
        if self._memory_check:  # before anything is allocated
            check_host_memory(
                host_terms(
                    model,
                    optim_dtype,
                    pinned_allocator(self._pool),
                    host_memory_available(),
                    **sharding_terms(self._pool, state_placement, layers),
                ),
                f"RoundPipe{_tag(name)}",
                bool(self.model_run_config.offload_activations),
            )
        # The device check runs at the first forward_backward (it needs the call's inputs).
        self._device_check_pending = self._memory_check and self._pool.streaming
        self._optim_dtype = optim_dtype
        self._pool.backends[0].prepare_host(model)
        self._params = Params(
            model,
            [layer.module for layer in layers],
            optim_dtype,
            owner=self,
            placement=state_placement,
            pinned=pinned_allocator(self._pool),
        )
        self._stages = ModelStages(layers, self._params)
        self._hooks = GradHooks(self._params.records, owner=self)
        self._has_grads = False
        self._warned_uneven = False  # UnevenMicrobatchWarning given
        # Stages (by their layers and training mode) probed for drawing random numbers; main
        # thread. See [Note: RNG chains].
        self._rng_memo: RngMemo = {}
        # Run on the optimizer thread before each step_fn (register_step_pre_hook).
        self._step_pre_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        # The roundpipe GradScalers this model's step functions used (main thread).
        self._step_scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        # Told of each of them (register_step_scaler_hook; main thread).
        self._step_scaler_hooks: OrderedDict[int, Callable[[GradScaler], None]] = OrderedDict()
        self._resolve(None)  # checks the model-level execute_plan now

    @property
    def state_placement(self) -> MasterPlacement:
        """Where the masters, their gradients and the optimizer state live (chosen at
        construction). Any thread; never blocks."""
        return self._params.placement

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 master parameters (one per trainable parameter; with a sharded
        ``state_placement``, those of this rank's share only). Any thread; never blocks."""
        return iter(list(self._params.masters.values()))

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, master)`` pairs, named like the wrapped module's parameters."""
        return iter(list(self._params.masters.items()))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters (names without a wrapper prefix); inside
        :class:`OptimizerCtx`, the masters. Decided at the call, not at iteration."""
        if in_optimizer_ctx():
            sep = "." if prefix else ""
            return iter([(prefix + sep + n, m) for n, m in self._params.masters.items()])
        return self.module.named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """``named_parameters()`` without the names (masters inside :class:`OptimizerCtx`)."""
        return iter([p for _, p in self.named_parameters(recurse=recurse)])

    def register_step_pre_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` on the optimizer thread before each later ``step_fn`` (in
        registration order, inside :class:`OptimizerCtx`), e.g. to average the masters'
        gradients over data-parallel ranks. A step launched before it or before
        ``handle.remove()`` keeps the hooks it was launched with. Main thread."""
        check_main_thread("register_step_pre_hook")
        handle = RemovableHandle(self._step_pre_hooks)
        self._step_pre_hooks[handle.id] = hook
        return handle

    def register_grad_reducer(self, reducer: GradReducer) -> Callable[[], None]:
        """Hand each later ``forward_backward``'s per-stage gradient sums to ``reducer``
        instead of the masters (see [Note: gradient accumulation] in
        :mod:`roundpipe.runtime.grad_router`): :class:`roundpipe.distributed.DataParallel`
        registers one for sharded state, to sum them over the ranks as the backward produces
        them. One at a time. Returns a function that unregisters it. Main thread; call it
        between iterations (no call running)."""
        check_main_thread("register_grad_reducer")
        if self._hooks.reducer is not None:
            raise RuntimeError("this RoundPipe already has a gradient reducer")
        self._hooks.reducer = reducer

        def remove() -> None:
            check_main_thread("register_grad_reducer")
            if self._hooks.reducer is reducer:
                self._hooks.reducer = None

        return remove

    def register_step_scaler_hook(self, hook: Callable[[GradScaler], None]) -> RemovableHandle:
        """Call ``hook(scaler)`` for every :class:`roundpipe.GradScaler` that this model's step
        functions use: at once for those already seen, and at the ``step`` that first uses a
        new one, before it is launched (e.g. so that the scaler agrees over data-parallel
        ranks). Main thread; ``hook`` runs on the main thread.

        Args:
            hook: called with each scaler, once per scaler.
        """
        check_main_thread("register_step_scaler_hook")
        handle = RemovableHandle(self._step_scaler_hooks)
        self._step_scaler_hooks[handle.id] = hook
        for scaler in list(self._step_scalers):
            hook(scaler)
        return handle

    # -- state dicts --------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict (same keys; the low-precision values the model holds
        now). Main thread; waits for a pending master->model copy, not for the step."""
        check_main_thread("state_dict")
        self._params.wait_ready()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module, then refresh the masters from the loaded params.

        The state dict is checked first, as torch checks it (with ``strict``, missing and
        unexpected keys; every shape): a refused load raises before anything changes, the
        model's parameters and the masters stay as they were. For an exact resume, use
        :func:`roundpipe.checkpoint.load` (or call :meth:`load_master_state_dict` afterwards).
        Main thread; blocks until the optimizer thread has run everything launched before.
        """
        check_main_thread("load_state_dict")
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameter objects "
                "that RoundPipe's masters shadow; load with assign=False"
            )
        check_state_dict(self.module, state_dict, strict)
        self._params.synchronize()
        self._params.wait_ready()
        result = self.module.load_state_dict(state_dict, strict=strict)
        self._params.refresh_masters()
        return result

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: clone of the master}``. Main thread; waits for the optimizer thread."""
        self._params.synchronize()
        return {n: m.detach().clone() for n, m in self._params.masters.items()}

    def load_master_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy values into the masters in place (the optimizer keeps referencing them). The
        model params are not touched: :meth:`synchronize` or the next step copies them.
        Main thread; blocks until the optimizer thread has applied it."""
        check_main_thread("load_master_state_dict")
        self._params.load_masters(state_dict)

    def state_access(self) -> StateAccess:
        """For :mod:`roundpipe.checkpoint` (which saves and loads a model through it): the
        wrapped module, the parameter records and masters, the device backends and the
        pending-gradients flag. Main thread; never blocks."""
        check_main_thread("state_access")

        def set_pending(value: bool) -> None:
            self._has_grads = bool(value)

        return StateAccess(
            module=self.module,
            params=self._params,
            backends=tuple(self._pool.backends),
            owner=self,
            pending_grads=lambda: self._has_grads,
            set_pending_grads=set_pending,
        )

    # -- config and plans ---------------------------------------------------------------------
    def plan(
        self,
        run_config: RoundPipeRunConfig | None = None,
        training: bool = True,
        *,
        inputs: tuple[Sequence[Any], dict[str, Any]] | None = None,
    ) -> Plan:
        """The plan a call would execute: ``print`` it to see, per device, the order and, on an
        accelerator, the program with every upload, prefetch, release, gradient download,
        hand-off, offload and host wait (see [Note: the program] in
        :mod:`roundpipe.plan.actions`). Main thread.

        Args:
            run_config: the call's :class:`RoundPipeRunConfig` (None: the model's).
            training: plan a ``forward_backward`` (True) or an inference ``forward``.
            inputs: the call's ``(input_args, input_kwargs)``. Under a ``device_memory_budget``
                the offloads depend on the sizes of the stage inputs; without ``inputs`` every
                stage input counts as 0 bytes.
        """
        check_main_thread("plan")
        cfg = self._resolve(run_config)
        chunks = None
        if inputs is not None:
            args, kwargs = inputs
            chunks, _ = split_inputs(tuple(args), dict(kwargs), cfg.num_microbatch, cfg.split_input)
        return plan_call(self._parts(), cfg, training, chunks)[2]

    def memory_plan(
        self,
        input_args: Sequence[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        run_config: RoundPipeRunConfig | None = None,
        return_outputs: bool = False,
    ) -> MemoryPlan:
        """What a ``forward_backward`` with these arguments would take, host and devices,
        without running it: ``print(model.memory_plan(input_args=(x,), label=y,
        loss_fn=loss_fn))`` prints the report (docs/memory.md reads one). The arguments are
        :meth:`forward_backward`'s. Host RAM: the weights, the masters, their gradients,
        an Adam-sized optimizer state, the pinned pool's slack, the stage inputs an accelerator
        offloads (a CPU pool: the activations). Per device of an accelerator pool: the peak
        of the call's plan, from its program and each stage's activations, traced on fake
        tensors (shapes only, no compute). ``loss_fn`` runs on fake tensors, once per distinct
        microbatch shape (None: a stand-in whose gradient is the size of the output); a stage
        fake tensors cannot run is measured by a real CPU run if small, else reported in
        ``untraced``. Without inputs only the host terms and the weights are counted. Main
        thread; changes nothing of the model."""
        check_main_thread("memory_plan")
        return memory_plan_of(
            self._parts(),
            self.module,
            self._optim_dtype,
            self._resolve(run_config),
            CallArgs(tuple(input_args), dict(input_kwargs or {}), label, loss_fn, return_outputs),
            **sharding_terms(self._pool, self.state_placement, self._parts().stages.layers),
            buckets=data_parallel_buckets(self),
        )

    def _resolve(self, run_config: RoundPipeRunConfig | None) -> ResolvedRunConfig:
        return resolve_config(run_config, self.model_run_config, len(self._stages.layers))

    def _parts(self) -> ModelParts:
        return ModelParts(
            tag=self._name_tag(),
            pool=self._pool,
            stages=self._stages,
            ready=self._params.ready,
            cast_dtype=self._params.cast_dtype,
            hooks=self._hooks,
            rng_memo=self._rng_memo,
        )

    # -- public calls -------------------------------------------------------------------------
    def forward_backward(
        self,
        input_args: Sequence[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """Forward and backward of one batch, in microbatches.

        Gradients accumulate into the masters' ``.grad`` (``optim_dtype``); inputs that require
        grad get theirs in ``.grad`` (through whatever graph produced them), as
        ``loss.backward()`` would give them. The call stops at its first failure: no
        microbatch runs after one has failed. Main thread; blocks until every gradient of the
        call is accumulated, so nothing of it is in flight afterwards (it also waits for a step
        launched before, whose gradient moves come first). If it raises, the gradients
        accumulated since the last step are discarded, so the next iteration starts clean.

        Args:
            input_args: positional inputs, split into microbatches along their batch dimension;
                they reach the first layer only (every later layer gets the previous layer's
                output as its one argument).
            input_kwargs: keyword inputs of the first layer, split the same way.
            label: split the same way; each microbatch's part reaches ``loss_fn``.
            loss_fn: ``loss_fn(output, label_mb)`` or ``loss_fn(output, label_mb, mb)``, run
                once per microbatch on the worker of the last stage; returns a single-element
                tensor. ``mb`` is a :class:`roundpipe.MicrobatchInfo` (``mb.share``: the
                microbatch's fraction of the batch, to weight a mean loss when the microbatches
                differ in size; a batch that does not split evenly warns, once per model, for a
                two-argument ``loss_fn``).
            return_outputs: also return the model's outputs, merged over the microbatches.
            run_config: overrides the model-level :class:`RoundPipeRunConfig` for this call.

        Returns:
            The sum of the microbatch losses (detached: its backward has run; calling
            ``backward()`` on it raises ``RuntimeError`` naming :meth:`step`), or ``(loss,
            merged_outputs)`` with ``return_outputs``.
        """
        check_main_thread("forward_backward")
        self._check_fork()
        self._report_failures()
        if not callable(loss_fn):
            raise ValueError("forward_backward needs loss_fn(output, label) -> scalar tensor")
        cfg = self._resolve(run_config)
        spec, state = prepare_call(
            self._parts(),
            cfg,
            tuple(input_args),
            dict(input_kwargs or {}),
            label,
            loss_fn,
            training=True,
            return_outputs=return_outputs,
        )
        if self._device_check_pending:
            self._check_device_memory(spec, cfg)
        if (
            self.warns_uneven_microbatches
            and len(set(spec.sizes)) > 1
            and not spec.loss_takes_microbatch
            and not self._warned_uneven
        ):
            self._warned_uneven = True
            warnings.warn(
                f"a batch of {sum(spec.sizes)} samples splits into microbatches of "
                f"{', '.join(map(str, spec.sizes))}: a loss_fn that divides each microbatch's "
                f"mean loss by num_microbatch weights their samples unequally, so the gradient "
                f"is not the batch mean's. Take a third argument, loss_fn(output, label, mb), "
                f"and scale the microbatch's mean by mb.share (its fraction of the batch), or "
                f"use a batch size that num_microbatch divides. (Warned once per model.)",
                UnevenMicrobatchWarning,
                stacklevel=2,
            )
        self._has_grads = True
        if self._pool.streaming:
            _DEVICE_BACKWARD_RAN.add(self._pool.device_type)
        ok = False
        try:
            try:
                execute(spec, state)
            finally:
                state.grads.finish()
            learn_rng_use(self._rng_memo, spec.rng, state.stage_drew)
            for item in state.grads.moves:
                item.wait(report=False)  # reported together, below
            # The moves' failures (one per stage when a data-parallel group breaks) in one
            # report, with any of a step of this model launched before.
            optimizer_thread.raise_failures(self)
            ok = True
            out_device = cfg.output_device
            # Summed where the losses are when they share a device (one transfer, not M).
            losses = state.losses
            same = len({loss.device for loss in losses}) == 1
            total = losses[0] if same else losses[0].to(out_device)
            for loss in losses[1:]:
                total = total + (loss if same else loss.to(out_device))
            # Its backward has run: loss.backward() says so and names model.step.
            total = finished(total.to(out_device))
            if return_outputs:
                merged = _to_device(
                    merge_outputs(state.outputs, spec.sizes, cfg.merge_output), out_device
                )
            if spec.input_grad:  # last: a failure before it leaves the inputs' .grad untouched
                backward_to_inputs(state)
        except BaseException as exc:
            # Whatever failed (a stage, loss_fn, an earlier step, the merge), the call's
            # gradients are dropped so that retrying the iteration does not add them twice.
            # Ctrl-C does not wait for that (a running step may be long): launched behind the
            # call's moves, the drop runs before anything launched later.
            self._discard_grads(wait=not isinstance(exc, KeyboardInterrupt))
            raise
        finally:
            for p, g in state.stashed_grads:
                p.grad = g
            self._restore_rng(spec, state, ok)
        return (total, merged) if return_outputs else total

    def forward(
        self, *args: Any, run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Microbatched inference; differentiable when ``requires_grad`` (default: grad mode at
        the call) is on. Then a ``backward()`` through the output moves the parameter gradients
        into the masters (as forward_backward does) and :meth:`step` may follow. Main thread;
        blocks until the output is computed.

        Args:
            *args: the first layer's positional inputs, split into microbatches (as in
                :meth:`forward_backward`).
            run_config: keyword only, not passed to the model: overrides the model-level
                config for this call, e.g. ``model(x,
                run_config=RoundPipeRunConfig(num_microbatch=1))`` for a small batch.
            **kwargs: the first layer's keyword inputs, split the same way.

        Returns:
            The outputs of the microbatches, merged along the batch dimension.
        """
        check_main_thread("forward")
        self._report_failures()
        cfg = self._resolve(run_config)
        grad = torch.is_grad_enabled() if cfg.requires_grad == "caller" else bool(cfg.requires_grad)
        grad = grad and not torch.is_inference_mode_enabled()
        spec, state = prepare_call(
            self._parts(),
            cfg,
            args,
            kwargs,
            None,
            None,
            training=False,
            return_outputs=True,
            grad_enabled=grad,
        )
        if grad:
            self._check_fork()
            self._hooks.ensure()
            if self._pool.streaming:
                _DEVICE_BACKWARD_RAN.add(self._pool.device_type)
        ok = False
        try:
            try:
                execute(spec, state)
            finally:
                state.grads.finish()
            learn_rng_use(self._rng_memo, spec.rng, state.stage_drew)
            ok = True
        finally:
            self._restore_rng(spec, state, ok)
        merged = _to_device(
            merge_outputs(state.outputs, spec.sizes, cfg.merge_output), cfg.output_device
        )
        if grad and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(merged)
        ):
            self._has_grads = True
        return merged

    def step(self, step_fn: Callable[[], Any], is_async: bool = True) -> None:
        """Run ``step_fn`` on the optimizer thread, inside :class:`OptimizerCtx`.

        Main thread. Raises ``RuntimeError`` if no gradients were produced since the last step;
        re-raises an earlier failure of the optimizer thread (and then discards the accumulated
        gradients).

        Args:
            step_fn: what one step does, e.g. ``lambda: (scaler.step(opt), opt.zero_grad())``;
                a :class:`roundpipe.GradScaler` it names is found at launch and decides its
                mode from this step (docs/scaler.md).
            is_async: True (default): launch the master->model copy, then ``step_fn``, and
                return without waiting; the next iteration computes with parameters one step
                older (see [Note: staleness]). False: launch ``step_fn``, then the copy, and
                wait (zero-stale).
        """
        check_main_thread("step")
        self._report_failures()
        if not callable(step_fn):
            raise ValueError(
                "step() needs a callable step_fn, e.g. lambda: (opt.step(), opt.zero_grad())"
            )
        # Before anything changes: a refused step can be retried. The step's failure belongs to
        # this model and to the scalers its steps use, now or before (see
        # [Note: error reporting] in roundpipe.threads.optimizer_thread): the scaler of this loop reports it at its
        # update.
        for scaler in check_step_fn(step_fn):
            if scaler not in self._step_scalers:
                self._step_scalers.add(scaler)
                for hook in list(self._step_scaler_hooks.values()):
                    hook(scaler)
        owners = (self, *self._step_scalers)
        self._params.placement.check_step()
        if not self._has_grads:
            raise RuntimeError(
                "step() called with no gradients since the last step: run forward_backward() (or "
                "a differentiable forward() and backward()) first; each step consumes the "
                "gradients accumulated since the previous one"
            )
        self._has_grads = False
        run = wrap_step(
            self._params,
            self._name_tag(),
            step_fn,
            list(self._step_pre_hooks.values()),
            in_place_copy=not is_async,
        )
        if is_async:
            self._params.launch_copy()
            note_step_launched(
                self._step_scalers, optimizer_thread.launch_work(run, step=True, owners=owners)
            )
            return
        note_step_launched(
            self._step_scalers, optimizer_thread.launch_work(run, step=True, owners=owners)
        )
        self._params.launch_copy()
        self._wait_for_steps()

    def _wait_for_steps(self) -> None:
        """Main thread: wait for every launched step and raise this model's failures (then
        drop its gradients). Ctrl-C raises at once: the step runs on and nothing is dropped."""
        optimizer_thread.wait_all()
        try:
            optimizer_thread.raise_failures(self)
        except BaseException:
            self._discard_grads()
            raise

    def synchronize(self) -> None:
        """Wait for every launched step, then copy the newest masters into the model's
        parameters (the user's parameter objects hold the newest values afterwards). Main
        thread; blocks; re-raises an optimizer-thread failure."""
        check_main_thread("synchronize")
        self._wait_for_steps()
        self._params.launch_copy()
        self._params.wait_ready()

    # -- internals ----------------------------------------------------------------------------
    def _check_device_memory(self, spec: CallSpec, cfg: ResolvedRunConfig) -> None:
        """The first forward_backward on an accelerator pool: refuse it before anything is
        allocated if its planned peak does not fit a device (see
        :func:`roundpipe.runtime.call_memory.check_call_memory`); the calls after a refusal
        are checked again, until one passes."""
        check_call_memory(spec, f"RoundPipe{self._name_tag()}", cfg)
        # Only a call that passed: after a refusal, the same call is checked again.
        self._device_check_pending = False

    def _check_fork(self) -> None:
        """A backward on an accelerator in a fork child of a process that ran one: torch's
        autograd cannot start its device threads there (it raises "Unable to handle autograd's
        threading in combination with fork-based multiprocessing" from a worker); say so before
        anything runs. A CPU pool trains in a fork child (see [Note: fork] in roundpipe.threads.optimizer_thread)."""
        if (
            self._pool.streaming
            and self._pool.device_type in _DEVICE_BACKWARD_RAN
            and in_fork_child()
        ):
            raise RuntimeError(
                f"RoundPipe{self._name_tag()}: this process was made by os.fork() from one that "
                f"had already trained on {self._pool.device_type} devices, and torch's autograd "
                f"cannot run a backward on them in a fork child (its device threads do not "
                f"survive the fork). Start the process with multiprocessing's 'spawn' (or "
                f"'forkserver') method, or fork before the first forward_backward"
            )

    def _restore_rng(self, spec: CallSpec, state: CallState, ok: bool) -> None:
        end = None
        if ok and spec.plan.num_microbatch == 1:
            end = state.slots[(len(spec.stages) - 1, 0)].rng_end
        restore_after_call(spec.rng, self._pool.backends[0], end)

    def _discard_grads(self, wait: bool = True) -> None:
        self._has_grads = False
        item = self._params.launch(clear_grads, self._params.grad_targets, touches=TOUCHES_GRADS)
        if wait:
            item.wait()

    def _report_failures(self) -> None:
        try:
            optimizer_thread.raise_failures(self)
        except BaseException:
            self._discard_grads()
            raise
        if self._params.ready.failed():
            # A failed copy leaves the params partly updated; the next call must not read them.
            self._params.launch_copy()

    def _name_tag(self) -> str:
        return _tag(self.name)


def _check_masters_hold(model: nn.Module, optim_dtype: torch.dtype | None) -> None:
    """``ValueError`` if masters in ``optim_dtype`` could not hold every value of a trainable
    parameter's dtype (fewer mantissa bits or less range: fp16 or bf16 masters of fp32
    parameters, bf16 masters of fp16 ones), naming the fix."""
    if optim_dtype is None:
        return
    masters = torch.finfo(optim_dtype)
    for name, p in model.named_parameters():
        if not (p.requires_grad and p.is_floating_point()) or p.dtype == optim_dtype:
            continue
        own = torch.finfo(p.dtype)
        if masters.eps > own.eps or masters.max < own.max:
            raise ValueError(
                f"optim_dtype={optim_dtype} would keep the masters in lower precision than the "
                f"model's {p.dtype} parameters ({name}, ...): every step would round the "
                f"trained weights to {optim_dtype} and small updates would be lost. Leave "
                f"optim_dtype=None (fp32 masters for fp16/bf16 parameters, else the parameters' "
                f"own dtype) or pass one at least as precise as {p.dtype}; to keep "
                f"{optim_dtype} masters to save memory, convert the model to {optim_dtype} "
                f"before wrapping (model.to({optim_dtype}))"
            )


def _tag(name: str | None) -> str:
    return f" {name!r}" if name else ""


def _to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)
