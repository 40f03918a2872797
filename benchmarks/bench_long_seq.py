"""The longest sequence one training iteration fits in a fixed device memory: roundpipe at its
defaults against plain transformers at its best standard options, same small Llama, same
capacity, in one run.

    python benchmarks/bench_long_seq.py                        # three capacities, both systems
    python benchmarks/bench_long_seq.py --capacity-mib 32 64 128 --layers 4

The device is the emulated accelerator (``roundpipe.testing.emu``) with its memory capacity set:
it counts every device allocation exactly and raises ``torch.OutOfMemoryError`` past the
capacity, as a GPU's allocator would (without a caching allocator's rounding and fragmentation).
Each probe (one system, one length) runs two full iterations (forward, backward, optimizer step)
in a fresh process, so that the second backward runs beside the optimizer state the first step
made, as every step of a real run does; a bisection over lengths finds the longest that trains.

- plain: what a transformers user does to fit a long sequence on one device: the model in bf16
  on the device (no fp32 copy), ``torch.optim.AdamW`` on the device (its state in bf16),
  transformers' activation checkpointing with its activation offload to pinned host memory
  where the installed version has it (``activation_checkpointing_enable(offload=True)``,
  transformers 5.24; else ``gradient_checkpointing_enable()``), and the loss computed in chunks
  of ``--plain-loss-chunk`` tokens, each chunk's logits recomputed in the backward
  (``torch.utils.checkpoint``), so no (tokens x vocabulary) logits exist at once.
- roundpipe: ``roundpipe.hf.wrap`` of the same model in bf16 at its defaults (whatever loss chunk,
  offload and recompute its plan chooses for the device), one sequence per batch, fp32 masters
  and AdamW on the host. A call the memory check refuses counts as not fitting, as it would for
  a user.

Attention is SDPA in both, which on the emulated device takes torch's fused CPU kernel (no
tokens x tokens scores), as a GPU's fused kernels do.
"""

import argparse
import json
import os
import subprocess
import sys
import time

# 64 x the hidden size, as real models have it (Qwen3-1.7B: 151936 / 2048 = 74).
HIDDEN = 128
# Iterations per probe: from the second on, the optimizer's state exists during the backward.
ITERATIONS = 2
VOCAB = 64 * HIDDEN


def build(args, dtype):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(args.heads // 2, 1),
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def plain_iterations(args, model, batch):
    """Plain transformers at its best standard options (see the module doc)."""
    import inspect

    import torch

    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "offload" in inspect.signature(enable).parameters:
        enable(offload=True)
    else:
        (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {k: v.to("emu") for k, v in batch.items()}
    for _ in range(ITERATIONS):
        _plain_step(args, model, opt, batch)


def _plain_step(args, model, opt, batch):
    """One iteration: the model's hidden states, the loss in recomputed chunks, AdamW."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    hidden = hidden.last_hidden_state[:, :-1].flatten(0, 1)
    labels = batch["labels"][:, 1:].flatten()
    head = model.lm_head

    def chunk_loss(h, y):
        return F.cross_entropy(head(h).float(), y, reduction="sum")

    loss = (
        sum(
            checkpoint(chunk_loss, h, y, use_reentrant=False)
            for h, y in zip(
                hidden.split(args.plain_loss_chunk), labels.split(args.plain_loss_chunk)
            )
        )
        / labels.numel()
    )
    loss.backward()
    opt.step()
    opt.zero_grad()


def probe(args):
    """One iteration at ``args.length`` tokens; prints a JSON line with ok/oom and the peak."""
    import torch

    from roundpipe.testing import emu

    emu.install()
    emu.set_memory_capacity(args.capacity_mib << 20)
    memory = torch.get_device_module("emu")
    ids = torch.randint(args.vocab, (1, args.length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    start = time.perf_counter()
    try:
        if args.impl == "plain":
            plain_iterations(args, build(args, torch.bfloat16).to("emu"), batch)
        else:
            import roundpipe
            from roundpipe import OptimizerCtx, RoundPipeRunConfig

            model = roundpipe.hf.wrap(
                build(args, torch.bfloat16),
                devices="emu",
                model_run_config=RoundPipeRunConfig(num_microbatch=1),
            )
            with OptimizerCtx():
                opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(ITERATIONS):
                model.forward_backward(input_kwargs=batch)
                model.step(lambda: (opt.step(), opt.zero_grad()))
            model.synchronize()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    except Exception as exc:  # roundpipe's memory check refusing the call: it does not fit
        if type(exc).__name__ != "DeviceMemoryError":
            raise
        ok = False
    result = {
        "impl": args.impl,
        "length": args.length,
        "ok": ok,
        "peak_mib": round(memory.max_memory_allocated(0) / 2**20, 2),
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(result), flush=True)


def run_probe(args, impl, capacity, length):
    cmd = [sys.executable, __file__, "--probe", impl, "--length", str(length)]
    cmd += ["--capacity-mib", str(capacity)] + shared_flags(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe {impl} {length} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def longest(args, impl, capacity):
    """Bisection over multiples of ``--step`` tokens: the longest length that trains."""
    lo, hi = 0, args.step
    while True:  # grow until a length fails
        result = run_probe(args, impl, capacity, hi)
        print(f"  {impl:9} {capacity:5} MiB {hi:7} tokens: {'ok ' if result['ok'] else 'OOM'}"
              f" (peak {result['peak_mib']} MiB, {result['seconds']} s)", flush=True)  # fmt: skip
        if not result["ok"]:
            break
        lo, hi = hi, hi * 2
        if hi > args.max_length:
            return lo
    while hi - lo > args.step:
        mid = (lo + hi) // 2 // args.step * args.step
        result = run_probe(args, impl, capacity, mid)
        print(f"  {impl:9} {capacity:5} MiB {mid:7} tokens: {'ok ' if result['ok'] else 'OOM'}"
              f" (peak {result['peak_mib']} MiB, {result['seconds']} s)", flush=True)  # fmt: skip
        lo, hi = (mid, hi) if result["ok"] else (lo, mid)
    return lo


def shared_flags(args):
    return [
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
        "--vocab", str(args.vocab), "--plain-loss-chunk", str(args.plain_loss_chunk),
    ]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--capacity-mib",
        type=int,
        nargs="+",
        default=[32, 64, 128],
        help="device capacities (MiB; default 32 64 128: from plain's model state barely fitting "
        "to ample)",
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument(
        "--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})"
    )
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary (default {VOCAB})")
    parser.add_argument(
        "--plain-loss-chunk",
        type=int,
        default=512,
        help="plain's loss chunk (default 512 tokens)",
    )
    parser.add_argument("--step", type=int, default=512, help="length resolution (default 512)")
    parser.add_argument(
        "--max-length", type=int, default=1 << 18, help="stop growing here (default 262144)"
    )
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per probe")
    parser.add_argument("--impls", nargs="+", default=["plain", "roundpipe"], help="systems")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        args.impl = args.probe
        args.capacity_mib = args.capacity_mib[0]
        probe(args)
        return

    import torch

    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; Llama {args.layers} layers, hidden "
        f"{args.hidden}, vocab {args.vocab}; emulated device; command: python "
        f"benchmarks/bench_long_seq.py {' '.join(sys.argv[1:])}"
    )
    rows = []
    for capacity in args.capacity_mib:
        found = {impl: longest(args, impl, capacity) for impl in args.impls}
        rows.append((capacity, found))
    print("\n| capacity | " + " | ".join(f"{i} longest" for i in args.impls) + " | ratio |")
    print("|---:|" + "---:|" * (len(args.impls) + 1))
    for capacity, found in rows:
        cells = " | ".join(f"{found[i]:,}" for i in args.impls)
        ratio = (
            found.get("roundpipe", 0) / found["plain"]
            if found.get("plain") and "roundpipe" in found
            else float("nan")
        )
        print(f"| {capacity} MiB | {cells} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
