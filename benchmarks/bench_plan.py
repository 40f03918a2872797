"""How long the plan command takes to answer, and what it answers, on full-size configs.

    python benchmarks/bench_plan.py            # the questions of issue 43, item 4
    python benchmarks/bench_plan.py --long     # also the longest sequences on a 24 GiB GPU with
                                               # ample host RAM (docs/hf.md's table; minutes)

Each question is one ``python -m roundpipe plan`` process, as a user runs it, timed from its
start (wall clock, and the CPU time it and its children used, which a machine shared with
other work inflates less); its first lines are printed (the answer and the limit that binds).
The configs (benchmarks/configs/) are transformers configs with the published shapes of
Llama-3.1-8B and Qwen3-1.7B; nothing is downloaded and no weights exist: the plan builds the
model on the meta device. The emulated device the plan traces on is built once before the
first question (its C++ libraries, cached by torch), so no question pays for that.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
LLAMA = str(CONFIGS / "llama-3.1-8b.json")
QWEN = str(CONFIGS / "qwen3-1.7b.json")
GPU = ["--gpu", "rtx4090"]

QUESTIONS = [
    ("Llama-3.1-8B, full, 20 GiB host", [LLAMA, "--max-seq-len", *GPU, "--host-memory", "20GiB"]),
    (
        "Llama-3.1-8B, LoRA 16, 20 GiB host",
        [LLAMA, "--max-seq-len", *GPU, "--host-memory", "20GiB", "--lora", "16"],
    ),
    ("Qwen3-1.7B, full, 20 GiB host", [QWEN, "--max-seq-len", *GPU, "--host-memory", "20GiB"]),
    (
        "Qwen3-1.7B, LoRA 16, 20 GiB host",
        [QWEN, "--max-seq-len", *GPU, "--host-memory", "20GiB", "--lora", "16"],
    ),
    ("Qwen3-1.7B, full, 64 GiB host", [QWEN, "--max-seq-len", *GPU, "--host-memory", "64GiB"]),
    (
        "Llama-3.1-8B, full, 20 GiB host, 8192 tokens",
        [LLAMA, "--seq-len", "8192", *GPU, "--host-memory", "20GiB"],
    ),
]
LONG = [
    (
        "Qwen3-1.7B, full, 512 GiB host",
        [QWEN, "--max-seq-len", "--seq-step", "1024", *GPU, "--host-memory", "512GiB"],
    ),
    (
        "Llama-3.1-8B, full, 512 GiB host",
        [LLAMA, "--max-seq-len", "--seq-step", "1024", *GPU, "--host-memory", "512GiB"],
    ),
]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ask(args: list[str]) -> tuple[float, float, int, list[str]]:
    """Run the plan command once: (wall s, CPU s, exit code, the lines before the plan)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "roundpipe", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    wall = time.perf_counter() - start
    lines = []
    for line in proc.stdout.splitlines():
        if line.startswith("Memory plan"):
            break
        lines.append(line)
    if proc.returncode not in (0, 1):
        lines.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?")
    return wall, _children_cpu() - cpu, proc.returncode, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="also the 512 GiB host questions")
    parser.add_argument(
        "--only", default="", help="ask only the questions whose name contains this text"
    )
    args = parser.parse_args()
    from roundpipe.testing import emu

    emu.install()  # its C++ libraries built (or found) before the first timed question
    import torch
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    for name, question in QUESTIONS + (LONG if args.long else []):
        if args.only not in name:
            continue
        wall, cpu, code, lines = ask(question)
        shown = " ".join(a if "/" not in a else Path(a).name for a in question)
        print(f"\n{name}: {wall:.1f} s ({cpu:.1f} s CPU), exit {code}")
        print(f"  python -m roundpipe plan {shown}")
        for line in lines:
            print(f"  | {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
