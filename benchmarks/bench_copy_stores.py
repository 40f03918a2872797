"""The one-pass step's low-precision copy streamed or stored plainly: ms per step of the exact,
bf16-moment and 8-bit-moment roundpipe AdamW inside a RoundPipe step (the bf16 copy written in
the same pass), with the compiled kernels' streaming stores for the copy (the default, see
[Note: the copy's streaming stores] in roundpipe/optim/_step_kernels.cpp) and with plain
stores (``ROUNDPIPE_COPY_STORES=plain``, read once per process).

    python benchmarks/bench_copy_stores.py [--numel N] [--threads K] [--rounds R] [--repeat S]

Each round runs one child process per contender, alternating which goes first; a child builds
the masters, gradients and copies (10 B/param), warms each optimizer up and times ``--repeat``
steps of it. Medians over rounds x repeats, and plain / streamed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("exact", "bf16", "8bit")


def _child(numel: int, threads: int, repeat: int) -> None:
    import torch

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_optim import _split, _Step

    import roundpipe.optim
    from roundpipe.optim import native

    torch.set_num_threads(threads)
    native.kernels(wait=True)
    gen = torch.Generator().manual_seed(0)
    sizes = _split(numel, 8)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    step = _Step(params, [torch.empty(n, dtype=torch.bfloat16) for n in sizes])
    states = {"exact": "exact", "bf16": torch.bfloat16, "8bit": "8bit"}
    out = {}
    for name in VARIANTS:
        opt = roundpipe.optim.AdamW(params, state_dtype=states[name])
        step.run(opt)  # allocates the state
        step.run(opt)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            step.run(opt)
            times.append(time.perf_counter() - start)
        out[name] = times
        del opt
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", choices=["streamed", "plain"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.numel, args.threads, args.repeat)
        return
    times: dict[str, dict[str, list[float]]] = {
        how: {name: [] for name in VARIANTS} for how in ("streamed", "plain")
    }
    for r in range(args.rounds):
        order = ("streamed", "plain") if r % 2 == 0 else ("plain", "streamed")
        for how in order:
            env = dict(os.environ)
            env.pop("ROUNDPIPE_COPY_STORES", None)
            if how == "plain":
                env["ROUNDPIPE_COPY_STORES"] = "plain"
            argv = [sys.executable, __file__, "--child", how, "--numel", str(args.numel)]
            argv += ["--threads", str(args.threads), "--repeat", str(args.repeat)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            for name, ts in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[how][name].extend(ts)
    load = os.getloadavg()
    print(
        f"# {args.numel:,} fp32 params in 8 tensors, bf16 copy, {args.threads} threads; medians "
        f"of {args.rounds} rounds x {args.repeat} steps, a process per contender and round, "
        f"alternated; load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print()
    print("| optimizer (one pass) | streamed ms/step | plain ms/step | plain / streamed |")
    print("|---|---:|---:|---:|")
    for name in VARIANTS:
        streamed = statistics.median(times["streamed"][name]) * 1e3
        plain = statistics.median(times["plain"][name]) * 1e3
        print(
            f"| roundpipe AdamW, {name} moments | {streamed:.1f} | {plain:.1f} | "
            f"{plain / streamed:.3f} |"
        )


if __name__ == "__main__":
    main()
