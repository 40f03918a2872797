"""Time one Adam step on fp32 CPU master params: roundpipe.optim.Adam vs torch's fused and foreach.

    python benchmarks/bench_optim.py [--numel N] [--repeat R] [--rounds K] [--tensors T] [--complex]

Adam is memory bound on CPU: a step reads param, grad, exp_avg, exp_avg_sq (16 B/param) and
writes param, exp_avg, exp_avg_sq (12 B/param), 28 B/param in all. The script measures a plain
large copy (``dst.copy_(src)``, 8 B/element) in the same run to get the machine's achievable
GB/s, and reports each optimizer's effective GB/s as a fraction of it. A copy's 8 B/element
undercounts what the memory bus moves (writing ``dst`` first reads its cache lines), so the
script also times ``a.add_(b)``, which like Adam writes only what it has read (12 B/element).

Ratios are against torch fused measured in the same run (with ``--complex``, complex64 params
that torch's fused Adam refuses, against roundpipe's). Timings are medians over ``--rounds`` x
``--repeat`` steps, because the cores may be shared; the minimum is printed too.

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


def _reference_times(numel: int, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds per ``dst.copy_(src)`` (8 B/elem) and per ``a.add_(b)`` (12 B/elem)."""
    a = torch.randn(numel)
    b = torch.randn(numel)
    copy_times = _time(lambda: a.copy_(b), repeat, warmup=2)
    add_times = _time(lambda: a.add_(b), repeat, warmup=2)
    a = b = torch.empty(0)  # the closures above keep no large buffer alive
    gc.collect()
    return copy_times, add_times


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
    parser.add_argument(
        "--numel", type=int, default=100_000_000, help="total params (default 100M)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per optimizer per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all optimizers; the median is over rounds x repeat steps",
    )
    parser.add_argument(
        "--tensors", type=int, default=8, help="how many tensors the params are split into"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch.set_num_threads (default: torch's default)",
    )
    parser.add_argument(
        "--complex",
        action="store_true",
        help="complex64 params (numel/2 complex = numel fp32 numbers)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (the first allocates state)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {_cpu_name()}, "
        f"os.cpu_count()={os.cpu_count()}"
    )
    print(
        f"# {args.numel:,} {'fp32 numbers as complex64' if args.complex else 'fp32'} params in "
        f"{args.tensors} tensors; median of {args.rounds} rounds x {args.repeat} steps, "
        f"each round after {args.warmup} warm-up steps"
    )

    gen = torch.Generator().manual_seed(0)
    dtype = torch.complex64 if args.complex else torch.float32
    # --numel counts fp32 numbers, so a complex run moves as many bytes as a real one.
    sizes = (
        [n // 2 for n in _split(args.numel, args.tensors)]
        if args.complex
        else _split(args.numel, args.tensors)
    )
    params = [torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype) * 1e-3

    candidates = [
        ("torch.optim.Adam(fused=True)", lambda: torch.optim.Adam(params, lr=1e-3, fused=True)),
        ("roundpipe.optim.Adam()", lambda: roundpipe.optim.Adam(params, lr=1e-3)),
        ("torch.optim.Adam(foreach=True)", lambda: torch.optim.Adam(params, lr=1e-3, foreach=True)),
        # torch's default picks foreach only on accelerators: on CPU it is the for-loop.
        ("torch.optim.Adam() (torch default)", lambda: torch.optim.Adam(params, lr=1e-3)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in candidates}
    refused: dict[str, str] = {}
    # Rounds: each optimizer runs once per round, one at a time, so slow drift in what else runs
    # on the shared cores spreads over all of them instead of biasing one.
    copy_times: list[float] = []
    add_times: list[float] = []
    for _ in range(args.rounds):
        round_copy, round_add = _reference_times(args.numel, args.repeat)
        copy_times += round_copy
        add_times += round_add
        for name, make in candidates:
            if name in refused:
                continue
            opt = make()
            try:
                times[name] += _time(opt.step, args.repeat, args.warmup)
            except RuntimeError as exc:  # torch's fused Adam refuses complex params
                refused[name] = str(exc).split(":")[0]
            finally:
                del opt  # free exp_avg/exp_avg_sq before the next optimizer allocates its own
                gc.collect()
    rows = [
        (name, None, None, refused[name])
        if name in refused
        else (name, statistics.median(times[name]), min(times[name]), "")
        for name, _ in candidates
    ]

    copy_gbps = 8 * args.numel / statistics.median(copy_times) / 1e9
    add_gbps = 12 * args.numel / statistics.median(add_times) / 1e9
    print(
        f"# dst.copy_(src) on {args.numel:,} fp32 (8 B/elem): {copy_gbps:.2f} GB/s; "
        f"a.add_(b) (12 B/elem, no write-allocate): {add_gbps:.2f} GB/s (medians, same rounds)"
    )
    baseline_name, baseline = next(
        (name, median) for name, median, _, _ in rows if median is not None
    )
    print()
    print(
        f"| optimizer | median ms/step | min ms/step | time vs {baseline_name} | "
        f"effective GB/s (28 B/param) | of copy GB/s | of add_ GB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, median, best, why in rows:
        if median is None:
            print(f"| {name} | n/a: {why} | | | | | |")
            continue
        gbps = BYTES_PER_PARAM * args.numel / median / 1e9
        print(
            f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | {median / baseline:.3f} | "
            f"{gbps:.2f} | {gbps / copy_gbps:.0%} | {gbps / add_gbps:.0%} |"
        )


if __name__ == "__main__":
    main()
