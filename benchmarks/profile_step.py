"""Where the time of one synchronous ``model.step`` goes, in bytes per parameter.

    python benchmarks/profile_step.py [--layers 12] [--width 2048] [--rounds 5] [--trace DIR]

A bf16 ``nn.Sequential`` of ``--layers`` Linear(width, width) layers (12 x 2048: 50.4M
parameters) wrapped in a CPU RoundPipe with fp32 masters and ``roundpipe.optim.AdamW``. Each
round runs one ``forward_backward`` (not timed), then one ``model.step(step_fn,
is_async=False)`` whose parts are timed where they run, on the optimizer thread: the step
function's ``opt.step()`` and ``opt.zero_grad()``, the master->model copy (the model's copy
work item), and what is left (queueing, hooks, waking the main thread). The same rounds time a
plain ``a.add_(b)`` on as many fp32 elements as there are parameters (12 B per element), and
every part is written as the bytes per parameter that ``add_`` streams in the same time: the
step's cost in the only unit that stays put across machines.

``--trace DIR`` also writes a torch.profiler trace of one more step (all threads) there and
prints the ops that took the most time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is profiled)
import roundpipe.optim  # noqa: E402
from roundpipe.runtime import params as params_module  # noqa: E402


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _isolated(seq: nn.Module, gbps: float, numel: int, rounds: int) -> None:
    """The parts of a step one by one on standalone tensors of the model's shapes, each
    round alternating with the same ``add_``: what each costs on its own."""
    from roundpipe.optim.kernel import fused_step

    shapes = [p.shape for p in seq.parameters()]
    masters = [torch.randn(s) for s in shapes]
    low = [m.to(torch.bfloat16) for m in masters]
    grads16 = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    state = [(torch.zeros_like(m), torch.zeros_like(m), torch.zeros(())) for m in masters]
    group = {
        "lr": 1e-4,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": True,
    }
    a, b = torch.randn(numel), torch.randn(numel)
    times: dict[str, list[float]] = {}

    def clock(name: str, fn) -> None:
        start = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - start)

    holder: dict[str, list[torch.Tensor]] = {}

    def alloc_grads() -> None:  # a gradient move's first write: new fp32 buffers from bf16
        holder["g"] = [torch.empty_like(m).copy_(g) for m, g in zip(masters, grads16)]

    def free_grads() -> None:  # zero_grad(set_to_none=True)
        holder["g"] = []

    def refill() -> None:  # into buffers that stay allocated
        for t, g in zip(holder["g"], grads16):
            t.copy_(g)

    def zero() -> None:
        for t in holder["g"]:
            t.zero_()

    def kernel() -> None:
        lists = [
            masters,
            holder["g"],
            [s[0] for s in state],
            [s[1] for s in state],
            [],
            [s[2] for s in state],
        ]
        fused_step(group, {(torch.device("cpu"), torch.float32): lists}, None, None)

    def cast() -> None:
        for lp, m in zip(low, masters):
            lp.copy_(m)

    for r in range(rounds + 1):
        record = r > 0
        clock("add_ (12 B/elem)", lambda: a.add_(b))
        clock("grads: allocate + write from bf16 (gradient move)", alloc_grads)
        clock("Adam kernel alone (torch._fused_adamw_)", kernel)
        clock("grads: zero_() in place", zero)
        clock("grads: write from bf16 into kept buffers", refill)
        clock("grads: free (zero_grad set_to_none)", free_grads)
        clock("master->model cast alone (copy_ fp32->bf16)", cast)
        if not record:
            times.clear()
    add_gbps = 12 * numel / statistics.median(times["add_ (12 B/elem)"]) / 1e9
    print()
    print(f"# isolated parts, same shapes; add_ here: {add_gbps:.1f} GB/s")
    print()
    print("| part | median ms | bytes/param at add_'s GB/s |")
    print("|---|---:|---:|")
    for name, xs in times.items():
        ms = _median_ms(xs)
        print(f"| {name} | {ms:.1f} | {ms / 1e3 * add_gbps * 1e9 / numel:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trace", default=None, help="directory for a torch.profiler trace")
    parser.add_argument(
        "--async-step", action="store_true", help="time model.step(is_async=True) instead"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    seq = seq.to(torch.bfloat16)
    numel = sum(p.numel() for p in seq.parameters())
    model = roundpipe.RoundPipe(seq, optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-4)
    x = torch.randn(2, args.width, dtype=torch.bfloat16)

    parts: dict[str, list[float]] = {
        "opt.step()": [],
        "opt.zero_grad()": [],
        "master->model copy": [],
        "model.step total": [],
    }

    def timed(name: str, fn):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name].append(time.perf_counter() - start)

        return run

    # The copy work item the model launches: timed where it runs.
    copy = params_module.Params.copy_masters_to_model
    params_module.Params.copy_masters_to_model = timed("master->model copy", copy)  # type: ignore[method-assign]
    step_fn = lambda: (timed("opt.step()", opt.step)(), timed("opt.zero_grad()", opt.zero_grad)())  # noqa: E731

    a = torch.randn(numel)
    b = torch.randn(numel)
    add_times: list[float] = []

    def one_round(record: bool) -> None:
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
        model.synchronize() if args.async_step else None
        start = time.perf_counter()
        model.step(step_fn, is_async=args.async_step)
        if args.async_step:
            roundpipe.optim_thread.synchronize()
        total = time.perf_counter() - start
        if record:
            parts["model.step total"].append(total)
        start = time.perf_counter()
        a.add_(b)
        if record:
            add_times.append(time.perf_counter() - start)

    one_round(False)  # the first step allocates Adam's state
    for name in parts:
        parts[name].clear()
    for _ in range(args.rounds):
        one_round(True)

    add_s = statistics.median(add_times)
    gbps = 12 * numel / add_s / 1e9
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads; {numel:,} bf16 params "
        f"({args.layers} x Linear({args.width}, {args.width})), fp32 masters, roundpipe AdamW; "
        f"median of {args.rounds} rounds"
    )
    print(f"# a.add_(b) on {numel:,} fp32: {add_s * 1e3:.1f} ms = {gbps:.1f} GB/s (12 B/elem)")
    print()
    print("| part | median ms | bytes/param at add_'s GB/s |")
    print("|---|---:|---:|")
    inner = 0.0
    for name, xs in parts.items():
        ms = _median_ms(xs)
        if name != "model.step total":
            inner += ms
        print(f"| {name} | {ms:.1f} | {ms / 1e3 * gbps * 1e9 / numel:.1f} |")
    total = _median_ms(parts["model.step total"])
    rest = total - inner
    print(f"| rest (queue, hooks, wake-ups) | {rest:.1f} | {rest / 1e3 * gbps * 1e9 / numel:.1f} |")

    _isolated(seq, gbps, numel, args.rounds)

    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            model.step(step_fn, is_async=False)
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, "step.json"))
        print()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
