"""The pieces of the GPU run of models and sequences that do not fit a 24 GiB GPU
(benchmarks/gpu_offload.sh), loaded by the side-by-side harness (``.peer/peer_bench.py``, as
benchmarks/peer_setup.py patches it) into every contender's process:

- **the cap** (:func:`apply_cap`, from ``$BENCH_GPU_CAP_GIB``): the process emulates a GPU of
  that many GiB. torch's caching allocator may reserve at most the cap less the CUDA context
  (``torch.cuda.set_per_process_memory_fraction``), and ``torch.cuda.mem_get_info`` answers as
  that GPU would (its total the cap, its free memory what the allocator may still reserve), so
  every library that sizes itself from the free memory (roundpipe's defaults and memory check,
  the public RoundPipe's stage sizes) sizes itself for that GPU;
- **random models from published configs, fast** (:func:`build_random_model`): built with
  transformers' own ``no_init_weights`` (no per-element initialisation) and filled from one
  small pool of normal samples, so a multi-GB model costs about a memory copy;
- **model FLOPs utilisation** (:func:`flops_per_token`, :func:`mfu`);
- **the contenders of a config-driven model** (``--model hf``, :func:`run_hf`): roundpipe
  (``roundpipe.hf.wrap`` at its defaults), the public RoundPipe 0.1.1 (its HF preset), and
  PyTorch FSDP2 with CPU offload (``fully_shard`` with ``CPUOffloadPolicy(pin_memory=True)``,
  bf16 ``MixedPrecisionPolicy``, one rank, activation checkpointing), same data, batch,
  microbatches and loop; each prints one JSON line.

It imports nothing of roundpipe at module level: the public RoundPipe's process has its own
``roundpipe`` on the path (the same import name). ``python benchmarks/gpu_rows.py layers CONFIG N
OUT`` writes CONFIG with N decoder layers (the plan command takes a config file);
``python benchmarks/gpu_rows.py run --impl IMPL --config CONFIG ...`` runs one contender as the
harness's ``--model hf`` does, without the harness (tests/test_bench_gpu.py runs it on the CPU);
``python benchmarks/gpu_rows.py build CONFIG [--own-init]`` times building a config's model
(benchmarks/results/gpu.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CAP_ENV",
    "CUDA_CONTEXT",
    "LORA_TARGETS",
    "PEAK_FLOPS",
    "apply_cap",
    "attention_dims",
    "build_random_model",
    "cap_fraction",
    "capped_mem_info",
    "fill_random_",
    "finish",
    "flops_per_token",
    "harness_dims",
    "load_config",
    "mfu",
    "run_hf",
]

GiB = 1 << 30
# Dense bf16 (and fp16) tensor-core peak of an H100/H200 SXM, FLOP/s: the MFU's denominator.
PEAK_FLOPS = 989e12
# The CUDA context, outside torch's allocator: the same figure the memory plan takes off a GPU
# (roundpipe.hf.memory_cli.CUDA_CONTEXT; tests/test_bench_gpu.py holds the two equal). Each row
# prints what its process held outside the allocator, to compare.
CUDA_CONTEXT = 512 << 20
CAP_ENV = "BENCH_GPU_CAP_GIB"
# LoRA on the attention and MLP projections (Llama and Qwen3 module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Normal samples the fast builder copies into every weight (a prime count, so that the pattern
# does not line up with the rows of a matrix).
POOL_NUMEL = 1_000_003
INIT_STD = 0.02  # transformers' initializer_range for these models

_cap: dict[str, Any] = {}  # what apply_cap applied, for finish()


# -- the cap -------------------------------------------------------------------------------------
def cap_fraction(cap_bytes: int, total_bytes: int, context_bytes: int = CUDA_CONTEXT) -> float:
    """The fraction of a device of ``total_bytes`` that torch's caching allocator may reserve so
    that the process, with its CUDA context of ``context_bytes``, holds at most ``cap_bytes``
    (the argument of ``torch.cuda.set_per_process_memory_fraction``); 1.0 when the device is
    smaller than the cap."""
    if cap_bytes <= context_bytes:
        raise ValueError(
            f"a cap of {cap_bytes / GiB:.2f} GiB leaves nothing beside the CUDA context "
            f"({context_bytes / GiB:.2f} GiB): give a larger ${CAP_ENV}"
        )
    return min(1.0, (cap_bytes - context_bytes) / total_bytes)


def capped_mem_info(
    free: int, total: int, reserved: int, fraction: float, cap_bytes: int
) -> tuple[int, int]:
    """``mem_get_info`` as a GPU of ``cap_bytes`` would answer it, from what the real device
    answers (``free``, ``total``) and what this process's allocator has reserved: free is what
    the allocator may still reserve under ``fraction`` of ``total`` (no more than the device
    has free), total the cap."""
    limit = int(fraction * total)
    return max(0, min(free, limit - reserved)), cap_bytes


def apply_cap(cap_gib: float | None = None, device: int = 0) -> dict[str, Any] | None:
    """Make this process a GPU of ``cap_gib`` GiB (default: ``$BENCH_GPU_CAP_GIB``; unset or
    empty: no cap): the allocator's fraction and a ``torch.cuda.mem_get_info`` that answers for
    that GPU (see the module's docstring). Call it first, before any library sizes itself from
    the free memory. Returns what it applied (None without a cap, or without CUDA: it says so
    on stderr). Main thread."""
    if cap_gib is None:
        text = os.environ.get(CAP_ENV, "").strip()
        if not text:
            return None
        cap_gib = float(text)
    if not torch.cuda.is_available():
        print(f"no CUDA: the {cap_gib:g} GiB cap is not applied", file=sys.stderr)
        return None
    cap = int(cap_gib * GiB)
    real = torch.cuda.mem_get_info
    _, total = real(device)
    fraction = cap_fraction(cap, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)

    def mem_get_info(dev: Any = None) -> tuple[int, int]:
        free, whole = real(dev)
        return capped_mem_info(free, whole, torch.cuda.memory_reserved(dev), fraction, cap)

    torch.cuda.mem_get_info = mem_get_info  # type: ignore[assignment]
    torch.cuda.memory.mem_get_info = mem_get_info  # type: ignore[assignment]
    _cap.update(
        cap_GiB=cap_gib,
        fraction=round(fraction, 6),
        allocator_limit_GiB=round(fraction * total / GiB, 3),
        real_mem_get_info=real,
    )
    return {k: v for k, v in _cap.items() if k != "real_mem_get_info"}


# -- configs and random models --------------------------------------------------------------------
def load_config(path: str | os.PathLike[str], layers: int | None = None) -> Any:
    """The transformers config of a config.json (as ``python -m roundpipe plan`` reads it), with
    ``layers`` decoder layers if given, SDPA attention and no key/value cache."""
    from transformers import AutoConfig

    raw = json.loads(Path(path).read_text())
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if "max_window_layers" in raw:
            raw["max_window_layers"] = layers
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


@contextlib.contextmanager
def _no_init_weights() -> Iterator[None]:
    """transformers' own context that skips weight initialisation (torch's ``nn.init``
    functions and the model's ``init_weights``): in ``transformers.initialization`` from 5.0,
    ``transformers.modeling_utils`` before."""
    import importlib

    try:
        module = importlib.import_module("transformers.initialization")
    except ImportError:  # transformers 4.x
        module = importlib.import_module("transformers.modeling_utils")
    with module.no_init_weights():
        yield


def fill_random_(model: nn.Module, seed: int = 0, std: float = INIT_STD) -> nn.Module:
    """Fill every parameter of ``model`` in place without drawing a number per element: each
    weight matrix is a copy of one pool of :data:`POOL_NUMEL` normal samples of standard
    deviation ``std`` (generated once from ``seed``), starting at an offset of its own; a
    one-dimensional parameter named ``bias`` is zero, any other (a norm's scale) one. Tied
    parameters are filled once. Returns ``model``."""
    g = torch.Generator().manual_seed(seed)
    pool32 = torch.randn(POOL_NUMEL, generator=g) * std
    pools: dict[torch.dtype, torch.Tensor] = {}
    offsets = torch.randint(0, POOL_NUMEL, (len(list(model.parameters())),), generator=g)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.dim() < 2:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            if p.dtype not in pools:
                pools[p.dtype] = pool32.to(p.dtype)
            pool = pools[p.dtype]
            _copy_from_pool(p.view(-1), pool, int(offsets[i]))
    return model


def _copy_from_pool(flat: torch.Tensor, pool: torch.Tensor, at: int) -> None:
    """``flat`` := the pool from ``at`` on, repeated: three copies whatever the size (one
    copy per pool-sized chunk is as many small parallel regions, slow on a busy host)."""
    size = pool.numel()
    head = min(size - at, flat.numel())
    flat[:head].copy_(pool[at : at + head])
    rest = flat[head:]
    rows = rest.numel() // size
    if rows:
        rest[: rows * size].view(rows, size).copy_(pool.expand(rows, size))
    tail = rest.numel() - rows * size
    if tail:
        rest[rows * size :].copy_(pool[:tail])


def build_random_model(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Any:
    """transformers' causal LM for ``config`` in ``dtype`` with random weights, built without
    per-element initialisation (:func:`_no_init_weights`, then :func:`fill_random_`): the
    weights' memory is allocated once and written once. The same ``seed`` gives the same
    weights in any dtype (up to its rounding)."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    # The parameters are made in dtype directly, as from_config(dtype=...) makes them; the
    # buffers the model makes in fp32 on purpose (the rotary tables) stay fp32.
    torch.set_default_dtype(dtype)
    try:
        with _no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.tie_weights()  # skipped with the initialisation (tie_word_embeddings: one tensor)
    return fill_random_(model, seed)


# -- model FLOPs ---------------------------------------------------------------------------------
def attention_dims(config: Any) -> tuple[int, int, int]:
    """(decoder layers, attention heads, head dimension) of a transformers config."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), heads, int(head_dim)


def flops_per_token(
    model: nn.Module, seq_len: int, dims: tuple[int, int, int], *, causal: bool = True
) -> float:
    """Model FLOPs of training on one token of a ``seq_len``-token sequence (forward and
    backward, no recompute), by a documented formula:

    * every ``nn.Linear`` whose weight trains: 6 x its weight's elements (forward, the input's
      gradient, the weight's gradient); a frozen one (LoRA's base weights, a frozen head): 4 x
      (forward and the input's gradient). Embedding lookups are no matmuls and count nothing;
      a tied head counts as the ``nn.Linear`` it is called through;
    * attention (``dims``: layers, heads, head dimension): per layer, the scores and the
      weighted sum take 2 x 2 x seq_len x heads x head_dim forward, x 3 with the backward;
      half of it under a ``causal`` mask (the half a causal kernel computes).

    With ``causal=False`` it is what ``torch.utils.flop_counter.FlopCounterMode`` counts for one
    training step on SDPA's math kernel (tests/test_bench_gpu.py checks it), where every layer's
    input needs a gradient: with LoRA the first layer's projections get none unless the
    embedding's output requires grad, so a run computes slightly less than this counts."""
    trained = frozen = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if module.weight.requires_grad:
                trained += module.weight.numel()
            else:
                frozen += module.weight.numel()
    layers, heads, head_dim = dims
    attention = 3 * 4 * seq_len * heads * head_dim * layers
    if causal:
        attention //= 2
    return float(6 * trained + 4 * frozen + attention)


def harness_dims(model: nn.Module, a: argparse.Namespace) -> tuple[int, int, int]:
    """:func:`attention_dims` of the harness's model: its config's (qwen3), else the GPT's
    from the harness's options (layers, heads, d / heads)."""
    config = getattr(model, "config", None)
    if config is not None:
        return attention_dims(config)
    return int(a.layers), int(a.heads), int(a.d) // int(a.heads)


def mfu(tokens_per_s: float, flops_token: float, peak: float = PEAK_FLOPS) -> float:
    """Model FLOPs utilisation: the model FLOPs a second reaches over the GPU's dense peak."""
    return tokens_per_s * flops_token / peak


def finish(res: dict[str, Any], flops_token: float) -> dict[str, Any]:
    """``res`` (a harness row with ``tok_s``) with its model FLOPs per token and MFU, the
    allocator's reserved peak, what the process held on the device at the end (the allocator's
    reserve and what is outside it: the CUDA context), and the cap. Main thread, after the
    timed iterations."""
    res["flops_per_token"] = flops_token
    res["mfu"] = float(f"{mfu(res['tok_s'], flops_token):.4g}")
    if torch.cuda.is_available():
        real = _cap.get("real_mem_get_info", torch.cuda.mem_get_info)
        free, total = real(0)
        reserved = torch.cuda.memory_reserved(0)
        res["gpu_reserved_peak_GB"] = round(torch.cuda.max_memory_reserved(0) / GiB, 3)
        res["device_held_GB"] = round((total - free) / GiB, 3)
        res["outside_allocator_GB"] = round((total - free - reserved) / GiB, 3)
    if _cap:
        res["cap_GiB"] = _cap["cap_GiB"]
        res["allocator_limit_GiB"] = _cap["allocator_limit_GiB"]
    return res


# -- the contenders of --model hf ----------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness's options for ``--model hf`` (the harness keeps its own for the rest)."""
    parser.add_argument("--config", help="--model hf: a transformers config.json")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="--model hf")
    parser.add_argument("--lora", type=int, default=0, help="--model hf: LoRA rank (0: full)")
    parser.add_argument(
        "--optim-states",
        default="exact",
        choices=["exact", "bf16", "8bit"],
        help="--model hf, ours: Adam's moments (roundpipe.optim.Adam(state_dtype=None | "
        "torch.bfloat16 | '8bit'))",
    )
    parser.add_argument(
        "--memory-plan",
        action="store_true",
        help="--model hf, ours: the wrapped model's memory plan of the first batch, in the row",
    )


def _lora(model: Any, rank: int) -> Any:
    """``model`` with peft's LoRA adapters of ``rank`` on :data:`LORA_TARGETS`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    return get_peft_model(model, config)


def _ours(
    model: Any, a: argparse.Namespace, dtype: torch.dtype, res: dict[str, Any]
) -> tuple[Callable, Callable]:
    """roundpipe.hf.wrap at its defaults with docs/hf.md's loop (fp32 masters, roundpipe's
    Adam, its moments as ``a.optim_states`` says; the GradScaler only in fp16, as
    examples/finetune_hf.py). With ``a.memory_plan``
    the first batch's memory plan goes into ``res`` before it runs (the first device's peak,
    reserve and what it had free)."""
    import roundpipe
    from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig

    rp = roundpipe.hf.wrap(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=a.mb),
    )
    states = getattr(a, "optim_states", "exact")
    with OptimizerCtx():  # state_dtype takes the option's names ("exact", "bf16", "8bit")
        opt = roundpipe.optim.Adam(rp.parameters(), lr=1e-5, state_dtype=states)
    res["optim_states"] = states
    scaler = GradScaler(enabled=dtype == torch.float16)
    planned: list[bool] = []

    def step() -> None:  # on the optimizer thread
        scaler.step(opt)
        opt.zero_grad()

    def it(ids: torch.Tensor) -> float:
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        if a.memory_plan and not planned:  # the first batch's plan, before it runs
            planned.append(True)
            plan = rp.memory_plan(input_kwargs=batch)
            res["plan_fits"] = plan.fits
            for dev in plan.devices[:1]:  # none on a CPU pool
                res.update(
                    plan_peak_GiB=round(dev.peak / GiB, 4),
                    plan_reserve_GiB=round(dev.reserve / GiB, 4),
                    plan_peak_plus_reserve_GiB=round((dev.peak + dev.reserve) / GiB, 4),
                    plan_available_GiB=round((dev.available or 0) / GiB, 4),
                )
        scale = scaler.get_scale()
        loss = rp.forward_backward(input_kwargs=batch, loss_fn=lambda l, _: scaler.scale(l))
        rp.step(step)
        scaler.update()
        return float(loss.item()) / scale

    return it, rp.synchronize


def _upstream(model: Any, a: argparse.Namespace) -> tuple[Callable, Callable]:
    """The public RoundPipe 0.1.1 at its documented HF setup: its sequential preset, fp32
    masters, its Adam, the loss as the HF output's divided by the microbatches."""
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe.optim import Adam

    inner = model.base_model.model if a.lora else model  # its preset takes the HF class itself
    rp = wrap_model_to_roundpipe(
        inner,
        optim_dtype=torch.float32,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=a.mb),
    )
    opt = Adam(rp.optim_parameters(), lr=1e-5)

    def step() -> None:  # on its optimizer thread
        opt.step()
        opt.zero_grad()

    def it(ids: torch.Tensor) -> float:
        loss = rp.forward_backward(
            input_kwargs={
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "labels": ids,
                "return_logits": False,
            },
            loss_fn=lambda outputs, _: outputs.loss / a.mb,
        )
        rp.step(step)
        return float(loss)

    return it, rp.synchronize


def _fsdp2(model: Any, a: argparse.Namespace, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """PyTorch FSDP2 on one rank as a user with one GPU too small for the state runs it: every
    decoder layer and the root ``fully_shard``-ed with the fp32 parameters, gradients and
    optimizer state offloaded to pinned host memory (``CPUOffloadPolicy``), compute in
    ``dtype`` (``MixedPrecisionPolicy``, fp32 gradient reduction), transformers' activation
    checkpointing (non-reentrant) on every decoder layer, torch's fused AdamW on the host. The
    microbatches are accumulated (gradients reduced and offloaded after each). Without CUDA
    (the CPU smoke test) the same on gloo, the offload policy unpinned (pinning needs CUDA)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)  # NCCL's rank 0 and FSDP2's default mesh
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
        )
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model.float()  # the masters FSDP2 keeps sharded (on the host, offloaded)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for module in model.modules():  # the rotary tables etc. where the compute is
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(dev)
    mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=cuda)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def it(ids: torch.Tensor) -> float:
        total = 0.0
        for xs in ids.to(dev).chunk(a.mb):
            loss = model(input_ids=xs, labels=xs).loss / a.mb
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def fin() -> None:
        if cuda:
            torch.cuda.synchronize()

    return it, fin


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_hf(a: argparse.Namespace) -> None:
    """One contender (``a.impl``: ours, upstream, fsdp2) on the model ``a.config`` describes
    (``a.layers`` decoder layers if given), random weights (:func:`build_random_model`), ``a.lora``
    adapters if given; ``a.batch`` sequences of ``a.seq`` random tokens in ``a.mb``
    microbatches, ``a.warmup`` then ``a.iters`` timed iterations. Prints one JSON line (with an
    ``error`` if it failed, e.g. out of memory under the cap)."""
    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    config = load_config(a.config, a.layers)
    res: dict[str, Any] = dict(
        model=Path(a.config).stem,
        impl=a.impl,
        lora=a.lora,
        layers=config.num_hidden_layers,
        dtype=a.dtype,
        seq=a.seq,
        batch=a.batch,
        mb=a.mb,
    )
    t0 = time.perf_counter()
    model = build_random_model(config, torch.float32 if a.impl == "fsdp2" else dtype)
    res["build_s"] = round(time.perf_counter() - t0, 1)
    if a.lora:
        model = _lora(model, a.lora)
    res["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    res["trained_M"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 1)
    flops_token = flops_per_token(model, a.seq, attention_dims(config))
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=g) for _ in range(2)]
    losses: list[float] = []
    try:
        t0 = time.perf_counter()
        if a.impl == "ours":
            it, fin = _ours(model, a, dtype, res)
        elif a.impl == "upstream":
            it, fin = _upstream(model, a)
        elif a.impl == "fsdp2":
            it, fin = _fsdp2(model, a, dtype)
        else:
            raise ValueError(f"--model hf runs ours, upstream or fsdp2, not {a.impl!r}")
        res["setup_s"] = round(time.perf_counter() - t0, 1)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses.append(it(data[0]))
        fin()
        res["first_iter_s"] = round(time.perf_counter() - t0, 2)
        for i in range(1, a.warmup):
            losses.append(it(data[i % len(data)]))
        fin()
        t0 = time.perf_counter()
        for i in range(a.iters):
            losses.append(it(data[(a.warmup + i) % len(data)]))
        fin()
        dt = time.perf_counter() - t0
    except Exception as exc:  # one line says what failed, the traceback goes to stderr
        import traceback

        traceback.print_exc()
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        dt = 0.0
    tokens = a.batch * a.seq
    res["tok_s"] = round(a.iters * tokens / dt, 1) if dt else 0.0
    res["s_per_iter"] = round(dt / a.iters, 3) if dt else None
    res["gpu_peak_GB"] = round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else 0
    res["host_rss_GB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    res["loss_first"] = round(losses[0], 4) if losses else None
    res["loss_last"] = round(losses[-1], 4) if losses else None
    print(json.dumps(finish(res, flops_token)), flush=True)
    if "error" in res:
        sys.exit(1)


def _time_build(args: argparse.Namespace) -> None:
    """Prints one JSON line: the build's wall and CPU seconds (transformers imported first)
    and the process's peak RSS."""
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = load_config(args.config)
    wall, cpu = time.perf_counter(), time.process_time()
    if args.own_init:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = build_random_model(config, dtype)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    print(
        json.dumps(
            dict(
                model=Path(args.config).stem,
                how="from_config" if args.own_init else "build_random_model",
                params_B=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
                weights_GiB=round(sum(weights.values()) / GiB, 2),
                build_s=round(wall, 1),
                cpu_s=round(cpu, 1),
                rss_peak_GiB=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                threads=torch.get_num_threads(),
            )
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    layers = sub.add_parser("layers", help="write CONFIG with N decoder layers to OUT")
    layers.add_argument("config")
    layers.add_argument("n", type=int)
    layers.add_argument("out")
    run = sub.add_parser(
        "run", help="one contender of --model hf without the harness (as the harness runs it)"
    )
    run.add_argument("--impl", required=True, choices=["ours", "upstream", "fsdp2"])
    run.add_argument("--layers", type=int)
    for name, default in (("seq", 1024), ("batch", 16), ("mb", 4), ("warmup", 2), ("iters", 6)):
        run.add_argument(f"--{name}", type=int, default=default)
    add_arguments(run)
    build = sub.add_parser("build", help="time building CONFIG's model with random weights")
    build.add_argument("config")
    build.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    build.add_argument(
        "--own-init",
        action="store_true",
        help="transformers' own from_config (an initialisation per element), to compare",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        apply_cap()
        run_hf(args)
        return 0
    if args.command == "build":
        _time_build(args)
        return 0
    raw = json.loads(Path(args.config).read_text())
    raw["num_hidden_layers"] = args.n
    if "max_window_layers" in raw:
        raw["max_window_layers"] = args.n
    Path(args.out).write_text(json.dumps(raw, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
