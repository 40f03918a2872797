"""Fine-tune a HuggingFace causal LM with roundpipe: a Llama-shaped model built from a config
(sizes by flags), trained on the Python standard library's sources with a byte-level tokenizer
(nothing is downloaded), saved with ``save_pretrained`` and reloaded in plain transformers to
generate a few tokens.

    pip install -e ".[hf,examples]"
    python examples/finetune_hf.py                         # full fine-tuning, bf16 on the CPU
    python examples/finetune_hf.py --lora 8                # LoRA adapters of rank 8 (peft)
    python examples/finetune_hf.py --devices emu:2 --dtype fp16   # the emulated accelerator

For a real checkpoint on disk, three lines change (the loop stays as it is)::

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    batch = tokenizer(texts, padding=True, return_tensors="pt") | {"labels": ...}

The loop is the one in docs/hf.md: ``roundpipe.hf.wrap`` splits the model into stages (the
embedding, each decoder layer, the head with a chunked loss), ``forward_backward`` returns the
loss transformers computes for the whole batch, and after ``model.synchronize()`` the HF model
object holds the trained weights under its own names.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PAD = 256  # bytes are 0..255; one more id pads
VOCAB = 257


def load_corpus(max_bytes):
    """The first ``max_bytes`` bytes of the standard library's top-level ``*.py`` files, in
    sorted order, as byte ids."""
    stdlib = Path(os.__file__).resolve().parent
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample_batch(tokens, batch_size, seq_len, generator):
    """A dict as HF's collators make it: random windows, a quarter of them cut short and
    right-padded (attention_mask 0, labels -100 there), so microbatches differ in real tokens."""
    starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator)
    ids = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
    lengths = torch.full((batch_size,), seq_len)
    short = torch.rand(batch_size, generator=generator) < 0.25
    lengths[short] = torch.randint(seq_len // 4, seq_len, (int(short.sum()),), generator=generator)
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_model(args, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 256),
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.lora,
            lora_alpha=2 * args.lora,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            lora_dropout=0.0,
        )
        model = get_peft_model(model, lora)
    return model


def generate(path, prompt, new_tokens):
    """Reload the saved model in plain transformers and continue ``prompt`` greedily."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([list(prompt.encode())])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
    )
    return bytes(t for t in out[0, ids.shape[1] :].tolist() if t < 256).decode(errors="replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training iterations (default 60)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument(
        "--intermediate", type=int, default=0, help="MLP width (default 4 x hidden)"
    )
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument(
        "--kv-heads", type=int, default=2, help="key/value heads, grouped-query (default 2)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=128, help="tokens per sequence (default 128)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    parser.add_argument(
        "--num-microbatch", type=int, default=4, help="microbatches per batch (default 4)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="the model's dtype (default fp16 on CUDA, bf16 elsewhere: 16-bit CPU math is slow, "
        "fp16 most of all)",
    )
    parser.add_argument("--lr", type=float, default=None, help="AdamW's learning rate")
    parser.add_argument(
        "--lora", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)"
    )
    parser.add_argument(
        "--devices", default=None, help="device pool, e.g. cpu:2, emu:2, cuda:0 (default: auto)"
    )
    parser.add_argument(
        "--corpus-bytes", type=int, default=1_000_000, help="bytes of stdlib source to train on"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data order")
    parser.add_argument(
        "--out", default=None, help="directory for save_pretrained (default: a temporary one)"
    )
    parser.add_argument(
        "--generate", type=int, default=24, help="tokens the reloaded model generates (0: none)"
    )
    args = parser.parse_args()

    if args.dtype is None:
        args.dtype = "fp16" if torch.cuda.is_available() else "bf16"
    dtype = DTYPES[args.dtype]
    lr = args.lr or (2e-3 if args.lora else 1e-3)
    tokens = load_corpus(args.corpus_bytes)
    hf_model = build_model(args, dtype)

    model = roundpipe.hf.wrap(
        hf_model,
        optim_dtype=torch.float32,
        devices=args.devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scaler = GradScaler(enabled=dtype == torch.float16)
    trained = sum(p.numel() for p in model.optim_parameters())
    total = sum(p.numel() for p in hf_model.parameters())
    print(
        f"roundpipe {roundpipe.__version__}: Llama-shaped, {total / 1e6:.2f}M params "
        f"({args.dtype}), {trained / 1e6:.3f}M trained{' (LoRA)' if args.lora else ''}, "
        f"{args.batch_size} x {args.seq_len} tokens per batch in {args.num_microbatch} "
        f"microbatches"
    )

    generator = torch.Generator().manual_seed(args.seed + 1)
    bar = tqdm(range(args.steps), desc="fine-tuning", unit="step")
    first = last = None
    seen, start = 0, time.perf_counter()
    for it in bar:
        batch = sample_batch(tokens, args.batch_size, args.seq_len, generator)
        scale = scaler.get_scale()  # the scale this iteration's loss is multiplied by
        loss = model.forward_backward(
            input_kwargs=batch, loss_fn=lambda mb_loss, _: scaler.scale(mb_loss)
        )
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        last = loss.item() / scale
        first = last if first is None else first
        seen += int(batch["attention_mask"].sum())
        bar.set_postfix(loss=f"{last:.3f}", tok_s=f"{seen / (time.perf_counter() - start):.0f}")
        if it == 0 or (it + 1) % max(args.steps // 6, 1) == 0:
            tqdm.write(f"iteration {it} loss {last:.4f}")
    model.synchronize()  # the HF model's own parameters now hold the trained weights
    print(f"loss {first:.3f} -> {last:.3f}")

    out = args.out or tempfile.mkdtemp(prefix="finetune_hf_")
    to_save = hf_model.merge_and_unload() if args.lora else hf_model
    to_save.save_pretrained(out)
    print(f"saved to {out}")
    if args.generate:
        prompt = "def "
        print(
            f"reloaded in plain transformers: {prompt!r} -> {generate(out, prompt, args.generate)!r}"
        )


if __name__ == "__main__":
    main()
