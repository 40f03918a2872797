"""Fine-tune a causal LM with transformers' Trainer (or TRL's SFTTrainer, ``--sft``) on
roundpipe: a Llama-shaped model built from a config, trained on the Python standard library's
sources with a byte-level tokenizer made here (nothing is downloaded), then saved with
``save_model`` and reloaded in plain transformers.

    pip install -e ".[hf,trl,examples]"
    python examples/trainer_hf.py                      # transformers' Trainer API, on roundpipe
    python examples/trainer_hf.py --sft --lora 8       # TRL's SFTTrainer with a LoRA adapter
    python examples/trainer_hf.py --plain              # the same script on the plain Trainer
    python examples/trainer_hf.py --devices emu:2      # the emulated accelerator
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py   # 2 data-parallel ranks

What changes from the plain Trainer script (``--plain`` runs the left side)::

    -from transformers import Trainer                 |  -from trl import SFTTrainer
    +from roundpipe.hf import Trainer                 |  +from roundpipe.hf import SFTTrainer
     trainer = Trainer(model=hf_model, args=TrainingArguments(...),
                       train_dataset=..., data_collator=...,
    +                  devices="cuda:0")              # optional: roundpipe's device pool

The model stays in host memory (bf16 weights and fp32 masters); every TrainingArguments option
the script sets (batch size, gradient accumulation, cosine schedule with warmup, weight decay,
clipping, logging, checkpoints) means what it means to the plain Trainer. The optimizer step
runs one step behind on roundpipe's optimizer thread (``async_step=False`` waits for it).
Under torchrun the same script runs data parallel: each rank trains on its share of every
global batch (``--batch-size`` x ``--grad-accum`` x the ranks), the gradients are averaged over
the ranks, and rank 0 logs, saves and reloads (docs/distributed.md, "The Trainer").
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def byte_tokenizer():
    """A byte-level tokenizer: one token per byte (256 ids), then [PAD] and [EOS]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["[PAD]"], vocab["[EOS]"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


def corpus(max_bytes, chunk):
    """Text chunks of ``chunk`` characters from the standard library's top-level sources."""
    stdlib = Path(os.__file__).resolve().parent
    text, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text.append(path.read_text(errors="replace"))
        total += len(text[-1])
        if total >= max_bytes:
            break
    data = "".join(text)[:max_bytes]
    return [data[i : i + chunk] for i in range(0, len(data) - chunk, chunk)]


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(args.seq_len, 256),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--sft", action="store_true", help="TRL's SFTTrainer (default: Trainer)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--plain", action="store_true", help="the plain Trainer, for comparison")
    parser.add_argument("--sync", action="store_true", help="the synchronous optimizer step")
    parser.add_argument("--devices", default=None, help="roundpipe's device pool (default: auto)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="model dtype")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument("--batch-size", type=int, default=4, help="per-device batch (default 4)")
    parser.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--corpus-bytes", type=int, default=400_000, help="bytes of stdlib text")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--out", default=None, help="output_dir (default: a temporary one)")
    parser.add_argument(
        "--spill-dir",
        default=None,
        help="keep the masters and Adam's state in files under this directory (6 bytes per "
        "parameter in RAM instead of 18)",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, TrainingArguments

    tokenizer = byte_tokenizer()
    texts = corpus(args.corpus_bytes, args.seq_len)
    hf_model = build_model(args, tokenizer)
    out = args.out or tempfile.mkdtemp(prefix="trainer_hf_")
    if args.out is None and "MASTER_PORT" in os.environ:  # torchrun: one directory for every rank
        out = os.path.join(tempfile.gettempdir(), f"trainer_hf_{os.environ['MASTER_PORT']}")
    options = dict(
        output_dir=out,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=2e-3 if args.lora else 1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(args.steps // 10, 1),
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=max(args.steps // 6, 1),
        save_steps=max(args.steps // 2, 1),
        save_total_limit=1,
        report_to=[],
        seed=args.seed,
        bf16=args.dtype == "bf16",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora,
            lora_alpha=2 * args.lora,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        )
    extra = {} if args.plain else {"devices": args.devices, "async_step": not args.sync}
    if args.spill_dir is not None and not args.plain:
        extra["spill_dir"] = args.spill_dir
    if args.sft:
        from datasets import Dataset
        from trl import SFTConfig

        if args.plain:
            from trl import SFTTrainer
        else:
            from roundpipe.hf import SFTTrainer
        options["bf16"] = args.dtype == "bf16"
        trainer = SFTTrainer(
            model=hf_model,
            args=SFTConfig(max_length=args.seq_len, packing=False, **options),
            train_dataset=Dataset.from_dict({"text": texts}),
            processing_class=tokenizer,
            peft_config=peft_config,
            **extra,
        )
    else:
        from datasets import Dataset
        from transformers import DataCollatorForLanguageModeling

        if args.plain:
            from transformers import Trainer
        else:
            from roundpipe.hf import Trainer
        if peft_config is not None:
            from peft import get_peft_model

            hf_model = get_peft_model(hf_model, peft_config)
        # A datasets.Dataset after map, its "text" column kept: the Trainer drops the columns
        # the model's forward does not take (TrainingArguments' remove_unused_columns=True).
        data = Dataset.from_dict({"text": texts}).map(
            lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.seq_len),
            batched=True,
        )
        trainer = Trainer(
            model=hf_model,
            args=TrainingArguments(**options),
            train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            **extra,
        )
    result = trainer.train()
    final = os.path.join(out, "final")
    trainer.save_model(final)  # under torchrun rank 0 writes
    if not trainer.is_world_process_zero():
        return
    history = [e for e in trainer.state.log_history if "loss" in e]
    print(f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}")
    print(f"train tokens/s {result.metrics.get('train_tokens_per_second', float('nan')):.0f}")
    if trainer.args.world_size > 1:
        print(f"{trainer.args.world_size} data-parallel ranks")
    if args.lora:
        print(f"saved the adapter to {final}")
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(final)
        ids = torch.tensor([tokenizer("def ")["input_ids"]])
        new = reloaded.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(new[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"reloaded in plain transformers: 'def ' -> {text!r}")


if __name__ == "__main__":
    main()
