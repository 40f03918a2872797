"""Time one Adam step on fp32 CPU master params, with the bytes each variant must move.

    python benchmarks/bench_optim.py [--numel N] [--tensors T] [--threads K] [--rounds R]
                                     [--repeat S] [--complex] [--no-bnb]
                                     [--no-bf16-grads]

Adam is memory bound on CPU, so each variant is measured against what it must move per
parameter and against a plain streaming ``a.add_(b)`` (12 B/element, measured in the same
rounds: the machine's bandwidth for a kernel that writes only what it read, as Adam does):

* torch.optim.AdamW(fused=True): reads param, grad, exp_avg, exp_avg_sq, writes param and both
  moments: 28 B/param;
* the same, then the master->model copy (``low.copy_(master)``, bf16): the two passes a
  RoundPipe step made before the one-pass step: 28 + 6 = 34 B/param;
* roundpipe.optim.AdamW inside a RoundPipe step (the copy written in the same pass, see [Note:
  the copy in the step]): 28 + 2 = 30 B/param; bitwise the two passes;
* with ``state_dtype=torch.bfloat16``: 20 B + 2 for the copy = 22 B/param;
* with ``state_dtype="8bit"``: 16 B + 2 for the copy + 2 x 4 B per 256 for the absmax = 18.06;
* bitsandbytes' AdamW8bit on the same CPU tensors (if installed; no copy): 16.06 B/param;
* with bf16 gradients (``AdamW(grad_dtype=torch.bfloat16)``, the sums a device made in bf16
  handed over as they are; [Note: gradients in their summed dtype]): 2 B/param less read:
  28, 20 and 16.06 B/param for exact, bf16 and 8-bit moments with the copy. Their params are
  second Parameter objects over the same masters (``--no-bf16-grads`` leaves them out).

Each round builds, warms up, times and frees each contender in turn (the cores may be
shared); medians over rounds x repeats, minima too. ``RSS B/param`` is the host memory the
optimizer's state (and, for the one-pass variants, nothing else: the copy is the model's)
added, measured from /proc/self/statm around its first step. ``--complex``: complex64 params
(which torch's fused Adam refuses), the exact variants only.

Memory: masters, gradients and bf16 copies take 10 B/param (1 GB at the default 100M), plus
one optimizer's state at a time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import roundpipe.optim  # noqa: E402  (after the path tweak, so the checkout is benchmarked)
from roundpipe.optim import native  # noqa: E402
from roundpipe.runtime.step_copy import StepCopies  # noqa: E402
from roundpipe.threads.step_context import running_step  # noqa: E402

ABSMAX = 2 * 4 / 256  # two fp32 absmax per block of 256, read and written: per param


def _split(numel: int, parts: int) -> list[int]:
    # Unequal sizes, like a model's layers, but summing exactly to numel.
    weights = [2 ** (i % 3) for i in range(parts)]
    sizes = [numel * w // sum(weights) for w in weights]
    sizes[0] += numel - sum(sizes)
    return sizes


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class _Step:
    """A RoundPipe step's view of the masters, for a one-pass optimizer outside a model: the
    low-precision copies it writes in place (what a synchronous model.step arms)."""

    def __init__(self, masters: list[torch.Tensor], lows: list[torch.Tensor]) -> None:
        self.step_copies = StepCopies(list(zip(lows, masters)))

    def record_of(self, param: Any) -> None:
        return None

    def run(self, opt: torch.optim.Optimizer) -> None:
        with running_step(self), self.step_copies.armed(in_place=True):
            opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000, help="params (default 100M)")
    parser.add_argument("--tensors", type=int, default=8, help="tensors they are split into")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all contenders")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--complex", action="store_true", help="complex64 params (exact only)")
    parser.add_argument("--no-bnb", action="store_true", help="leave bitsandbytes out")
    parser.add_argument(
        "--no-bf16-grads", action="store_true", help="leave the bf16-gradient rows out"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.kernels(wait=True)

    dtype = torch.complex64 if args.complex else torch.float32
    sizes = [n // 2 for n in _split(args.numel, args.tensors)] if args.complex else None
    sizes = sizes or _split(args.numel, args.tensors)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype) * 1e-3
    lows = [torch.empty(n, dtype=torch.bfloat16) for n in _split(args.numel, args.tensors)]
    step = _Step(params, lows) if not args.complex else None

    def two_passes(opt: torch.optim.Optimizer) -> None:
        opt.step()
        with torch.no_grad():
            for low, p in zip(lows, params):
                low.copy_(p)

    contenders: list[tuple[str, float, Callable, Callable]] = [
        ("torch.optim.AdamW(fused=True)", 28, lambda: torch.optim.AdamW(params, fused=True), None),
    ]
    if not args.complex:
        contenders += [
            (
                "torch fused AdamW, then the bf16 copy (two passes)",
                34,
                lambda: torch.optim.AdamW(params, fused=True),
                two_passes,
            ),
            ("roundpipe AdamW, one pass", 30, lambda: roundpipe.optim.AdamW(params), step.run),
            (
                "roundpipe AdamW bf16 moments, one pass",
                22,
                lambda: roundpipe.optim.AdamW(params, state_dtype=torch.bfloat16),
                step.run,
            ),
            (
                "roundpipe AdamW 8-bit moments, one pass",
                18 + ABSMAX,
                lambda: roundpipe.optim.AdamW(params, state_dtype="8bit"),
                step.run,
            ),
            (
                "roundpipe AdamW 8-bit moments, no copy",
                16 + ABSMAX,
                lambda: roundpipe.optim.AdamW(params, state_dtype="8bit"),
                None,
            ),
        ]
        if not args.no_bf16_grads and hasattr(params[0], "grad_dtype"):
            # The same masters, as Parameters whose gradients are bf16 (what a device's bf16
            # sums become with Adam(grad_dtype=torch.bfloat16)).
            halves = [torch.nn.Parameter(p.data) for p in params]
            for h, p in zip(halves, params):
                h.grad_dtype = torch.bfloat16
                h.grad = p.grad.to(torch.bfloat16)
            half_step = _Step(halves, lows)
            bf16 = torch.bfloat16
            contenders += [
                (
                    "roundpipe AdamW, one pass, bf16 grads",
                    28,
                    lambda: roundpipe.optim.AdamW(halves, grad_dtype=bf16),
                    half_step.run,
                ),
                (
                    "roundpipe AdamW bf16 moments, one pass, bf16 grads",
                    20,
                    lambda: roundpipe.optim.AdamW(halves, state_dtype=bf16, grad_dtype=bf16),
                    half_step.run,
                ),
                (
                    "roundpipe AdamW 8-bit moments, one pass, bf16 grads",
                    16 + ABSMAX,
                    lambda: roundpipe.optim.AdamW(halves, state_dtype="8bit", grad_dtype=bf16),
                    half_step.run,
                ),
            ]
    else:
        contenders.append(("roundpipe AdamW", 28, lambda: roundpipe.optim.AdamW(params), None))
    bnb_version = None
    if not args.no_bnb and not args.complex:
        try:
            import bitsandbytes as bnb

            bnb_version = bnb.__version__
            contenders.append(
                (
                    f"bitsandbytes {bnb_version} AdamW8bit (CPU)",
                    16 + ABSMAX,
                    lambda: bnb.optim.AdamW8bit(params),
                    None,
                )
            )
        except Exception as exc:  # not installed, or no CPU backend
            print(f"# bitsandbytes left out: {type(exc).__name__}: {exc}")

    a, b = torch.randn(args.numel), torch.randn(args.numel)
    add_times: list[float] = []
    times: dict[str, list[float]] = {name: [] for name, *_ in contenders}
    rss: dict[str, int] = {}
    refused: dict[str, str] = {}
    for _ in range(args.rounds):
        for _ in range(args.repeat):
            start = time.perf_counter()
            a.add_(b)
            add_times.append(time.perf_counter() - start)
        for name, _, make, run in contenders:
            if name in refused:
                continue
            gc.collect()
            before = _rss()
            try:
                opt = make()
            except (RuntimeError, ValueError) as exc:
                refused[name] = str(exc).split(":")[0]
                continue
            run_step = functools.partial(run, opt) if run is not None else opt.step
            run_step()  # allocates the state
            rss[name] = max(rss.get(name, 0), _rss() - before)
            slow = "bitsandbytes" in name  # seconds per step on a CPU: one timed step a round
            for _ in range(0 if slow else args.warmup - 1):
                run_step()
            for _ in range(1 if slow else args.repeat):
                start = time.perf_counter()
                run_step()
                times[name].append(time.perf_counter() - start)
            del opt, run_step
            gc.collect()

    add_gbps = 12 * args.numel / statistics.median(add_times) / 1e9
    load = os.getloadavg()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {_cpu_name()}, "
        f"os.cpu_count()={os.cpu_count()}; compiled step: {native.status()}"
        + (f" (AVX2: {ops.has_avx2()})" if ops is not None else "")
    )
    print(
        f"# {args.numel:,} {'fp32 numbers as complex64' if args.complex else 'fp32'} params in "
        f"{args.tensors} tensors; medians of {args.rounds} rounds x {args.repeat} steps "
        f"(bitsandbytes: {args.rounds} x 1) after warm-up; load average at the end "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(f"# a.add_(b), 12 B/elem, same rounds: {add_gbps:.2f} GB/s")
    print()
    print(
        "| optimizer | median ms/step | min ms/step | B/param moved | GB/s | of add_'s GB/s | "
        "RSS B/param |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, nbytes, *_ in contenders:
        if name in refused:
            print(f"| {name} | n/a: {refused[name]} | | | | | |")
            continue
        median, best = statistics.median(times[name]), min(times[name])
        gbps = nbytes * args.numel / median / 1e9
        print(
            f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | {nbytes:.2f} | {gbps:.2f} | "
            f"{gbps / add_gbps:.0%} | {rss[name] / args.numel:.2f} |"
        )


if __name__ == "__main__":
    main()
