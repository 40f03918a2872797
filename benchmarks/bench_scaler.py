"""GradScaler benchmarks: printed ratios against baselines measured in the same run.

1. ``scaler.step(opt) + scaler.update()`` of roundpipe.GradScaler against torch.amp.GradScaler on
   the same fused-Adam work (default 16M fp32 parameters). Target ratio <= 1.05.
2. Time the main thread spends in ``update()`` while a step that takes ``--step-ms`` runs on the
   optimizer thread (async mode). Target: about zero.

    python benchmarks/bench_scaler.py [--numel 16000000] [--repeat 30] [--step-ms 100] [--plot PNG]

``--plot`` draws the main thread's time in ``update()`` per iteration, async against a loop that
waits for each step before updating (matplotlib needed).
"""

import argparse
import statistics
import threading
import time

import torch

from roundpipe import GradScaler, optim_thread


def _make_work(numel, chunks=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // chunks] * chunks
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1024.0 for n in sizes]
    return params, grads


def bench_step_update(scaler_factory, numel, repeat, warmup=3):
    params, grads = _make_work(numel)
    opt = torch.optim.Adam(params, lr=1e-4, fused=True)
    scaler = scaler_factory()
    scaler.scale(torch.ones(()))  # initialise the scale on the CPU
    times = []
    for i in range(warmup + repeat):
        for p, g in zip(params, grads):
            p.grad = g  # stands in for a backward pass; not timed
        start = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def bench_update_while_stepping(step_s, iters, wait_for_step=False):
    """Main-thread time inside update() while each launched step takes ``step_s`` seconds.

    ``wait_for_step``: the baseline that waits for the step before updating (what a scaler
    without a double buffer has to do); that wait is counted as time spent in the update."""
    scaler = GradScaler("cpu", init_scale=2.0**10)
    w = torch.nn.Parameter(torch.ones(16))
    opt = torch.optim.SGD([w], lr=0.0)
    in_update, iteration = [], []
    for _ in range(iters):
        it_start = time.perf_counter()
        grad = scaler.scale(torch.ones(16))
        done = threading.Event()

        def step(grad=grad, done=done):
            w.grad = grad
            scaler.step(opt)
            opt.zero_grad()
            done.wait(step_s)  # a step that costs step_s (e.g. a large optimizer on slow memory)

        optim_thread.launch(step)
        start = time.perf_counter()
        if wait_for_step:
            optim_thread.synchronize()
        scaler.update()
        in_update.append(time.perf_counter() - start)
        # The next iteration's compute would run here, overlapping the step; model it as the
        # same cost so the pipeline stays one step deep, as in a balanced training loop.
        time.sleep(step_s)
        iteration.append(time.perf_counter() - it_start)
    optim_thread.synchronize()
    return in_update, iteration


def _plot(path, step_ms, async_times, waiting_times):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([t * 1e3 for t in waiting_times], "o-", label="update() after waiting for the step")
    ax.plot([t * 1e3 for t in async_times], "o-", label="roundpipe.GradScaler, async update()")
    ax.set_xlabel("iteration")
    ax.set_ylabel("main thread in update (ms)")
    ax.set_title(f"while a {step_ms:.0f} ms step runs on the optimizer thread")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--plot", help="write a PNG of the main thread's time in update()")
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel / 1e6:.0f}M params, fused Adam"
    )
    # Interleave the two so drifting machine load affects both alike.
    ours, theirs = [], []
    for _ in range(3):
        theirs.append(
            bench_step_update(lambda: torch.amp.GradScaler("cpu"), args.numel, args.repeat // 3)
        )
        ours.append(bench_step_update(lambda: GradScaler("cpu"), args.numel, args.repeat // 3))
    t_torch, t_ours = min(theirs), min(ours)
    print("| scaler | step+update (ms) | ratio |")
    print("|---|---|---|")
    print(f"| torch.amp.GradScaler | {t_torch * 1e3:.2f} | 1.000 |")
    print(f"| roundpipe.GradScaler | {t_ours * 1e3:.2f} | {t_ours / t_torch:.3f} |")

    in_updates, iterations = bench_update_while_stepping(args.step_ms / 1e3, args.iters)
    in_update, iteration = statistics.median(in_updates), statistics.median(iterations)
    print()
    print(f"async update() while a {args.step_ms:.0f} ms step runs on the optimizer thread:")
    print(
        f"  main thread in update(): median {in_update * 1e6:.0f} us "
        f"= {in_update / iteration * 100:.3f}% of a {iteration * 1e3:.0f} ms iteration "
        f"(a waiting update would take ~{args.step_ms:.0f} ms)"
    )
    if args.plot:
        waiting, _ = bench_update_while_stepping(args.step_ms / 1e3, args.iters, wait_for_step=True)
        print(
            f"  waiting for the step first: median {statistics.median(waiting) * 1e3:.1f} ms in update()"
        )
        _plot(args.plot, args.step_ms, in_updates, waiting)
        print(f"  plot: {args.plot}")


if __name__ == "__main__":
    main()
