"""A small decoder-only transformer language model trained with RoundPipe on the Python standard
library's own source files (byte-level tokens; the corpus is already on every machine), with
checkpoints that resume exactly.

    python examples/tiny_lm.py --steps 300                      # train, print losses, sample text
    python examples/tiny_lm.py --steps 150 --save ckpts         # stop at iteration 150 ...
    python examples/tiny_lm.py --steps 300 --resume ckpts       # ... continue to 300
    python examples/tiny_lm.py --steps 300 --save ckpts --save-every 50   # one every 50

``--steps`` is the iteration to stop at, counting the checkpoint's iterations: resuming a
checkpoint at iteration 150 with ``--steps 100`` is refused, with the ``--steps`` that trains
100 more.

The two-part run prints the same losses and ends with the same parameters (the printed sha256)
as the uninterrupted one, bit for bit. ``roundpipe.checkpoint.save`` takes everything that
takes (docs/checkpointing.md): the model's low-precision parameters as the next iteration
computes with them and the fp32 masters (with the asynchronous step they differ), the optimizer
and the scaler, the RNG states (dropout, the per-call microbatch seed), and ``extra``: here the
iteration, the settings and the data sampler's generator. It writes while training goes on (a
checkpoint every ``--save-every`` iterations costs the loop little), into a directory of
checkpoints; ``roundpipe.checkpoint.load`` resumes from the newest one.

The model is an ``nn.Sequential`` of stages: the embedding, ``--layers`` transformer blocks and
the head, so each block is a stage that the pool's workers run in turn.
"""

import argparse
import hashlib
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import roundpipe
import roundpipe.checkpoint as ckpt
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VOCAB = 256  # bytes


# -- data -------------------------------------------------------------------------------------


def load_corpus(max_bytes):
    """The first ``max_bytes`` bytes of the standard library's top-level ``*.py`` files, in
    sorted order, so every machine with the same Python reads the same text."""
    stdlib = Path(os.__file__).resolve().parent
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), stdlib


def sample_batch(tokens, batch_size, context, generator):
    starts = torch.randint(0, len(tokens) - context - 1, (batch_size,), generator=generator)
    offsets = torch.arange(context)
    x = tokens[starts[:, None] + offsets]
    y = tokens[starts[:, None] + offsets + 1]
    return x, y


# -- model: an nn.Sequential of stages --------------------------------------------------------


class Embedding(nn.Module):
    def __init__(self, dim, context, dropout):
        super().__init__()
        self.token = nn.Embedding(VOCAB, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx):
        return self.drop(self.token(idx) + self.position[: idx.shape[1]])


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, x):
        return self.out(self.ln(x))


def build_model(args):
    return nn.Sequential(
        Embedding(args.dim, args.context, args.dropout),
        *[Block(args.dim, args.heads, args.dropout) for _ in range(args.layers)],
        Head(args.dim),
    )


# -- checkpoints ------------------------------------------------------------------------------

# Settings that must match between a checkpoint and the run that resumes it.
MODEL_KEYS = (
    "dim",
    "heads",
    "layers",
    "context",
    "dropout",
    "dtype",
    "batch_size",
    "num_microbatch",
    "lr",
    "corpus_bytes",
    "seed",
)


def save_checkpoint(root, iteration, args, model, opt, scaler, data_gen, keep_last=None):
    """A checkpoint of the state before iteration ``iteration``, written in the background."""
    return ckpt.save(
        root,
        model,
        opt,
        scaler=scaler,
        extra={
            "iteration": iteration,
            "config": {k: getattr(args, k) for k in MODEL_KEYS},
            "data": data_gen.get_state(),
        },
        keep_last=keep_last,
    )


def load_checkpoint(root, args, model, opt, scaler, data_gen):
    """Resume from the newest checkpoint in ``root``; returns its iteration."""
    extra = ckpt.load(root, model, opt, scaler=scaler)
    config = {k: getattr(args, k) for k in MODEL_KEYS}
    if extra["config"] != config:
        saved = extra["config"]
        diff = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
        raise SystemExit(f"{root} was saved with other settings (checkpoint, now): {diff}")
    data_gen.set_state(extra["data"])
    return extra["iteration"]


def params_digest(model):
    """sha256 over the fp32 masters, in name order (bitwise identity of two runs)."""
    h = hashlib.sha256()
    for name, p in sorted(model.master_state_dict().items()):
        h.update(name.encode())
        h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- evaluation and sampling ------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tokens, args, dtype):
    gen = torch.Generator().manual_seed(1234)
    x, y = sample_batch(tokens, 32, args.context, gen)
    model.eval()
    try:
        logits = model(x)
    finally:
        model.train()
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1)).item()


@torch.no_grad()
def sample(seq_model, prompt, length, args):
    """Sample with the user's own module: after model.synchronize() its parameter objects hold
    the newest values, so plain PyTorch can use it (one sequence: no microbatches needed)."""
    idx = torch.tensor([list(prompt.encode())])
    gen = torch.Generator().manual_seed(0)
    seq_model.eval()
    try:
        for _ in range(length):
            logits = seq_model(idx[:, -args.context :])[0, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            idx = torch.cat([idx, nxt[None]], dim=1)
    finally:
        seq_model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- main -------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="train until this iteration (total, counting a resumed run's earlier steps)",
    )
    parser.add_argument(
        "--save", metavar="DIR", help="save a checkpoint into DIR (a directory of them) at the end"
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="with --save: also every N iterations, keeping the newest 2 (0: only at the end)",
    )
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from the newest checkpoint in DIR"
    )
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument(
        "--heads", type=int, default=4, help="attention heads per block (default 4)"
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="transformer blocks, one stage each (default 2)"
    )
    parser.add_argument(
        "--context", type=int, default=64, help="tokens (bytes) per training sequence (default 64)"
    )
    parser.add_argument(
        "--dropout", type=float, default=0.1, help="dropout probability (default 0.1)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp16",
        help="the stages' low-precision dtype (default fp16)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per iteration (default 16)"
    )
    parser.add_argument(
        "--num-microbatch",
        type=int,
        default=2,
        help="microbatches each batch is split into (default 2)",
    )
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)"
    )
    parser.add_argument(
        "--corpus-bytes",
        type=int,
        default=2_000_000,
        help="bytes of standard-library source to train on (default 2000000)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the model, the data order and dropout"
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="device pool, e.g. cpu:2 (default: ROUNDPIPE_DEVICES, else all CUDA devices, else one CPU worker)",
    )
    parser.add_argument(
        "--print-every",
        type=int,
        default=25,
        help="print the loss every N iterations (1: every iteration, exactly)",
    )
    parser.add_argument(
        "--sample", type=int, default=120, help="bytes of text to sample at the end (0: none)"
    )
    args = parser.parse_args()

    dtype = DTYPES[args.dtype]
    tokens, stdlib = load_corpus(args.corpus_bytes)
    split = int(len(tokens) * 0.95)
    train_tokens, val_tokens = tokens[:split], tokens[split:]

    torch.manual_seed(args.seed)
    seq_model = build_model(args).to(dtype)
    num_mb = args.num_microbatch
    model = RoundPipe(
        seq_model,
        optim_dtype=torch.float32,
        devices=args.devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = GradScaler()
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    start = 0
    if args.resume:
        start = load_checkpoint(args.resume, args, model, opt, scaler, data_gen)
        if args.steps < start:
            parser.error(
                f"--steps {args.steps} is below the iteration {start} of {args.resume}: "
                f"--steps is the iteration to train until, counting the checkpoint's "
                f"(--steps {start + args.steps} trains {args.steps} more)"
            )
        if args.steps == start:
            print(
                f"{args.resume} is already at iteration {start} = --steps: nothing to train "
                f"(a larger --steps continues)"
            )
    n_params = sum(p.numel() for p in model.optim_parameters())
    print(
        f"roundpipe {roundpipe.__version__}: {n_params / 1e6:.2f}M params ({args.dtype} shards, fp32 "
        f"masters), {len(tokens) / 1e6:.1f} MB of {stdlib}, iterations {start}..{args.steps}"
    )

    def loss_fn(logits, target):  # per microbatch, on a device worker
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))
        return scaler.scale(loss) / num_mb

    bar = tqdm(
        range(start, args.steps), desc="training", unit="step", initial=start, total=args.steps
    )
    for it in bar:
        x, y = sample_batch(train_tokens, args.batch_size, args.context, data_gen)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        value = (
            loss.item() / scaler.get_scale()
        )  # the loss is on the CPU; get_scale(): this iteration's
        if (it + 1) % args.print_every == 0 or it == args.steps - 1:
            # float.hex: the exact value, so two runs can be compared bit for bit.
            tqdm.write(f"iteration {it} loss {value:.4f} {value.hex()}")
            bar.set_postfix(loss=f"{value:.3f}", scale=f"{scaler.get_scale():g}")
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        if (
            args.save
            and args.save_every
            and (it + 1) % args.save_every == 0
            and it + 1 < args.steps
        ):
            save_checkpoint(args.save, it + 1, args, model, opt, scaler, data_gen, keep_last=2)

    if args.save:
        path = save_checkpoint(args.save, args.steps, args, model, opt, scaler, data_gen).wait()
        print(f"saved checkpoint at iteration {args.steps} to {path}")
    print(f"params sha256: {params_digest(model)}")
    model.synchronize()  # the model now holds the newest masters, for plain PyTorch below
    val = evaluate(model, val_tokens, args, dtype)
    print(f"validation loss: {val:.4f} ({val / math.log(2):.3f} bits per byte; uniform: 8)")
    if args.sample:
        print("sample:\n" + sample(seq_model, "def ", args.sample, args))


if __name__ == "__main__":
    main()
