"""``python -m roundpipe plan CONFIG``: the memory plan of fine-tuning a transformers causal LM
before anything is trained: host RAM term by term and each device's peak, at a sequence length
and microbatch size, with the largest term named.

The whole model is built on the meta device (shapes only: no weights are allocated) and
wrapped as :func:`roundpipe.hf.wrap` wraps it, so the host terms and every stage's device bytes
are the real model's; a plan traces one decoder layer and reuses its bytes for the identical
ones (see [Note: identical stages] in :mod:`roundpipe.memory.trace`), so planning a 70B model
costs about what a small one does. ``--max-seq-len`` answers "how long a sequence fits": a
search over the plan (:meth:`ConfigPlanner.search`, see [Note: the length search]), never a
run.

The question it answers is "does it fit on my machine": ``--device-memory 24GiB`` or ``--gpu
rtx4090`` (:data:`GPUS`) plans against that GPU instead of the local device, with the reserve a
GPU needs beside the tensors (see [Note: the device reserve] in
:mod:`roundpipe.devices.accelerator`), and ``--host-memory`` against that much RAM.
``--spill-dir DIR`` plans Adam's state in files there (``roundpipe.optim.AdamW(state_dir=DIR)``):
only its streaming buffer counts against the host; ``--spill-masters`` plans the masters there too
(``state_placement=roundpipe.MastersOnDisk(DIR)``): only its copy buffer counts.
``--optim-states bf16|8bit`` plans Adam's moments in 4 or about 2 bytes per parameter
(``roundpipe.optim.AdamW(state_dtype=torch.bfloat16 | "8bit")``). ``--grad-dtype bf16``
plans the gradients handed to the step as the device summed them, 2 bytes per parameter
(``roundpipe.optim.AdamW(grad_dtype=torch.bfloat16)`` with ``RoundPipeRunConfig(
device_grad_dtype=torch.bfloat16)``). Planned from a config, the weights do not exist yet, so
they count against the host like every other term. When it does not fit, the
report ends with what to change, each change with what it saves.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from roundpipe.devices import pool as device_pool
from roundpipe.hf.defaults import (
    default_loss_chunk_tokens,
    default_mlp_tile_tokens,
    kept_input_bytes,
    offload_needed,
)
from roundpipe.hf.quantized import EIGHT_BIT, QUANTIZATIONS, quantize_on_meta
from roundpipe.memory.host import (
    OPTIM_STATES,
    HostTerms,
    adam_state_bytes,
    format_bytes,
    host_terms,
    ranks_to_fit,
)
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.report import (
    HOST_FREE_HERE,
    MemoryPlan,
    PlannedCall,
    TraceMemo,
    make_memory_plan,
    reused_traces,
)
from roundpipe.memory.search import longest_fitting
from roundpipe.memory.trace import StageTraces, interpolate_traces
from roundpipe.optim.master_file import DEFAULT_COPY_BUFFER_BYTES
from roundpipe.optim.one_pass import LOW_GRAD_DTYPES
from roundpipe.optim.spill import DEFAULT_BUFFER_BYTES
from roundpipe.runtime import grad_router
from roundpipe.runtime.stages import model_layers

__all__ = [
    "GPUS",
    "CUDA_CONTEXT",
    "LORA_TARGETS",
    "ConfigPlanner",
    "LengthPlans",
    "SeqLenSearch",
    "main",
    "parse_size",
    "plan_config",
    "what_to_change",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_MIB = 1 << 20
# GPU name -> (total memory as nvidia-smi reports it, compute capability's major version).
GPUS: dict[str, tuple[int, int]] = {
    "rtx3090": (24576 * _MIB, 8),
    "rtx4080": (16376 * _MIB, 8),
    "rtx4090": (24564 * _MIB, 8),
    "rtx5090": (32607 * _MIB, 12),
    "l4": (23034 * _MIB, 8),
    "a100-40gb": (40960 * _MIB, 8),
    "a100-80gb": (81920 * _MIB, 8),
    "h100": (81559 * _MIB, 9),
}
# What the CUDA context takes of a GPU before the first tensor (it varies with the driver and
# the libraries loaded; about this much with torch's CUDA libraries on a recent driver).
CUDA_CONTEXT = 512 * _MIB
# The modules ``--lora`` puts adapters on, in every decoder layer (peft's LoraConfig
# target_modules; alpha twice the rank).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: ``24GiB``, ``24GB`` (10**9), ``512 MiB``, ``1e9``."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number and a unit, e.g. 24GiB, 24GB, "
            f"512MiB (GiB = 2**30 bytes, GB = 10**9)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _load_config(path: str) -> Any:
    from transformers import AutoConfig

    if os.path.isfile(path):  # a config.json
        with open(path) as f:
            raw = json.load(f)
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{path} has no model_type: is it a transformers config.json?")
        return AutoConfig.for_model(model_type, **raw)
    return AutoConfig.from_pretrained(path)  # a local model directory


def _with_lora(model: Any, rank: int) -> Any:
    if not rank:
        return model
    from peft import LoraConfig, get_peft_model

    from roundpipe.hf import compat

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS))
    with compat.quiet_checkpointing_names():  # peft reads the old name
        return get_peft_model(model, config)


def _lora_numel(model: torch.nn.Module, rank: int) -> int:
    """Parameters LoRA adapters of ``rank`` on :data:`LORA_TARGETS` would add to ``model``:
    ``rank x (in + out)`` per targeted linear layer."""
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear):
            total += rank * (module.in_features + module.out_features)
    return total


def _decoder_linear_numel(model: torch.nn.Module) -> int:
    """Elements of the linear layers' weights but the output embedding: what QLoRA quantizes."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )


def _host_fits(plan: MemoryPlan) -> bool:
    host = plan.host
    return host.available is None or host.new_bytes <= host.available


def _devices_fit(plan: MemoryPlan) -> bool:
    return all(d.fits for d in plan.devices)


@dataclasses.dataclass(frozen=True)
class LengthPlans:
    """The plans of ``seq_len`` tokens per sequence under each activation-offload setting the
    planner weighs (``by_offload``: False, the stage inputs kept on the device; True, in host
    memory), the setting chosen (``offload``) and why (``reason``). The plan at that setting is
    :attr:`plan`; it fits when any setting does (see :meth:`ConfigPlanner.plans`)."""

    seq_len: int
    by_offload: dict[bool, MemoryPlan]
    offload: bool
    reason: str

    @property
    def plan(self) -> MemoryPlan:
        return self.by_offload[self.offload]

    @property
    def fits(self) -> bool:
        return self.plan.fits


@dataclasses.dataclass(frozen=True)
class SeqLenSearch:
    """What :meth:`ConfigPlanner.search` found: ``seq_len``, the longest multiple of ``step``
    of at most ``limit`` tokens that fits (0: none), the plans there (``at``; at ``step`` when
    none fits), the plans one step more (``beyond``: the length that does not fit; None when
    ``seq_len`` is the limit, or when the host is short at every length, ``host_everywhere``,
    found before tracing anything), and how many lengths were traced (``traced``)."""

    seq_len: int
    step: int
    limit: int
    at: LengthPlans
    beyond: LengthPlans | None
    host_everywhere: bool
    traced: int


class _Traces(TraceMemo):
    """The planner's trace memo: traces reused per call (see [Note: reused traces]); the last
    one handed out (``last``); and, while ``predicted`` is set, those traces instead of any."""

    def __init__(self) -> None:
        super().__init__()
        self.predicted: StageTraces | None = None
        self.last: StageTraces | None = None
        self.last_call: PlannedCall | None = None

    def get(self, call: Any, real_runs: bool, trace: Callable[[], StageTraces]) -> StageTraces:
        if self.predicted is not None:
            return self.predicted
        self.last_call = call
        self.last = super().get(call, real_runs, trace)
        return self.last


# [Note: the length search]
# The longest sequence that fits is the edge of a verdict that is monotone in the length (what
# fits at n fits at every shorter n), found to the step with real plans on both sides of it:
# the plan at the answer fits and the plan one step more does not, each traced. What makes it
# seconds rather than minutes:
# * The host is bounded before anything is traced: its terms do not depend on the length
#   except the offloaded stage inputs, so a host short with them kept on the device is short at
#   every length, and the search ends there (the host binds).
# * A length is traced once, whatever the settings weighed there (the activation offload on
#   and off trace the same, [Note: reused traces]), and of its stages only the first, one
#   decoder layer and the head ([Note: identical stages]).
# * Between traced lengths the plan is estimated from two traces (interpolate_traces: each
#   stage's counts are affine in the tokens once a sequence spans several MLP tiles and loss
#   chunks) and the whole plan walked on the estimate, which costs no trace; the search traces
#   the length the estimate names as the edge and the one after it. Where the estimate is off
#   (short sequences, a kink), the traced lengths bracket the edge tighter and the next estimate
#   comes from the two traces nearest to it; a bracket that does not halve in two rounds is
#   bisected, so the search ends in about log2(limit / step) traces at worst, as plain bisection.
# * A trace costs about the same at any length: of the MLP's tiles and the loss's chunks it runs
#   four ([Note: elided repeats] in roundpipe.memory.repeats), so the search's cost is its
#   number of traces (four for Llama-3.1-8B with LoRA: two short ones, then the edge).
# The first two are short (eight MLP tiles and twice that: past the kinks of the first few),
# and, before any length has failed, an estimate more than three times the longest traced
# length (which may miss a kink on the way) is approached by the geometric mean of the two.


def _grad_dtype_refusal(
    grad_dtype: torch.dtype | None,
    optim_dtype: torch.dtype,
    ranks: int,
    spill_dir: str | None,
    devices: str | None,
) -> str | None:
    """Why gradients in ``grad_dtype`` cannot be planned with these options, in the plan
    command's words (None: they can, or ``grad_dtype`` is None): what the runtime refuses (see
    ``Adam._take_gradients_in`` in :mod:`roundpipe.optim.adam` and DataParallel's reduction),
    and a CPU pool, where the gradients are summed in the masters' dtype."""
    if grad_dtype is None:
        return None
    name = f"--grad-dtype {_dtype_name(grad_dtype)}"
    if not grad_router.torch_has_grad_dtype():
        return (
            f"{name} plans roundpipe.optim.AdamW(grad_dtype=...), which needs a torch whose "
            f"tensors have grad_dtype (2.10 or newer); torch {torch.__version__} does not: "
            f"upgrade torch, or leave --grad-dtype out (the gradients then arrive in the "
            f"masters' dtype)"
        )
    if optim_dtype != torch.float32 or grad_dtype not in LOW_GRAD_DTYPES:
        return (
            f"{name} with --optim-dtype {_dtype_name(optim_dtype)}: "
            f"roundpipe.optim.AdamW(grad_dtype=...) takes bf16 or fp16 gradients of fp32 "
            f"masters; give --optim-dtype fp32 --grad-dtype bf16, or leave --grad-dtype out"
        )
    if spill_dir is not None:
        return (
            f"{name} with --spill-dir: Adam's streamed step (AdamW(state_dir=...)) and masters "
            f"in files read fp32 gradients; give one of them"
        )
    if ranks > 1:
        return (
            f"{name} with --ranks {ranks}: roundpipe.distributed.DataParallel sums the "
            f"gradients in the masters' dtype and refuses masters that take another (leave "
            f"grad_dtype=None under DataParallel); give one of them"
        )
    if devices is not None and device_pool.resolve_devices(devices)[0].type == "cpu":
        return (
            f"{name} with --devices {devices}: a CPU pool sums the gradients in the masters' "
            f"dtype (RoundPipeRunConfig(device_grad_dtype=...) has no effect there), and this "
            f"plan counts the sums an accelerator makes in {_dtype_name(grad_dtype)}; plan it "
            f"on the accelerator pool you will train on"
        )
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    """``bf16``: the plan command's name of ``dtype`` (torch's for one it has no name for)."""
    return next((name for name, d in _DTYPES.items() if d == dtype), str(dtype))


class ConfigPlanner:
    """Memory plans of training the causal LM that ``path`` (a config.json or a local model
    directory) describes, at any sequence length, from one model of shapes only: the whole
    model is built on the meta device (no weights are allocated, so the host terms and every
    stage are the real model's), wrapped once, and each length traces one decoder layer and
    reuses it for the identical ones (see [Note: identical stages] in
    :mod:`roundpipe.memory.trace`). ``device_memory``: plan against a GPU of that many bytes
    (its total: the CUDA context is taken off) and compute capability ``compute_capability``
    instead of the local device, with the loss chunk and the MLP tile chosen for it as
    :func:`roundpipe.hf.wrap` chooses them for a local device (:mod:`roundpipe.hf.defaults`);
    ``gpu``: its name, for the report; ``offload_activations`` None: chosen per length, on
    only where it makes the plan fit (see :meth:`plans`); ``mlp_tile_tokens``: wrap's (None:
    chosen for the device, 0: untiled); ``host_memory``: against that much host RAM instead of
    what this machine has free; ``ranks``: the state sharded over that many data-parallel
    ranks (:class:`roundpipe.distributed.ShardedState`), the host terms of the rank with the
    largest share; ``spill_dir``: Adam's state in files there
    (``roundpipe.optim.AdamW(state_dir=spill_dir)``), so only its streaming buffer counts
    against the host; ``spill_masters`` (with ``spill_dir``): the masters in files there too
    (:class:`roundpipe.MastersOnDisk`), so only its copy buffer counts; ``optim_states``:
    how Adam keeps its moments ("exact", "bf16", "8bit":
    ``roundpipe.optim.AdamW(state_dtype=...)``); ``grad_dtype`` (``torch.bfloat16`` or
    ``torch.float16``; None: the masters' dtype): the masters' gradients handed to the step in
    that dtype, as the device summed them (``roundpipe.optim.AdamW(grad_dtype=...)`` with
    ``RoundPipeRunConfig(device_grad_dtype=...)``, see [Note: gradients in their summed dtype]
    in :mod:`roundpipe.runtime.grad_router`), on an accelerator pool, with fp32 masters in RAM
    and one process, as the runtime takes them; ``quantize`` (``"nf4"``/``"fp4"``, with
    ``lora``): the base quantized as transformers loads it with bitsandbytes in 4 bits,
    ``double_quant`` its ``bnb_4bit_use_double_quant``, computing in ``dtype``
    (:func:`roundpipe.hf.quantized.quantize_on_meta`): QLoRA. Main thread."""

    def __init__(
        self,
        path: str,
        *,
        batch_size: int = 1,
        num_microbatch: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        optim_dtype: torch.dtype = torch.float32,
        lora: int = 0,
        devices: str | None = None,
        offload_activations: bool | None = None,
        device_memory: int | None = None,
        compute_capability: int = 9,
        host_memory: int | None = None,
        ranks: int = 1,
        spill_dir: str | None = None,
        mlp_tile_tokens: int | None = None,
        spill_masters: bool = False,
        gpu: str | None = None,
        optim_states: str = "exact",
        quantize: str | None = None,
        double_quant: bool = True,
        sync_step: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        # the options as given, for variant(): every argument but the path
        self._options = {k: v for k, v in locals().items() if k not in ("self", "path")}
        from transformers import AutoModelForCausalLM

        import roundpipe

        self.path = path
        self.config = config = _load_config(path)
        self.batch_size = batch_size
        self.num_microbatch = num_microbatch
        self.offload_activations = offload_activations
        self.device_memory = device_memory
        self.compute_capability = compute_capability
        self.itemsize = dtype.itemsize
        self.dtype = dtype
        self.optim_dtype = optim_dtype
        self.lora = lora
        self.gpu = gpu
        self.quantize = quantize
        self.sync_step = sync_step
        self.spill_dir = spill_dir
        if grad_dtype == optim_dtype:
            grad_dtype = None  # the masters' own: the plan without it
        self.grad_dtype = grad_dtype
        if spill_masters and spill_dir is None:
            raise ValueError("spill_masters plans the masters in files under spill_dir: give it")
        if quantize is not None and not lora:
            raise ValueError(
                f"quantize={quantize!r} plans QLoRA: a quantized base cannot train, give the "
                f"LoRA rank (lora=16, --lora 16)"
            )
        if devices is None:
            devices = "cuda:0" if torch.cuda.is_available() else "emu"
        self.devices = devices
        refused = _grad_dtype_refusal(grad_dtype, optim_dtype, ranks, spill_dir, devices)
        if refused is not None:
            raise ValueError(refused)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
            self._lora_numel = _lora_numel(plain, lora or 16)
            self._decoder_linear_numel = _decoder_linear_numel(plain)
            if quantize is not None:
                quantize_on_meta(plain, quantize, double_quant, compute_dtype=dtype)
            whole = _with_lora(plain, lora)
        chunk = None
        if device_memory is not None:
            chunk = default_loss_chunk_tokens(
                int(getattr(config, "vocab_size", 0) or 0), device_memory - CUDA_CONTEXT
            )
            if mlp_tile_tokens is None:
                intermediate = getattr(config, "intermediate_size", 0) or 4 * config.hidden_size
                mlp_tile_tokens = default_mlp_tile_tokens(
                    int(intermediate), dtype.itemsize, device_memory - CUDA_CONTEXT
                )
        self.model = roundpipe.hf.wrap(
            whole,
            optim_dtype=optim_dtype,
            devices=devices,
            check=False,  # a meta model computes nothing to compare
            memory_check=False,
            loss_chunk_tokens=chunk,
            mlp_tile_tokens=mlp_tile_tokens,
            # Gradients in grad_dtype: summed in it on the device, and the masters set to hold
            # them as roundpipe.optim.AdamW(grad_dtype=...) sets them, so that the plan counts
            # the pinned downloads in it (both sets with the asynchronous step).
            model_run_config=roundpipe.RoundPipeRunConfig(device_grad_dtype=grad_dtype),
        )
        if grad_dtype is not None:
            for master in self.model.optim_parameters():
                master.grad_dtype = grad_dtype
        # Shapes only: the meta model's terms are the whole model's (nothing pinned is counted);
        # an accelerator pool hands the gradients over stage by stage.
        available = host_memory if host_memory is not None else host_memory_available()
        self.host_source = "host RAM given (--host-memory)" if host_memory is not None else None
        layers = [layer.module for layer in model_layers(self.model.module)]
        self.host = dataclasses.replace(
            host_terms(
                whole,
                optim_dtype,
                None,
                available,
                ranks=ranks,
                layers=layers,
                optim_states=optim_states,
            ),
            weights_allocated=False,
        )
        if sync_step:  # model.step(fn, is_async=False): no second copies
            self.host = dataclasses.replace(self.host, next_weights=0, next_grads=0)
        if spill_dir is not None and optim_states != "exact":
            raise ValueError(
                f"optim_states={optim_states!r} keeps lean moments in RAM; spill_dir streams "
                f"exact ones through files: give one of them"
            )
        if spill_masters and spill_dir is None:
            raise ValueError("spill_masters plans the masters in files under spill_dir: give it")
        if spill_dir is not None:
            self.host = dataclasses.replace(
                self.host, optimizer=DEFAULT_BUFFER_BYTES, optimizer_dir=spill_dir
            )
        if spill_masters:
            self.host = dataclasses.replace(
                self.host, masters=DEFAULT_COPY_BUFFER_BYTES, masters_dir=spill_dir
            )
        self._stage_names = _hf_stage_names(whole, self.model.module)
        self._traces = _Traces()
        self._plans: dict[tuple[int, int], LengthPlans] = {}
        self._traced: dict[int, StageTraces] = {}  # exact traces, by length
        # A traced call and its host terms per (offload, microbatches), for predicted plans.
        self._calls: dict[tuple[bool, int], tuple[PlannedCall, HostTerms]] = {}
        # Without inputs: the host terms that do not depend on the length (the gradients' pinned
        # downloads counted as the runtime holds them), and whether there are devices at all.
        bare = self.model.memory_plan()
        self.streaming = bool(bare.devices)
        self.fixed_host = self._host(bare.host, activations=0)

    # -- one length ------------------------------------------------------------------------------
    def _host(self, planned: HostTerms, activations: int) -> HostTerms:
        # The masters' gradients as the runtime holds them (the wrapped model's plan): on an
        # accelerator each stage's are downloaded into a pinned pool of their own, so a tied
        # embedding (in the first and last stage) has two until the second is added. Sharded,
        # a rank keeps its share only (self.host's).
        return dataclasses.replace(
            self.host,
            activations=activations,
            grads=self.host.grads if self.host.ranks > 1 else planned.grads,
            grads_dtype=self.host.grads_dtype if self.host.ranks > 1 else planned.grads_dtype,
            next_grads=(
                0
                if self.sync_step
                else self.host.next_grads
                if self.host.ranks > 1
                else planned.next_grads
            ),
        )

    def variant(self, **changes: Any) -> ConfigPlanner:
        """A planner of the same config with ``changes`` to the options this one was given
        (``lora=16``): what the advice plans a change with."""
        return ConfigPlanner(self.path, **{**self._options, **changes})

    @contextlib.contextmanager
    def _masters_holding(self, grad_dtype: torch.dtype) -> Iterator[None]:
        """The masters set to hold gradients in ``grad_dtype`` (as ``roundpipe.optim.AdamW(
        grad_dtype=...)`` sets them) for the duration; as they were afterwards."""
        masters = list(self.model.optim_parameters())
        before = [master.grad_dtype for master in masters]
        try:
            for master in masters:
                master.grad_dtype = grad_dtype
            yield
        finally:
            for master, dtype in zip(masters, before):
                master.grad_dtype = dtype

    def gradients_in(self, grad_dtype: torch.dtype) -> HostTerms:
        """The host terms of the model's state (no activations) with the masters' gradients
        handed to the step in ``grad_dtype`` instead, as :meth:`__init__`'s ``grad_dtype``
        plans them; the model is left as it was. For the advice: what ``--grad-dtype`` saves."""
        import roundpipe

        with self._masters_holding(grad_dtype):
            config = roundpipe.RoundPipeRunConfig(device_grad_dtype=grad_dtype)
            planned = self.model.memory_plan(run_config=config).host
        return self._host(planned, activations=0)

    def plan_with_gradients_in(self, lp: LengthPlans, grad_dtype: torch.dtype) -> MemoryPlan:
        """``lp``'s plan (its length and offload setting) with the gradients summed in
        ``grad_dtype`` on the device and handed to the step so; the model is left as it was.
        For the advice: what ``--grad-dtype`` saves on the device."""
        with self._masters_holding(grad_dtype):
            return self._plan_with(
                lp.seq_len, lp.offload, self.num_microbatch, grad_dtype=grad_dtype
            )

    def device_free(self) -> int | None:
        """What the planned device has free for tensors: the GPU's total less the CUDA context,
        or what the local device has free (None: a CPU pool)."""
        if self.device_memory is not None:
            return self.device_memory - CUDA_CONTEXT
        return self.model.device_free()

    def _plan_with(
        self,
        seq_len: int,
        offload: bool,
        num_microbatch: int,
        predicted: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> MemoryPlan:
        """The plan at ``seq_len`` with ``offload``: traced (the wrapped model's memory_plan),
        or, ``predicted``, walked on the memo's predicted traces with the call of a traced
        length (the program does not depend on the length without a device budget, which
        the planner never sets), which costs no trace. ``grad_dtype``: the call's
        ``device_grad_dtype`` (None: the planner's; the masters set to hold it by the
        caller); such a plan is not kept for prediction."""
        from roundpipe import RoundPipeRunConfig

        key = (offload, num_microbatch)
        if predicted and key in self._calls:
            known, base = self._calls[key]
            plan = make_memory_plan("", base, known)
        else:
            run_config = RoundPipeRunConfig(
                num_microbatch=num_microbatch,
                offload_activations=offload,
                device_grad_dtype=grad_dtype,  # None: the model's, self.grad_dtype
            )
            ids = torch.zeros((self.batch_size, seq_len), dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            plan = self.model.memory_plan(input_kwargs=batch, run_config=run_config)
            call = self._traces.last_call
            sizes = call.plan.sizes if call is not None else None
            if grad_dtype is None and call is not None and (sizes is None or sizes.budget is None):
                self._calls[key] = (call, plan.host)
        host = self._host(plan.host, plan.host.activations)
        devs = plan.devices
        if self.device_memory is not None:
            from roundpipe.devices.accelerator import cublas_workspace_bytes, device_reserve

            workspace = cublas_workspace_bytes(self.compute_capability)
            gpu_devs = []
            for i, d in enumerate(devs):
                reserve, note = device_reserve(d.peak, workspace)
                label = self.gpu or f"GPU of {format_bytes(self.device_memory)}"
                gpu_devs.append(
                    dataclasses.replace(
                        d,
                        device=label if len(devs) == 1 else f"{label} #{i}",
                        available=self.device_memory - CUDA_CONTEXT,
                        reserve=reserve,
                        reserve_note=note,
                    )
                )
            devs = tuple(gpu_devs)
        names = plan.stage_names
        if len(self._stage_names) == len(names):
            names = self._stage_names
        return dataclasses.replace(
            plan,
            host=host,
            devices=devs,
            name=f" {type(self.model.hf_model).__name__} ({self.path})",
            stage_names=names,
            host_source=self.host_source or plan.host_source,
        )

    def _settings(self) -> list[bool]:
        # Both where there are devices, even with one given: they trace the same, and the
        # other is what the advice weighs.
        if not self.streaming:
            return [False]
        return [False, True]

    def _length_plans(
        self, seq_len: int, predicted: StageTraces | None = None, num_microbatch: int | None = None
    ) -> LengthPlans:
        m = self.num_microbatch if num_microbatch is None else num_microbatch
        self._traces.predicted = predicted
        self._traces.last = None
        try:
            with reused_traces(self._traces):
                by = {
                    off: self._plan_with(seq_len, off, m, predicted is not None)
                    for off in self._settings()
                }
        finally:
            self._traces.predicted = None
        if predicted is None and self._traces.last is not None and m == self.num_microbatch:
            self._traced[seq_len] = self._traces.last
        return self._choose(seq_len, by)

    def _choose(self, seq_len: int, by: dict[bool, MemoryPlan]) -> LengthPlans:
        if len(by) == 1:
            return LengthPlans(seq_len, by, False, "no accelerator: nothing to offload")
        if self.offload_activations is not None:
            given = self.offload_activations
            return LengthPlans(seq_len, by, given, f"{'on' if given else 'off'}, as given")
        kept, offloaded = by[False], by[True]
        if kept.fits:
            reason = "off: the device holds the stage inputs kept for the backward"
            return LengthPlans(seq_len, by, False, reason)
        if offloaded.fits:
            reason = "on: the device is short without it, and the host holds the stage inputs"
            return LengthPlans(seq_len, by, True, reason)
        # Neither fits: offloaded where that moves the shortfall off the device onto a host
        # that holds it, else kept (the host is the shortfall, or both are short either way).
        if not _devices_fit(kept) and _host_fits(offloaded):
            return LengthPlans(seq_len, by, True, "on: the device is short without it")
        return LengthPlans(seq_len, by, False, "off: offloading does not make it fit")

    def plans(self, seq_len: int, num_microbatch: int | None = None) -> LengthPlans:
        """The plans of one ``forward_backward`` of ``batch_size`` sequences of ``seq_len``
        tokens under each activation-offload setting weighed, and the one chosen: as given
        (``offload_activations``), else off where it fits (the stage inputs cost no transfer
        on the device), on where only that fits (the device short without it, the host with
        room for them), so that the verdict is the best setting's. One trace per length
        (cached, see [Note: reused traces])."""
        m = self.num_microbatch if num_microbatch is None else num_microbatch
        key = (seq_len, m)
        if key not in self._plans:
            self._plans[key] = self._length_plans(seq_len, num_microbatch=m)
        return self._plans[key]

    def plan(self, seq_len: int) -> MemoryPlan:
        """The :class:`roundpipe.MemoryPlan` of one ``forward_backward`` of ``batch_size``
        sequences of ``seq_len`` tokens, under the setting :meth:`plans` chooses."""
        return self.plans(seq_len).plan

    def offloads(self, seq_len: int) -> bool:
        """Whether the plan at ``seq_len`` offloads the stage inputs (given, or chosen by
        :meth:`plans`)."""
        return self.plans(seq_len).offload

    def wrap_offloads(self, seq_len: int) -> bool:
        """Whether :func:`roundpipe.hf.wrap`'s per-call default would offload the stage inputs
        of this batch on the planned machine (:func:`roundpipe.hf.defaults.offload_needed`:
        more than a quarter of the device, and room on the host beside the model's state)."""
        kept = kept_input_bytes(
            int(self.config.num_hidden_layers),
            self.batch_size * seq_len,
            int(self.config.hidden_size),
            self.itemsize,
        )
        host = self.fixed_host
        room = None if host.available is None else host.available - host.new_bytes
        return offload_needed(kept, self.device_free(), room)

    # -- the longest that fits -----------------------------------------------------------------
    def longest_seq_len(self, limit: int, step: int = 1) -> int:
        """The longest sequence, a multiple of ``step`` of at most ``limit`` tokens, whose plan
        fits (host and devices) under the setting :meth:`plans` chooses; 0 if ``step`` does
        not (see :meth:`search`)."""
        return self.search(limit, step).seq_len

    def search(self, limit: int, step: int = 1) -> SeqLenSearch:
        """The longest sequence, a multiple of ``step`` of at most ``limit`` tokens, whose plan
        fits, with the plans there and one step more, each traced (see [Note: the length
        search]): assumes, as any bisection, that what fits at n fits at every shorter n."""
        if step < 1 or limit < step:
            raise ValueError(f"search needs 1 <= step <= limit, got step {step}, limit {limit}")
        traced_before = len(self._traced)
        host = self.fixed_host
        if host.available is not None and host.new_bytes > host.available:
            return SeqLenSearch(
                0, step, limit, self.plans(step), None, True, len(self._traced) - traced_before
            )
        top = limit // step  # in steps from here on
        lo, hi = 0, top + 1  # fits at lo (0: nothing yet), not at hi (top + 1: past the limit)
        exact: dict[int, LengthPlans] = {}

        def probe(k: int) -> LengthPlans:
            nonlocal lo, hi
            if k not in exact:
                exact[k] = self.plans(k * step)
            if exact[k].fits:
                lo = max(lo, k)
            else:
                hi = min(hi, k)
            return exact[k]

        for length, m in list(self._plans):  # planned before: a bracket
            if m == self.num_microbatch and length % step == 0 and length <= limit:
                probe(length // step)
        first = min(top, max(1, -(-self._short_length() // step)))
        if len(self._traced) < 2:
            probe(first)
        if len(self._traced) < 2:
            probe(min(top, 2 * first) if exact[first].fits else max(1, first // 4))
        widths, los = [hi - lo], [lo]
        while hi - lo > 1 and lo < top:
            if hi <= top and len(widths) >= 3 and widths[-1] * 2 > widths[-3]:
                k = (lo + hi) // 2  # the estimates are not closing in on the edge: bisect
            else:
                k = self._estimated_edge(exact, lo, hi, step)
                # No length that does not fit traced yet: the estimate may be far past the
                # longest traced length and miss a kink there, or creep up to the edge a step
                # at a time: trace halfway first (the geometric mean; a trace costs about its
                # length, so this costs less than a wrong guess at the edge would).
                creeping = len(los) >= 3 and los[-1] - los[-3] <= 4
                if hi > top and lo and (k > 3 * lo or creeping):
                    probe(min(top, max(2 * lo, math.isqrt(lo * k))))
                    widths.append(hi - lo)
                    los.append(lo)
                    continue
            probe(k)
            if exact[k].fits and k + 1 < hi:
                probe(k + 1)
            widths.append(hi - lo)
            los.append(lo)
        at = exact[lo] if lo else (exact.get(1) or self.plans(step))
        beyond = exact.get(hi) if hi <= top else None
        return SeqLenSearch(
            lo * step, step, limit, at, beyond, False, len(self._traced) - traced_before
        )

    def _short_length(self) -> int:
        """The first length the search traces: several MLP tiles and loss chunks, past the
        lengths that run untiled and the kinks of the first few tiles, short enough to trace
        in a few seconds."""
        stages = list(self.model.module.children())
        tile = getattr(stages[1], "mlp_tile_tokens", None) if len(stages) > 2 else None
        chunk = getattr(stages[-1], "chunk_tokens", None)
        return max(8 * max(tile or 0, 1024), 4 * (chunk or 0))

    def _estimated_edge(self, exact: dict[int, LengthPlans], lo: int, hi: int, step: int) -> int:
        """The step in ``(lo, hi)`` (fits at ``lo``, not at ``hi``) where the plan estimated
        from the traced lengths stops fitting (see :meth:`estimate`): its last fitting step,
        ``lo + 1`` at least."""
        if len(self._traced) < 2:
            return (lo + hi) // 2

        def fits(n: int) -> bool:
            length = (lo + n) * step
            return self._length_plans(length, predicted=self.estimate(length)).fits

        right = hi - 1 if hi > lo + 1 else lo + 1
        edge = longest_fitting(fits, right - lo) + lo
        return min(max(edge, lo + 1), right)

    def estimate(self, seq_len: int) -> StageTraces:
        """The traces at ``seq_len`` estimated from the lengths traced so far (two at least):
        interpolated between the traced lengths on either side, or extrapolated from the two
        nearest (see :func:`roundpipe.memory.trace.interpolate_traces`)."""
        known = sorted(self._traced)
        if len(known) < 2:
            raise ValueError("estimate needs two traced lengths")
        below = [n for n in known if n <= seq_len]
        above = [n for n in known if n > seq_len]
        if below and above:
            a, b = below[-1], above[0]
        elif above:
            a, b = above[0], above[1]
        else:
            a, b = below[-2], below[-1]
        return interpolate_traces(self._traced[a], self._traced[b], (seq_len - a) / (b - a))


def _hf_stage_names(whole: torch.nn.Module, stages: torch.nn.Module) -> tuple[str, ...]:
    """Each stage named by the HF modules it runs: ``"layer 33 (model.norm + lm_head + loss)"``.
    A stage's modules are the largest HF modules all of whose tensors are the stage's; a tied
    tensor is named as the stage holds it (the head's ``lm_head``, not the embedding)."""
    names: dict[int, list[str]] = {}
    for name, t in (
        *whole.named_parameters(remove_duplicate=False),
        *whole.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(t), []).append(name)
    # HF module path -> ids of every tensor under it
    under: dict[str, set[int]] = {}
    for tid, tensor_names in names.items():
        for name in tensor_names:
            parts = name.split(".")[:-1]
            for i in range(1, len(parts) + 1):
                under.setdefault(".".join(parts[:i]), set()).add(tid)
    out = []
    children = list(stages.named_children())
    for index, (_, stage) in enumerate(children):
        own: dict[int, str] = {}
        for local, t in (
            *stage.named_parameters(remove_duplicate=False),
            *stage.named_buffers(remove_duplicate=False),
        ):
            candidates = names.get(id(t))
            if not candidates:
                continue
            tail = ".".join(local.split(".")[-2:])
            own.setdefault(id(t), next((n for n in candidates if n.endswith(tail)), candidates[0]))
        modules: list[str] = []
        for name in own.values():
            parts = name.split(".")[:-1]
            best = ".".join(parts)
            for i in range(len(parts), 0, -1):
                path = ".".join(parts[:i])
                if under.get(path, set()) <= own.keys():
                    best = path
                else:
                    break
            if best and best not in modules:
                modules.append(best)
        shown = [m.removeprefix("base_model.model.") for m in modules]
        if index == len(children) - 1 and index > 0:
            shown.append("loss")
        out.append(f"layer {index} ({' + '.join(shown) or type(stage).__name__})")
    return tuple(out)


def plan_config(path: str, *, seq_len: int, **kwargs: Any) -> Any:
    """The :class:`roundpipe.MemoryPlan` of training the causal LM that ``path`` describes at
    ``seq_len`` tokens per sequence (``kwargs``: :class:`ConfigPlanner`'s)."""
    return ConfigPlanner(path, **kwargs).plan(seq_len)


# -- what to say -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Change:
    """One change the advice names: its options, what it saves (bytes; ``about``: an
    estimate, not a plan), whether it alone makes the plan fit (``fits_alone``), and a note."""

    options: str
    saves: int
    fits_alone: bool
    note: str
    about: bool = False


def _host_changes(planner: ConfigPlanner, lp: LengthPlans) -> list[_Change]:
    plan = lp.plan
    host = plan.host
    assert host.available is not None
    short = host.new_bytes - host.available
    devices_fit = _devices_fit(plan)

    def alone(saves: int) -> bool:  # a change of the host terms only
        return saves >= short and devices_fit

    changes = []
    if lp.offload and False in lp.by_offload:
        kept = lp.by_offload[False]
        dev = next((d for d in kept.devices if not d.fits), None)
        note = "the stage inputs kept for the backward stay on the device"
        if dev is not None:
            over = dev.peak + dev.reserve - (dev.available or 0)
            note += f", {format_bytes(over)} more than it has"
        changes.append(_Change("--no-offload-activations", host.activations, kept.fits, note))
    if not planner.sync_step and host.next_weights + host.next_grads:
        saves = host.next_weights + host.next_grads
        changes.append(
            _Change(
                "--sync-step",
                saves,
                alone(saves),
                "a synchronous step, model.step(fn, is_async=False) (the Trainer's "
                "async_step=False): one copy of the weights and one set of gradients, the step "
                "no longer overlapped with the next iteration",
            )
        )
    if planner.grad_dtype is None and not _grad_dtype_refusal(
        torch.bfloat16, planner.optim_dtype, host.ranks, planner.spill_dir, planner.devices
    ):
        low = planner.gradients_in(torch.bfloat16)
        saves = host.grads + host.next_grads - (low.grads + low.next_grads)
        if saves > 0:
            changes.append(
                _Change(
                    "--grad-dtype bf16",
                    saves,
                    alone(saves),
                    "the gradients summed in bf16 on the device and handed to the step as they "
                    "are, 2 bytes per parameter instead of 4"
                    + (", both sets with the async step" if low.next_grads else "")
                    + " (roundpipe.optim.AdamW(..., grad_dtype=torch.bfloat16) with "
                    "RoundPipeRunConfig(device_grad_dtype=torch.bfloat16); the Trainer's "
                    "grad_dtype=torch.bfloat16)",
                )
            )
    # what LoRA drops: the full weights' masters, gradients (the next call's too), optimizer
    # state and next weights, the adapters' own left
    state = host.masters + host.grads + host.next_grads + host.optimizer + host.next_weights
    adapters = _adapter_bytes(
        planner, next_weights=host.next_weights > 0, next_grads=host.next_grads > 0
    )
    if not planner.lora:
        saves = state - adapters
        targets = ", ".join(LORA_TARGETS)
        changes.append(
            _Change(
                "--lora 16",
                saves,
                alone(saves),
                f"adapters of rank 16 on {targets}: only they get masters, gradients and "
                f"optimizer state",
                about=True,
            )
        )
    if planner.quantize is None:
        packed = planner._decoder_linear_numel * (planner.itemsize - _NF4_BYTES)
        saves = int(packed) + (0 if planner.lora else state - adapters)
        changes.append(
            _Change(
                "--lora 16 --quantize nf4",
                saves,
                alone(saves),
                "QLoRA: the frozen linear weights in 4 bits (about 0.52 bytes a parameter), "
                "LoRA adapters trained (the qlora extra)",
                about=True,
            )
        )
    # With --grad-dtype, neither Adam's state nor the masters in files nor sharding: each takes
    # the gradients in the masters' dtype only (_grad_dtype_refusal).
    takes_low_grads = planner.grad_dtype is None
    if host.optimizer_dir is None and takes_low_grads:
        saves = host.optimizer - DEFAULT_BUFFER_BYTES
        if saves > 0:
            changes.append(
                _Change(
                    "--spill-dir DIR",
                    saves,
                    alone(saves),
                    "Adam's state in files on a fast disk (roundpipe.optim.AdamW(..., "
                    "state_dir=DIR)), streamed through a buffer",
                )
            )
    if host.masters_dir is None and host.ranks == 1 and takes_low_grads:
        saves = host.masters - DEFAULT_COPY_BUFFER_BYTES
        if host.optimizer_dir is None:
            saves += host.optimizer - DEFAULT_BUFFER_BYTES
        if saves > 0:
            flags = "--spill-masters" if host.optimizer_dir else "--spill-dir DIR --spill-masters"
            changes.append(
                _Change(
                    flags,
                    saves,
                    alone(saves),
                    "the masters in files too (RoundPipe(..., state_placement="
                    "roundpipe.MastersOnDisk(DIR)))",
                )
            )
    if host.optimizer_dir is None and host.optim_states != "8bit" and host.master_dtype:
        itemsize = host.master_dtype.itemsize
        lean = adam_state_bytes(host.optimizer // (2 * itemsize), itemsize, "8bit")
        saves = host.optimizer - lean
        if saves > 0:
            changes.append(
                _Change(
                    "--optim-states 8bit",
                    saves,
                    alone(saves),
                    "Adam's moments in 8 bits, blockwise (roundpipe.optim.AdamW(..., "
                    "state_dtype='8bit'))",
                    about=True,
                )
            )
    # bf16 masters take their gradients in bf16: fp16 ones (--grad-dtype fp16) are refused
    if (
        host.master_dtype is not None
        and host.master_dtype.itemsize == 4
        and planner.grad_dtype in (None, torch.bfloat16)
    ):
        in_ram = (0 if host.masters_dir else host.masters) + (
            0 if host.optimizer_dir else host.optimizer
        )
        if planner.grad_dtype is None:  # else in bf16 already
            in_ram += host.grads + host.next_grads
        saves = in_ram // 2
        changes.append(
            _Change(
                "--optim-dtype bf16",
                saves,
                alone(saves),
                (
                    "masters, their gradients and the optimizer state"
                    if planner.grad_dtype is None
                    else "masters and the optimizer state (the gradients are in bf16 already)"
                )
                + " in half the bytes (less precise updates)",
                about=True,
            )
        )
    fit = ranks_to_fit(host) if host.ranks == 1 and not host.masters_dir else None
    if fit is not None and takes_low_grads:
        n, per_machine = fit
        saves = host.new_bytes - per_machine
        if saves > 0:
            changes.append(
                _Change(
                    f"--ranks {n}",
                    saves,
                    alone(saves),
                    f"masters, optimizer state and the next call's gradients sharded over {n} "
                    f"data-parallel ranks, one "
                    f"per machine (roundpipe.distributed.ShardedState); per machine",
                    about=True,
                )
            )
    return changes


# Host bytes per frozen parameter of NF4 with double quantization (the packed data, the 8-bit
# absmax of each block of 64 and its scales); roundpipe/hf/quantized.py counts it exactly.
_NF4_BYTES = 0.52


def _adapter_bytes(planner: ConfigPlanner, *, next_weights: bool, next_grads: bool) -> int:
    """LoRA 16's adapters: master and two moments in the masters' dtype, gradient in the
    planned gradients' dtype (twice with ``next_grads``: the next call's while the asynchronous
    step holds these), weights (twice with ``next_weights``: the copy the step writes while
    compute reads the other)."""
    weights = planner.itemsize * (2 if next_weights else 1)
    grad_itemsize = (planner.grad_dtype or planner.optim_dtype).itemsize
    state = 3 * planner.optim_dtype.itemsize + grad_itemsize * (2 if next_grads else 1)
    return planner._lora_numel * (state + weights)


class _Alternatives:
    """The plans the device advice weighs against ``lp``'s, each made once, when first asked
    for, however many devices are short."""

    def __init__(self, planner: ConfigPlanner, lp: LengthPlans) -> None:
        self.planner = planner
        self.lp = lp

    @functools.cached_property
    def split(self) -> LengthPlans:  # one sequence per microbatch
        return self.planner.plans(self.lp.seq_len, num_microbatch=self.planner.batch_size)

    @functools.cached_property
    def bf16_grads(self) -> MemoryPlan:
        return self.planner.plan_with_gradients_in(self.lp, torch.bfloat16)

    @functools.cached_property
    def lora(self) -> LengthPlans:  # planned with the adapters
        return self.planner.variant(lora=16).plans(self.lp.seq_len)

    @functools.cached_property
    def longest(self) -> SeqLenSearch:  # the longest length that fits, in the advice's steps
        seq_len = self.lp.seq_len
        return self.planner.search(seq_len - 1, _advice_step(seq_len))


def _device_changes(alts: _Alternatives, dev_index: int, longer_search: bool) -> list[_Change]:
    planner, lp = alts.planner, alts.lp
    plan = lp.plan
    changes = []

    def need(p: MemoryPlan) -> int:
        d = p.devices[dev_index]
        return d.peak + d.reserve

    if not lp.offload and True in lp.by_offload:
        moved = lp.by_offload[True]
        note = (
            f"the stage inputs kept for the backward wait in host memory instead: "
            f"{format_bytes(moved.host.activations)} more host RAM"
        )
        if not _host_fits(moved):
            over = moved.host.new_bytes - (moved.host.available or 0)
            note += f", {format_bytes(over)} more than it has"
        changes.append(_Change("--offload-activations", need(plan) - need(moved), moved.fits, note))
    if planner.batch_size > planner.num_microbatch:
        split = alts.split
        saves = need(plan) - need(split.plan)
        changes.append(
            _Change(
                f"--num-microbatch {planner.batch_size}",
                saves,
                split.fits,
                "one sequence per microbatch: fewer tokens per action",
            )
        )
    # Full fine-tuning's gradients in bf16 on the device: the sums in half the bytes, and the
    # first microbatch's gradient taken as the sum instead of copied into an fp32 one (which
    # the peak's terms count under the running action, not as sums).
    if (
        not planner.lora
        and planner.grad_dtype is None
        and not _grad_dtype_refusal(
            torch.bfloat16,
            planner.optim_dtype,
            plan.host.ranks,
            planner.spill_dir,
            planner.devices,
        )
    ):
        low = alts.bf16_grads
        saves = need(plan) - need(low)
        if saves > 0:
            changes.append(
                _Change(
                    "--grad-dtype bf16",
                    saves,
                    low.fits,
                    "the gradient sums in bf16 on the device, handed to the step as they are "
                    f"(and {format_bytes(plan.host.new_bytes - low.host.new_bytes)} less host "
                    "RAM; roundpipe.optim.AdamW(..., grad_dtype=torch.bfloat16) with "
                    "RoundPipeRunConfig(device_grad_dtype=torch.bfloat16); the Trainer's "
                    "grad_dtype=torch.bfloat16)",
                )
            )
    if not planner.lora and planner.quantize is None:
        # planned with the adapters: the full weights' gradients leave the device (their sums
        # and the first gradient of each, which the peak's terms may count under the running
        # action), and the choice of offload may change with them
        adapters = alts.lora
        saves = need(plan) - need(adapters.plan)
        if saves > 0:
            changes.append(
                _Change(
                    "--lora 16",
                    saves,
                    adapters.fits,
                    "no gradients of the full weights on the device (the adapters' only)",
                )
            )
    if longer_search and lp.seq_len > _advice_step(lp.seq_len):
        found = alts.longest
        if found.seq_len:
            saves = need(plan) - need(found.at.plan)
            changes.append(
                _Change(
                    f"--seq-len {found.seq_len}",
                    saves,
                    True,
                    "the longest that fits (a multiple of "
                    f"{_advice_step(lp.seq_len)} tokens, --max-seq-len's search)",
                )
            )
    return changes


def _advice_step(seq_len: int) -> int:
    """The step of the shorter length the advice names for ``seq_len``: a power of two about a
    sixty-fourth of it, at least 16 tokens."""
    return max(16, 1 << max(0, (seq_len // 64).bit_length() - 1))


def _change_lines(changes: list[_Change]) -> list[str]:
    lines = []
    closing = [c for c in changes if c.fits_alone]
    partial = [c for c in changes if not c.fits_alone and c.saves > 0]

    def line(c: _Change) -> str:
        saves = ("about " if c.about else "") + format_bytes(c.saves)
        return f"      {c.options}: saves {saves}; {c.note}"

    if closing:
        lines.append("    any one of these makes it fit:")
        lines.extend(line(c) for c in sorted(closing, key=lambda c: -c.saves))
    if partial:
        lines.append("    not enough alone:" if closing else "    none is enough alone:")
        lines.extend(line(c) for c in sorted(partial, key=lambda c: -c.saves))
    return lines


def what_to_change(
    planner: ConfigPlanner, lp: LengthPlans, *, longer_search: bool = False
) -> list[str]:
    """Lines naming what would make ``lp``'s plan fit, for the host and each device that is
    short: each change with what it saves, and apart those that alone make the whole plan fit.
    ``longer_search``: also search the longest length that fits (a ``--seq-len`` plan)."""
    lines = []
    plan = lp.plan
    host = plan.host
    alts = _Alternatives(planner, lp)
    if host.available is not None and host.new_bytes > host.available:
        short = host.new_bytes - host.available
        lines.append(
            f"  host RAM: {format_bytes(short)} short ({format_bytes(host.new_bytes)} to "
            f"allocate, {format_bytes(host.available)} {_host_name(plan)})"
        )
        lines.extend(_change_lines(_host_changes(planner, lp)))
    for i, dev in enumerate(plan.devices):
        if dev.fits:
            continue
        short = dev.peak + dev.reserve - (dev.available or 0)
        lines.append(
            f"  device {dev.device}: {format_bytes(short)} short at the peak, during "
            f"{plan.describe_peak(dev)}"
        )
        lines.extend(_change_lines(_device_changes(alts, i, longer_search)))
    return lines


def _host_name(plan: MemoryPlan) -> str:
    return "given" if plan.host_source != HOST_FREE_HERE else "free on this machine"


def _short_of(plan: MemoryPlan) -> list[str]:
    """What ``plan`` is short of, in words: ``["the host RAM by 4.49 GiB"]``."""
    out = []
    host = plan.host
    if host.available is not None and host.new_bytes > host.available:
        out.append(f"the host RAM by {format_bytes(host.new_bytes - host.available)}")
    for dev in plan.devices:
        if not dev.fits:
            over = dev.peak + dev.reserve - (dev.available or 0)
            out.append(
                f"the device ({dev.device}) by {format_bytes(over)}, during "
                f"{plan.describe_peak(dev)}"
            )
    return out


def describe_bound(found: SeqLenSearch) -> list[str]:
    """Which limit binds the answer of a search, in words."""
    if found.host_everywhere:
        host = found.at.plan.host
        assert host.available is not None
        return [
            f"Bound by the host RAM at every length: the model's state alone (weights, masters, "
            f"their gradients, the optimizer's state, and the asynchronous step's second "
            f"copies) takes {format_bytes(host.new_bytes)} of "
            f"the {format_bytes(host.available)} {_host_name(found.at.plan)}, "
            f"{format_bytes(host.new_bytes - host.available)} short before any activation."
        ]
    if found.beyond is None:
        return [f"Bound by the search's limit ({found.limit} tokens), not by memory."]
    beyond = found.beyond
    lines = [f"Bound at {beyond.seq_len} tokens by:"]
    for offload, plan in sorted(beyond.by_offload.items()):
        what = "short of " + " and ".join(_short_of(plan)) if not plan.fits else "it fits"
        if len(beyond.by_offload) == 1:
            lines.append(f"  {what}")
            continue
        given = " (given)" if offload == beyond.offload and "given" in beyond.reason else ""
        lines.append(f"  activation offload {'on' if offload else 'off'}{given}: {what}")
    return lines


# --max-seq-len searches up to this many tokens unless given a limit.
MAX_SEQ_LEN_LIMIT = 1 << 20


def _offload_line(planner: ConfigPlanner, lp: LengthPlans) -> str | None:
    if not planner.streaming:
        return None
    line = f"Activation offload: {lp.reason}"
    if planner.offload_activations is None and planner.wrap_offloads(lp.seq_len) != lp.offload:
        line += (
            f". roundpipe.hf.wrap's per-call default would choose otherwise at this length: "
            f"pass RoundPipeRunConfig(offload_activations={lp.offload}) to train as planned"
        )
    return line


def quantizes(argv: list[str]) -> bool:
    """Whether the plan command's arguments ``argv`` ask for a quantized base (``--quantize``,
    however abbreviated); True when they do not parse, so that the caller changes nothing and
    :func:`main` reports the error (or prints the help: nothing is printed here)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args, _ = _parser().parse_known_args(argv)
    except SystemExit:
        return True
    return args.quantize is not None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    return _run(parser, parser.parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe plan",
        description="The memory plan of fine-tuning a transformers causal LM with "
        "roundpipe.hf.wrap: host RAM and device peak, before anything is trained.",
    )
    parser.add_argument("config", help="a transformers config.json, or a local model directory")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--seq-len", type=int, help="tokens per sequence")
    length.add_argument(
        "--max-seq-len",
        type=int,
        nargs="?",
        const=MAX_SEQ_LEN_LIMIT,
        metavar="LIMIT",
        help="find the longest sequence that fits (at most LIMIT tokens, default "
        f"{MAX_SEQ_LEN_LIMIT}), by a search over the plan, and print its plan and the limit "
        "that binds",
    )
    parser.add_argument(
        "--seq-step",
        type=int,
        default=256,
        help="--max-seq-len answers a multiple of this many tokens (256)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per batch (1)")
    parser.add_argument("--num-microbatch", type=int, default=1, help="microbatches (1)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weights (bf16)")
    parser.add_argument(
        "--optim-dtype", choices=sorted(_DTYPES), default="fp32", help="masters' dtype (fp32)"
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help=f"LoRA rank (0: full fine-tuning): adapters on every decoder layer's "
        f"{', '.join(LORA_TARGETS)} (peft, alpha = 2 x rank), the rest frozen",
    )
    parser.add_argument(
        "--quantize",
        choices=[*QUANTIZATIONS, "int8"],
        default=None,
        help="QLoRA (with --lora): the base loaded in 4 bits by bitsandbytes, as "
        "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=nf4|fp4) loads it "
        "(needs the qlora extra); int8 (load_in_8bit) is refused, as roundpipe.hf.wrap refuses it",
    )
    parser.add_argument(
        "--double-quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --quantize: bnb_4bit_use_double_quant (default: on, as QLoRA recipes load)",
    )
    parser.add_argument(
        "--devices", default=None, help="device pool (default cuda:0, else the emulated device)"
    )
    parser.add_argument(
        "--offload-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep stage inputs in host memory (RoundPipeRunConfig.offload_activations; "
        "default: chosen per length, on only where the device is short without it and the "
        "host holds them)",
    )
    parser.add_argument(
        "--mlp-tile-tokens",
        type=int,
        default=None,
        metavar="N",
        help="run each decoder layer's MLP and norms in tiles of N tokens (roundpipe.hf.wrap's "
        "mlp_tile_tokens; 0: untiled; default: chosen for the device as wrap chooses it)",
    )
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="plan against a GPU of this total memory, e.g. 24GiB (default: the local device)",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        help="plan against this GPU's memory and workspaces (default: the local device)",
    )
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="plan against this much host RAM, e.g. 128GiB (default: what is free here)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="data-parallel ranks the masters, gradients' owners and optimizer state are "
        "sharded over (roundpipe.distributed.ShardedState; default 1: not sharded); the host "
        "terms are one rank's",
    )
    parser.add_argument(
        "--spill-dir",
        metavar="DIR",
        help="keep Adam's state in files under DIR (roundpipe.optim.AdamW(state_dir=DIR)): only "
        "its streaming buffer counts against the host",
    )
    parser.add_argument(
        "--spill-masters",
        action="store_true",
        help="with --spill-dir: keep the masters in files there too (RoundPipe(..., "
        "state_placement=roundpipe.MastersOnDisk(DIR))): only its copy buffer counts",
    )
    parser.add_argument(
        "--sync-step",
        action="store_true",
        help="plan a synchronous step, model.step(fn, is_async=False): without the "
        "asynchronous step's second copies of the weights and gradients",
    )
    parser.add_argument(
        "--optim-states",
        choices=OPTIM_STATES,
        default="exact",
        help="how Adam keeps its moments: exact (8 B/param), bf16 (4) or 8bit (about 2): "
        "roundpipe.optim.AdamW(state_dtype=None | torch.bfloat16 | '8bit')",
    )
    parser.add_argument(
        "--grad-dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="the dtype the masters' gradients are handed to the step in (default: the "
        "masters', --optim-dtype): bf16 plans roundpipe.optim.AdamW(grad_dtype=torch.bfloat16) "
        "with RoundPipeRunConfig(device_grad_dtype=torch.bfloat16), the gradients summed in "
        "bf16 on the device and handed to the step in 2 bytes per parameter instead of 4 "
        "(both sets with the asynchronous step); needs torch 2.10 or newer, fp32 masters, "
        "an accelerator pool, and neither --spill-dir nor --ranks above 1",
    )
    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.optim_states != "exact" and args.spill_dir is not None:
        parser.error(
            f"--optim-states {args.optim_states} keeps lean moments in RAM; --spill-dir streams "
            "exact ones through files: give one of them"
        )
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    if args.spill_masters and args.spill_dir is None:
        parser.error("--spill-masters keeps the masters in files under --spill-dir: give it")
    if args.mlp_tile_tokens is not None and args.mlp_tile_tokens < 0:
        parser.error("--mlp-tile-tokens must be >= 0 (0: untiled)")
    if args.quantize == "int8":
        parser.error(f"--quantize int8: {EIGHT_BIT}")
    if args.quantize is not None and not args.lora:
        parser.error("--quantize plans QLoRA: a quantized base cannot train; give --lora RANK")
    grad_dtype = _DTYPES[args.grad_dtype] if args.grad_dtype else None
    optim_dtype = _DTYPES[args.optim_dtype]
    refused = _grad_dtype_refusal(
        None if grad_dtype == optim_dtype else grad_dtype,
        optim_dtype,
        args.ranks,
        args.spill_dir,
        args.devices,
    )
    if refused is not None:
        parser.error(refused)
    try:
        device_memory = parse_size(args.device_memory) if args.device_memory else None
        host_memory = parse_size(args.host_memory) if args.host_memory else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.seq_step < 1 or (args.max_seq_len is not None and args.max_seq_len < args.seq_step):
        parser.error("--seq-step must be a positive int no larger than --max-seq-len's limit")
    major = 9
    if args.gpu:
        if device_memory is not None:
            parser.error("give --gpu or --device-memory, not both")
        device_memory, major = GPUS[args.gpu]
    start = time.perf_counter()
    planner = ConfigPlanner(
        args.config,
        batch_size=args.batch_size,
        num_microbatch=args.num_microbatch,
        dtype=_DTYPES[args.dtype],
        optim_dtype=optim_dtype,
        lora=args.lora,
        devices=args.devices,
        offload_activations=args.offload_activations,
        device_memory=device_memory,
        compute_capability=major,
        host_memory=host_memory,
        ranks=args.ranks,
        spill_dir=args.spill_dir,
        mlp_tile_tokens=args.mlp_tile_tokens,
        spill_masters=args.spill_masters,
        gpu=args.gpu,
        optim_states=args.optim_states,
        quantize=args.quantize,
        double_quant=args.double_quant,
        sync_step=args.sync_step,
        grad_dtype=grad_dtype,
    )
    if args.lora:
        print(
            f"LoRA rank {args.lora} (alpha {2 * args.lora}) on every decoder layer's "
            f"{', '.join(LORA_TARGETS)}; the rest frozen"
        )
    if args.max_seq_len is not None:
        found = planner.search(args.max_seq_len, args.seq_step)
        took = time.perf_counter() - start
        searched = f"{found.traced} length(s) traced, {took:.1f} s"
        lp = found.at
        if not found.seq_len:
            print(
                f"No sequence fits: not even {args.seq_step} tokens x {args.batch_size} "
                f"sequence(s) ({searched})."
            )
        else:
            print(
                f"Longest sequence that fits: {found.seq_len} tokens x {args.batch_size} "
                f"sequence(s), a multiple of {args.seq_step} ({searched})"
            )
        for line in describe_bound(found):
            print(line)
        if not found.seq_len:
            print(f"The plan at {found.at.seq_len} tokens:")
    else:
        lp = planner.plans(args.seq_len)
    offload = _offload_line(planner, lp)
    if offload:
        print(offload)
    print(lp.plan)
    if not lp.fits:
        print("DOES NOT FIT. What would make it fit:")
        for line in what_to_change(planner, lp, longer_search=args.max_seq_len is None):
            print(line)
        return 1
    return 0
