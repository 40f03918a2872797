"""Adam's state on disk (``state_dir=``), and the masters with it (``roundpipe.MastersOnDisk``),
against in RAM: the step's time, the disk bandwidth it reaches, how much of it the next iteration
hides, and the host RSS.

    python benchmarks/bench_spill.py [--dir DIR] [--numel N] [--rounds K] [--repeat R]
                                     [--width W] [--layers L] [--batch B] [--iters I]

Part a, the optimizer step alone: roundpipe.optim.AdamW on N fp32 params (split into 8
tensors) with the state in RAM, with it in files under ``--dir`` (default: a temporary
directory on this machine's disk), and with the params as MastersOnDisk makes them (in a file
there too), alternated round by round, medians of ``--rounds`` x ``--repeat`` steps. The
spilled step reads and writes 8 B/param of state (12 with the masters); the read and write
bandwidth are the bytes over the time the reader and writer threads spent in ``preadv`` and
``pwritev`` (their busy time), and the effective bandwidth is the bytes over the whole step.
The same run also times a plain sequential write and read of a file of the same size (1 MiB
``pwrite``/``pread`` calls, buffered, with ``posix_fadvise(DONTNEED)`` after writing as the
spill does), for the disk's own figure.

Part b, training: a Sequential of ``--layers`` fp16 Linear(W, W) layers with fp32 masters
(about 14 B/param of host state in RAM, 8 B/param of it spilled), ``forward_backward`` then
``model.step`` (async: the step runs on the optimizer thread while the next iteration
computes), iteration time in four modes alternated: no step at all (the compute alone), the
state in RAM, the state on disk, and the masters on disk too. Hidden fraction of a step = 1 -
(iteration - compute) / step, with the step's time from part a's medians scaled per parameter
(with the masters on disk, the master->model copy's read of them is not in part a's step but is
in the iteration). The step runs on the CPU
beside the compute here, so on a machine with few cores they compete for the cores.

Part c (``--part c``), host memory: part b's model in a fresh process per mode, the growth of
its RSS (``/proc/self/status`` VmRSS, and the peak VmHWM) from before the model is built to after
two training iterations, per parameter: with no optimizer (weights, masters and gradients,
10 B/param), with the state in RAM (8 B/param more planned), on disk (only the streaming
buffer more), and with the masters in files too (``roundpipe.MastersOnDisk``, 6 B/param: the
fp16 weights and the gradients, plus the streaming and copy buffers). Each child first trains a
small model, so that the runtime's own memory is in place before it measures, builds the model
in fp16, and runs with ``MALLOC_MMAP_THRESHOLD_=1048576`` (glibc maps every block of 1 MiB or
more on its own and unmaps it when freed), so that RSS counts what is live rather than what the
heap kept of earlier frees.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is benchmarked)
import roundpipe.optim  # noqa: E402
from roundpipe.optim import spill  # noqa: E402

MASTERS = "masters and state on disk"
CONTENDERS = ("in RAM", "on disk", MASTERS)


class _IOClock:
    """Busy seconds and bytes of the placement's reads and writes (patched in, per thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = {"read": 0.0, "write": 0.0}
        self.bytes = {"read": 0, "write": 0}

    def wrap(self, store: spill.StateOnDisk) -> None:
        read, write = store._read, store._write

        def timed(kind, fn):
            def run(dest, offset, *rest):
                start = time.perf_counter()
                fn(dest, offset, *rest)
                with self.lock:
                    self.seconds[kind] += time.perf_counter() - start
                    self.bytes[kind] += dest.numel() * dest.element_size()

            return run

        store._read = timed("read", read)  # type: ignore[method-assign]
        store._write = timed("write", write)  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds = {"read": 0.0, "write": 0.0}
        self.bytes = {"read": 0, "write": 0}


def _sizes(numel: int, parts: int) -> list[int]:
    sizes = [numel // parts] * parts
    sizes[0] += numel - sum(sizes)
    return sizes


def _disk_baseline(directory: str, nbytes: int) -> tuple[float, float]:
    """GB/s of a plain sequential buffered write (with DONTNEED behind) and read-back."""
    block = torch.empty(1 << 20, dtype=torch.uint8).numpy()
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, len(block)):
            os.pwrite(fd, block, offset)
            os.posix_fadvise(fd, offset, len(block), os.POSIX_FADV_DONTNEED)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, len(block)):
            os.preadv(fd, [block], offset)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def part_a(args: argparse.Namespace) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    sizes = _sizes(args.numel, 8)
    made = {}
    placements = []
    for name in CONTENDERS:
        params = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        if name == MASTERS:  # the masters as MastersOnDisk makes them for a model
            placement = roundpipe.MastersOnDisk(args.dir, copy_buffer_bytes=args.buffer_mib << 20)
            params = placement.make_masters([(p, torch.float32) for p in params])
            placements.append(placement)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        options = (
            {"state_dir": args.dir, "state_buffer_bytes": args.buffer_mib << 20}
            if name != "in RAM"
            else {}
        )
        made[name] = roundpipe.optim.AdamW(params, lr=1e-4, **options)
    clock = _IOClock()
    clock.wrap(made["on disk"]._placement)  # type: ignore[arg-type]
    for opt in made.values():
        opt.step()  # allocates (or lays out) the state
    times: dict[str, list[float]] = {name: [] for name in made}
    disk_w: list[float] = []
    disk_r: list[float] = []
    clock.reset()
    for _ in range(args.rounds):
        for name, opt in made.items():
            for _ in range(args.repeat):
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        w, r = _disk_baseline(args.dir, 8 * args.numel)
        disk_w.append(w)
        disk_r.append(r)
    steps = args.rounds * args.repeat
    state_bytes = 8 * args.numel
    ram, disk = statistics.median(times["in RAM"]), statistics.median(times["on disk"])
    print(
        f"## a. one AdamW step, {args.numel:,} fp32 params, state {state_bytes / 1e9:.2f} GB "
        f"(median of {args.rounds} rounds x {args.repeat} steps, alternated)\n"
    )
    print("| state | median ms/step | min ms/step | time vs in RAM |")
    print("|---|---:|---:|---:|")
    for name in made:
        med = statistics.median(times[name])
        print(f"| {name} | {med * 1e3:.1f} | {min(times[name]) * 1e3:.1f} | {med / ram:.2f} |")
    print()
    read_gbps = clock.bytes["read"] / clock.seconds["read"] / 1e9
    write_gbps = clock.bytes["write"] / clock.seconds["write"] / 1e9
    assert clock.bytes["read"] == clock.bytes["write"] == steps * state_bytes  # every byte once
    print(
        f"spilled step: reads {read_gbps:.2f} GB/s, writes {write_gbps:.2f} GB/s (busy time of "
        f"the reader/writer threads), {2 * state_bytes / disk / 1e9:.2f} GB/s read+written "
        f"over the whole step; plain sequential file I/O of the same {state_bytes / 1e9:.2f} GB "
        f"in the same rounds: write {statistics.median(disk_w):.2f} GB/s, read "
        f"{statistics.median(disk_r):.2f} GB/s (medians)\n"
    )
    for opt in made.values():
        opt.close()
    del made, placements
    gc.collect()
    return {name: statistics.median(times[name]) / args.numel for name in CONTENDERS}


def part_b(args: argparse.Namespace, per_param: dict[str, float]) -> None:
    batch = torch.randn(args.batch, args.width)
    label = torch.randint(0, args.width, (args.batch,))
    models = {}
    for name in ("compute only", *CONTENDERS):
        torch.manual_seed(0)
        seq = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        placement = None
        if name == MASTERS:
            placement = roundpipe.MastersOnDisk(args.dir, copy_buffer_bytes=args.buffer_mib << 20)
        model = roundpipe.RoundPipe(
            seq.half(),
            optim_dtype=torch.float32,
            devices="cpu",
            model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2),
            state_placement=placement,
        )
        opt = None
        if name != "compute only":
            options = (
                {"state_dir": args.dir, "state_buffer_bytes": args.buffer_mib << 20}
                if name != "in RAM"
                else {}
            )
            opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-5, **options)
        models[name] = (model, opt)
    numel = sum(p.numel() for p in models["in RAM"][0].optim_parameters())

    def iteration(model, opt):
        model.forward_backward(
            input_args=(batch,), label=label, loss_fn=lambda o, y: F.cross_entropy(o.float(), y)
        )
        if opt is not None:
            model.step(lambda: (opt.step(), opt.zero_grad()))
        else:
            model.step(lambda: None)  # the gradients still move to the masters

    times: dict[str, list[float]] = {name: [] for name in models}
    for model, opt in models.values():
        for _ in range(2):
            iteration(model, opt)
        model.synchronize()
    for _ in range(args.rounds):
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            for _ in range(args.iters):
                iteration(model, opt)
            model.synchronize()  # the last step is charged to this mode
            times[name].append((time.perf_counter() - start) / args.iters)
    compute = statistics.median(times["compute only"])
    print(
        f"## b. training: {args.layers} fp16 Linear({args.width}, {args.width}), {numel / 1e6:.1f}M "
        f"params ({numel * 2 / 1e6:.0f} MB fp16, {numel * 8 / 1e6:.0f} MB of Adam state), async "
        f"step, median of {args.rounds} rounds x {args.iters} iterations, alternated\n"
    )
    print("| mode | ms/iteration | step alone (part a, scaled) ms | step hidden |")
    print("|---|---:|---:|---:|")
    print(f"| compute only | {compute * 1e3:.1f} | | |")
    for name in CONTENDERS:
        med = statistics.median(times[name])
        step = per_param[name] * numel
        hidden = 1 - max(med - compute, 0.0) / step
        print(f"| step {name} | {med * 1e3:.1f} | {step * 1e3:.1f} | {hidden:.0%} |")
    for _, opt in models.values():
        if opt is not None:
            opt.close()


MODES = ("no optimizer", *CONTENDERS)


def _rss() -> tuple[int, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _wrap(seq: nn.Module, placement: roundpipe.MastersOnDisk | None = None) -> roundpipe.RoundPipe:
    """Part c's model: two microbatches on one CPU device, no host memory check."""
    return roundpipe.RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices="cpu",
        memory_check=False,
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2),
        state_placement=placement,
    )


def _warm_up(width: int) -> None:
    """Train a two-layer model of the same width once, so that the RSS the runtime, its threads
    and torch's first use of each kernel take is in place before the measured model exists."""
    model = _wrap(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)).half())
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-5)
    batch, label = torch.randn(8, width), torch.randint(0, width, (8,))
    for _ in range(2):
        model.forward_backward(
            input_args=(batch,), label=label, loss_fn=lambda o, y: F.cross_entropy(o.float(), y)
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()


def rss_child(args: argparse.Namespace, mode: str) -> None:
    """One mode of part c, in this (fresh) process: prints one JSON line."""
    import json

    _warm_up(args.width)
    gc.collect()  # the warm-up model is gone
    before, _ = _rss()
    torch.manual_seed(0)
    # Made in fp16: an fp32 model cast down would leave its freed fp32 bytes in the heap.
    seq = nn.Sequential(
        *[nn.Linear(args.width, args.width, dtype=torch.float16) for _ in range(args.layers)]
    )
    placement = None
    if mode == MASTERS:
        placement = roundpipe.MastersOnDisk(args.dir, copy_buffer_bytes=args.buffer_mib << 20)
    model = _wrap(seq, placement)
    options = (
        {"state_dir": args.dir, "state_buffer_bytes": args.buffer_mib << 20}
        if mode != "in RAM"
        else {}
    )
    opt = None
    if mode != "no optimizer":
        opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-5, **options)
    batch = torch.randn(8, args.width)
    label = torch.randint(0, args.width, (8,))
    for _ in range(2):
        model.forward_backward(
            input_args=(batch,), label=label, loss_fn=lambda o, y: F.cross_entropy(o.float(), y)
        )
        # The gradients are kept: they are part of the state.
        model.step(lambda: opt.step() if opt is not None else None)
    model.synchronize()
    after, peak = _rss()
    numel = sum(p.numel() for p in model.optim_parameters())
    print(
        json.dumps({"mode": mode, "numel": numel, "growth": after - before, "peak": peak - before})
    )
    if opt is not None:
        opt.close()


def part_c(args: argparse.Namespace) -> None:
    import json
    import subprocess

    rows = []
    for mode in MODES:
        cmd = [sys.executable, __file__, "--rss-mode", mode, "--dir", args.dir]
        cmd += ["--width", str(args.width), "--layers", str(args.layers)]
        cmd += ["--buffer-mib", str(args.buffer_mib)]
        # A fixed mmap threshold: every large block is mapped on its own and unmapped when
        # freed, so RSS is what is live, not what glibc's heap kept of earlier frees.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    numel = rows[0]["numel"]
    base = rows[0]["growth"]
    print(
        f"## c. host RSS growth, {args.layers} fp16 Linear({args.width}, {args.width}), "
        f"{numel / 1e6:.1f}M params, wrap + 2 iterations, a fresh process per mode\n"
    )
    print(
        "| mode | RSS growth B/param | peak growth B/param | optimizer's share B/param "
        "(growth - no optimizer's) | planned B/param |"
    )
    print("|---|---:|---:|---:|---:|")
    for row, planned in zip(rows, ("10", "18", "10 + buffer", "6 + 2 buffers")):
        share = "" if row is rows[0] else f"{(row['growth'] - base) / numel:.2f}"
        print(
            f"| {row['mode']} | {row['growth'] / numel:.2f} | {row['peak'] / numel:.2f} | "
            f"{share} | {planned} |"
        )
    print(
        f"\n(each {args.buffer_mib} MiB buffer is {(args.buffer_mib << 20) / numel:.2f} B/param "
        f"here if every page of it is touched; the child trains a two-layer model first, so "
        f"the runtime's own RSS is mostly in place before the measured growth)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="state_dir (default: a temporary directory)")
    parser.add_argument("--numel", type=int, default=50_000_000, help="part a's params (50M)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="part a's steps per round")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16, help="part b: 16 x 1024^2 = 17M params")
    parser.add_argument(
        "--buffer-mib", type=int, default=256, help="state_buffer_bytes in MiB (default 256)"
    )
    parser.add_argument("--batch", type=int, default=8, help="part b's batch (2 microbatches)")
    parser.add_argument("--iters", type=int, default=3, help="part b's iterations per round")
    parser.add_argument("--part", choices=["a", "b", "ab", "c", "abc"], default="abc")
    parser.add_argument("--rss-mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_mode:
        rss_child(args, args.rss_mode)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        print(
            f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"os.cpu_count()={os.cpu_count()}, state_dir on {_filesystem(tmp)}\n"
        )
        if "a" in args.part:
            per_param = part_a(args)
            if "b" in args.part:
                part_b(args, per_param)
        if "c" in args.part:
            part_c(args)


def _filesystem(path: str) -> str:
    best = ("?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if path.startswith(mount) and len(mount) >= len(best[0]):
                    best = (mount, f"{device} ({fstype}, mounted at {mount})")
    except OSError:
        pass
    return best[1]


if __name__ == "__main__":
    main()
