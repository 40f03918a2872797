"""Tokens/s through ``roundpipe.hf.Trainer`` against roundpipe's own loop on the same model,
on the CPU and on the emulated device, in one run, as ratios.

    python benchmarks/bench_trainer.py                     # cpu and emu, 3 rounds
    python benchmarks/bench_trainer.py --devices cpu --rounds 5

Both sides train the same bf16 Llama (fp32 masters) on the same fixed-length batches, with the
same work per optimizer step: ``--batch`` sequences x ``--accum`` accumulation steps in one
``forward_backward`` of ``--accum`` microbatches, then, on the optimizer thread (async step),
clipping of the whole gradient norm, ``torch.optim.AdamW`` (what ``optim="adamw_torch"``
builds), a cosine scheduler's step and ``zero_grad``.

* ``loop``: the loop of docs/hf.md written by hand, with those pieces in its step function.
* ``Trainer``: ``roundpipe.hf.Trainer`` with the TrainingArguments that say the same
  (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``max_grad_norm``,
  ``lr_scheduler_type="cosine"``, ``logging_steps=5``), its dataloader and collator, callbacks
  and logs; a callback takes the time at each step's end.

Each round runs both, alternating which goes first; a contender's figure is its median step
time after ``--warmup`` steps, and the report gives the median over rounds of each and of the
per-round ratio Trainer / loop (target: within a few percent of 1.00x).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import roundpipe  # noqa: E402  (after the path tweak, so the checkout is benchmarked)
from roundpipe import RoundPipeRunConfig  # noqa: E402


def build(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def samples(args):
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.accum * (args.steps + 1)
    return [{"input_ids": torch.randint(args.vocab, (args.seq,), generator=g)} for _ in range(n)]


def collate(examples):
    ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_loop(args, device, data):
    import transformers

    model = roundpipe.hf.wrap(build(args), optim_dtype=torch.float32, devices=device)
    masters = list(model.optim_parameters())
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.0)
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=1, num_training_steps=99)

    def step():
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()

    per_step = args.batch * args.accum
    run_config = RoundPipeRunConfig(num_microbatch=args.accum)
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        batch = collate(data[i * per_step : (i + 1) * per_step])
        loss = model.forward_backward(input_kwargs=batch, run_config=run_config)
        model.step(step)
        float(loss)
        times.append(time.perf_counter() - start)
    model.synchronize()
    return times[args.warmup :]


def run_trainer(args, device, data):
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, *a, **kw):
            self.stamps.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accum,
            max_steps=args.steps,
            learning_rate=1e-4,
            lr_scheduler_type="cosine",
            warmup_steps=1,
            max_grad_norm=1.0,
            logging_steps=5,
            save_strategy="no",
            report_to=[],
            bf16=True,
            use_cpu=True,
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = roundpipe.hf.Trainer(
            model=build(args),
            args=targs,
            train_dataset=data,
            data_collator=collate,
            devices=device,
            callbacks=[clock],
        )
        trainer.train()
    stamps = clock.stamps
    return [b - a for a, b in zip(stamps, stamps[1:])][args.warmup - 1 :]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "emu"], help="cpu and/or emu")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary (default 2048)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--batch", type=int, default=2, help="per-device batch (default 2)")
    parser.add_argument("--accum", type=int, default=2, help="accumulation steps (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="steps per contender (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    args = parser.parse_args()
    if any(d.startswith("emu") for d in args.devices):
        from roundpipe.testing import emu

        emu.install()
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs; Llama {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}; {args.batch} x {args.accum} x {args.seq} tokens per step; command: "
        f"python benchmarks/bench_trainer.py {' '.join(sys.argv[1:])}"
    )
    tokens = args.batch * args.accum * args.seq
    data = samples(args)
    for device in args.devices:
        loop_s, trainer_s, ratios = [], [], []
        for r in range(args.rounds):
            order = [("loop", run_loop), ("Trainer", run_trainer)]
            if r % 2:
                order.reverse()
            got = {name: statistics.median(fn(args, device, data)) for name, fn in order}
            loop_s.append(got["loop"])
            trainer_s.append(got["Trainer"])
            ratios.append((tokens / got["Trainer"]) / (tokens / got["loop"]))
        print(f"{device}:")
        print(f"  roundpipe's own loop      {tokens / statistics.median(loop_s):9.1f} tokens/s")
        print(f"  roundpipe.hf.Trainer      {tokens / statistics.median(trainer_s):9.1f} tokens/s")
        print(
            f"  Trainer / loop            {statistics.median(ratios):9.3f}x tokens/s "
            f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
