"""Data parallelism: what the gradient average costs per step and how much of it the async step
hides, on processes of this machine (gloo over 127.0.0.1); and the state sharded over the ranks
(``ShardedState``): its iteration time against the replicated run's, and each rank's host RSS
against the plan.

Each configuration runs as its own set of processes, one after the other:

* ``1 process``: the loop without DataParallel (the per-rank work of the others, alone);
* ``N ranks, sync``: ``model.step(fn, is_async=False)``, the all-reduce on the critical path;
* ``N ranks, async``: ``model.step(fn)``, the all-reduce overlapping the next iteration;
* ``N ranks, sharded, sync|async``: the same with ``state_placement=ShardedState()``: the
  gradients reduced onto their owners, the weights broadcast in the master->model copy.

Every rank runs the same per-rank batch, so a perfect data-parallel run takes the time of
``1 process`` per iteration. Printed: the median iteration time on rank 0 (main thread), its
ratio to ``1 process``, and the median time of the gradient reduction on the optimizer thread.
The replicated and sharded configurations alternate, ``--rounds`` times; each cell is the
median over the rounds of the per-round medians.

``--memory``: a transformers Llama of ``--memory-layers`` decoder layers (fp16 weights, fp32
masters, Adam), trained a few steps by each of replicated and sharded ranks; printed per rank:
host RSS added by the model and its training (VmRSS after training, less VmRSS before the model
was built, free heap trimmed) per parameter, the peak (VmHWM, restarted after the model's
initialisation) likewise, against the ideal (2 + 16/N bytes per parameter sharded, 18
replicated) and the plan's prediction (``python -m roundpipe plan CONFIG --ranks N``, whose host
total this calls ``plan_config`` for).

    python benchmarks/bench_distributed.py [--ranks 2] [--layers 8] [--width 1024] [--iters 30]
    python benchmarks/bench_distributed.py --memory [--ranks 2]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(cfg):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from roundpipe import distributed as rpd

    torch.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.Tanh()]
    if cfg["dp"]:
        rpd.init_process_group("gloo", timeout=120)
    model = RoundPipe(
        nn.Sequential(*layers),
        optim_dtype=torch.float32,
        devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        state_placement=rpd.ShardedState() if cfg.get("shard") else None,
    )
    reduce_times = []
    if cfg["dp"]:
        # Step pre-hooks run in registration order: DataParallel's gradient average between
        # these two.
        started = []
        model.register_step_pre_hook(lambda: started.append(time.perf_counter()))
        dp = rpd.DataParallel(model)
        model.register_step_pre_hook(
            lambda: reduce_times.append(time.perf_counter() - started.pop())
        )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(cfg["batch"], cfg["width"])
    target = torch.randn(cfg["batch"], cfg["width"])
    times = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        t0 = time.perf_counter()
        model.forward_backward(
            input_args=(x,), label=target, loss_fn=lambda out, y: F.mse_loss(out, y) / 2
        )
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=cfg["async"])
        if it >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    model.synchronize()
    if cfg["dp"]:
        dp.close()
        torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        skip = cfg["warmup"]
        print(
            json.dumps(
                {
                    "iteration_ms": 1e3 * statistics.median(times),
                    "reduce_ms": 1e3 * statistics.median(reduce_times[skip:])
                    if reduce_times
                    else None,
                }
            )
        )


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim():
    """Return the heap's free memory to the OS (glibc's malloc_trim), so RSS counts live data."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_worker(cfg):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipeRunConfig
    from roundpipe import distributed as rpd

    rpd.init_process_group("gloo", timeout=600)
    before = _status_bytes("VmRSS")
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(Path(cfg["config"]).read_text()))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    numel = sum(p.numel() for p in hf.parameters())
    # The model's initialisation (in fp32, then cast) leaves freed heap behind: hand it back
    # to the OS and restart the peak (Linux: clear_refs 5 resets VmHWM), so that what follows
    # counts the weights, the wrap and the training only.
    _trim()
    weights = _status_bytes("VmRSS") - before
    Path("/proc/self/clear_refs").write_text("5")
    model = roundpipe.hf.wrap(
        hf,
        optim_dtype=torch.float32,
        devices="cpu",
        check=False,
        memory_check=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
        state_placement=rpd.ShardedState() if cfg["shard"] else None,
    )
    dp = rpd.DataParallel(model)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (1, cfg["seq_len"]))
    batch = {"input_ids": ids, "labels": ids}
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        times.append(time.perf_counter() - t0)
    model.synchronize()
    peak = _status_bytes("VmHWM") - before
    _trim()
    rss = _status_bytes("VmRSS") - before
    dp.close()
    torch.distributed.destroy_process_group()
    print(
        json.dumps(
            {
                "rank": int(os.environ["RANK"]),
                "numel": numel,
                "weights": weights,
                "rss": rss,
                "peak": peak,
                "iteration_s": statistics.median(times[1:] or times),
            }
        )
    )


def memory(args):
    import torch

    from roundpipe.hf.memory_cli import plan_config

    spec = {
        "vocab_size": 16000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": args.memory_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "roundpipe_bench_distributed"
    out.mkdir(exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({**spec, "model_type": "llama"}))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; Llama config {json.dumps(spec)}; "
        f"fp16 weights, fp32 masters, Adam; seq len {args.seq_len}, {args.memory_steps} steps"
    )
    print(
        "| ranks | state | rank | params | weights (B/param) | RSS after training (B/param) "
        "| peak RSS (B/param) | plan (B/param) | ideal | iteration (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    n = args.ranks
    for shard in (False, True):
        plan = plan_config(
            str(config), seq_len=args.seq_len, dtype=torch.float16, ranks=n if shard else 1
        )
        cfg = {
            "memory": True,
            "shard": shard,
            "config": str(config),
            "seq_len": args.seq_len,
            "steps": args.memory_steps,
            "threads": args.threads,
        }
        for r in launch(n, cfg, all_ranks=True):
            numel = r["numel"]
            ideal = 2 + 16 / n if shard else 18
            print(
                f"| {n} | {'sharded' if shard else 'replicated'} | {r['rank']} | "
                f"{numel / 1e6:.1f}M | {r['weights'] / numel:.2f} | {r['rss'] / numel:.2f} | "
                f"{r['peak'] / numel:.2f} | "
                f"{plan.host.total / numel:.2f} | {ideal:.2f} | {r['iteration_s']:.2f} |",
                flush=True,
            )
    print(
        f"plan command: python -m roundpipe plan {config} --seq-len {args.seq_len} "
        f"--dtype fp16 --ranks {n}"
    )


def launch(world, cfg, all_ranks=False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS=str(cfg["threads"]),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(cfg)],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    if all_ranks:
        return [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the contenders")
    parser.add_argument("--memory", action="store_true", help="host RSS per rank (see above)")
    parser.add_argument("--memory-layers", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        memory_worker(cfg) if cfg.get("memory") else worker(cfg)
        return
    if args.memory:
        memory(args)
        return
    import torch

    base = {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "iters": args.iters,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {args.threads} thread(s) per "
        f"process, {params / 1e6:.1f}M fp32 params ({params * 4 / 2**20:.0f} MiB of gradients), "
        f"per-rank batch {args.batch}, {args.iters} iterations"
    )
    n = args.ranks
    rows = [
        ("1 process", 1, {**base, "dp": False, "async": True}),
        (f"{n} ranks, sync", n, {**base, "dp": True, "async": False}),
        (f"{n} ranks, sharded, sync", n, {**base, "dp": True, "async": False, "shard": True}),
        (f"{n} ranks, async", n, {**base, "dp": True, "async": True}),
        (f"{n} ranks, sharded, async", n, {**base, "dp": True, "async": True, "shard": True}),
    ]
    results: dict[str, list] = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):  # the contenders alternate
        for name, world, cfg in rows:
            results[name].append(launch(world, cfg))
    print("| configuration | iteration (ms) | ratio to 1 process | reduction per step (ms) |")
    print("|---|---|---|---|")
    baseline = statistics.median(r["iteration_ms"] for r in results["1 process"])
    for name, _, _ in rows:
        it = statistics.median(r["iteration_ms"] for r in results[name])
        reduces = [r["reduce_ms"] for r in results[name] if r["reduce_ms"] is not None]
        reduce = f"{statistics.median(reduces):.1f}" if reduces else "-"
        print(f"| {name} | {it:.1f} | {it / baseline:.2f} | {reduce} |", flush=True)


if __name__ == "__main__":
    main()
