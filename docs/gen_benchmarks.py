"""Assemble docs/benchmarks.md from the result files in benchmarks/results/.

    python docs/gen_benchmarks.py          # rewrite docs/benchmarks.md
    python docs/gen_benchmarks.py --check  # exit 1 if it is out of date (tests/test_docs.py)

Each benchmark script's owner writes its numbers, with the command and the machine, into
benchmarks/results/<name>.md; this script puts them under one section each, headings demoted
two levels, in the order of SECTIONS. A result file not listed there goes under "Other".
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks.md"

# (section title, result file stem, script, what it measures)
SECTIONS = [
    (
        "GradScaler",
        "scaler",
        "benchmarks/bench_scaler.py",
        "`scaler.step` + `scaler.update` against `torch.amp.GradScaler` on the same fused-Adam work "
        "(target ratio <= 1.05), and the main thread's time in an async `update()` while a step runs "
        "on the optimizer thread (target: about zero).",
    ),
    (
        "roundpipe.optim",
        "optim",
        "benchmarks/bench_optim.py",
        "one synchronous `model.step` taken apart in bytes per parameter; torch's fused AdamW "
        "alone and followed by the master->model copy against roundpipe's one-pass step (exact, "
        "bf16 and 8-bit moments) and bitsandbytes' 8-bit AdamW on 100M fp32 parameters, each "
        "with the bytes it must move and the share of an `add_`'s bandwidth it reaches; the "
        "copy streamed past the caches against stored plainly (benchmarks/bench_copy_stores.py); "
        "the convergence of the lean moments on a small LM.",
    ),
    (
        "Host RAM against the plan",
        "host_memory",
        "benchmarks/bench_host_memory.py",
        "the memory plan's host terms against the RSS growth of a wrap and two iterations of a "
        "transformers model on the emulated device, in one process and on two data-parallel "
        "ranks (replicated and sharded), with every storage roundpipe holds walked.",
    ),
    (
        "Optimizer state on disk",
        "spill",
        "benchmarks/bench_spill.py",
        "the AdamW step with its state in files (`state_dir=`) against in RAM, the read and write "
        "bandwidth the spilled step reaches on the machine's disk next to plain sequential file "
        "I/O, and how much of the step the next iteration hides in training (async step).",
    ),
    (
        "Runtime",
        "runtime",
        "benchmarks/bench_runtime.py",
        "async against sync iteration time when the step costs as much as `forward_backward` "
        "(target <= 0.55) and the main thread's share in `scaler.update()` (target <= 1%); overhead "
        "against plain PyTorch with `torch.utils.checkpoint` per stage (target <= 1.05), in one "
        "process and with each variant alone in its own, and the fixed cost behind it; peak memory per parameter against the 18 "
        "bytes the state itself needs.",
    ),
    (
        "Data parallelism",
        "distributed",
        "benchmarks/bench_distributed.py",
        "iteration time of 2 gloo ranks (sync and async step) against one process doing one rank's "
        "work, and the gradient all-reduce's time per step on the optimizer thread; the state "
        "sharded over the ranks (`ShardedState`) against replicated and against torch's FSDP2 "
        "(`fully_shard`) on the same ranks, model and loop, alternated in one run, and each rank's "
        "host RSS per parameter against 2 + 16/N, FSDP2's and the plan's prediction.",
    ),
    (
        "Checkpoints",
        "checkpoint",
        "benchmarks/bench_checkpoint.py",
        "`roundpipe.checkpoint.save` (written behind the compute) against a synchronous "
        "`torch.save` of the same state (with and without fsync), alternated in one run: the main "
        "thread's stall per save, what the save costs the iterations after it, when the checkpoint "
        "is complete, and the peak RSS during the save against the state's size (no second copy).",
    ),
    (
        "Trainer",
        "trainer",
        "benchmarks/bench_trainer.py",
        "tokens/s through `roundpipe.hf.Trainer` against roundpipe's own loop on the same model and "
        "the same work per step (clipping, AdamW, cosine scheduler, async step), alternated in one "
        "run on the CPU and the emulated device (target: within a few percent).",
    ),
    (
        "The plan command",
        "plan",
        "benchmarks/bench_plan.py",
        "how long `python -m roundpipe plan --max-seq-len` takes to answer on Llama-3.1-8B's and "
        "Qwen3-1.7B's configs, and what it answers (issue 43: seconds, not minutes, on the 2-core "
        "machine; the target is under 20 s for an 8B config).",
    ),
    (
        "GPU",
        "gpu",
        "benchmarks/bench_gpu.py",
        "a GPT-style decoder-only transformer trained with roundpipe against plain PyTorch on the "
        "same GPU, with the model resident there, with and without per-block checkpoint: tokens/s "
        "for each microbatch count, peak GPU memory and peak host RSS, in one run, with the "
        "issue's targets (roundpipe >= 0.85x plain PyTorch with the same recompute, tokens/s not "
        "falling as microbatches grow, GPU peak <= 2 stages + activations); the side-by-side "
        "harness against the public RoundPipe (`benchmarks/peer_setup.py`, "
        "`benchmarks/gpu_session.sh`); and the run of models and sequences that do not fit a 24 "
        "GiB GPU, every contender capped to it (`benchmarks/gpu_offload.sh`: roundpipe, the "
        "public RoundPipe and FSDP2 with CPU offload, each row with its MFU).",
    ),
]

HEADER = """\
# Benchmarks

Assembled from `benchmarks/results/*.md` by `python docs/gen_benchmarks.py`; do not edit by
hand. Every number comes with the command that produced it and the machine it ran on; the
benchmarks print ratios against a baseline measured in the same run, because absolute times on
a shared machine drift. Rerun a script to regenerate its numbers on your machine, then
`python docs/gen_benchmarks.py`.
"""


def _demote(text: str, levels: int = 2) -> str:
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out).strip()


def render() -> str:
    parts = [HEADER]
    known = set()
    for title, stem, script, what in SECTIONS:
        known.add(stem)
        parts.append(f"## {title}\n")
        parts.append(f"{what} Script: `{script}`.\n")
        path = RESULTS / f"{stem}.md"
        if path.exists():
            parts.append(_demote(path.read_text()) + "\n")
        else:
            parts.append(
                f"No results yet: run `python {script}` and write its output, the "
                f"command and the machine into `benchmarks/results/{stem}.md`.\n"
            )
    others = (
        sorted(p for p in RESULTS.glob("*.md") if p.stem not in known) if RESULTS.exists() else []
    )
    if others:
        parts.append("## Other\n")
        for path in others:
            parts.append(_demote(path.read_text()) + "\n")
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _generate import main

    raise SystemExit(main(OUT, render, "Assemble docs/benchmarks.md from benchmarks/results/."))
