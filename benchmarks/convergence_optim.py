"""Convergence of Adam's lean moments: a small causal LM trained on real text with exact, bf16
and 8-bit moments (``roundpipe.optim.AdamW(state_dtype=None | torch.bfloat16 | "8bit")``),
per-step losses and the final held-out loss of each.

    python benchmarks/convergence_optim.py [--steps 400] [--out benchmarks/results/convergence_optim]
    python benchmarks/convergence_optim.py --trainer [--steps 120]   # through the Trainer's optim names

The text is the Python standard library's own sources (on every machine; nothing is
downloaded), one token per byte; the model a Llama of 4 layers of width 128 (about 1.05M
parameters, built from a config) in fp32, wrapped by ``roundpipe.hf.wrap`` on the CPU with
fp32 masters (the moments' kinds do not depend on the weights' dtype, and 16-bit compute on a
CPU is slow), trained with the asynchronous step (one step stale, as roundpipe trains by
default), AdamW (lr 1e-3, weight decay 0.01, 5% linear warmup then cosine to 10%), batches of
8 x 128 tokens, the same data order and initial weights for every kind. The final loss is the
mean loss of 32 held-out batches (the last 5% of the text, never trained on), computed by the
HF model after ``synchronize()``. Writes ``<out>.csv`` (step, loss per kind) and ``<out>.md``.

``--trainer``: the same model through ``roundpipe.hf.Trainer``: ``optim="adamw_torch_fused"``
(exact) against ``optim="adamw_8bit"`` (transformers' name, mapped to roundpipe's 8-bit AdamW),
and bf16 moments through ``optimizer_cls_and_kwargs``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is measured)
from roundpipe.optim import native  # noqa: E402

KINDS = {"exact": None, "bf16": torch.bfloat16, "8bit": "8bit"}
SEQ = 128
BATCH = 8
PAD = 256


def corpus() -> torch.Tensor:
    """The standard library's top-level sources as one stream of byte tokens."""
    stdlib = Path(os.__file__).resolve().parent
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))
    return torch.tensor(list(data), dtype=torch.long)


def model_of(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=257,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batches(tokens: torch.Tensor, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` batches of BATCH x SEQ tokens at random offsets of the training part."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - SEQ - 1, (steps, BATCH), generator=g)
    return [torch.stack([tokens[s : s + SEQ] for s in row.tolist()]) for row in starts]


def schedule(steps: int):
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def held_out_loss(hf_model, held: torch.Tensor) -> float:
    losses = []
    for i in range(32):
        ids = held[i * SEQ : (i + 1) * SEQ + 0].unsqueeze(0)
        if ids.shape[1] < SEQ:
            break
        losses.append(float(hf_model(input_ids=ids, labels=ids).loss))
    return sum(losses) / len(losses)


def train(kind: str, train_tokens, held, steps: int) -> tuple[list[float], float, float]:
    hf_model = model_of()
    model = roundpipe.hf.wrap(hf_model, devices="cpu")
    with roundpipe.OptimizerCtx():
        opt = roundpipe.optim.AdamW(
            model.parameters(), lr=1e-3, weight_decay=0.01, state_dtype=KINDS[kind]
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps))
    losses = []
    start = time.perf_counter()
    for ids in batches(train_tokens, steps):
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        losses.append(float(loss))
        model.step(lambda: (opt.step(), opt.zero_grad(), sched.step()))
    model.synchronize()
    seconds = time.perf_counter() - start
    return losses, held_out_loss(hf_model, held), seconds


def train_with_trainer(kind: str, train_tokens, held, steps: int, out: Path):
    from transformers import TrainingArguments

    data = [
        {"input_ids": ids[i], "labels": ids[i]}
        for ids in batches(train_tokens, steps)
        for i in range(BATCH)
    ]
    args = TrainingArguments(
        output_dir=str(out / f"trainer_{kind}"),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        optim="adamw_8bit" if kind == "8bit" else "adamw_torch_fused",
    )
    explicit = None
    if kind == "bf16":
        explicit = (roundpipe.optim.AdamW, {"lr": 1e-3, "state_dtype": torch.bfloat16})
    hf_model = model_of()
    trainer = roundpipe.hf.Trainer(
        model=hf_model,
        args=args,
        train_dataset=data,
        data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
        optimizer_cls_and_kwargs=explicit,
        devices="cpu",
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    return losses, held_out_loss(hf_model, held), seconds, type(trainer.optimizer).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps (400; 120 with --trainer)")
    parser.add_argument("--trainer", action="store_true", help="through roundpipe.hf.Trainer")
    parser.add_argument("--out", default=None, help="output path prefix")
    args = parser.parse_args()
    steps = args.steps or (120 if args.trainer else 400)
    here = Path(__file__).resolve().parent / "results"
    out = (
        Path(args.out)
        if args.out
        else here / ("convergence_trainer" if args.trainer else "convergence_optim")
    )
    native.kernels(wait=True)
    tokens = corpus()
    cut = int(len(tokens) * 0.95)
    train_tokens, held = tokens[:cut], tokens[cut:]
    results = {}
    for kind in KINDS:
        if args.trainer:
            losses, final, seconds, name = train_with_trainer(
                kind, train_tokens, held, steps, out.parent / "tmp"
            )
        else:
            losses, final, seconds = train(kind, train_tokens, held, steps)
            name = "roundpipe.optim.AdamW"
        results[kind] = (losses, final, seconds, name)
        print(
            f"{kind}: held-out loss {final:.4f}, last-20 train loss {sum(losses[-20:]) / 20:.4f}, {seconds:.0f} s",
            flush=True,
        )
    with open(f"{out}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *KINDS])
        for i in range(steps):
            w.writerow(
                [
                    i + 1,
                    *(f"{results[k][0][i]:.5f}" if i < len(results[k][0]) else "" for k in KINDS),
                ]
            )
    exact = results["exact"][1]
    command = f"python benchmarks/convergence_optim.py{' --trainer' if args.trainer else ''}"
    csv_name = Path(str(out) + ".csv").name
    lines = [
        f"# Convergence of lean Adam moments ({'roundpipe.hf.Trainer' if args.trainer else 'roundpipe.hf.wrap + model.step'})",
        "",
        f"`{command} --steps {steps}`; torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, compiled step: {native.status()}. Per-step losses in `{csv_name}`.",
        "",
        "| moments | optimizer | held-out loss | vs exact | mean train loss, last 20 steps | seconds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind, (losses, final, seconds, name) in results.items():
        lines.append(
            f"| {kind} | {name} | {final:.4f} | {100 * (final - exact) / exact:+.2f}% | "
            f"{sum(losses[-20:]) / len(losses[-20:]):.4f} | {seconds:.0f} |"
        )
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
