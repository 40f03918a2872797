"""Where a roundpipe iteration's time goes on a GPU: one iteration under torch.profiler, beside the
plan's own priced timeline (roundpipe.plan.price) for the same model, batch and run config.

    python benchmarks/profile_gpu.py --out DIR                 # on a CUDA machine
    python benchmarks/profile_gpu.py --devices emu --out DIR   # tests the script (tiny sizes)

The model is bench_gpu.py's GPT (an nn.Sequential: embedding, --layers blocks, head; fp16, fp32
masters), trained by the README loop at roundpipe's defaults (Adam, GradScaler, async step).

What it measures, in order:

1. The measured iteration: --iters iterations back to back after --warmup, between two
   ``model.synchronize()`` calls, seconds per iteration (the optimizer step overlaps the next
   iteration, as in a real run).
2. The price: each stage's forward and backward of one microbatch, timed alone on the first
   device (CUDA events; wall clock elsewhere), medians of 3; the host time to enqueue a stage's
   forward and backward; the host-to-device bandwidth of a pinned copy of the largest stage.
   With these, ``price(model.plan(...), Costs(...))`` gives the planned iteration time, its
   compute time and the compute stream's idle time; the ratio measured / priced is printed.
   The optimizer thread's step is timed alone too (synchronous), and so is a forward_backward
   with no step in flight: the price overlaps the two with ``--contention`` (the host they
   share), and the contention the measured iteration shows beside them is printed.
3. The profile: two more iterations under ``torch.profiler`` (host and device activity), the
   device time split into kernels, host-to-device and device-to-host copies, the busy share of
   the iteration's wall time (the union of kernel intervals), and the top operators by device
   and by host time.

Writes under --out: ``trace.json.gz`` (Chrome trace: open it in Perfetto or chrome://tracing)
and ``timeline.json`` (the priced plan: one span per action and stream). Everything else is
printed. Without CUDA and without --devices, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import build_model, loss_of  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig  # noqa: E402
from roundpipe.plan import HOST_CONTENTION, Costs, contention_shown, overlapped, price  # noqa: E402

PROFILED = 2  # iterations under the profiler
GPU_SIZES = dict(layers=12, dim=2048, heads=16, seq=1024, vocab=32000, batch=16)
TINY_SIZES = dict(layers=2, dim=32, heads=2, seq=16, vocab=64, batch=4)


class _Clock:
    """Device time of a callable: CUDA events on a GPU, wall clock between synchronizations
    elsewhere. Also the host time the call took to return (what enqueuing it costs)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.module = torch.get_device_module(device.type) if device.type != "cpu" else None

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize(self.device)

    def time(self, fn, repeats: int = 3) -> tuple[float, float]:
        """(device seconds, host seconds), medians of ``repeats`` after one warm-up call."""
        fn()
        device_s, host_s = [], []
        for _ in range(repeats):
            self.sync()
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t0 = time.perf_counter()
            fn()
            host_s.append(time.perf_counter() - t0)
            if self.cuda:
                end.record()
                end.synchronize()
                device_s.append(start.elapsed_time(end) / 1e3)
            else:
                self.sync()
                device_s.append(time.perf_counter() - t0)
        return statistics.median(device_s), statistics.median(host_s)


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def stage_costs(seq: nn.Sequential, x, y, device, clock: _Clock):
    """Per layer: (forward s, backward s, issue s) of one microbatch on ``device``, each layer
    on a copy of itself fed the previous layer's output."""
    forward, backward, issue = [], [], []
    h = x.to(device)
    last = len(seq) - 1
    for i, layer in enumerate(seq):
        dev_layer = _copy_to(layer, device)
        inp = h.detach().requires_grad_(h.is_floating_point())

        def fwd(layer=dev_layer, inp=inp):
            with torch.no_grad():
                return layer(inp)

        def fwd_bwd(layer=dev_layer, inp=inp, i=i):
            out = layer(inp)
            if i == last:
                loss_of(out, y.to(device)).backward()
            else:
                out.backward(torch.ones_like(out))

        f, _ = clock.time(fwd)
        fb, host = clock.time(fwd_bwd)
        forward.append(f)
        backward.append(max(fb - f, 0.0))  # backward alone: the price adds recompute's forward
        issue.append(host)
        with torch.no_grad():
            h = dev_layer(inp)
        del dev_layer
    return forward, backward, issue


def _copy_to(layer: nn.Module, device) -> nn.Module:
    import copy

    return copy.deepcopy(layer).to(device)


def host_bandwidth(nbytes: int, device, clock: _Clock) -> float:
    """Bytes per second of one pinned host-to-device copy of ``nbytes``."""
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds, _ = clock.time(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / max(seconds, 1e-9)


def _device_time(evt) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def profile_summary(prof, wall_s: float) -> str:
    """Device time per kind (kernels, copies each way), busy share of the wall time, top ops."""
    kinds: dict[str, float] = {}
    kernels: list[tuple[float, float]] = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = evt.time_range.start, evt.time_range.end
        name = evt.name
        if name.startswith("Memcpy") or name.startswith("Memset"):
            kind = " ".join(name.split()[:2])
        else:
            kind = "kernels"
            kernels.append((start, end))
        kinds[kind] = kinds.get(kind, 0.0) + (end - start) / 1e6
    busy, end_ = 0.0, float("-inf")
    for s, e in sorted(kernels):
        if s > end_:
            busy += e - s
            end_ = e
        elif e > end_:
            busy += e - end_
            end_ = e
    lines = [f"profiled: {PROFILED} iterations and the last step, {wall_s:.4f} s wall"]
    threads: dict[int, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and evt.cpu_parent is None:
            threads[evt.thread] = threads.get(evt.thread, 0.0) + evt.time_range.elapsed_us() / 1e6
    for thread, seconds in sorted(threads.items(), key=lambda kv: -kv[1]):
        lines.append(f"  host thread {thread}: {seconds:.4f} s in top-level ops")
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  device {kind}: {seconds:.4f} s ({seconds / wall_s:.0%} of the wall)")
    if kernels:
        lines.append(
            f"  kernels busy (union): {busy / 1e6:.4f} s = {busy / 1e6 / wall_s:.0%} of the wall"
        )
    averages = prof.key_averages()
    sort_device = "self_device_time_total"
    try:
        lines.append(averages.table(sort_by=sort_device, row_limit=25))
    except (AttributeError, KeyError):
        lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=25))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    return "\n".join(lines)


def _all_threads():
    """The profiler's config that records the device workers' and the optimizer thread's ops too
    (and CUDA synchronizations), where this torch has it; else None (the calling thread only)."""
    config = torch._C._profiler._ExperimentalConfig
    for kwargs in (dict(profile_all_threads=True, enable_cuda_sync_events=True), {}):
        try:
            return config(**kwargs) if kwargs else None
        except TypeError:
            continue
    return None


def pool_and_sizes(args, gpu_sizes: dict, tiny_sizes: dict) -> str | None:
    """The pool to run on (``--devices``, else ``$ROUNDPIPE_DEVICES``, else ``cuda:0`` where CUDA
    is there; None: none), with each size ``args`` leaves unset taken from ``gpu_sizes`` on a
    GPU and from ``tiny_sizes`` elsewhere."""
    cuda = torch.cuda.is_available()
    spec = args.devices or os.environ.get("ROUNDPIPE_DEVICES") or ("cuda:0" if cuda else None)
    if spec is None:
        return None
    for key, value in (gpu_sizes if spec.startswith("cuda") else tiny_sizes).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return spec


def profile_steady_state(iteration, synchronize, on_gpu: bool, out_dir: Path):
    """Two iterations back to back (the second overlaps the first's step, as in a run), then
    the last step, under torch.profiler: the steady state, not one iteration alone. Writes
    ``trace.json.gz`` under ``out_dir``; returns the profile and the wall seconds."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, experimental_config=_all_threads()) as prof:
        t0 = time.perf_counter()
        for _ in range(PROFILED):
            iteration()
        synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(out_dir / "trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    return prof, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in GPU_SIZES:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--devices", help="roundpipe's pool (default: cuda:0 if CUDA is there)")
    parser.add_argument("--out", default="profile_out", help="folder for the trace and timeline")
    parser.add_argument(
        "--contention",
        type=float,
        default=HOST_CONTENTION,
        help="the price's host contention between the step and the devices (Costs.contention; "
        f"default {HOST_CONTENTION}, what GPU machines measured)",
    )
    args = parser.parse_args()

    spec = pool_and_sizes(args, GPU_SIZES, TINY_SIZES)
    if spec is None:
        print("No GPU: CUDA is not available; --devices emu (or cpu) tests the script.")
        return 0
    on_gpu = spec.startswith("cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    M = args.microbatches

    seq = build_model(args, dtype)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    n_params = sum(p.numel() for p in seq.parameters())
    print(
        f"torch {torch.__version__}; pool {spec}; GPT {args.layers} blocks, dim {args.dim}, seq "
        f"{args.seq}, batch {args.batch}, {M} microbatches, {n_params / 1e6:.1f}M params "
        f"({args.dtype})"
    )

    # The price's inputs first, on copies of the layers, before roundpipe pins the model.
    device = roundpipe.devices.resolve_devices(spec)[0].torch_device
    clock = _Clock(device)
    mb = args.batch // M
    forward, backward, issue = stage_costs(seq, x[:mb], y[:mb], device, clock)
    upload = [_nbytes(layer) for layer in seq]
    grads = [sum(p.numel() for p in layer.parameters()) * 4 for layer in seq]  # fp32 sums
    bandwidth = host_bandwidth(max(upload), device, clock)
    if on_gpu:
        torch.cuda.empty_cache()

    model = RoundPipe(seq, optim_dtype=torch.float32, devices=spec)
    cfg = RoundPipeRunConfig(num_microbatch=M)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-4)
    scaler = GradScaler()

    def iteration():
        model.forward_backward(
            input_args=(x,),
            label=y,
            run_config=cfg,
            loss_fn=lambda out, lbl: scaler.scale(loss_of(out, lbl)) / M,
        )
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()

    for _ in range(args.warmup):
        iteration()
    model.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        iteration()
    model.synchronize()
    measured = (time.perf_counter() - t0) / args.iters

    # The devices' share alone: a forward_backward with no step in flight, then the optimizer
    # thread's share alone: one step and the master->model copy after it.
    t0 = time.perf_counter()
    model.forward_backward(
        input_args=(x,),
        label=y,
        run_config=cfg,
        loss_fn=lambda out, lbl: scaler.scale(loss_of(out, lbl)) / M,
    )
    model.synchronize()
    fb_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # a synchronous step: the step, then the master->model copy
    model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
    step_s = time.perf_counter() - t0
    scaler.update()

    costs = Costs(
        forward,
        backward,
        upload,
        grads,
        bandwidth,
        issue=issue,
        optimizer=step_s,
        contention=args.contention,
    )
    plan = model.plan(cfg, inputs=((x,), {}))
    timeline = price(plan, costs)
    apart = overlapped(timeline.device_time, step_s, 0.0)
    tokens = args.batch * args.seq
    print(f"measured: {measured:.4f} s/iteration ({tokens / measured:,.0f} tokens/s)")
    print(
        f"priced:   {timeline.iteration_time:.4f} s/iteration (devices {timeline.device_time:.4f} "
        f"s, optimizer thread {step_s:.4f} s: "
        f"{'optimizer' if timeline.optimizer_bound else 'device'}-bound, contention "
        f"{args.contention}); compute {timeline.compute_time():.4f} s; compute stream idle "
        f"{timeline.compute_idle(0):.4f} s; measured/priced "
        f"{measured / timeline.iteration_time:.2f} (without contention "
        f"{measured / apart:.2f}); optimizer thread's threads "
        f"{roundpipe.optim_thread.get_num_threads()} of {torch.get_num_threads()}"
    )
    # The contention this run shows: measured against its two sides, each timed alone.
    shown = contention_shown(measured, fb_s, step_s)
    print(
        f"alone:    forward_backward {fb_s:.4f} s, step {step_s:.4f} s; the iteration's "
        f"contention {'not shown (one side under a tenth of the other)' if shown is None else round(shown, 2)} "
        f"(the price's {args.contention})"
    )
    print(
        f"price inputs: forward {sum(forward) * 1e3:.2f} ms, backward {sum(backward) * 1e3:.2f} "
        f"ms, issue {sum(issue) * 1e3:.2f} ms per microbatch over all stages; uploads "
        f"{sum(upload) / 2**20:.1f} MiB, gradient sums {sum(grads) / 2**20:.1f} MiB, host link "
        f"{bandwidth / 2**30:.1f} GiB/s"
    )
    for i in range(len(seq)):
        print(
            f"  stage {i}: fwd {forward[i] * 1e3:.3f} ms bwd {backward[i] * 1e3:.3f} ms issue "
            f"{issue[i] * 1e3:.3f} ms upload {upload[i] / 2**20:.1f} MiB "
            f"({upload[i] / bandwidth * 1e3:.3f} ms)"
        )
    spans = [
        dict(
            device=s.device,
            stream=s.stream,
            action=str(s.action),
            start=s.start,
            end=s.end,
        )
        for s in timeline.spans
    ]
    (out_dir / "timeline.json").write_text(
        json.dumps(dict(iteration_time=timeline.iteration_time, measured=measured, spans=spans))
    )

    prof, wall = profile_steady_state(iteration, model.synchronize, on_gpu, out_dir)
    print(profile_summary(prof, wall))
    print(f"wrote {out_dir / 'trace.json.gz'} and {out_dir / 'timeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
