"""RoundPipe runtime benchmarks: printed ratios against baselines measured in the same run.

(a) async against sync iteration time when the step costs as much as ``forward_backward``
    (the step runs a real Adam step, then waits on an Event until it has taken as long as the
    measured ``forward_backward``: an optimizer step that costs time but not this machine's two
    cores, as one running elsewhere would), and the share of the iteration the main thread
    spends in ``scaler.update()``. Targets: <= 0.55 and <= 1%.
(b) overhead of ``forward_backward`` on one CPU worker against plain PyTorch running the same
    microbatches with ``torch.utils.checkpoint`` per stage and ``backward()``. Target <= 1.05.
(d) the same two, each alone in a fresh process (as a user runs one of them), processes
    alternating; catches what sharing one process hides (e.g. OpenMP thread teams).
(e) the fixed cost per call behind (b): the same stages at width 16, where compute is
    negligible, in microseconds per stage and microbatch, for one worker and for two.
(c) peak memory (VmHWM) per parameter of a ~300M-parameter fp16 model with fp32 Adam masters,
    in a subprocess, against the 18 bytes/param the state itself needs
    (2 fp16 param + 4 fp32 master + 4 fp32 grad + 8 Adam moments).

    python benchmarks/bench_runtime.py [--part a,b,d,e,c] [--iters 20]
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig


def mlp(width, depth, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 16))
    return nn.Sequential(*layers).to(dtype)


def loss_of(out, y):
    return F.cross_entropy(out.float(), y)


# -- (a) ----------------------------------------------------------------------------------------


def part_a(args):
    width, depth, batch, M = 768, 6, 256, 4
    x = torch.randn(batch, width)
    y = torch.randint(0, 16, (batch,))
    cfg = RoundPipeRunConfig(num_microbatch=M)

    def build():
        model = RoundPipe(mlp(width, depth, torch.bfloat16), devices="cpu", model_run_config=cfg)
        with OptimizerCtx():
            opt = roundpipe.optim.Adam(model.parameters(), lr=1e-4)
        return model, opt, GradScaler()

    # Measure forward_backward alone (with its gradient moves), after a warm-up.
    model, opt, scaler = build()
    fb = []
    for _ in range(args.iters // 2 + 3):
        t0 = time.perf_counter()
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(loss_of(o, l)) / M
        )
        fb.append(time.perf_counter() - t0)
        model.step(lambda: opt.zero_grad(), is_async=False)
    t_fb = statistics.median(fb[3:])

    # Sync and async blocks alternate on one model (the scaler follows: update() is sync after a
    # waited step, async after a launched one), so that load from other processes on the machine
    # hits both alike. The first iteration of a block is a transition and is not counted.
    model, opt, scaler = build()
    idle = threading.Event()  # never set: wait(timeout) is a step that costs wall time only

    def step_fn():
        t0 = time.perf_counter()
        scaler.step(opt)
        opt.zero_grad()
        idle.wait(max(0.0, t_fb - (time.perf_counter() - t0)))

    times = {False: [], True: []}
    in_update, async_total = 0.0, 0.0
    for _ in range(args.iters // 4):
        for is_async in (False, True):
            for i in range(5):
                t0 = time.perf_counter()
                model.forward_backward(
                    input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(loss_of(o, l)) / M
                )
                model.step(step_fn, is_async=is_async)
                t1 = time.perf_counter()
                scaler.update()
                t2 = time.perf_counter()
                if i > 0:
                    times[is_async].append(t2 - t0)
                    if is_async:
                        in_update += t2 - t1
                        async_total += t2 - t0
    model.synchronize()
    t_sync, t_async = statistics.median(times[False]), statistics.median(times[True])
    best = min(times[True]) / min(times[False])
    update_share = in_update / async_total
    n_params = sum(p.numel() for p in model.optim_parameters())
    print(
        f"(a) bf16 MLP {n_params / 1e6:.1f}M params, batch {batch}, {M} microbatches, 1 CPU "
        f"worker, roundpipe.optim.Adam + GradScaler, step padded to forward_backward time"
    )
    print(f"    forward_backward alone      {t_fb * 1e3:8.1f} ms")
    print(f"    sync iteration              {t_sync * 1e3:8.1f} ms")
    print(f"    async iteration             {t_async * 1e3:8.1f} ms")
    print(
        f"    async / sync                {t_async / t_sync:8.3f}   (target <= 0.55; medians; "
        f"ratio of minima {best:.3f})"
    )
    print(
        f"    main thread in update()     {update_share * 100:8.3f} % of the async iteration "
        f"(target <= 1%)"
    )


# -- (b) ----------------------------------------------------------------------------------------


_B_SHAPE = dict(width=1024, depth=8, batch=256, M=4)


def _b_iterations(devices="cpu", **shape):
    """The two iterations (b), (d) and (e) compare: plain PyTorch with checkpoint per stage, and
    RoundPipe's forward_backward, on equal models and data (``_B_SHAPE``, or ``shape``)."""
    shape = {**_B_SHAPE, **shape}
    width, depth, batch, M = (shape[k] for k in ("width", "depth", "batch", "M"))
    x = torch.randn(batch, width)
    y = torch.randint(0, 16, (batch,))

    plain = mlp(width, depth)
    stages = list(plain.children())

    def plain_iteration():
        for xm, ym in zip(torch.tensor_split(x, M), torch.tensor_split(y, M)):
            h = xm
            for i, stage in enumerate(stages):
                h = checkpoint(stage, h, use_reentrant=False) if i < len(stages) - 1 else stage(h)
            (loss_of(h, ym) / M).backward()
        for p in plain.parameters():
            p.grad = None

    model = RoundPipe(
        mlp(width, depth), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=M)
    )

    def rp_iteration():
        model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, l: loss_of(o, l) / M)
        for m in model.optim_parameters():  # as plain's p.grad = None (optimizer thread is idle)
            m.grad = None

    n_params = sum(p.numel() for p in plain.parameters())
    return plain_iteration, rp_iteration, n_params, len(stages)


def _alternate(plain_iteration, rp_iteration, iters, warmup):
    """Run the two one iteration each in turn; per variant, the wall and the process CPU times
    (all threads) of every iteration."""
    times = ([], []), ([], [])
    for fn in (plain_iteration, rp_iteration) * warmup:
        fn()
    for _ in range(iters):
        for fn, (wall, cpu) in zip((plain_iteration, rp_iteration), times):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return times


def part_b(args):
    plain_iteration, rp_iteration, n_params, n_stages = _b_iterations()
    batch, M = _B_SHAPE["batch"], _B_SHAPE["M"]

    # The two run alternately, one iteration each, so that load from other processes on the
    # machine hits both alike; the minimum estimates the cost without that load.
    # Wall time, and CPU time of the whole process (all threads): on a shared VM the wall
    # time also measures how much of the two cores the hypervisor lent us, the CPU time only
    # the work done.
    (tp, cp), (tr, cr) = _alternate(plain_iteration, rp_iteration, args.iters, warmup=2)
    t_plain, t_rp = min(tp), min(tr)
    med = statistics.median(tr) / statistics.median(tp)
    # Each RoundPipe iteration against the plain one just before it: the two of a pair ran
    # under the same load, so the median of these ratios is the least noisy estimate.
    paired = statistics.median(r / p for r, p in zip(tr, tp))
    q = statistics.quantiles([r / p for r, p in zip(tr, tp)], n=4)
    cpu = statistics.median(cr) / statistics.median(cp)
    print(
        f"(b) fp32 MLP {n_params / 1e6:.1f}M params, {n_stages} stages, batch {batch}, "
        f"{M} microbatches, one CPU worker"
    )
    print(f"    plain PyTorch + checkpoint  {t_plain * 1e3:8.1f} ms")
    print(f"    RoundPipe forward_backward  {t_rp * 1e3:8.1f} ms   (grads into the masters)")
    print(
        f"    RoundPipe / plain           {paired:8.3f}   (target <= 1.05; median of {args.iters} "
        f"paired runs, quartiles {q[0]:.3f}-{q[2]:.3f}; ratio of minima {t_rp / t_plain:.3f}, "
        f"of medians {med:.3f})"
    )
    print(
        f"    CPU time (all threads)      {statistics.median(cp) * 1e3:8.1f} ms plain, "
        f"{statistics.median(cr) * 1e3:.1f} ms RoundPipe: ratio {cpu:.3f} (medians)"
    )


# -- (d) ----------------------------------------------------------------------------------------


def _d_child(which, iters):
    """One variant of (b) alone in this process: median wall and CPU time of ``iters``."""
    plain_iteration, rp_iteration, _, _ = _b_iterations()
    fn = plain_iteration if which == "plain" else rp_iteration
    for _ in range(3):
        fn()
    wall, cpu = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / iters
    print(statistics.median(wall), statistics.median(cpu), faults)


def part_d(args):
    """(b) as a user runs it: each variant alone in a fresh process, the two alternating."""
    rounds, iters = max(3, args.iters // 4), 12
    runs = {"plain": [], "roundpipe": []}
    for _ in range(rounds):
        for which in runs:
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    which,
                    "--iters",
                    str(iters),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            runs[which].append([float(v) for v in out])
    wall = [r[0] / p[0] for p, r in zip(runs["plain"], runs["roundpipe"])]
    cpu = [r[1] / p[1] for p, r in zip(runs["plain"], runs["roundpipe"])]
    print(
        f"(d) as (b), each variant alone in its own process, {rounds} alternating pairs of "
        f"processes, {iters} iterations each"
    )
    for which, name in (
        ("plain", "plain PyTorch + checkpoint"),
        ("roundpipe", "RoundPipe forward_backward"),
    ):
        print(
            f"    {name:27s} {statistics.median(r[0] for r in runs[which]) * 1e3:8.1f} ms   "
            f"({statistics.median(r[2] for r in runs[which]):.0f} page faults/iteration)"
        )
    print(
        f"    RoundPipe / plain           {statistics.median(wall):8.3f}   (target <= 1.05; "
        f"median of the pairs' medians, range {min(wall):.3f}-{max(wall):.3f}); CPU time "
        f"{statistics.median(cpu):.3f}"
    )


# -- (e) ----------------------------------------------------------------------------------------


def part_e(args):
    """(b)'s 17 stages and 4 microbatches at width 16: compute is negligible, so the difference
    is RoundPipe's fixed cost per call, which (b) at full width cannot resolve on a noisy machine."""
    iters = 10 * args.iters
    print(f"(e) fixed cost: (b) at width 16, batch 16, {iters} paired iterations (medians)")
    for devices, what in (("cpu", "one worker (fused plan)"), ("cpu:2", "two workers")):
        plain_iteration, rp_iteration, _, n_stages = _b_iterations(devices, width=16, batch=16)
        (tp, _), (tr, _) = _alternate(plain_iteration, rp_iteration, iters, warmup=5)
        p, r = statistics.median(tp), statistics.median(tr)
        per = (r - p) / (n_stages * _B_SHAPE["M"])
        print(
            f"    {what:24s} plain {p * 1e3:6.2f} ms, RoundPipe {r * 1e3:6.2f} ms: "
            f"{per * 1e6:+6.1f} us per stage and microbatch"
        )


# -- (c) ----------------------------------------------------------------------------------------

_MEM_CHILD = r"""
import sys, torch, torch.nn.functional as F
from torch import nn
import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield line.split()[0][:-1], int(line.split()[1]) * 1024

base = dict(hwm())["VmRSS"]
width, depth = 4096, 18
layers = []
for _ in range(depth):
    lin = nn.Linear(width, width, dtype=torch.float16)
    layers += [lin, nn.ReLU()]
torch.manual_seed(0)
with torch.no_grad():
    for m in layers:
        if isinstance(m, nn.Linear):
            m.weight.uniform_(-0.01, 0.01); m.bias.zero_()
seq = nn.Sequential(*layers)
n = sum(p.numel() for p in seq.parameters())
model = RoundPipe(seq, optim_dtype=torch.float32, devices="cpu",
                  model_run_config=RoundPipeRunConfig(num_microbatch=2))
with OptimizerCtx():
    opt = roundpipe.optim.Adam(model.parameters(), lr=1e-5)
x = torch.randn(2, width)
for _ in range(int(sys.argv[1])):
    model.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.float().pow(2).mean())
    model.step(lambda: (opt.step(), opt.zero_grad()))
model.synchronize()
d = dict(hwm())
print(n, base, d["VmHWM"])
"""


def part_c(args):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _MEM_CHILD, "3"], check=True, env=env, capture_output=True, text=True
    ).stdout.split()
    n, base, peak = int(out[0]), int(out[1]), int(out[2])
    print(
        f"(c) fp16 model of {n / 1e6:.1f}M params, fp32 masters, roundpipe.optim.Adam, 3 async "
        f"iterations, batch 2 ({time.perf_counter() - t0:.0f} s)"
    )
    print(f"    peak RSS (VmHWM)            {peak / 2**30:8.2f} GiB")
    print(f"    RSS before the model        {base / 2**30:8.2f} GiB (torch + python)")
    print(f"    (peak - before) / param     {(peak - base) / n:8.2f} bytes   (state needs 18)")
    print(f"    peak / param                {peak / n:8.2f} bytes")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="a,b,d,e,c")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--child", choices=["plain", "roundpipe"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _d_child(args.child, args.iters)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"{os.cpu_count()} CPUs"
    )
    for part in args.part.split(","):
        {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}[part.strip()](args)


if __name__ == "__main__":
    main()
