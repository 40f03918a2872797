"""``python -m roundpipe plan CONFIG``: the memory plan of fine-tuning a transformers causal LM
before anything is trained: host RAM term by term and each device's peak, at a sequence length
and microbatch size, with the largest term named.

The whole model is built on the meta device (shapes only: no weights are allocated) and
wrapped as :func:`roundpipe.hf.wrap` wraps it, so the host terms and every stage's device bytes
are the real model's; a plan traces one decoder layer and reuses its bytes for the identical
ones (see [Note: identical stages] in :mod:`roundpipe.memory.trace`), so planning a 70B model
costs about what a small one does. ``--max-seq-len`` answers "how long a sequence fits": a
bisection over the plan (:class:`ConfigPlanner`), never a run.

The question it answers is "does it fit on my machine": ``--device-memory 24GiB`` or ``--gpu
rtx4090`` (:data:`GPUS`) plans against that GPU instead of the local device, with the reserve a
GPU needs beside the tensors (see [Note: the device reserve] in
:mod:`roundpipe.devices.accelerator`), and ``--host-memory`` against that much RAM.
``--spill-dir DIR`` plans Adam's state in files there (``roundpipe.optim.AdamW(state_dir=DIR)``):
only its streaming buffer counts against the host; ``--spill-masters`` plans the masters there too
(``state_placement=roundpipe.MastersOnDisk(DIR)``): only its copy buffer counts. Planned from a
config, the weights do not
exist yet, so they count against the host like every other term. When it does not fit, the
report ends with what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Any

import torch

from roundpipe.hf.defaults import (
    default_loss_chunk_tokens,
    default_mlp_tile_tokens,
    kept_input_bytes,
    offload_needed,
)
from roundpipe.hf.quantized import EIGHT_BIT, QUANTIZATIONS, quantize_on_meta
from roundpipe.memory.host import format_bytes, host_terms
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.search import longest_fitting
from roundpipe.optim.master_file import DEFAULT_COPY_BUFFER_BYTES
from roundpipe.optim.spill import DEFAULT_BUFFER_BYTES
from roundpipe.runtime.stages import model_layers

__all__ = ["GPUS", "CUDA_CONTEXT", "ConfigPlanner", "main", "parse_size", "plan_config"]

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

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


class ConfigPlanner:
    """Memory plans of training the causal LM that ``path`` (a config.json or a local model
    directory) describes, at any sequence length, from one model of shapes only: the whole
    model is built on the meta device (no weights are allocated, so the host terms and every
    stage are the real model's), wrapped once, and each plan traces one decoder layer and
    reuses it for the identical ones (see [Note: identical stages] in
    :mod:`roundpipe.memory.trace`). ``device_memory``: plan against a GPU of that many bytes
    (its total: the CUDA context is taken off) and compute capability ``compute_capability``
    instead of the local device, with the loss chunk, the MLP tile and the activation offload
    chosen for it as :func:`roundpipe.hf.wrap` chooses them for a local device
    (:mod:`roundpipe.hf.defaults`); ``offload_activations`` None: chosen per length;
    ``mlp_tile_tokens``: wrap's (None: chosen for the device, 0: untiled);
    ``host_memory``: against that much host RAM instead of what this machine has free;
    ``ranks``: the state sharded over that many data-parallel ranks
    (:class:`roundpipe.distributed.ShardedState`), the host terms of the rank with the largest
    share; ``spill_dir``: Adam's state in files there (``roundpipe.optim.AdamW(state_dir=spill_dir)``),
    so only its streaming buffer counts against the host; ``spill_masters`` (with ``spill_dir``):
    the masters in files there too (:class:`roundpipe.MastersOnDisk`), so only its copy buffer
    counts. ``quantize`` (``"nf4"``/``"fp4"``, with ``lora``): the base quantized as
    transformers loads it with bitsandbytes in 4 bits, ``double_quant`` its
    ``bnb_4bit_use_double_quant``, computing in ``dtype`` (:func:`roundpipe.hf.quantized.
    quantize_on_meta`): QLoRA. Main thread."""

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
        quantize: str | None = None,
        double_quant: bool = True,
    ) -> None:
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
        if quantize is not None and not lora:
            raise ValueError(
                f"quantize={quantize!r} plans QLoRA: a quantized base cannot train, give the "
                f"LoRA rank (lora=16, --lora 16)"
            )
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if quantize is not None:
                quantize_on_meta(base, quantize, double_quant, compute_dtype=dtype)
            whole = _with_lora(base, lora)
        if devices is None:
            devices = "cuda:0" if torch.cuda.is_available() else "emu"
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
        )
        # Shapes only: the meta model's terms are the whole model's (nothing pinned is counted);
        # an accelerator pool hands the gradients over stage by stage.
        available = host_memory if host_memory is not None else host_memory_available()
        layers = [layer.module for layer in model_layers(self.model.module)]
        self.host = dataclasses.replace(
            host_terms(whole, optim_dtype, None, available, ranks=ranks, layers=layers),
            weights_allocated=False,
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

    def offloads(self, seq_len: int) -> bool:
        """Whether the plan at ``seq_len`` offloads the stage inputs (given, or chosen as wrap
        chooses it for the target device)."""
        if self.offload_activations is not None:
            return self.offload_activations
        free = None if self.device_memory is None else self.device_memory - CUDA_CONTEXT
        if free is None:
            free = self.model.device_free()
        kept = kept_input_bytes(
            int(self.config.num_hidden_layers),
            self.batch_size * seq_len,
            int(self.config.hidden_size),
            self.itemsize,
        )
        return offload_needed(kept, free)

    def plan(self, seq_len: int) -> Any:
        """The :class:`roundpipe.MemoryPlan` of one ``forward_backward`` of ``batch_size``
        sequences of ``seq_len`` tokens."""
        from roundpipe import RoundPipeRunConfig

        run_config = RoundPipeRunConfig(
            num_microbatch=self.num_microbatch, offload_activations=self.offloads(seq_len)
        )
        ids = torch.zeros((self.batch_size, seq_len), dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        plan = self.model.memory_plan(input_kwargs=batch, run_config=run_config)
        # The masters' gradients as the runtime holds them (the wrapped model's plan): on an
        # accelerator each stage's are downloaded into a pinned pool of their own, so a tied
        # embedding (in the first and last stage) has two until the second is added. Sharded,
        # a rank keeps its share only (self.host's).
        host = dataclasses.replace(
            self.host,
            activations=plan.host.activations,
            grads=self.host.grads if self.host.ranks > 1 else plan.host.grads,
        )
        devs = plan.devices
        if self.device_memory is not None:
            from roundpipe.devices.accelerator import cublas_workspace_bytes, device_reserve

            workspace = cublas_workspace_bytes(self.compute_capability)
            gpu_devs = []
            for d in devs:
                reserve, note = device_reserve(d.peak, workspace)
                gpu_devs.append(
                    dataclasses.replace(
                        d,
                        available=self.device_memory - CUDA_CONTEXT,
                        reserve=reserve,
                        reserve_note=note,
                    )
                )
            devs = tuple(gpu_devs)
        name = f" {type(self.model.hf_model).__name__} ({self.path})"
        return dataclasses.replace(plan, host=host, devices=devs, name=name)

    def longest_seq_len(self, limit: int, step: int = 1) -> int:
        """The longest sequence, a multiple of ``step`` of at most ``limit`` tokens, whose plan
        fits (host and devices), by bisection over :meth:`plan`; 0 if ``step`` does not."""
        return longest_fitting(lambda n: self.plan(n).fits, limit, step)


def plan_config(path: str, *, seq_len: int, **kwargs: Any) -> Any:
    """The :class:`roundpipe.MemoryPlan` of training the causal LM that ``path`` describes at
    ``seq_len`` tokens per sequence (``kwargs``: :class:`ConfigPlanner`'s)."""
    return ConfigPlanner(path, **kwargs).plan(seq_len)


def what_to_change(
    plan: Any, *, lora: int, offload_activations: bool, seq_len: int, quantize: str | None = None
) -> list[str]:
    """Lines naming what would make a plan that does not fit fit."""
    lines = []
    host = plan.host
    if host.available is not None and host.new_bytes > host.available:
        short = host.new_bytes - host.available
        lines.append(f"  host RAM: {format_bytes(short)} more (or any of these):")
        if quantize is None:
            lines.append(
                "    --lora 16 --quantize nf4: QLoRA, the frozen weights in 4 bits (about 0.52 "
                "bytes a parameter) with LoRA adapters"
            )
        if host.optimizer_dir is None:
            lines.append(
                "    --spill-dir DIR: the optimizer state in files on a fast disk "
                "(roundpipe.optim.AdamW(..., state_dir=DIR))"
            )
        if host.masters_dir is None:
            lines.append(
                "    --spill-masters (with a spill directory): the masters in files there too "
                "(RoundPipe(..., state_placement=roundpipe.MastersOnDisk(DIR)))"
            )
        if not lora:
            lines.append(
                "    --lora 16: only the adapters get masters, gradients and optimizer state"
            )
        lines.append(
            "    --optim-dtype bf16: masters, gradients and optimizer state in half the bytes"
        )
        if not lora:
            lines.append(
                "    --ranks N: masters and optimizer state sharded over N data-parallel ranks "
                "(machines), roundpipe.distributed.ShardedState"
            )
    for dev in plan.devices:
        if dev.fits:
            continue
        short = dev.peak + dev.reserve - (dev.available or 0)
        lines.append(f"  device {dev.device}: {format_bytes(short)} less at the peak:")
        if not offload_activations:
            lines.append("    --offload-activations: stage inputs kept for recompute on the host")
        lines.append(
            "    --num-microbatch N (larger) with --batch-size N: fewer tokens per microbatch"
        )
        lines.append(f"    --seq-len below {seq_len}: activations grow with the tokens")
        if not lora:
            lines.append("    --lora 16: no gradient sums of the full weights on the device")
    return lines


# --max-seq-len searches up to this many tokens unless given a limit.
MAX_SEQ_LEN_LIMIT = 1 << 20


def main(argv: list[str] | None = None) -> int:
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
        f"{MAX_SEQ_LEN_LIMIT}), by a search over the plan, and print its plan",
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
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
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
        "default: where they would take more than a quarter of the device, as wrap chooses)",
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
    args = parser.parse_args(argv)
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
    planner = ConfigPlanner(
        args.config,
        batch_size=args.batch_size,
        num_microbatch=args.num_microbatch,
        dtype=_DTYPES[args.dtype],
        optim_dtype=_DTYPES[args.optim_dtype],
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
        quantize=args.quantize,
        double_quant=args.double_quant,
    )
    seq_len = args.seq_len
    if args.max_seq_len is not None:
        seq_len = planner.longest_seq_len(args.max_seq_len, args.seq_step)
        if not seq_len:
            print(f"No sequence fits: not even {args.seq_step} tokens. At {args.seq_step}:")
            seq_len = args.seq_step
        else:
            limit = " (the search's limit)" if seq_len + args.seq_step > args.max_seq_len else ""
            print(
                f"Longest sequence that fits: {seq_len} tokens{limit} x {args.batch_size} "
                f"sequence(s), a multiple of {args.seq_step} (found by a search over the plan)"
            )
    plan = planner.plan(seq_len)
    print(plan)
    if not plan.fits:
        print("DOES NOT FIT. What would make it fit:")
        for line in what_to_change(
            plan,
            lora=args.lora,
            offload_activations=planner.offloads(seq_len),
            seq_len=seq_len,
            quantize=args.quantize,
        ):
            print(line)
        return 1
    return 0
