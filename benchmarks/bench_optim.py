"""Time one Adam step on fp32 CPU master params: roundpipe.optim.Adam vs torch's fused and foreach.

    python benchmarks/bench_optim.py [--numel N] [--repeat R] [--tensors T] [--threads K] [--complex]

Adam is memory bound on CPU: a step reads param, grad, exp_avg, exp_avg_sq (16 B/param) and
writes param, exp_avg, exp_avg_sq (12 B/param), 28 B/param in all. The script measures a plain
large copy (``dst.copy_(src)``, 8 B/element) in the same run to get the machine's achievable
GB/s, and reports each optimizer's effective GB/s as a fraction of it. A copy's 8 B/element
undercount what the memory bus moves (writing ``dst`` first reads its cache lines), so the script
also times ``a.add_(b)``, which like Adam writes only what it has read (12 B/element). Ratios are
against torch fused measured in the same run; with ``--complex`` (complex64 params, which
torch's fused Adam refuses) they are against torch foreach. Timings are medians over ``--repeat`` steps, because the cores
may be shared; the minimum is printed too.

Memory: N params need 16 B each per optimizer (param, grad and two moments), so 1.6 GB at the
default 100M; optimizers run one at a time and are freed in between.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe.optim  # noqa: E402  (after the path tweak, so the checkout is benchmarked)

BYTES_PER_PARAM = 28  # read 4 x 4 B, write 3 x 4 B (fp32, no amsgrad)


def _split(numel: int, parts: int) -> list[int]:
    # Unequal sizes, like a model's layers, but summing exactly to numel.
    weights = [2 ** (i % 3) for i in range(parts)]
    sizes = [numel * w // sum(weights) for w in weights]
    sizes[0] += numel - sum(sizes)
    return sizes


def _time(fn, repeat: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _reference_bandwidths(numel: int, repeat: int) -> tuple[float, float]:
    """GB/s of ``dst.copy_(src)`` (8 B/elem) and of ``a.add_(b)`` (12 B/elem), medians."""
    a = torch.randn(numel)
    b = torch.randn(numel)
    copy_s = statistics.median(_time(lambda: a.copy_(b), repeat, warmup=2))
    add_s = statistics.median(_time(lambda: a.add_(b), repeat, warmup=2))
    del a, b
    gc.collect()
    return 8 * numel / copy_s / 1e9, 12 * numel / add_s / 1e9


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000, help="total params (default 100M)")
    parser.add_argument("--repeat", type=int, default=7, help="timed steps per optimizer (median)")
    parser.add_argument("--tensors", type=int, default=8, help="how many tensors the params are split into")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--complex", action="store_true",
                        help="complex64 params (numel/2 complex = numel fp32 numbers)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first allocates state)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {_cpu_name()}, "
          f"os.cpu_count()={os.cpu_count()}")
    print(f"# {args.numel:,} fp32 params in {args.tensors} tensors, median of {args.repeat} steps "
          f"after {args.warmup} warm-up steps")

    copy_gbps, add_gbps = _reference_bandwidths(args.numel, args.repeat)
    print(f"# dst.copy_(src) on {args.numel:,} fp32 (8 B/elem): {copy_gbps:.2f} GB/s; "
          f"a.add_(b) (12 B/elem, no write-allocate): {add_gbps:.2f} GB/s")

    gen = torch.Generator().manual_seed(0)
    dtype = torch.complex64 if args.complex else torch.float32
    # --numel counts fp32 numbers, so a complex run moves as many bytes as a real one.
    sizes = [n // 2 for n in _split(args.numel, args.tensors)] if args.complex else _split(args.numel, args.tensors)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype) * 1e-3

    candidates = [
        ("torch.optim.Adam(fused=True)", lambda: torch.optim.Adam(params, lr=1e-3, fused=True)),
        ("roundpipe.optim.Adam()", lambda: roundpipe.optim.Adam(params, lr=1e-3)),
        ("torch.optim.Adam(foreach=True)", lambda: torch.optim.Adam(params, lr=1e-3, foreach=True)),
    ]
    rows = []
    for name, make in candidates:
        opt = make()
        try:
            times = _time(opt.step, args.repeat, args.warmup)
        except RuntimeError as exc:  # torch's fused Adam refuses complex params
            rows.append((name, None, None, str(exc).split(":")[0]))
            continue
        finally:
            del opt  # free exp_avg/exp_avg_sq before the next optimizer allocates its own
            gc.collect()
        rows.append((name, statistics.median(times), min(times), ""))

    baseline_name, baseline = next((name, median) for name, median, _, _ in rows if median is not None)
    print()
    print(f"| optimizer | median ms/step | min ms/step | time vs {baseline_name} | "
          f"effective GB/s (28 B/param) | of copy GB/s | of add_ GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, median, best, why in rows:
        if median is None:
            print(f"| {name} | n/a: {why} | | | | | |")
            continue
        gbps = BYTES_PER_PARAM * args.numel / median / 1e9
        print(f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | {median / baseline:.3f} | "
              f"{gbps:.2f} | {gbps / copy_gbps:.0%} | {gbps / add_gbps:.0%} |")


if __name__ == "__main__":
    main()
