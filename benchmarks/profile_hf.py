"""Where a ``roundpipe.hf.wrap`` iteration's time goes on a GPU: a HuggingFace Qwen3 at
Qwen3-1.7B's shape (random weights, ``--layers`` decoder layers), trained by the HF loop of
docs/hf.md at wrap's defaults, timed, then two iterations under torch.profiler.

    python benchmarks/profile_hf.py --layers 8 --out DIR       # on a CUDA machine
    python benchmarks/profile_hf.py --devices emu --out DIR    # tests the script (tiny sizes)

Printed, in order:

1. ``measured``: seconds per iteration over --iters iterations after --warmup, between two
   ``synchronize()`` calls (the step overlapping the next iteration, as in a run).
2. ``forward_backward alone``: one ``forward_backward`` with no step in flight (the devices'
   share), and ``step alone``: one synchronous step (the optimizer thread's share: the fused
   Adam and the master->model copy). The iteration is bound by the larger of the two when
   they overlap perfectly; ``overlapped`` prices them with the host contention of
   :data:`roundpipe.plan.HOST_CONTENTION` and prints the contention the measured iteration
   shows. Then the peak GPU memory beside the memory plan's.
3. The profile of two iterations and the last step: device time by kind, each host thread's
   time in top-level ops, and a table of roundpipe's own actions (``roundpipe forward stage
   3``: the host time of that stage's forwards summed over the microbatches, and the device
   time of what the worker launched inside them), then torch's tables of the top operators.

Writes ``trace.json.gz`` under --out (open it in Perfetto). ``--loss-chunk-tokens``,
``--mlp-tile-tokens`` and ``--compile`` (default/on/off) pass through to wrap, ``--overlap-recompute`` sets the
run config's, and ``--switch-interval`` the interpreter's thread switch interval, so two runs
compare a setting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_gpu import (  # noqa: E402
    _device_time,
    pool_and_sizes,
    profile_steady_state,
    profile_summary,
)

import roundpipe  # noqa: E402
from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig  # noqa: E402
from roundpipe.plan import HOST_CONTENTION, contention_shown, overlapped  # noqa: E402

# Qwen3-1.7B's published shape; the sequence, batch and microbatches of the GPU harness.
GPU_SIZES = dict(layers=8, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128)
GPU_SIZES.update(vocab=151936, seq=1024, batch=16)
TINY_SIZES = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)
TINY_SIZES.update(vocab=512, seq=32, batch=4)


def build(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(args.seq, 128),
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to({"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype])


def compiled_summary() -> str:
    """What torch.compile did in this process: graphs, graph breaks by reason, recompiles."""
    from torch._dynamo.utils import counters

    stats = dict(counters["stats"])
    if not stats:
        return "none (eager)"
    breaks = {k.splitlines()[0][:120]: v for k, v in counters["graph_break"].items()}
    return f"{stats}; graph breaks {breaks or 'none'}; frames {dict(counters['frames'])}"


def action_table(prof) -> str:
    """roundpipe's own actions (the executor's labels): calls, host and device seconds."""
    rows = [e for e in prof.key_averages() if e.key.startswith("roundpipe ")]
    rows.sort(key=lambda e: -e.cpu_time_total)
    lines = [f"  {'action':<36} {'calls':>6} {'host s':>9} {'device s':>9}"]
    for e in rows:
        lines.append(
            f"  {e.key:<36} {e.count:>6} {e.cpu_time_total / 1e6:>9.4f} "
            f"{_device_time(e) / 1e6:>9.4f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in GPU_SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--loss-chunk-tokens", type=int, help="wrap's (default: its own)")
    parser.add_argument("--mlp-tile-tokens", type=int, help="wrap's (default: its own)")
    parser.add_argument(
        "--overlap-recompute",
        action="store_true",
        help="RoundPipeRunConfig(overlap_recompute=True): the next microbatch's recompute on "
        "the device's helper thread while autograd's thread issues this one's backward",
    )
    parser.add_argument(
        "--compile",
        choices=["default", "on", "off"],
        default="default",
        help="roundpipe.hf.wrap(compile=None/True/False): the decoder layers through "
        "torch.compile (the default: on CUDA with Triton)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval(SECONDS) first (CPython's default: 0.005)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        help="first time the iteration with the optimizer thread on each of these thread counts "
        "(roundpipe.optim_thread.set_num_threads), in this order; then back to the default",
    )
    parser.add_argument("--no-profile", action="store_true", help="time only")
    parser.add_argument("--devices", help="roundpipe's pool (default: cuda:0 if CUDA is there)")
    parser.add_argument("--out", default="profile_hf_out", help="folder for the trace")
    args = parser.parse_args()

    spec = pool_and_sizes(args, GPU_SIZES, TINY_SIZES)
    if spec is None:
        print("No GPU: CUDA is not available; --devices emu (or cpu) tests the script.")
        return 0
    on_gpu = spec.startswith("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    M = args.microbatches
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    t0 = time.perf_counter()
    hf_model = build(args)
    n_params = sum(p.numel() for p in hf_model.parameters())
    model = roundpipe.hf.wrap(
        hf_model,
        optim_dtype=torch.float32,
        devices=spec,
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_tile_tokens=args.mlp_tile_tokens,
        compile={"default": None, "on": True, "off": False}[args.compile],
        model_run_config=RoundPipeRunConfig(
            num_microbatch=M, overlap_recompute=args.overlap_recompute or None
        ),
    )
    print(
        f"torch {torch.__version__}; pool {spec}; Qwen3 {args.layers} layers, hidden "
        f"{args.hidden}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, {M} "
        f"microbatches, {n_params / 1e6:.1f}M params ({args.dtype}); loss chunk "
        f"{args.loss_chunk_tokens or 'default'}, MLP tile {args.mlp_tile_tokens or 'default'}, "
        f"overlap_recompute {args.overlap_recompute}, compile {args.compile}, switch "
        f"interval {sys.getswitchinterval()} s; "
        f"built and wrapped in {time.perf_counter() - t0:.1f} s"
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-5)
    scaler = GradScaler()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def forward_backward():
        return model.forward_backward(input_kwargs=batch, loss_fn=lambda l, _: scaler.scale(l))

    def step(is_async=True):
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=is_async)
        scaler.update()

    def iteration():
        forward_backward()
        step()

    def timed() -> float:
        """Seconds per iteration over --iters after --warmup."""
        for _ in range(args.warmup):
            iteration()
        model.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            iteration()
        model.synchronize()
        return (time.perf_counter() - t0) / args.iters

    tokens = args.batch * args.seq
    default_threads = roundpipe.optim_thread.get_num_threads()
    for count in args.threads or ():
        roundpipe.optim_thread.set_num_threads(count)
        seconds = timed()
        print(
            f"optimizer thread on {count} threads: {seconds:.4f} s/iteration "
            f"({tokens / seconds:,.0f} tokens/s)"
        )
    if args.threads:
        roundpipe.optim_thread.set_num_threads(default_threads)
    t0 = time.perf_counter()
    iteration()
    model.synchronize()
    print(f"first iteration (compiles, if --compile): {time.perf_counter() - t0:.1f} s")
    measured = timed()

    t0 = time.perf_counter()
    forward_backward()
    fb_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(is_async=False)
    step_s = time.perf_counter() - t0
    print(f"measured: {measured:.4f} s/iteration ({tokens / measured:,.0f} tokens/s)")
    print(f"compiled decoder layers: {compiled_summary()}")
    print(
        f"forward_backward alone: {fb_s:.4f} s; step alone (synchronous, with the copy): "
        f"{step_s:.4f} s; optimizer thread's threads "
        f"{roundpipe.optim_thread.get_num_threads()} of {torch.get_num_threads()}"
    )
    # The two overlapped on one host (see [Note: pricing] in roundpipe/plan/price.py).
    priced = overlapped(fb_s, step_s, HOST_CONTENTION)
    shown = contention_shown(measured, fb_s, step_s)
    print(
        f"overlapped: {priced:.4f} s/iteration at the price's contention {HOST_CONTENTION} "
        f"(measured/that {measured / priced:.2f}); the contention measured: "
        f"{'not shown (one side under a tenth of the other)' if shown is None else round(shown, 2)}"
    )
    if on_gpu:
        planned = model.memory_plan(input_kwargs=batch).devices[0].peak
        print(
            f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB measured, "
            f"{planned / 2**30:.2f} GiB planned (model.memory_plan)"
        )
    if args.no_profile:
        return 0

    prof, wall = profile_steady_state(iteration, model.synchronize, on_gpu, out_dir)
    print("roundpipe's actions over the profiled iterations:")
    print(action_table(prof))
    print(profile_summary(prof, wall))
    print(f"wrote {out_dir / 'trace.json.gz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
