"""Memory benchmarks: what pinning costs the host, and memory plans against what a run takes.

(a) host bytes per parameter of a model's pinned copy, on the emulated device (whose pinned
    allocator rounds each allocation up to a power of two, as CUDA's caching host allocator
    does, and counts it exactly): unpinned (the model as built), pinned tensor by tensor
    (``t.pin_memory()``, what roundpipe did before) and pinned from the pool (``pin_module``),
    as ratios against the unpinned baseline measured in the same run; for a Llama-shaped and a
    GPT-2-shaped model (a few layers each: the ratios depend on the shapes, not the depth).
(b) the memory plan's host terms against the process's RSS growth over the wrap and two Adam
    steps, in a fresh process per model (RSS is noisy: the allocator keeps freed pages, and the
    emulated device's pinned rounding is address space the process never touches, so RSS shows
    the bytes used, not the rounding; on CUDA pinned pages are locked, rounding included).
(c) the memory plan's device peak against the peak the emulated device measures for a real
    ``forward_backward`` of the same batch, for a few shapes and pools.

    python benchmarks/bench_memory.py [--part a,b,c]
"""

import argparse
import gc
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, pin_module
from roundpipe.devices import pinned as hm
from roundpipe.memory.host import format_bytes
from roundpipe.testing import EMU_PINNED, emu

emu.install()
memory = torch.get_device_module("emu")


class LlamaLayer(nn.Module):
    """The parameter shapes of a Llama decoder layer (attention q/k/v/o, a gated MLP, two
    norms), with a forward that is only a stand-in."""

    def __init__(self, d, ff):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x):
        h = x + self.o(self.v(self.norm1(x)))
        return h + self.down(F.silu(self.gate(self.norm2(h))) * self.up(h))


class GPT2Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.proj(self.attn(self.ln1(x))[..., : x.shape[-1]])
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def llama(d=1024, ff=2752, vocab=32000, layers=8):
    # Llama-7B's proportions (d 4096, ff 11008, vocab 32000) with d and ff divided by 4: a
    # power of two rounds these sizes as it rounds the full ones.
    return nn.Sequential(
        nn.Embedding(vocab, d),
        *[LlamaLayer(d, ff) for _ in range(layers)],
        nn.Sequential(nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)),
    )


def gpt2(d=768, vocab=50257, layers=12):
    return nn.Sequential(
        nn.Embedding(vocab, d),
        *[GPT2Layer(d) for _ in range(layers)],
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)),
    )


MODELS = {"llama-shaped": llama, "gpt2-shaped": gpt2}


def _pinned_growth(pin):
    before = emu.pinned_memory_stats().allocated_bytes
    pin()
    return emu.pinned_memory_stats().allocated_bytes - before


def part_a():
    print("(a) host bytes per parameter of the pinned copy, fp16, on the emulated device")
    for limit in (hm.UNLIMITED, 2**20):
        emu.set_pinned_round_limit(limit)
        if limit == hm.UNLIMITED:
            print("  CUDA's default: every pinned allocation rounded up to a power of two")
        else:
            print("  PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:1 (larger ones exact)")
        _pinning(limit)
    emu.set_pinned_round_limit(hm.cuda_pinned_round_limit())


def _pinning(limit):
    for name, make in MODELS.items():
        per_tensor, pooled = make().half(), make().half()
        tensors = list(pooled.parameters()) + list(pooled.buffers())
        numel = sum(p.numel() for p in pooled.parameters())
        unpinned = sum(t.untyped_storage().nbytes() for t in tensors)

        def pin_each(model=per_tensor):
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    t.data = t.data.pin_memory()

        each = _pinned_growth(pin_each)
        layout = hm.pinned_layout(pooled, EMU_PINNED)
        pool = _pinned_growth(lambda m=pooled: pin_module(m, EMU_PINNED))
        assert pool == layout.taken
        print(f"    {name}: {numel / 1e6:.1f}M params, {len(tensors)} tensors")
        print(f"      unpinned                 {unpinned / numel:6.3f} bytes/param   1.000x")
        print(
            f"      pinned tensor by tensor  {each / numel:6.3f} bytes/param   {each / unpinned:.3f}x"
        )
        print(
            f"      pinned from the pool     {pool / numel:6.3f} bytes/param   {pool / unpinned:.3f}x"
            f"   ({len(layout.blocks)} blocks: "
            f"{', '.join(format_bytes(b) for b in layout.blocks[:4])}"
            f"{', ...' if len(layout.blocks) > 4 else ''})"
        )
        del per_tensor, pooled
        gc.collect()


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child_b(name):
    """One model in a fresh process: the plan's host terms and the RSS growth over the wrap
    and two Adam steps. Prints one JSON line."""
    torch.manual_seed(0)
    seq = MODELS[name]().half()
    gc.collect()
    rss0 = _rss()
    model = RoundPipe(seq, optim_dtype=torch.float32, devices="emu")
    x = torch.randint(0, 1000, (2, 16))
    plan = model.memory_plan()
    with OptimizerCtx():
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(2):
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().mean())
        model.step(lambda: opt.step())  # no zero_grad: the gradients stay, as the plan counts
    model.synchronize()
    gc.collect()
    rss1 = _rss()
    print(
        json.dumps(
            {
                "planned": plan.host.new_bytes,
                "terms": plan.host.rows(),
                "measured": rss1 - rss0,
                "pinned": emu.pinned_memory_stats().allocated_bytes,
            }
        )
    )


def part_b():
    print("(b) host RAM: the plan's terms (all but the weights) against RSS growth, fresh process")
    for name in MODELS:
        out = (
            subprocess.run(
                [sys.executable, __file__, "--child-b", name],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ),
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        result = json.loads(out)
        planned, measured = result["planned"], result["measured"]
        print(f"    {name}:")
        for label, nbytes in result["terms"][1:]:
            print(f"      {label:<52} {format_bytes(nbytes):>10}")
        print(f"      {'planned (to allocate)':<52} {format_bytes(planned):>10}")
        print(
            f"      {'measured RSS growth (wrap + 2 Adam steps)':<52} {format_bytes(measured):>10}"
            f"   measured / planned {measured / planned:.3f}"
        )


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)
        )
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


def decoder(vocab=2048, d=256, layers=4, heads=8):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, d),
        *[Block(d, heads) for _ in range(layers)],
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab)),
    )


def part_c():
    print(
        "(c) device peak: memory plan against the emulated device's measurement, one forward_backward"
    )
    cases = [
        ("decoder fp32, bf16 autocast", torch.float32, "emu", dict(num_microbatch=4, autocast=torch.bfloat16), 2, 128),
        ("decoder fp16", torch.float16, "emu", dict(num_microbatch=2), 4, 256),
        ("decoder fp16, offloaded inputs", torch.float16, "emu", dict(num_microbatch=4, offload_activations=True), 2, 256),
        ("decoder fp16, 2 devices", torch.float16, "emu:2", dict(num_microbatch=4), 2, 128),
        ("decoder fp32, no recompute", torch.float32, "emu", dict(num_microbatch=2, recompute=False), 2, 128),
    ]  # fmt: skip
    for name, dtype, devices, cfg, rows, seq in cases:
        model = RoundPipe(
            decoder().to(dtype),
            optim_dtype=torch.float32,
            devices=devices,
            model_run_config=RoundPipeRunConfig(**cfg),
        )
        M = cfg["num_microbatch"]
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 2048, (rows * M, seq), generator=g)
        y = torch.randint(0, 2048, (rows * M, seq), generator=g)

        def loss_fn(out, lbl):
            return F.cross_entropy(out.float().flatten(0, 1), lbl.flatten())

        plan = model.memory_plan(input_args=(x,), label=y, loss_fn=loss_fn)
        gc.collect()
        n = len(plan.devices)
        base = [memory.memory_allocated(d) for d in range(n)]
        for d in range(n):
            memory.reset_peak_memory_stats(d)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        measured = [memory.max_memory_allocated(d) - base[d] for d in range(n)]
        for d, dev in enumerate(plan.devices):
            print(
                f"    {name:<32} {dev.device}  planned {format_bytes(dev.peak):>10}  measured "
                f"{format_bytes(measured[d]):>10}  planned / measured {dev.peak / measured[d]:.3f}"
                f"  (largest: {dev.terms[0][0]})"
            )
        del model
        gc.collect()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="a,b,c")
    parser.add_argument("--child-b", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_b:
        _child_b(args.child_b)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    parts = {"a": part_a, "b": part_b, "c": part_c}
    for p in args.part.split(","):
        parts[p.strip()]()


if __name__ == "__main__":
    main()
