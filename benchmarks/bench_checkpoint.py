"""What a checkpoint costs a training loop: roundpipe.checkpoint.save (written behind the
compute) against a synchronous torch.save of the same state, in the same run.

    python benchmarks/bench_checkpoint.py [--width 2048] [--layers 14] [--batch 64]
        [--after 6] [--rounds 3] [--dir DIR]

The model is an fp32 ``nn.Sequential`` of ``--layers`` Linear(width, width)+GELU blocks on the
CPU pool, trained with roundpipe.optim.Adam (async step); its state (the parameters, the fp32
masters, Adam's two moments and step) is about 16 bytes per parameter. Each round runs both
contenders, in alternating order, at the same point of the loop (after ``scaler.update()``):

* ``roundpipe``: ``roundpipe.checkpoint.save(...)`` then ``--after`` iterations, then
  ``handle.wait()``. Its files are fsynced before the directory is renamed into place.
* ``torch.save``: ``torch.save({model.state_dict(), model.master_state_dict(),
  opt.state_dict(), rng}, path)`` and an ``os.fsync`` of the file (the same durability), then
  the same iterations. ``torch.save`` without the fsync is timed too (the file is then only in
  the page cache when the call returns).

Per save it reports the main thread's stall in the call, the extra time of the ``--after``
iterations that follow against the same number of plain iterations measured in the same round
(the write's cost to the loop: for torch.save, its stall plus that), the time until the
checkpoint is complete, and the peak RSS above the plain iterations' own peak (VmHWM reset
through /proc/self/clear_refs before each window), against the state's size. Medians over
``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is benchmarked)
import roundpipe.checkpoint as ckpt  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class Loop:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        blocks = []
        for _ in range(args.layers):
            blocks += [nn.Linear(args.width, args.width), nn.GELU()]
        self.model = RoundPipe(
            nn.Sequential(*blocks),
            devices="cpu",
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        with OptimizerCtx():
            self.opt = roundpipe.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width)
        self.it = 0

    def iteration(self) -> None:
        self.model.forward_backward(
            input_args=(self.x,), loss_fn=lambda out, _: out.square().mean() / 2
        )
        self.model.step(lambda: (self.opt.step(), self.opt.zero_grad()))
        self.it += 1

    def iterations(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.iteration()
        optim_thread.wait_all()
        return time.perf_counter() - start


def _roundpipe_save(loop: Loop, root: str, after: int) -> dict[str, float]:
    _reset_peak()
    base_rss = _status("VmRSS")
    start = time.perf_counter()
    handle = ckpt.save(root, loop.model, loop.opt, extra={"iteration": loop.it}, keep_last=1)
    stall = time.perf_counter() - start
    window = loop.iterations(after)
    before_wait = time.perf_counter()
    handle.wait()
    waited = time.perf_counter() - before_wait
    return {
        "stall": stall,
        "window": window,
        "waited": waited,
        "complete": time.perf_counter() - start,
        "peak": _status("VmHWM") - base_rss,
        "bytes": handle.bytes_total,
    }


def _torch_save(loop: Loop, path: str, after: int, fsync: bool) -> dict[str, float]:
    _reset_peak()
    base_rss = _status("VmRSS")
    start = time.perf_counter()
    state = {
        "model": loop.model.state_dict(),
        "masters": loop.model.master_state_dict(),  # waits for the step; clones the masters
        "optimizer": loop.opt.state_dict(),
        "rng": torch.get_rng_state(),
        "iteration": loop.it,
    }
    torch.save(state, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    del state
    stall = time.perf_counter() - start
    window = loop.iterations(after)
    return {
        "stall": stall,
        "window": window,
        "waited": 0.0,
        "complete": stall,
        "peak": _status("VmHWM") - base_rss,
        "bytes": os.path.getsize(path),
    }


def _plain(loop: Loop, after: int) -> dict[str, float]:
    _reset_peak()
    base_rss = _status("VmRSS")
    window = loop.iterations(after)
    return {"window": window, "peak": _status("VmHWM") - base_rss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="Linear width (default 2048)")
    parser.add_argument("--layers", type=int, default=14, help="Linear+GELU blocks (default 14)")
    parser.add_argument("--batch", type=int, default=64, help="rows per batch (default 64)")
    parser.add_argument(
        "--after", type=int, default=6, help="iterations timed after each save (default 6)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, medians (default 3)")
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory in /tmp)"
    )
    args = parser.parse_args()

    loop = Loop(args)
    n_params = sum(p.numel() for p in loop.model.optim_parameters())
    work = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"os.cpu_count()={os.cpu_count()}, writing to {work}"
    )
    print(
        f"# {n_params / 1e6:.1f}M fp32 params ({args.layers} x Linear({args.width}, "
        f"{args.width})), batch {args.batch}, roundpipe.optim.Adam, async step, CPU pool"
    )
    for _ in range(3):
        loop.iteration()
    optim_thread.wait_all()
    contenders = ["roundpipe", "torch.save+fsync", "torch.save"]
    results: dict[str, list[dict[str, float]]] = {c: [] for c in contenders + ["plain"]}
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        results["plain"].append(_plain(loop, args.after))
        for name in order:
            if name == "roundpipe":
                res = _roundpipe_save(loop, os.path.join(work, "rp"), args.after)
            else:
                res = _torch_save(
                    loop, os.path.join(work, "ckpt.pt"), args.after, name.endswith("fsync")
                )
            results[name].append(res)
            results["plain"].append(_plain(loop, args.after))
            print(
                f"# round {r} {name}: stall {res['stall']:.3f} s, {args.after} iterations "
                f"{res['window']:.2f} s, complete after {res['complete']:.2f} s",
                flush=True,
            )
    shutil.rmtree(work, ignore_errors=True)

    med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    plain_window = med(results["plain"], "window")
    plain_peak = med(results["plain"], "peak")
    state_bytes = med(results["roundpipe"], "bytes")
    print(
        f"# state written by roundpipe: {state_bytes / 2**30:.2f} GiB; {args.after} plain "
        f"iterations: {plain_window:.2f} s ({plain_window / args.after * 1000:.0f} ms each), "
        f"their own peak RSS +{plain_peak / 2**20:.0f} MiB"
    )
    print()
    print(
        "| contender | main-thread stall per save (s) | extra time of the save + "
        f"{args.after} iterations (s) | complete after (s) | peak RSS above plain iterations' "
        "(MiB) | of the state's size | file bytes (GiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in contenders:
        rows = results[name]
        stall = med(rows, "stall")
        extra = statistics.median(
            row["stall"] + row["window"] + row["waited"] - plain_window for row in rows
        )
        peak = max(0.0, med(rows, "peak") - plain_peak)
        print(
            f"| {name} | {stall:.3f} | {extra:.2f} | {med(rows, 'complete'):.2f} | "
            f"{peak / 2**20:.0f} | {peak / state_bytes:.0%} | {med(rows, 'bytes') / 2**30:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
