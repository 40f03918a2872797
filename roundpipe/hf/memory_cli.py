"""``python -m roundpipe plan CONFIG``: the memory plan of fine-tuning a transformers causal LM
before anything is trained: host RAM term by term and each device's peak, at a sequence length
and microbatch size, with the largest term named.

The host terms are counted for the whole model from its shapes alone (built on the meta device:
no weights are allocated). The device peak comes from :meth:`HFRoundPipe.memory_plan` of the
same architecture cut to two decoder layers, built for real at the chosen dtype: the stages
stream through a device one at a time, so every decoder layer past the second adds host bytes
but not device bytes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from typing import Any

import torch

from roundpipe.memory.host import host_terms
from roundpipe.memory.probe import host_memory_available

__all__ = ["main", "plan_config"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def plan_config(
    path: str,
    *,
    seq_len: int,
    batch_size: int = 1,
    num_microbatch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    optim_dtype: torch.dtype = torch.float32,
    lora: int = 0,
    devices: str | None = None,
    offload_activations: bool = False,
) -> Any:
    """The :class:`roundpipe.MemoryPlan` of training the causal LM that ``path`` (a config.json
    or a local model directory) describes: host terms for the whole model, device peaks from a
    two-layer cut of it (see the module doc)."""
    from transformers import AutoModelForCausalLM

    import roundpipe
    from roundpipe import RoundPipeRunConfig

    config = _load_config(path)
    with torch.device("meta"):
        whole = _with_lora(AutoModelForCausalLM.from_config(config, dtype=dtype), lora)
    # Shapes only: the meta model's terms are the whole model's (nothing pinned is counted).
    host = host_terms(whole, optim_dtype, None, host_memory_available())
    layers = int(config.num_hidden_layers)

    cut = copy.deepcopy(config)
    cut.num_hidden_layers = min(layers, 2)
    if getattr(cut, "layer_types", None) is not None:
        cut.layer_types = list(cut.layer_types)[: cut.num_hidden_layers]
    small = _with_lora(AutoModelForCausalLM.from_config(cut, dtype=dtype), lora)
    if devices is None:
        devices = "cuda:0" if torch.cuda.is_available() else "emu"
    model = roundpipe.hf.wrap(
        small,
        optim_dtype=optim_dtype,
        devices=devices,
        memory_check=False,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=num_microbatch, offload_activations=offload_activations
        ),
    )
    ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plan = model.memory_plan(input_kwargs=batch)
    # Stage inputs offloaded to the host: one per decoder layer, so scaled to the whole model.
    activations = plan.host.activations * max(layers, 1) // max(cut.num_hidden_layers, 1)
    host = dataclasses.replace(host, activations=activations)
    return dataclasses.replace(plan, host=host, name=f" {type(small).__name__} ({path})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe plan",
        description="The memory plan of fine-tuning a transformers causal LM with "
        "roundpipe.hf.wrap: host RAM and device peak, before anything is trained.",
    )
    parser.add_argument("config", help="a transformers config.json, or a local model directory")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per batch (1)")
    parser.add_argument("--num-microbatch", type=int, default=1, help="microbatches (1)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="weights (bf16)")
    parser.add_argument(
        "--optim-dtype", choices=sorted(_DTYPES), default="fp32", help="masters' dtype (fp32)"
    )
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument(
        "--devices", default=None, help="device pool (default cuda:0, else the emulated device)"
    )
    parser.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep stage inputs in host memory (RoundPipeRunConfig.offload_activations)",
    )
    args = parser.parse_args(argv)
    plan = plan_config(
        args.config,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        num_microbatch=args.num_microbatch,
        dtype=_DTYPES[args.dtype],
        optim_dtype=_DTYPES[args.optim_dtype],
        lora=args.lora,
        devices=args.devices,
        offload_activations=args.offload_activations,
    )
    print(plan)
    return 0
