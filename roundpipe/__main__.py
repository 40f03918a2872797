"""``python -m roundpipe``: print the versions and the device pool, then run a short self-check
training loop and say whether it PASSED (exit code 0) or FAILED (exit code 1), and why.

The self-check trains a small classifier the way README.md's loop does: low-precision (fp16 by
default) stages under RoundPipe, fp32 masters updated by ``roundpipe.optim.Adam`` on the
optimizer thread with the asynchronous step, and a ``GradScaler``. It then checks what a broken
install or a broken machine would get wrong: the loss went down, the step ran on the optimizer
thread, the masters changed and reached the model's own parameters, the scale stayed sane, and
an exception raised inside a step came back to the main thread with the model still usable.

    python -m roundpipe [--quick] [--devices cpu:2] [--dtype fp16|bf16]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread
from roundpipe.devices import ENV_VAR, resolve_devices

__all__: list[str] = []

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _SelfCheckError(Exception):
    """Raised on purpose inside a step, to check that it reaches the main thread."""


def _make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four overlapping Gaussian blobs in 16 dimensions: quick to learn, not trivially."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=gen) * 0.7
    y = torch.randint(0, 4, (n,), generator=gen)
    x = centers[y] + torch.randn(n, 16, generator=gen)
    return x, y


def _describe_environment(devices: str | None) -> list[str]:
    lines = [
        f"roundpipe {roundpipe.__version__} ({os.path.dirname(roundpipe.__file__)})",
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} "
        f"{platform.machine()}, {torch.get_num_threads()} torch threads",
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"CUDA {torch.version.cuda}: {names}")
    else:
        lines.append("CUDA: not available")
    source = (
        "--devices"
        if devices is not None
        else f"${ENV_VAR}"
        if os.environ.get(ENV_VAR, "").strip()
        else "default"
    )
    pool = resolve_devices(devices)
    lines.append(f"device pool ({source}): {', '.join(str(d) for d in pool)}")
    return lines


class _Checks:
    def __init__(self) -> None:
        self.results: list[tuple[bool, str]] = []

    def check(self, ok: bool, what: str) -> None:
        self.results.append((bool(ok), what))
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)

    @property
    def failures(self) -> list[str]:
        return [what for ok, what in self.results if not ok]


def _self_check(
    iterations: int, dtype: torch.dtype, devices: str | None, progress: Callable[[int], None]
) -> _Checks:
    checks = _Checks()
    torch.manual_seed(0)
    x_all, y_all = _make_data(4096, seed=1)
    num_mb, batch = 4, 64
    seq_model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    ).to(dtype)
    user_params = list(seq_model.parameters())
    model = RoundPipe(
        seq_model,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler()
    initial = [m.detach().clone() for m in model.optim_parameters()]
    where_steps_ran: list[bool] = []

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return scaler.scale(F.cross_entropy(out.float(), label)) / num_mb

    def step_fn() -> None:
        where_steps_ran.append(optim_thread.on_optimizer_thread())
        scaler.step(opt)
        opt.zero_grad()

    gen = torch.Generator().manual_seed(2)
    losses: list[float] = []
    for it in range(iterations):
        idx = torch.randint(0, len(x_all), (batch,), generator=gen)
        loss = model.forward_backward(
            input_args=(x_all[idx].to(dtype),), label=y_all[idx], loss_fn=loss_fn
        )
        losses.append(loss.item() / scaler.get_scale())
        model.step(step_fn)
        scaler.update()
        progress(it + 1)
    model.synchronize()

    k = max(iterations // 10, 3)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    checks.check(all(math.isfinite(v) for v in losses[:k] + losses[-k:]), "the loss is finite")
    checks.check(
        last < 0.5 * first,
        f"the loss went down: {first:.3f} (first {k} iterations) -> {last:.3f} (last {k})",
    )
    checks.check(
        len(where_steps_ran) == iterations and all(where_steps_ran),
        f"all {iterations} steps ran on the optimizer thread",
    )
    masters = list(model.optim_parameters())
    checks.check(
        all(m.dtype == torch.float32 for m in masters)
        and all(p.dtype == dtype for p in user_params),
        f"masters are fp32, the model's parameters {str(dtype).replace('torch.', '')}",
    )
    changed = sum(not torch.equal(a, b) for a, b in zip(initial, masters))
    checks.check(
        changed == len(masters), f"the optimizer changed {changed}/{len(masters)} master tensors"
    )
    checks.check(
        all(torch.equal(p, m.to(dtype)) for p, m in zip(user_params, masters)),
        "after synchronize() the model's own parameters hold the newest masters",
    )
    snap = scaler.snapshot()
    scale = scaler.get_scale(up_to_date=True)
    checks.check(
        math.isfinite(scale)
        and 1.0 <= scale <= 2.0**24
        and snap.steps == iterations
        and snap.skipped_steps <= max(2, iterations // 10),
        f"the loss scale is sane: {scale:g}, {snap.skipped_steps} of {snap.steps} steps skipped",
    )

    # An exception inside a step must come back to the main thread, as its own type, and leave
    # the model usable.
    idx = torch.arange(batch)
    model.forward_backward(input_args=(x_all[idx].to(dtype),), label=y_all[idx], loss_fn=loss_fn)

    def failing_step() -> None:
        raise _SelfCheckError("raised on purpose by the self-check")

    model.step(failing_step)
    reported: BaseException | None = None
    try:
        scaler.update()
        model.synchronize()
    except _SelfCheckError as exc:
        reported = exc
    checks.check(
        reported is not None,
        "an exception raised inside a step is re-raised on the main thread as its own type",
    )
    loss = model.forward_backward(
        input_args=(x_all[idx].to(dtype),), label=y_all[idx], loss_fn=loss_fn
    )
    model.step(step_fn)
    scaler.update()
    model.synchronize()
    checks.check(math.isfinite(loss.item()), "the model is usable after that error")
    return checks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # python -m roundpipe plan CONFIG ...: a HuggingFace model's plan
        from roundpipe.hf.memory_cli import main as plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe",
        description="Print the versions and the device pool, then run a short self-check "
        "training loop and say whether it PASSED (exit code 0) or FAILED (exit code "
        "1), and why. `python -m roundpipe plan CONFIG --seq-len N` prints the memory plan "
        "of fine-tuning a transformers causal LM instead (see `plan --help`).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short check (a few seconds), for the test suite"
    )
    parser.add_argument(
        "--devices",
        default=None,
        help=f"device pool (default: ${ENV_VAR}, else every CUDA device, else one CPU worker)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="fp16", help="the model's low-precision dtype"
    )
    args = parser.parse_args(argv)

    try:
        for line in _describe_environment(args.devices):
            print(line)
    except ValueError as exc:  # a bad device spec
        print(f"FAILED: {exc}")
        return 1

    iterations = 40 if args.quick else 400
    print(
        f"self-check: {iterations} iterations, {args.dtype} shards, fp32 Adam masters, GradScaler, async step",
        flush=True,
    )
    start = time.perf_counter()
    step_every = max(iterations // 20, 1)

    def progress(done: int) -> None:
        if sys.stdout.isatty() and (done % step_every == 0 or done == iterations):
            print(f"\r  training {done}/{iterations}", end="", flush=True)
            if done == iterations:
                print("\r" + " " * 40 + "\r", end="", flush=True)

    try:
        checks = _self_check(iterations, _DTYPES[args.dtype], args.devices, progress)
    except BaseException as exc:  # noqa: B036 -- the point of a self-check is to report it
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        print(f"FAILED: the training loop raised {type(exc).__name__}: {exc}")
        return 1
    elapsed = time.perf_counter() - start
    if checks.failures:
        print(f"FAILED ({elapsed:.1f} s): " + "; ".join(checks.failures))
        return 1
    print(f"PASSED ({len(checks.results)} checks, {elapsed:.1f} s)")
    return 0


# [Note: a plan process without bitsandbytes]
# peft imports bitsandbytes whenever it is installed (peft.helpers), which costs about 2 s of
# the 20 s an 8B length search may take on a 2-core machine, and the plan of a model that is
# not quantized never calls it. So `python -m roundpipe plan` without --quantize, run as a
# process of its own, marks it absent before anything imports it (importlib.util.find_spec
# answers None for a module that sys.modules maps to None, which is how peft asks). Only here:
# main() called in a process that may quantize later (the tests, a notebook) must not do it.


def _plan_without_bitsandbytes(argv: list[str]) -> None:
    if argv[:1] != ["plan"] or "bitsandbytes" in sys.modules:
        return
    from roundpipe.hf.memory_cli import quantizes

    if not quantizes(argv[1:]):
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


if __name__ == "__main__":
    _plan_without_bitsandbytes(sys.argv[1:])
    sys.exit(main())
