"""Data parallelism: what the gradient average costs per step and how much of it the async step
hides, on processes of this machine (gloo over 127.0.0.1).

Each configuration runs as its own set of processes, one after the other:

* ``1 process``: the loop without DataParallel (the per-rank work of the others, alone);
* ``N ranks, sync``: ``model.step(fn, is_async=False)``, the all-reduce on the critical path;
* ``N ranks, async``: ``model.step(fn)``, the all-reduce overlapping the next iteration.

Every rank runs the same per-rank batch, so a perfect data-parallel run takes the time of
``1 process`` per iteration. Printed: the median iteration time on rank 0 (main thread), its
ratio to ``1 process``, and the median time of the gradient all-reduce on the optimizer thread.

    python benchmarks/bench_distributed.py [--ranks 2] [--layers 8] [--width 1024] [--iters 30]
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
    model = RoundPipe(
        nn.Sequential(*layers),
        optim_dtype=torch.float32,
        devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    reduce_times = []
    if cfg["dp"]:
        rpd.init_process_group("gloo", timeout=120)
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


def launch(world, cfg):
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
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
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
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
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
    rows = [
        ("1 process", 1, {**base, "dp": False, "async": True}),
        (f"{args.ranks} ranks, sync", args.ranks, {**base, "dp": True, "async": False}),
        (f"{args.ranks} ranks, async", args.ranks, {**base, "dp": True, "async": True}),
    ]
    print("| configuration | iteration (ms) | ratio to 1 process | all-reduce per step (ms) |")
    print("|---|---|---|---|")
    baseline = None
    for name, world, cfg in rows:
        result = launch(world, cfg)
        baseline = baseline or result["iteration_ms"]
        reduce = "-" if result["reduce_ms"] is None else f"{result['reduce_ms']:.1f}"
        print(
            f"| {name} | {result['iteration_ms']:.1f} | {result['iteration_ms'] / baseline:.2f} "
            f"| {reduce} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
