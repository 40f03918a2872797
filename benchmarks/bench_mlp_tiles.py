"""What the token-tiled MLP (roundpipe.hf.tiling) costs: tokens/s of ``forward_backward`` with
the decoder layers' MLP and norms in tiles against untiled, same model, same run, on the CPU.

    python benchmarks/bench_mlp_tiles.py                       # 4,096 and 8,192 tokens
    python benchmarks/bench_mlp_tiles.py --seq-len 8192 --tile 1024 --rounds 7

Two wraps of the same Llama-shaped model (two HF models of one seed, fp32: the CPU's bf16
matmuls are slow), ``mlp_tile_tokens=0`` (untiled) and ``--tile``, on the CPU pool (which
recomputes each stage in its backward, as every pool does). Each round times one
``forward_backward`` of one sequence for each contender, the order alternated round by round,
after a warm-up round; the result is the median of the rounds' tokens/s and the ratio of the
medians. The tiled run recomputes each tile's MLP once more in the backward (the price of
never holding the whole sequence's intermediates); at long sequences attention's share of the
work grows and that price shrinks.
"""

import argparse
import statistics
import time


def build(args, seed=0):
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
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def measure(args, seq_len):
    import torch

    import roundpipe

    models = {
        name: roundpipe.hf.wrap(build(args), devices="cpu", check=False, mlp_tile_tokens=tile)
        for name, tile in (("untiled", 0), ("tiled", args.tile))
    }
    ids = torch.randint(args.vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds + 1):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            start = time.perf_counter()
            models[name].forward_backward(input_kwargs=batch)
            took = time.perf_counter() - start
            if r:  # round 0 warms up
                rates[name].append(seq_len / took)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    for model in models.values():
        model.synchronize()
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tile", type=int, default=1024, help="tokens per tile (1024)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size; MLP 3x (256)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    import torch

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; Llama {args.layers} "
        f"layers, hidden {args.hidden}, MLP {3 * args.hidden}, vocab {args.vocab}, fp32, CPU "
        f"pool; tile {args.tile}; median of {args.rounds} alternated rounds"
    )
    for seq_len in args.seq_len:
        m = measure(args, seq_len)
        print(
            f"  {seq_len:>6} tokens: untiled {m['untiled']:8.1f} tok/s, tiled "
            f"{m['tiled']:8.1f} tok/s, tiled/untiled {m['tiled'] / m['untiled']:.3f}"
        )


if __name__ == "__main__":
    main()
