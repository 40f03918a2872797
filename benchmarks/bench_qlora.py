"""QLoRA on the CPU: a small Llama loaded in 4 bits (NF4, double quantization, bf16 compute)
with LoRA adapters, trained through ``roundpipe.hf.wrap`` against peft's own QLoRA model, and
roundpipe's bf16 LoRA of the same model: tokens/s, the three alternated round by round on the
same machine, medians of the timed iterations.

    python benchmarks/bench_qlora.py                 # 4 layers, hidden 256, 4 x 256 tokens
    python benchmarks/bench_qlora.py --rounds 5 --iters 4

peft: the QLoRA model as TRL's SFTTrainer trains it (``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))``, the rest of the model in bf16, LoRA r=16 on every
linear layer, gradient checkpointing), ``torch.optim.AdamW``, ``loss.backward()``. roundpipe QLoRA:
the same model (the same quantized weights) through ``roundpipe.hf.wrap`` on a CPU pool, fp32
masters of the adapters, ``roundpipe.optim.AdamW`` on the optimizer thread, 2 microbatches.
roundpipe bf16 LoRA: the same weights unquantized in bf16, the same adapters, wrapped the same
way. On the CPU roundpipe streams nothing: the ratios are the runtime's cost and what the 4-bit
kernels cost against bf16 matmuls, not a GPU's.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch


def save_model(args, path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def lora(model, args):
    import peft

    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(
        model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    )


def quantized(path, args):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        device_map="cpu",
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
    )
    return lora(base, args)


def batch(args, i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Peft:
    name = "peft QLoRA (checkpointing)"

    def __init__(self, path, args):
        self.model = quantized(path, args)
        self.model.train()
        base = self.model.get_base_model()
        # transformers 5.24 renamed it; older versions have only the first name
        enable = getattr(base, "activation_checkpointing_enable", None)
        (enable or base.gradient_checkpointing_enable)()
        self.model.enable_input_require_grads()  # as TRL does for a peft model
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-4)

    def step(self, inputs):
        loss = self.model(**inputs).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())

    def finish(self):
        pass


class RoundPipe:
    def __init__(self, model, name):
        import roundpipe
        from roundpipe import OptimizerCtx, RoundPipeRunConfig

        self.name = name
        self.model = roundpipe.hf.wrap(
            model,
            devices="cpu",
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        with OptimizerCtx():
            self.opt = roundpipe.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, inputs):
        loss = self.model.forward_backward(input_kwargs=inputs)
        self.model.step(lambda: (self.opt.step(), self.opt.zero_grad()))
        return float(loss)

    def finish(self):
        self.model.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the three")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per round")
    args = parser.parse_args()
    import bitsandbytes
    import transformers
    from transformers import AutoModelForCausalLM

    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, bitsandbytes "
        f"{bitsandbytes.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; "
        f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch "
        f"{args.batch} x {args.seq} tokens, LoRA r={args.rank} on every linear layer; "
        f"load average at start {load[0]:.2f}; command: python {' '.join(sys.argv)}"
    )
    path = tempfile.mkdtemp()
    save_model(args, path)
    plain_bf16 = lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), args)
    variants = [
        Peft(path, args),
        RoundPipe(quantized(path, args), "roundpipe QLoRA"),
        RoundPipe(plain_bf16, "roundpipe bf16 LoRA"),
    ]
    tokens = args.batch * args.seq
    times = {v.name: [] for v in variants}
    for v in variants:
        for i in range(args.warmup):
            v.step(batch(args, i))
        v.finish()
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else reversed(variants):
            for i in range(args.iters):
                start = time.perf_counter()
                v.step(batch(args, 100 + i))
                times[v.name].append(time.perf_counter() - start)
            v.finish()
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    for name, tps in rate.items():
        print(f"  {name:34s} {tps:8.1f} tokens/s")
    peft_name, ours, bf16 = (v.name for v in variants)
    print(f"  roundpipe QLoRA / peft QLoRA        {rate[ours] / rate[peft_name]:.2f}x tokens/s")
    print(f"  roundpipe QLoRA / roundpipe bf16    {rate[ours] / rate[bf16]:.2f}x tokens/s")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
