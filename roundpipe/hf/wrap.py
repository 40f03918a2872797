"""``roundpipe.hf.wrap``: a HuggingFace causal LM as a RoundPipe of stages."""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from roundpipe.devices import pool as device_pool
from roundpipe.hf import compat
from roundpipe.hf.calls import causal_lm_loss, count_predicted, parse_batch, positional_batch
from roundpipe.hf.check import check_stages
from roundpipe.hf.defaults import (
    default_loss_chunk_tokens,
    default_mlp_tile_tokens,
    kept_input_bytes,
    offload_needed,
)
from roundpipe.hf.families import Family, family_of, layer_attention_types
from roundpipe.hf.names import HFNames, export_state_dict
from roundpipe.hf.quantized import check_quantized, prepare_quantized
from roundpipe.hf.stages import Decoder, Embed, Head, has_experts
from roundpipe.main_thread import check_main_thread
from roundpipe.memory.checks import DeviceMemoryError
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.report import MemoryPlan
from roundpipe.memory.search import longest_fitting
from roundpipe.runtime import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.compiled import compile_options
from roundpipe.runtime.host_model import move_to_host
from roundpipe.runtime.optimizer_ctx import in_optimizer_ctx
from roundpipe.threads import optimizer_thread

__all__ = ["wrap", "HFRoundPipe", "default_loss_chunk_tokens"]


def _identity_loss(loss: Any, label: Any) -> torch.Tensor:
    return loss[0] if isinstance(loss, tuple) else loss  # (loss, token stats): the Head's


# [Note: the HF model's face]
# Libraries handed the wrapped model treat it as the HF model it wraps, and it answers as one:
# * its forward's signature, as ``inspect.signature(model.forward)`` reads it, is the causal
#   LM's own (the base model's, for a peft model, as transformers' Trainer reads it) with
#   ``run_config`` added: transformers' Trainer keeps the dataset columns that forward takes
#   (``remove_unused_columns``), and ``model(input_ids, attention_mask)`` binds positions by it.
#   The signature is the instance's: ``forward`` is a descriptor (``_HFForward``) that binds the
#   method with a copy of the function carrying the model's ``__signature__``.
# * what the HF model offers to read (``config``, ``generation_config``, ``device``, ``dtype``,
#   ``name_or_path``, ``peft_config``, its submodules, ...) and its methods that change nothing
#   (``_READ_ONLY_METHODS``) are found on the HF model when HFRoundPipe has no attribute of the
#   name; :meth:`HFRoundPipe.generate` synchronizes first. Its other methods (those that change
#   the model: ``resize_token_embeddings``, ``add_adapter``, ...) raise AttributeError naming
#   why: the stages hold the modules of the wrap, and such a change would not reach them.
# nn.Module's own attributes (parameters(), state_dict(), train()/eval(), to(), ...) are
# HFRoundPipe's, as before.

# The HF model's methods that change nothing, given on the wrapped model (see
# [Note: the HF model's face]).
_READ_ONLY_METHODS = frozenset(
    {
        "can_generate",
        "get_input_embeddings",
        "get_output_embeddings",
        "get_decoder",
        "get_base_model",
        "num_parameters",
        "get_memory_footprint",
        "floating_point_ops",
        "estimate_tokens",
        "get_nb_trainable_parameters",
        "print_trainable_parameters",
    }
)


def _forward_signature(base: nn.Module) -> inspect.Signature:
    """The signature the wrapped model's ``forward`` shows: ``base.forward``'s (the causal LM's)
    with ``run_config`` added as a keyword-only parameter, ``self`` first (see
    [Note: the HF model's face])."""
    own = inspect.signature(base.forward)
    kinds = inspect.Parameter
    params = [p for p in own.parameters.values() if p.name not in ("self", "run_config")]
    rest = [p for p in params if p.kind is not kinds.VAR_KEYWORD]
    var_kw = [p for p in params if p.kind is kinds.VAR_KEYWORD]
    run_config = kinds("run_config", kinds.KEYWORD_ONLY, default=None)
    return own.replace(
        parameters=[kinds("self", kinds.POSITIONAL_ONLY), *rest, run_config, *var_kw]
    )


class _HFForward:
    """``HFRoundPipe.forward``: on the class, the function; on an instance, the method bound
    with the function that carries the HF model's signature (see [Note: the HF model's
    face])."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self.function
        signed = obj.__dict__.get("_signed_forward")
        return types.MethodType(signed if signed is not None else self.function, obj)


class HFRoundPipe(RoundPipe):
    """A RoundPipe over the stages of a HuggingFace causal LM (made by :func:`wrap`), called and
    named like the HF model (docs/hf.md).

    * ``forward_backward(input_kwargs=batch)`` takes the batch as HF's collators make it
      (``input_ids``, ``attention_mask``, ``labels`` with -100 where no loss is taken) and,
      without a ``loss_fn``, backpropagates and returns the loss transformers computes for the
      whole batch. A ``loss_fn(loss, label)`` receives each microbatch's share of it (the
      microbatches add up to the batch's loss), e.g. ``lambda loss, _: scaler.scale(loss)``.
    * ``model(**batch)`` returns what the HF model returns: a ``CausalLMOutputWithPast`` with
      the batch's ``logits`` and, given ``labels``, transformers' ``loss``.
    * The batch's keys are HF's: those roundpipe cannot honour raise ``ValueError`` naming the
      accepted ones (:data:`roundpipe.hf.calls.ACCEPTED_KEYS`).
    * ``state_dict()``, ``master_state_dict()``, their loads and ``named_parameters()`` use the
      HF model's names (``model.layers.0.self_attn.q_proj.weight``), as ``hf_model.state_dict()``.
    * :meth:`save_pretrained` writes the trained weights as a directory that transformers'
      ``from_pretrained`` loads.
    * It answers as the HF model (see [Note: the HF model's face]): ``forward``'s signature is
      the HF model's (so transformers' Trainer keeps the dataset's columns); ``config``,
      ``generation_config``, ``device``, ``dtype``, ``get_input_embeddings()``,
      ``num_parameters()``, ``can_generate()`` and the HF model's other attributes and
      read-only methods are the HF model's; :meth:`generate` generates with the newest
      weights, so ``pipeline("text-generation", model=model, tokenizer=tok)`` works.

    ``hf_model`` is the model that was wrapped: after :meth:`synchronize` its parameters hold the
    trained weights. Every public method is for the main thread, as RoundPipe's, except where
    its docstring says otherwise.
    """

    # The head divides each microbatch's token losses by the batch's count of predicted tokens,
    # so uneven microbatches are weighted right: no UnevenMicrobatchWarning.
    warns_uneven_microbatches = False

    def __init__(self, hf_model: nn.Module, stages: nn.Sequential, **kwargs: Any) -> None:
        super().__init__(stages, **kwargs)
        self.hf_model = hf_model
        self._config = _base_model(hf_model).config
        # The stages' parameter names ("1.layer.self_attn.q_proj.weight") <-> the HF model's.
        self._names = HFNames(hf_model, stages)
        self._hf_names = self._names.hf_name
        # forward with the HF model's signature (see [Note: the HF model's face]).
        function = type(self).forward

        def signed(self: Any, *args: Any, **kwargs: Any) -> Any:
            return function(self, *args, **kwargs)

        signed.__doc__ = function.__doc__
        signed.__signature__ = _forward_signature(_base_model(hf_model))  # type: ignore[attr-defined]
        self._signed_forward = signed
        self._is_moe = has_experts(self._config)
        # Whether the head adds the load-balancing term (decided when the stages were built).
        self._router_aux = self._is_moe and bool(
            getattr(self._config, "output_router_logits", False)
        )

    # -- defaults that fit --------------------------------------------------------------------------
    def device_free(self) -> int | None:
        """Bytes the smallest device of the pool has free now (None: a CPU pool, which computes
        in host memory). Any thread."""
        free = [b.memory_available() for b in self._pool.backends]
        known = [f for f in free if f is not None]
        return min(known) if self._pool.streaming and len(known) == len(free) else None

    def fitting_run_config(
        self, input_kwargs: dict[str, Any] | None, run_config: RoundPipeRunConfig | None
    ) -> RoundPipeRunConfig | None:
        """``run_config`` with what the call needs to fit chosen where neither it nor the model's
        config chooses (see :mod:`roundpipe.hf.defaults`): ``offload_activations=True`` when the
        stage inputs kept for the recompute of this batch would not fit the device and the host
        has that much free. Main thread."""
        chosen = [c for c in (run_config, self.model_run_config) if c is not None]
        if any(c.offload_activations is not None for c in chosen):
            return run_config
        recompute = next((c.recompute for c in chosen if c.recompute is not None), True)
        if not recompute:  # offload moves the inputs a recompute keeps
            return run_config
        ids = (input_kwargs or {}).get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return run_config
        itemsize = next(self.hf_model.parameters()).element_size()
        kept = kept_input_bytes(
            int(self._config.num_hidden_layers),
            ids.numel(),
            int(self._config.hidden_size),
            itemsize,
        )
        if not offload_needed(kept, self.device_free(), host_memory_available()):
            return run_config
        if run_config is None:
            return RoundPipeRunConfig(offload_activations=True)
        return dataclasses.replace(run_config, offload_activations=True)

    def longest_seq_len(
        self,
        limit: int,
        batch_size: int = 1,
        run_config: RoundPipeRunConfig | None = None,
        step: int = 1,
    ) -> int:
        """The longest sequence, at most ``limit`` tokens (a multiple of ``step``), whose
        ``forward_backward`` of ``batch_size`` rows fits every device of the pool by the
        memory plan (with the defaults that fit chosen at each length), found by bisection over
        :meth:`memory_plan` (:func:`roundpipe.memory.search.longest_fitting`): nothing runs. 0
        when not even ``step`` tokens fit. Main thread; about log2(limit / step) plans."""

        def fits(seq_len: int) -> bool:
            ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            plan = self.memory_plan(input_kwargs=batch, run_config=run_config)
            return all(d.fits for d in plan.devices)

        return longest_fitting(fits, limit, step)

    # -- names ------------------------------------------------------------------------------------
    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The masters, under the HF model's parameter names (``model.layers.0.mlp...``); a
        tied parameter under its first name. Any thread; never blocks."""
        for name, master in super().optim_named_parameters():
            yield self._hf_names.get(name, name), master

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``hf_model.named_parameters()``; inside :class:`roundpipe.OptimizerCtx`, the masters
        under the same names (:meth:`optim_named_parameters`). Decided at the call."""
        if in_optimizer_ctx():
            sep = "." if prefix else ""
            return iter([(prefix + sep + n, m) for n, m in self.optim_named_parameters()])
        return self.hf_model.named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """``hf_model.state_dict()``: the HF model's names (a tied parameter under each of its
        names, one tensor), the low-precision values the model holds now. Main thread; waits for
        a pending master->model copy, not for the step."""
        check_main_thread("state_dict", "HFRoundPipe")
        self._params.wait_ready()
        return self.hf_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict with the HF model's names (:meth:`state_dict`'s, or
        ``hf_model.state_dict()``'s) into the HF model, then refresh the masters from the loaded
        parameters; a state dict with the stages' names (``"1.layer..."``, as this method took
        before) is translated. For an exact resume, call :meth:`load_master_state_dict`
        afterwards (docs/checkpointing.md). Main thread; blocks until the optimizer thread has
        run everything launched before."""
        check_main_thread("load_state_dict", "HFRoundPipe")
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameter objects "
                "that RoundPipe's masters shadow; load with assign=False"
            )
        optimizer_thread.synchronize()
        self._params.wait_ready()
        state = self._names.translate_stage_names(state_dict)
        result = self.hf_model.load_state_dict(state, strict=strict)
        self._params.refresh_masters()
        return result

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """``{HF name: clone of the master}``, a tied master under each of its names (one
        tensor), so ``hf_model.load_state_dict(model.master_state_dict())`` loads them into an
        HF model of the masters' dtype. Any thread (inside a step function, the masters as the
        step sees them); waits for the optimizer thread, except on it."""
        return self._names.masters_out(super().master_state_dict().items())

    def load_master_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy :meth:`master_state_dict`'s values (HF names; a tied master under any of its
        names; the stages' names are translated) into the masters in place. The model params
        are not touched: :meth:`synchronize` or the next step copies them. Main thread; blocks
        until the optimizer thread has applied it. ``ValueError`` names, in HF names, the
        masters missing and the keys that name no master."""
        check_main_thread("load_master_state_dict", "HFRoundPipe")
        stage_names = [name for name, _ in super().optim_named_parameters()]
        super().load_master_state_dict(self._names.masters_in(state_dict, stage_names))

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> None:
        """Write the trained model as a directory that transformers' ``from_pretrained`` loads:
        :meth:`synchronize`, then the HF model's own ``save_pretrained(save_directory,
        state_dict=...)`` with every weight in ``dtype`` (default fp32: the masters' values;
        the model's dtype, e.g. ``torch.float16``: the low-precision weights the model holds
        after synchronizing) and the config's ``dtype`` set to it. A peft model saves its
        adapter as peft does (``adapter_config.json`` and the adapter's weights, with their
        trained values in ``dtype``), loaded with ``PeftModel.from_pretrained(base,
        save_directory)``. ``kwargs`` go to the HF model's ``save_pretrained`` (e.g.
        ``max_shard_size``). Main thread; blocks until every launched step has run; like
        :meth:`synchronize`, the next iteration computes with the newest weights, so save a
        checkpoint for an exact resume before calling it (docs/checkpointing.md)."""
        check_main_thread("save_pretrained", "HFRoundPipe")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"save_pretrained(dtype=) takes a floating torch.dtype, got {dtype!r}")
        for key in ("state_dict", "push_to_hub"):
            if key in kwargs and (key == "state_dict" or kwargs[key]):
                raise ValueError(
                    f"save_pretrained({key}=...) is not taken: it writes the masters' values "
                    f"itself; save, then upload the directory"
                )
        self.synchronize()
        masters = dict(self.optim_named_parameters())
        state = export_state_dict(self.hf_model, masters, dtype)
        hf_model: Any = self.hf_model
        config = self._config
        before = config.dtype  # the HF model's save writes its own dtype into its config
        try:
            hf_model.save_pretrained(save_directory, state_dict=state, **kwargs)
            config_file = os.path.join(save_directory, "config.json")
            if not _is_peft(hf_model) and os.path.exists(config_file):
                # The weights are in dtype, and from_pretrained loads them in the config's.
                config.dtype = dtype
                if kwargs.get("is_main_process", True):
                    config.save_pretrained(save_directory)
        finally:
            config.dtype = before

    # -- calls ------------------------------------------------------------------------------------
    def _hf_kwargs(
        self, input_kwargs: Any, input_args: Any, call: str = "forward_backward"
    ) -> dict[str, Any]:
        """The first stage's kwargs for ``call`` of ``input_kwargs``, with the labels and the
        batch's count of predicted tokens; ``ValueError`` for anything else."""
        if isinstance(input_args, Mapping) or (
            isinstance(input_args, (tuple, list))
            and any(isinstance(a, Mapping) for a in input_args)
        ):
            raise ValueError(
                f"{call} got the batch (a dict) as input_args: pass it as input_kwargs=batch, "
                f"e.g. model.{call}(input_kwargs=batch)"
            )
        if input_args:
            raise ValueError(
                f"{call}: pass the batch as input_kwargs (input_ids=..., attention_mask=..., "
                f"labels=...), not input_args"
            )
        batch = parse_batch(input_kwargs or {}, f"{call}(input_kwargs=batch)")
        if batch.labels is None:
            raise ValueError(
                f"{call} of a wrapped HF model needs input_kwargs['labels'] (the "
                "input_ids, with -100 where no loss is taken, as HF's collators make them)"
            )
        wanted = batch.output_router_logits
        if self._is_moe and wanted is not None and wanted != self._router_aux:
            raise ValueError(
                f"{call}: output_router_logits={wanted} differs from the model's "
                f"{self._router_aux}, with which the stages were built (the head adds the "
                f"load-balancing term or not); set config.output_router_logits before "
                f"roundpipe.hf.wrap, or leave the key out"
            )
        kwargs = dict(batch.stage_kwargs, labels=batch.labels)
        num_items = batch.num_items_in_batch
        # Counted over the whole batch before it is split: each microbatch's loss is its token
        # losses' sum over this, so the microbatches add up to transformers' batch loss.
        kwargs["num_items_in_batch"] = (
            count_predicted(batch.labels) if num_items is None else num_items
        )
        return kwargs

    def memory_plan(
        self,
        input_args: Sequence[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        run_config: RoundPipeRunConfig | None = None,
        return_outputs: bool = False,
    ) -> MemoryPlan:
        """What ``forward_backward(input_kwargs=batch)`` would take, host and devices, without
        running it (see :meth:`RoundPipe.memory_plan`, whose arguments it takes): the batch
        as ``input_kwargs``, as for :meth:`forward_backward` (none: the host terms and the
        weights only). Main thread; changes nothing of the model."""
        if input_kwargs is None and not input_args:
            return super().memory_plan(run_config=run_config)
        return super().memory_plan(
            input_kwargs=self._hf_kwargs(input_kwargs, input_args, "memory_plan"),
            label=label,
            loss_fn=loss_fn or _identity_loss,
            run_config=self.fitting_run_config(input_kwargs, run_config),
            return_outputs=return_outputs,
        )

    def forward_backward(
        self,
        input_args: Sequence[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """:meth:`RoundPipe.forward_backward` of an HF batch (``input_kwargs=batch``, the keys
        of :meth:`forward`): without a ``loss_fn``, backpropagates transformers' loss of the
        whole batch and returns it; the token losses are summed over ``num_items_in_batch``
        where the batch gives it (a count over several batches, for gradient accumulation),
        else over the batch's count of predicted tokens. Main thread; blocks as RoundPipe's."""
        try:
            return super().forward_backward(
                input_kwargs=self._hf_kwargs(input_kwargs, input_args),
                label=label,
                loss_fn=loss_fn or _identity_loss,
                return_outputs=return_outputs,
                run_config=self.fitting_run_config(input_kwargs, run_config),
            )
        except DeviceMemoryError as exc:  # refused by the plan, before anything was allocated
            ids = (input_kwargs or {}).get("input_ids")
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
                raise
            rows, seq_len = ids.shape
            longest = self.longest_seq_len(seq_len - 1, rows, run_config)
            if longest:
                hint = (
                    f"The longest sequence that fits, {rows} row(s) per batch at these settings: "
                    f"{longest} tokens (a search over the memory plan; nothing ran)"
                )
            else:
                hint = (
                    f"No sequence of {rows} row(s) fits at these settings (the stages' weights "
                    f"and gradient sums alone do not): train LoRA adapters, or use a device "
                    f"with more memory"
                )
            raise DeviceMemoryError(f"{exc}\n{hint}") from exc

    def forward(
        self, *args: Any, run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """``model(**batch)`` as the HF model's forward: a
        ``transformers.modeling_outputs.CausalLMOutputWithPast`` whose ``logits`` are the whole
        batch's (the microbatches' merged) and, given ``labels``, whose ``loss`` is
        transformers' (the fp32 token losses summed over ``num_items_in_batch``, default the
        batch's count of predicted tokens); ``return_dict=False``: the tuple ``(loss, logits)``
        or ``(logits,)``. Positional arguments are taken in the HF model's order
        (``model(input_ids)``). Differentiable under grad mode, as :meth:`RoundPipe.forward`
        (``out.loss.backward()`` moves the gradients into the masters); under
        ``torch.no_grad()`` an evaluation. A mixture-of-experts model with
        ``output_router_logits`` raises ``NotImplementedError`` when given labels (the
        load-balancing term is ``forward_backward``'s). Main thread; blocks until the output is
        computed."""
        batch = parse_batch(positional_batch(self.forward, args, kwargs), "model(**batch)")
        if batch.labels is not None and self._is_moe:
            router = batch.output_router_logits
            if router is None:
                router = bool(getattr(self._config, "output_router_logits", False))
            if router:
                raise NotImplementedError(
                    "model(**batch) with labels, of a mixture-of-experts model with "
                    "output_router_logits=True: transformers adds the router load-balancing "
                    "term to this loss, and roundpipe's forward computes the cross-entropy "
                    "only. Train with model.forward_backward(input_kwargs=batch), which adds "
                    "the term (docs/hf.md), or pass output_router_logits=False for the "
                    "cross-entropy loss alone"
                )
        logits = super().forward(run_config=run_config, **batch.stage_kwargs)
        loss = None
        if batch.labels is not None:
            loss = causal_lm_loss(logits, batch.labels, batch.num_items_in_batch)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return_dict = batch.return_dict
        if return_dict is None:
            return_dict = bool(getattr(self._config, "return_dict", True))
        return out if return_dict else out.to_tuple()

    forward = _HFForward(forward)  # type: ignore[assignment]

    # -- the HF model's face ------------------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate`` of the HF model (the same arguments and result), with the
        newest weights: :meth:`synchronize` first (it waits for the steps launched so far and
        copies the newest masters into the model's parameters; the next iteration then computes
        with them too, as after an evaluation), then ``hf_model.generate(*args, **kwargs)``.

        Where it runs: where the HF model is, in host memory, so on the CPU, in the model's
        dtype (the stages stream through the devices for :meth:`forward` and
        :meth:`forward_backward` only). Cost: the wait for the step in flight, one copy of the
        trained weights into the model, then a CPU generation, which for a large model is slow:
        sample a few short texts (``max_new_tokens``), not an evaluation set. Inputs on a device
        are moved to the host. Main thread (it synchronizes)."""
        check_main_thread("generate", "HFRoundPipe")
        self.synchronize()
        hf_model: Any = self.hf_model
        args = tuple(_to_host(a) for a in args)
        kwargs = {k: _to_host(v) for k, v in kwargs.items()}
        return hf_model.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # The HF model's attributes and read-only methods where HFRoundPipe has none of the
        # name (see [Note: the HF model's face]).
        try:
            return super().__getattr__(name)
        except AttributeError:
            hf_model = self.__dict__.get("_modules", {}).get("hf_model")
            if hf_model is None or name.startswith("_"):
                raise
        value = getattr(hf_model, name)  # AttributeError when the HF model has none either
        if callable(value) and not isinstance(value, nn.Module):
            if name not in _READ_ONLY_METHODS:
                raise AttributeError(
                    f"{type(self).__name__} does not give the HF model's {name}(): the stages "
                    f"hold the model's modules as they were at roundpipe.hf.wrap, and a method "
                    f"that changes the model would not reach them. Call "
                    f"hf_model.{name}(...) before wrapping (the wrapped model's hf_model is the "
                    f"HF model); its read-only methods ({', '.join(sorted(_READ_ONLY_METHODS))}) "
                    f"and generate() are given"
                )
        return value


def _to_host(value: Any) -> Any:
    return value.to("cpu") if isinstance(value, torch.Tensor) else value


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None))


def _base_model(model: nn.Module) -> Any:
    """The ``*ForCausalLM`` inside ``model`` (itself, or the one a peft model wraps)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def wrap(
    model: nn.Module,
    *,
    family: Family | None = None,
    loss_chunk_tokens: int | None = None,
    mlp_tile_tokens: int | None = None,
    check: bool = True,
    compile: bool | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> HFRoundPipe:
    """Wrap a HuggingFace causal LM (``AutoModelForCausalLM``, or a peft model around one) as a
    RoundPipe of stages: the embedding, each decoder layer, and the head with a chunked loss.

    Args:
        model: the model; it keeps its parameter objects, which hold the trained weights after
            ``synchronize()`` (``model.save_pretrained`` then saves them).
        family: where the model keeps its parts; default: the family registered for
            ``model.config.model_type`` (see :func:`roundpipe.hf.register_family`).
        loss_chunk_tokens: tokens per chunk of the loss head (the fp32 logits of this many
            tokens exist at once); default :func:`default_loss_chunk_tokens` of the vocabulary
            and of what the pool's smallest device has free at the wrap.
        mlp_tile_tokens: tokens per tile of each decoder layer's MLP and its norms, and of
            the final norm in training (:mod:`roundpipe.hf.tiling`): a microbatch of more
            tokens runs them in tiles, each recomputed alone in the backward, so no (tokens x
            intermediate) tensor, nor the final norm's fp32 intermediates, of the whole
            microbatch exists; 0: never tiled; default
            :func:`roundpipe.hf.defaults.default_mlp_tile_tokens` of the intermediate size
            and of what the pool's smallest device has free at the wrap. A mixture-of-experts
            layer is not tiled (its final norm is).
        check: before anything else, compare the stages with the model's own forward on a
            cut of it (:func:`roundpipe.hf.check_stages`) and raise ``WrapCheckError`` naming
            the part that differs; a few seconds and a copy of the cut in fp32. ``False``
            skips it.
        compile: run each decoder layer through ``torch.compile`` (see [Note: compiled
            layers] in roundpipe/runtime/compiled.py): default (None): on CUDA where torch can
            build GPU kernels (Triton installed, torch >= 2.5), else eagerly; ``False``: eagerly; ``True``:
            with torch's defaults (inductor), also on the CPU; or a dict of
            ``torch.compile``'s arguments (``{"mode": "max-autotune-no-cudagraphs"}``). One
            compilation serves every layer of a family; the first iteration pays it (about
            20 s for Qwen3-1.7B's layers on an H200). On the emulated device, which compiled
            code cannot target, the layers run eagerly (with a warning).
        **kwargs: RoundPipe's (``optim_dtype``, ``model_run_config``, ``devices``, ``name``).

    HF's own gradient checkpointing is turned off (roundpipe recomputes each stage itself) and
    so is the key/value cache (``config.use_cache = False``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"roundpipe.hf.wrap takes a transformers model, got {type(model)!r}")
    move_to_host(model, "roundpipe.hf.wrap")  # before the check runs the model's own forward
    base: Any = _base_model(model)
    # A QLoRA model is checked before anything changes (docs/hf.md, "QLoRA").
    device_type = device_pool.resolve_devices(kwargs.get("devices"))[0].type
    quantized = check_quantized(model, base, device_type)
    family = family or family_of(base)
    parts = family.parts(base)
    config = base.config
    unhandled = family.unhandled_features(config)
    if unhandled:
        raise NotImplementedError(
            f"{type(base).__name__}: {', '.join(unhandled)} change the model outside its "
            f"decoder layers, which family {family.name!r} does not implement, so the stages "
            f"would train another model. Register a Family with embed_scale=, logits= and "
            f"handles= (docs/hf.md, 'Adding a family'), or report it"
        )
    if getattr(config, "output_router_logits", False) and family.router is None:
        raise NotImplementedError(
            f"{type(base).__name__}: config.output_router_logits adds the router's "
            f"load-balancing loss, and family {family.name!r} names no router (Family(router="
            f"'mlp.gate'), the router's path in a decoder layer); or set "
            f"config.output_router_logits = False to train without that loss"
        )
    vocab_size = int(getattr(config, "vocab_size", 0) or 0)
    chosen_chunk = loss_chunk_tokens
    if loss_chunk_tokens is None:  # the check's; the model's is chosen from its devices below
        loss_chunk_tokens = default_loss_chunk_tokens(vocab_size)
    if not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be a positive int, got {loss_chunk_tokens!r}")
    if mlp_tile_tokens is not None and (
        not isinstance(mlp_tile_tokens, int)
        or isinstance(mlp_tile_tokens, bool)
        or mlp_tile_tokens < 0
    ):
        raise ValueError(
            f"mlp_tile_tokens must be an int >= 0 (0: no tiling; None: chosen from the "
            f"device), got {mlp_tile_tokens!r}"
        )
    if quantized is not None:
        prepare_quantized(model)
        if compile is None:
            # The layers read each weight's quantization state from a Python attribute of its
            # device copy, a new object every upload: eager, unless asked.
            compile = False
    compat.disable_checkpointing(base)
    config.use_cache = False
    layers = list(parts["layers"])[: config.num_hidden_layers]
    kinds = layer_attention_types(config)
    known = compat.mask_builders()
    unknown = set(kinds) - set(known)
    if unknown or len(kinds) != len(layers):
        raise NotImplementedError(
            f"{type(base).__name__}: attention types {sorted(set(kinds))} for {len(layers)} "
            f"layers; roundpipe.hf builds the masks transformers has builders for "
            f"({', '.join(sorted(known))}), one type per layer (config.layer_types)"
        )
    if check:
        check_stages(base, family, kinds, loss_chunk_tokens)
    stages = nn.Sequential(
        Embed(parts, config, kinds, family),
        *(
            Decoder(layer, family, config, kind, mlp_tile_tokens or None)
            for layer, kind in zip(layers, kinds)
        ),
        Head(parts, config, loss_chunk_tokens, family, mlp_tile_tokens or None),
    )
    kwargs.setdefault("name", type(base).__name__)
    wrapped = HFRoundPipe(model, stages, **kwargs)
    compat.accept_in_pipelines(HFRoundPipe)  # pipeline("text-generation", model=wrapped)
    decoders: list[Any] = list(stages)[1:-1]
    options = compile_options(compile, wrapped._pool.device_type)
    if options is not None:
        for decoder in decoders:
            decoder.compile_layer(options)
    free = wrapped.device_free()
    head = cast(Head, stages[-1])
    if chosen_chunk is None:
        head.chunk_tokens = default_loss_chunk_tokens(vocab_size, free)
    if mlp_tile_tokens is None:
        itemsize = next(iter(base.parameters())).element_size()
        intermediate = int(getattr(config, "intermediate_size", 0) or 4 * config.hidden_size)
        tile = default_mlp_tile_tokens(intermediate, itemsize, free)
        for decoder in decoders:
            decoder.mlp_tile_tokens = tile
        head.norm_tile_tokens = tile
    return wrapped
