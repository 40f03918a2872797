"""The host time of running one layer on its stage's upload, the way an accelerator worker does
it for every forward and recompute of every microbatch: roundpipe's swap of the layer's tensors
(see [Note: the layer's device tensors] in roundpipe/devices/accelerator.py) against
``torch.func.functional_call`` with the same tensors, and the plain call as the floor.

    python benchmarks/bench_layer_call.py [--layer qwen3|linear] [--calls 300] [--repeats 7]

The layer is tiny (a HuggingFace Qwen3 decoder layer of hidden size 64, or one nn.Linear) on the
CPU, so its compute is small against the host work around it; the tensors are copies of its own
(standing in for the device copies). The contenders alternate, each timing ``--calls`` calls,
``--repeats`` times; medians are printed, and the overhead above the plain call as a ratio to
functional_call's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from roundpipe.devices.accelerator import run_swapped, swaps_of


def build(kind: str) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Linear(64, 64), (torch.randn(4, 64),), {}
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config._attn_implementation = "sdpa"
    layer = Qwen3DecoderLayer(config, 0)
    x = torch.randn(1, 8, 64)
    position = Qwen3RotaryEmbedding(config)(x, torch.arange(8)[None])
    return layer, (x,), {"position_embeddings": position, "attention_mask": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", choices=["qwen3", "linear"], default="qwen3")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    layer, call_args, call_kwargs = build(args.layer)
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        return copies.setdefault(id(t), t.detach().clone())

    swaps = swaps_of(layer, copy)
    by_name = {n: copy(t, True) for n, t in layer.named_parameters()}
    by_name.update({n: copy(t, False) for n, t in layer.named_buffers()})

    contenders = {
        "plain call": lambda: layer(*call_args, **call_kwargs),
        "torch.func.functional_call": lambda: torch.func.functional_call(
            layer, by_name, call_args, call_kwargs
        ),
        "roundpipe's swap": lambda: run_swapped(layer, swaps, call_args, call_kwargs),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.no_grad():
        for fn in contenders.values():  # warm up
            for _ in range(20):
                fn()
        for _ in range(args.repeats):
            for name, fn in contenders.items():  # alternated
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.calls)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    floor = median["plain call"]
    base = median["torch.func.functional_call"] - floor
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; layer {args.layer} "
        f"({len(swaps)} tensors); medians of {args.repeats} x {args.calls} "
        f"calls"
    )
    print("| contender | us per call | overhead above the plain call (us) | overhead ratio |")
    print("|---|---:|---:|---:|")
    for name, seconds in median.items():
        over = seconds - floor
        ratio = "" if name == "plain call" else f"{over / base:.3f}"
        print(f"| {name} | {seconds * 1e6:.1f} | {over * 1e6:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
