"""A HuggingFace Llama trained through ``roundpipe.hf.wrap`` against plain transformers with
gradient checkpointing: tokens/s and peak device memory, on the CPU and on the emulated device,
in one run, as ratios.

    python benchmarks/bench_hf.py                   # defaults: 4 layers, hidden 256, seq 256
    python benchmarks/bench_hf.py --devices cpu --iters 10

Plain: fp32 weights with ``torch.autocast`` in bf16, ``gradient_checkpointing_enable()``,
``torch.optim.AdamW``, the whole model on the device. roundpipe: the same model in bf16 with fp32
masters, ``roundpipe.optim.AdamW`` on the optimizer thread, each layer's weights streamed
through the device (on ``emu``) or computed in place (``cpu``). Both compute in bf16.

On the CPU there is no device memory to compare (both compute in host memory) and roundpipe
streams nothing, so the ratio there is the runtime's overhead; on the emulated device, kernels
run on the host one Python call per op, so its tokens/s says little and its peak memory is
exact. A GPU run of the same comparison is the side-by-side harness (benchmarks/peer_setup.py).
"""

import argparse
import gc
import os
import statistics
import sys
import time

import torch


def build(args, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def batches(args):
    g = torch.Generator().manual_seed(1)
    for _ in range(args.warmup + args.iters):
        ids = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def peak_reset(device):
    """Device memory in use now (after resetting the peak); 0 on the CPU."""
    gc.collect()
    if device == "cpu":
        return 0
    memory = torch.get_device_module(torch.device(device).type)
    index = torch.device(device).index or 0
    memory.reset_peak_memory_stats(index)
    return memory.memory_allocated(index)


def peak_read(device, base):
    """The peak device memory since :func:`peak_reset`, above ``base``; None on the CPU."""
    if device == "cpu":
        return None
    memory = torch.get_device_module(torch.device(device).type)
    return memory.max_memory_allocated(torch.device(device).index or 0) - base


def run_plain(args, device):
    model = build(args, torch.float32).to(device)
    # transformers 5.24 renamed it; older versions have only the first name
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    base = peak_reset(device)
    for i, batch in enumerate(batches(args)):
        start = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, peak_read(device, base), losses


def run_roundpipe(args, device):
    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipeRunConfig

    model = roundpipe.hf.wrap(
        build(args, torch.bfloat16),
        optim_dtype=torch.float32,
        devices=device,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    base = peak_reset(device)
    for i, batch in enumerate(batches(args)):
        start = time.perf_counter()
        loss = model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    model.synchronize()
    return times, peak_read(device, base), losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices", nargs="+", default=["cpu", "emu"], help="cpu, emu and/or cuda:0"
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--microbatches", type=int, default=2, help="roundpipe's (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="iterations not timed (default 2)")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations (default 6)")
    args = parser.parse_args()
    if any(d.startswith("emu") for d in args.devices):
        from roundpipe.testing import emu

        emu.install()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; "
        f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch "
        f"{args.batch} x {args.seq} tokens; command: python benchmarks/bench_hf.py "
        f"{' '.join(sys.argv[1:])}"
    )
    tokens = args.batch * args.seq
    for device in args.devices:
        plain_t, plain_peak, _ = run_plain(args, device)
        ours_t, ours_peak, _ = run_roundpipe(args, device)
        plain_tps = tokens / statistics.median(plain_t)
        ours_tps = tokens / statistics.median(ours_t)
        print(f"{device}:")
        print(f"  plain transformers + checkpointing  {plain_tps:9.1f} tokens/s", end="")
        print(f"   peak {plain_peak / 2**20:.1f} MiB" if plain_peak is not None else "")
        print(f"  roundpipe.hf.wrap                   {ours_tps:9.1f} tokens/s", end="")
        print(f"   peak {ours_peak / 2**20:.1f} MiB" if ours_peak is not None else "")
        line = f"  roundpipe / plain                   {ours_tps / plain_tps:9.2f}x tokens/s"
        if plain_peak and ours_peak:
            line += f"   {ours_peak / plain_peak:.2f}x peak device memory"
        print(line, flush=True)


if __name__ == "__main__":
    main()
