"""GPU benchmark: a GPT-style decoder-only transformer trained with roundpipe and with plain
PyTorch on the same GPU, in one run; tokens/s for each microbatch count, peak GPU memory and
peak host RSS, with ratios against plain PyTorch measured in the same run.

    python benchmarks/bench_gpu.py                                  # on a CUDA machine
    python benchmarks/bench_gpu.py --layers 24 --dim 2048 --microbatches 4 8 16
    python benchmarks/bench_gpu.py --devices emu                    # tests the script only

The model is an ``nn.Sequential``: a token + position embedding, ``--layers`` pre-norm
transformer blocks (causal ``scaled_dot_product_attention``, 4x GELU MLP, no dropout) and a
final LayerNorm + LM head (not tied to the embedding). Each is one roundpipe stage. The data is
one batch of random tokens, made here, used for every iteration.

Variants, each on the same model (same seed), data, microbatches, loss, GradScaler and Adam
hyperparameters, run one after the other (each freed before the next):

(1) roundpipe: ``RoundPipe(model.to(dtype), optim_dtype=torch.float32)`` on the ``--devices``
    pool, ``roundpipe.optim.Adam`` built in ``OptimizerCtx``, ``roundpipe.GradScaler``, the
    README loop with the asynchronous step. Parameters, fp32 masters and Adam state live in
    host memory.
(2) plain PyTorch: the same low-precision model resident on the GPU, fp32 master copies and
    ``torch.optim.Adam(fused=True)`` state on the GPU, ``torch.amp.GradScaler``, the same
    microbatches one after another (gradient accumulation).
(3) as (2), with ``torch.utils.checkpoint`` (non-reentrant) around the embedding and every
    block: the recompute roundpipe does (its last stage, the head, is not checkpointed either).

Why (2) computes with a low-precision model and fp32 masters rather than ``torch.autocast``
over fp32 weights: that is the computation roundpipe runs (the same kernels in the same dtype,
the same fp32 update), so the difference measured is roundpipe's runtime (host-resident state,
uploads, the schedule, the optimizer on the host), not a different recipe. autocast would run
norms and softmax in fp32 and cast every weight on each microbatch. Plain PyTorch sums each
gradient into its master's fp32 ``.grad`` as autograd produces it (a post-accumulate-grad hook
that then drops the low-precision ``.grad``), as roundpipe does, instead of accumulating the
microbatches in fp16.

Timing: after ``--warmup`` iterations, ``--iters`` iterations between two device
synchronizations (roundpipe: ``model.synchronize()`` on both sides, so the window holds exactly
``--iters`` forward_backward calls and ``--iters`` optimizer steps). Peak GPU memory:
``max_memory_allocated`` of the device's module after ``reset_peak_memory_stats`` at the start
of the timed window (roundpipe on several GPUs: the largest device's); the emulated device
counts its memory exactly too (no caching allocator), so ``--devices emu`` reports it. Peak host RSS: the process's
resident set (psutil's ``memory_info().rss`` if installed, else ``VmRSS`` of
/proc/self/status), sampled every 10 ms during the timed window; it includes whatever the
process held before the variant (torch, the CUDA context), which the header prints.

Targets (the issue's, on a GPU), printed beside the measured values:

* roundpipe >= 0.85x the tokens/s of plain PyTorch with the same recompute (3), per
  microbatch count;
* roundpipe's tokens/s does not fall as microbatches grow: every count within 5% of the
  smallest count's, or above;
* roundpipe's GPU peak <= 2 stages + activations, where a stage is the largest layer's
  low-precision parameters plus their gradients, and activations are measured: the GPU peak of
  a (3)-style forward+backward of the whole batch whose parameter gradients are dropped as
  they are produced, minus the memory allocated before it.

``--device-grad-dtype fp16`` runs roundpipe with ``RoundPipeRunConfig(device_grad_dtype=...)``:
gradient sums on the device in that dtype rather than fp32, which the memory target's "stage"
(low-precision parameters plus low-precision gradients) assumes. ``--offload-activations`` runs
it with ``offload_activations=True``: a stage-major schedule keeps every microbatch's stage
inputs until the backward pass, where plain PyTorch's gradient accumulation keeps one
microbatch's at a time (the activations of the memory target are measured that way).

Without CUDA the script says so and exits 0, unless ``--allow-cpu`` or ``--devices cpu`` /
``emu`` is given: then it runs a tiny configuration (sizes not given on the command line) on
that device, so the script itself can be tested; those numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is benchmarked)
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig  # noqa: E402
from roundpipe.devices import ENV_VAR, parse_devices  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Sizes when a GPU runs the script: about 0.7B parameters, so that plain PyTorch still fits on
# one 80 GB GPU (its resident state is about 18 bytes per parameter) and can be compared.
GPU_SIZES = dict(
    layers=12,
    dim=2048,
    heads=16,
    seq=1024,
    vocab=32000,
    batch=16,
    microbatches=[4, 8, 16],
    iters=5,
    warmup=2,
)
# Sizes of the script test on a CPU or the emulated device.
TINY_SIZES = dict(
    layers=2, dim=32, heads=2, seq=16, vocab=64, batch=4, microbatches=[1, 2], iters=2, warmup=1
)

TARGET_VS_CKPT = 0.85
TARGET_TREND = 0.95  # "not falling": within 5% of the smallest count's tokens/s, or above

VARIANTS = ("roundpipe", "plain PyTorch", "plain PyTorch + checkpoint")


# -- model ------------------------------------------------------------------------------------


class Embedding(nn.Module):
    def __init__(self, vocab, seq, dim):
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.token(idx) + self.position(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def build_model(args, dtype):
    """On the host, layer by layer: each is initialised in fp32 and cast before the next is
    made, so the host never holds the whole model in fp32. Same seed, same weights."""
    torch.manual_seed(0)
    layers = [Embedding(args.vocab, args.seq, args.dim).to(dtype)]
    layers += [Block(args.dim, args.heads).to(dtype) for _ in range(args.layers)]
    layers.append(Head(args.dim, args.vocab).to(dtype))
    return nn.Sequential(*layers)


def loss_of(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- measuring --------------------------------------------------------------------------------


def _rss_reader():
    """A function returning the process's resident set in bytes, and what it reads."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        proc = psutil.Process()
        return (lambda: proc.memory_info().rss), "psutil memory_info().rss"
    if os.path.exists("/proc/self/status"):

        def read():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
            return 0

        return read, "VmRSS of /proc/self/status"
    return None, "not available on this system"


class _RSSSampler:
    """Samples the resident set every ``period`` seconds on a thread, between start and stop."""

    def __init__(self, read, period=0.01):
        self.read, self.period = read, period
        self.peak = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.read is not None:
            self.peak = self.read()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.read())


class Bench:
    """The device, the data and the measurement of one variant's iterations."""

    def __init__(self, args, pool, dtype):
        self.args, self.pool, self.dtype = args, pool, dtype
        self.device = pool[0].torch_device  # where the plain variants run
        self.on_gpu = self.device.type == "cuda"
        self.devmod = torch.get_device_module(self.device.type)
        # CUDA and the emulated device count device memory (the emulated one exactly, without
        # a caching allocator's rounding); the CPU has none of its own.
        self.measures_memory = self.device.type != "cpu"
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.read_rss, self.rss_what = _rss_reader()

    def sync(self):
        for d in self.pool:  # every device of the pool, not only the current one
            if d.type != "cpu":
                torch.accelerator.synchronize(d.torch_device)

    def measure(self, iteration, finish, devices):
        """Warm up, then time ``--iters`` calls of ``iteration``; tokens/s, GPU peak (bytes or
        None), host RSS peak (bytes or None). ``finish`` drains asynchronous work."""
        args = self.args
        for _ in range(args.warmup):
            iteration()
        finish()
        self.sync()
        if self.measures_memory:
            for d in devices:
                self.devmod.reset_peak_memory_stats(d)
        with _RSSSampler(self.read_rss) as rss:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                iteration()
            finish()
            self.sync()
            elapsed = time.perf_counter() - t0
        gpu_peak = (
            max(self.devmod.max_memory_allocated(d) for d in devices)
            if self.measures_memory
            else None
        )
        return dict(tps=args.iters * args.batch * args.seq / elapsed, gpu=gpu_peak, rss=rss.peak)

    def free(self):
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()


# -- (1) roundpipe ----------------------------------------------------------------------------


def run_roundpipe(bench, spec):
    args, results = bench.args, {}
    model = RoundPipe(build_model(args, bench.dtype), optim_dtype=torch.float32, devices=spec)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-4)
    scaler = GradScaler()
    devices = [d.torch_device for d in bench.pool]
    for M in args.microbatches:
        cfg = RoundPipeRunConfig(
            num_microbatch=M,
            device_grad_dtype=bench.grad_dtype,
            offload_activations=bench.args.offload_activations,
        )

        def iteration(M=M, cfg=cfg):
            model.forward_backward(
                input_args=(bench.x,),
                label=bench.y,
                run_config=cfg,
                loss_fn=lambda out, lbl: scaler.scale(loss_of(out, lbl)) / M,
            )
            model.step(lambda: (scaler.step(opt), opt.zero_grad()))
            scaler.update()

        try:
            results[M] = bench.measure(iteration, model.synchronize, devices)
        except torch.OutOfMemoryError:  # re-raised on this thread as its own type
            results[M] = "OOM"
            model.synchronize()
    model = opt = scaler = None  # noqa: F841 -- frees the model before the next run
    bench.free()
    return results


# -- (2) and (3) plain PyTorch ----------------------------------------------------------------


class Plain:
    """The low-precision model resident on ``device`` with fp32 masters there; ``ckpt``: the
    embedding and every block under non-reentrant checkpoint, the head not (as roundpipe)."""

    def __init__(self, bench, ckpt):
        self.bench, self.ckpt = bench, ckpt
        self.model = build_model(bench.args, bench.dtype).to(bench.device)
        self.layers = list(self.model.children())
        self.params = [p for p in self.model.parameters()]
        self.x, self.y = bench.x.to(bench.device), bench.y.to(bench.device)
        self.masters = None
        self.sum_into_masters = False
        # A hook that holds this object makes a cycle through the parameters that torch's
        # garbage collector cannot free (a tensor's hooks are traversed only while Python
        # alone owns it): close() removes them, or the model would stay on the device and
        # count in the next variant's peak.
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self.params]

    def close(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def _grad_hook(self, p):
        # The gradient leaves the low-precision .grad at once: summed in fp32 into the master
        # (as roundpipe sums into its masters), or dropped by the activation probe.
        if self.sum_into_masters:
            m = self.master_of[p]
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
        p.grad = None

    def start_training(self):
        self.masters = [p.detach().float() for p in self.params]
        for m in self.masters:
            m.requires_grad_(True)
        self.master_of = dict(zip(self.params, self.masters))
        fused = self.bench.device.type in ("cuda", "cpu")  # the emulated device has no fused Adam
        self.opt = torch.optim.Adam(self.masters, lr=1e-4, fused=fused)
        self.scaler = torch.amp.GradScaler(self.bench.device.type)
        self.sum_into_masters = True

    def forward_backward(self, M, scale=lambda loss: loss):
        last = len(self.layers) - 1
        for xm, ym in zip(self.x.tensor_split(M), self.y.tensor_split(M)):
            h = xm
            for i, layer in enumerate(self.layers):
                h = (
                    checkpoint(layer, h, use_reentrant=False)
                    if self.ckpt and i < last
                    else layer(h)
                )
            (scale(loss_of(h, ym)) / M).backward()

    def iteration(self, M):
        self.forward_backward(M, self.scaler.scale)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def activation_bytes(self, M):
        """GPU peak of a forward+backward of the batch in M microbatches whose gradients are
        dropped as produced, minus what was allocated before it: the activations."""
        self.bench.sync()
        devmod = self.bench.devmod
        base = devmod.memory_allocated(self.bench.device)
        devmod.reset_peak_memory_stats(self.bench.device)
        self.forward_backward(M)
        self.bench.sync()
        return devmod.max_memory_allocated(self.bench.device) - base


def run_plain(bench, ckpt):
    args, results, activations = bench.args, {}, {}
    plain, failed = None, False
    try:
        plain = Plain(bench, ckpt)
        if (
            ckpt and bench.measures_memory
        ):  # before the masters exist, so nothing else is in the peak
            for M in args.microbatches:
                try:
                    activations[M] = plain.activation_bytes(M)
                except torch.OutOfMemoryError:
                    activations[M] = None
        plain.start_training()
    except torch.OutOfMemoryError:
        failed = True
    if failed:  # out here, where the exception no longer holds the frames' tensors
        if plain is not None:
            plain.close()
        plain = None
        bench.free()
        return {M: "OOM" for M in args.microbatches}, activations
    for M in args.microbatches:
        try:
            results[M] = bench.measure(lambda M=M: plain.iteration(M), lambda: None, [bench.device])
        except torch.OutOfMemoryError:
            results[M] = "OOM"
            # The next count starts clean: no partial gradient sums, and a scaler that may have
            # been stopped between unscale_ and update.
            plain.opt.zero_grad(set_to_none=True)
            plain.scaler = torch.amp.GradScaler(bench.device.type)
    plain.close()
    plain = None
    bench.free()
    return results, activations


# -- report -----------------------------------------------------------------------------------


def _gib(n):
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f}" if n >= 2**24 else f"{n / 2**30:.6f}"  # tiny runs: still visible


def _ratio(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return f"{a['tps'] / b['tps']:.3f}"
    return "n/a"


def _met(ok):
    return "met" if ok else "NOT met"


def report(bench, results, activations, stage_bytes):
    args = bench.args
    print()
    print(
        "| variant | microbatches | tokens/s | vs plain PyTorch | vs plain PyTorch + checkpoint "
        "| GPU peak GiB | host RSS peak GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for M in args.microbatches:
        plain, ckpt = results["plain PyTorch"][M], results["plain PyTorch + checkpoint"][M]
        for name in VARIANTS:
            r = results[name][M]
            if not isinstance(r, dict):
                print(f"| {name} | {M} | {r} | | | | |")
                continue
            print(
                f"| {name} | {M} | {r['tps']:,.0f} | {_ratio(r, plain)} | {_ratio(r, ckpt)} "
                f"| {_gib(r['gpu'])} | {_gib(r['rss'])} |"
            )

    print()
    note = "" if bench.on_gpu else "   [no GPU: not a measurement of the target]"
    print(f"Targets (the issue's, on a GPU):{note}")
    rp, ck = results["roundpipe"], results["plain PyTorch + checkpoint"]
    for M in args.microbatches:
        if isinstance(rp[M], dict) and isinstance(ck[M], dict):
            ratio = rp[M]["tps"] / ck[M]["tps"]
            verdict = _met(ratio >= TARGET_VS_CKPT)
            print(
                f"  roundpipe / plain PyTorch + checkpoint, {M:3d} microbatches: {ratio:.3f}  "
                f"(target >= {TARGET_VS_CKPT})  {verdict}"
            )
        else:
            print(
                f"  roundpipe / plain PyTorch + checkpoint, {M:3d} microbatches: n/a "
                f"(roundpipe {rp[M] if not isinstance(rp[M], dict) else 'ran'}, plain "
                f"{ck[M] if not isinstance(ck[M], dict) else 'ran'})"
            )
    measured = [M for M in args.microbatches if isinstance(rp[M], dict)]
    if len(measured) >= 2:
        first = min(measured)
        rel = {M: rp[M]["tps"] / rp[first]["tps"] for M in sorted(measured)}
        shown = ", ".join(
            f"{M}: {rel[M]:.3f}" if M in rel else f"{M}: {rp[M]}" for M in args.microbatches
        )
        ok = min(rel.values()) >= TARGET_TREND and len(rel) == len(args.microbatches)
        print(
            f"  roundpipe tokens/s against {first} microbatches: {shown}  (target: none "
            f"below {TARGET_TREND})  {_met(ok)}"
        )
        # With a fixed batch, more microbatches are smaller ones, which a GPU runs less
        # efficiently whatever the runtime: the baseline's own trend separates the two.
        if all(isinstance(ck[M], dict) for M in measured):
            base = ", ".join(
                f"{M}: {ck[M]['tps'] / ck[first]['tps']:.3f}" for M in sorted(measured)
            )
            print(f"    (plain PyTorch + checkpoint, the same way: {base})")
    else:
        print(
            "  roundpipe tokens/s as microbatches grow: n/a (needs two or more --microbatches "
            "that ran)"
        )
    if bench.measures_memory:
        where = "GPU" if bench.on_gpu else f"{bench.device.type} (emulated, exact counts)"
        print(
            f"  device memory on {where}; gradient sums in "
            f"{args.device_grad_dtype or 'fp32 (the masters dtype)'}; stage inputs "
            f"{'offloaded to the host' if args.offload_activations else 'kept on the device'}"
        )
        for M in args.microbatches:
            act = activations.get(M)
            if not isinstance(rp[M], dict) or act is None:
                print(f"  roundpipe GPU peak, {M:3d} microbatches: n/a (a run did not complete)")
                continue
            bound = 2 * stage_bytes + act
            print(
                f"  roundpipe GPU peak, {M:3d} microbatches: {_gib(rp[M]['gpu'])} GiB  "
                f"(target <= 2 stages {_gib(2 * stage_bytes)} + activations {_gib(act)} = "
                f"{_gib(bound)} GiB)  {_met(rp[M]['gpu'] <= bound)}"
            )
    else:
        print("  roundpipe GPU peak <= 2 stages + activations: n/a (no GPU memory to measure)")


# -- main -------------------------------------------------------------------------------------


def _no_gpu(why):
    print(
        f"No GPU: {why}. This benchmark measures roundpipe on a GPU, so there is nothing to "
        f"measure here. `--allow-cpu`, `--devices cpu` or `--devices emu` runs a tiny "
        f"configuration that tests the script (its numbers say nothing about a GPU)."
    )
    return 0


def resolve_pool(parser, args):
    """The pool as roundpipe resolves ``devices=`` (then $ROUNDPIPE_DEVICES, then every CUDA
    device), except that the CPU fallback needs --allow-cpu. None: say so and stop."""
    spec = args.devices or os.environ.get(ENV_VAR, "").strip() or None
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if spec is None:
        spec = "cuda" if cuda else ("cpu" if args.allow_cpu else None)
    elif spec.strip().lower().startswith("cuda") and not cuda:
        if not args.allow_cpu:
            return None, f"--devices {spec} but CUDA is not available (torch {torch.__version__})"
        print(f"--devices {spec}: CUDA is not available, --allow-cpu: running on the CPU")
        spec = "cpu"
    if spec is None:
        return None, f"CUDA is not available (torch {torch.__version__})"
    try:
        return (spec, parse_devices(spec)), None
    except ValueError as exc:
        parser.error(str(exc))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, help="transformer blocks")
    parser.add_argument("--dim", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int, help="tokens per sequence")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--batch", type=int, help="sequences per iteration")
    parser.add_argument("--microbatches", type=int, nargs="+", help="one or more counts")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--iters", type=int, help="timed iterations per variant and count")
    parser.add_argument("--warmup", type=int, help="untimed iterations before them")
    parser.add_argument("--devices", help="roundpipe's pool: cuda, cuda:0, cuda:0,1, cpu, emu")
    parser.add_argument(
        "--device-grad-dtype",
        choices=sorted(DTYPES),
        help="roundpipe's RoundPipeRunConfig(device_grad_dtype=...): the dtype "
        "gradients are summed in on the device (default: fp32, the "
        "masters')",
    )
    parser.add_argument(
        "--offload-activations",
        action="store_true",
        help="roundpipe's RoundPipeRunConfig(offload_activations=True): the "
        "stage inputs of every microbatch wait in pinned host memory",
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without CUDA, run a tiny configuration on the CPU"
    )
    args = parser.parse_args()

    resolved, why = resolve_pool(parser, args)
    if resolved is None:
        return _no_gpu(why)
    spec, pool = resolved
    on_gpu = pool[0].type == "cuda"
    for key, value in (GPU_SIZES if on_gpu else TINY_SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be at least 1 and --warmup at least 0")
    if any(M < 1 or M > args.batch for M in args.microbatches):
        parser.error(f"each --microbatches count must be between 1 and --batch {args.batch}")
    args.microbatches = sorted(set(args.microbatches))
    dtype = DTYPES[args.dtype]

    if on_gpu:
        names = ", ".join(f"{d}: {torch.cuda.get_device_name(d.index)}" for d in pool)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {names}")
        torch.cuda.init()  # the CUDA context is part of every variant's host RSS, not only the first's
    else:
        # Tiny tensors: on a busy machine, each parallel region of several intra-op threads
        # would wait for a descheduled one (milliseconds per op), which only slows the test down.
        torch.set_num_threads(1)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread; pool "
            f"{', '.join(map(str, pool))}"
        )
        print(
            "NOT A GPU RUN: a tiny configuration on "
            f"{pool[0].type}, to test the script. These numbers say nothing about a GPU."
        )

    bench = Bench(args, pool, dtype)
    bench.grad_dtype = DTYPES[args.device_grad_dtype] if args.device_grad_dtype else None
    with torch.device("meta"):  # sizes only
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in build_model(args, dtype)]
    n_params = sum(sizes)
    elem = torch.finfo(dtype).bits // 8
    stage_bytes = max(sizes) * elem * 2  # its low-precision parameters and their gradients
    print(
        f"GPT: {args.layers} blocks, dim {args.dim}, {args.heads} heads, seq {args.seq}, vocab "
        f"{args.vocab}: {n_params / 1e6:.2f}M params ({args.dtype}), largest stage "
        f"{max(sizes) / 1e6:.2f}M; batch {args.batch} x {args.seq} = "
        f"{args.batch * args.seq} tokens per iteration; microbatches "
        f"{' '.join(map(str, args.microbatches))}; {args.warmup} warm-up + {args.iters} timed "
        f"iterations per variant and count"
    )
    print(
        f"roundpipe on {', '.join(map(str, pool))}; plain PyTorch on {bench.device} "
        f"(low-precision model, fp32 masters and fused Adam on the device); host RSS: "
        f"{bench.rss_what}, sampled every 10 ms in the timed window; "
        f"{_gib(bench.read_rss() if bench.read_rss else None)} GiB before the variants"
    )
    if len(pool) > 1:
        print(f"NOTE: roundpipe uses {len(pool)} devices, plain PyTorch one")

    # Plain first, roundpipe last: each runs alone, and what a variant leaves in the process's
    # heap then inflates only roundpipe's host RSS, which holds the whole model state anyway.
    results, activations = {}, {}
    t0 = time.perf_counter()
    results["plain PyTorch"], _ = run_plain(bench, ckpt=False)
    results["plain PyTorch + checkpoint"], activations = run_plain(bench, ckpt=True)
    results["roundpipe"] = run_roundpipe(bench, spec)
    report(bench, results, activations, stage_bytes)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
