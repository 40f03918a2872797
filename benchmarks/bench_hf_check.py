"""What roundpipe.hf.wrap's self-check costs on a full-size config: seconds and host memory.

    python benchmarks/bench_hf_check.py                 # Llama 3 8B's shape
    python benchmarks/bench_hf_check.py --preset 70b    # Llama 3 70B's shape (needs ~40 GB)

The model is built on the meta device (no memory), then only what the check reads is made real,
with random weights in bf16: the embedding, the final norm, the head, the rotary embedding and
the first two decoder layers (the cut the check takes for a model of one attention type). The
rest stays on the meta device, so the figure is the check's own cost, not the model's. Prints
the check's seconds, the process's peak RSS before and after it, and what the fp32 copy of the
cut takes.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch
import transformers
from torch import nn

import roundpipe
from roundpipe.hf.families import layer_attention_types

PRESETS = {
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _materialize(module: nn.Module, dtype: torch.dtype) -> None:
    module.to_empty(device="cpu")
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, std=0.02)
        elif hasattr(sub, "weight") and isinstance(sub.weight, torch.Tensor):
            nn.init.ones_(sub.weight)
    module.to(dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    args = parser.parse_args()
    config = transformers.LlamaConfig(**PRESETS[args.preset], tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    body = model.model
    cut = [body.embed_tokens, body.norm, model.lm_head, body.layers[0], body.layers[1]]
    for part in cut:
        _materialize(part, torch.bfloat16)
    body.rotary_emb = type(body.rotary_emb)(config=config)  # its buffers, made on the CPU
    cut_bytes = sum(p.numel() for part in cut for p in part.parameters()) * 4
    total = sum(p.numel() for p in model.parameters())
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; Llama {args.preset}: {total / 1e9:.2f}B parameters "
        f"({total * 2 / 2**30:.1f} GiB in bf16); the cut in fp32: {cut_bytes / 2**30:.2f} GiB"
    )
    before = _rss_gib()
    start = time.perf_counter()
    report = roundpipe.hf.check_stages(
        model,
        roundpipe.hf.family_of(model),
        layer_attention_types(config),
        roundpipe.hf.default_loss_chunk_tokens(config.vocab_size),
    )
    seconds = time.perf_counter() - start
    assert report is not None
    print(
        f"self-check: {seconds:.1f} s; peak RSS {before:.2f} GiB before it, {_rss_gib():.2f} "
        f"GiB after (+{_rss_gib() - before:.2f}); layers {report.layers}; logits difference "
        f"{report.logits_difference:.1e}; loss {report.loss:.4f} vs {report.reference_loss:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
