"""roundpipe.hf.wrap(compile=...): each decoder layer runs through torch.compile (see [Note:
compiled layers] in roundpipe/runtime/compiled.py). Loss and every gradient equal plain
transformers; one compilation serves every layer; dropout's masks replay in the recompute; the
memory plan's trace still runs the layers eagerly; the emulated device runs them eagerly with a
warning. Most tests compile with ``aot_eager`` (torch's autograd graphs, eager kernels: seconds
on the CPU); one compiles with inductor, the default, whose CPU kernels take about a minute to
build here."""

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

from test_hf import build, config, master_grads, padded_batch, twins  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipeRunConfig  # noqa: E402
from roundpipe.runtime.compiled import compile_options  # noqa: E402

AOT_EAGER = {"backend": "aot_eager"}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def wrap(hf, compile, M=4, devices="cpu", **kwargs):
    return roundpipe.hf.wrap(
        hf,
        devices=devices,
        compile=compile,
        model_run_config=RoundPipeRunConfig(num_microbatch=M),
        **kwargs,
    )


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def assert_equals_plain(model, plain, batch, rtol=1e-5, atol=1e-6):
    ref = plain(**batch)
    ref.loss.backward()
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=rtol, atol=atol)
    grads = master_grads(model)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=100 * rtol, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_compiled_layers_give_the_loss_and_every_gradient_of_plain_transformers(family):
    """Left padding over four microbatches of different real lengths; the MoE family adds the
    router's load-balancing loss, read by a hook inside the compiled layer."""
    extra = {"output_router_logits": True} if family == "qwen3_moe" else {}
    wrapped, plain = twins(config(family, **extra))
    model = wrap(wrapped, AOT_EAGER, M=1 if extra else 4)
    assert_equals_plain(model, plain, padded_batch("left"))
    assert compiled_graphs() > 0


def test_one_compilation_serves_every_layer():
    """Eight layers, four microbatches, three steps: at most a graph without grad (a forward
    whose stage recomputes) and one with grad, not one per layer or per step."""
    model = wrap(build(config("qwen3", num_hidden_layers=8)), AOT_EAGER)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(96, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    for _ in range(3):
        model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    assert 1 <= compiled_graphs() <= 2


def _lora_losses(compile, seed=0):
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    hf = peft.get_peft_model(
        build(config("qwen3")),
        peft.LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    model = wrap(hf, compile, M=2)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(96, (4, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(input_kwargs=batch))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    with OptimizerCtx():
        masters = [p.detach().clone() for p in model.optim_parameters()]
    return torch.stack(losses), masters


def test_dropout_inside_compiled_layers_trains_as_the_eager_layers_bit_for_bit():
    """LoRA's dropout (p=0.5) draws inside the compiled layers: the recompute replays the
    forward's masks, so the losses and the trained adapters are the eager run's exactly (a
    different mask in the recompute would change the gradients by far more than rounding)."""
    eager_losses, eager_masters = _lora_losses(False)
    losses, masters = _lora_losses(AOT_EAGER)
    assert compiled_graphs() > 0
    assert torch.equal(losses, eager_losses)
    for ours, theirs in zip(masters, eager_masters):
        assert torch.equal(ours, theirs)


def test_the_memory_plan_traces_the_layers_eagerly():
    """The plan's trace on fake tensors runs under a dispatch mode: it compiles nothing, and
    its numbers are the eager model's."""
    cfg = config("llama", vocab_size=512, max_position_embeddings=256)
    ids = torch.randint(512, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plans = []
    for compile in (False, AOT_EAGER):
        model = wrap(build(cfg, torch.bfloat16), compile, M=2, loss_chunk_tokens=32)
        plans.append(model.memory_plan(input_kwargs=batch))
    assert compiled_graphs() == 0
    assert [d.peak for d in plans[0].devices] == [d.peak for d in plans[1].devices]


def test_the_emulated_device_runs_the_layers_eagerly_and_says_so():
    wrapped, plain = twins(config("qwen3"))
    with pytest.warns(UserWarning, match=r"emu devices run the layers eagerly"):
        model = wrap(wrapped, True, devices="emu")
    assert_equals_plain(model, plain, padded_batch("right"))
    assert compiled_graphs() == 0


def test_inductor_the_default_backend_matches_plain_transformers():
    """compile=True: inductor's generated CPU kernels (fused norms and pointwise ops, so the
    last bits of fp32 differ from the eager ops')."""
    wrapped, plain = twins(config("qwen3"))
    model = wrap(wrapped, True)
    assert_equals_plain(model, plain, padded_batch("right"), rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]


def test_compile_options(monkeypatch):
    from roundpipe.runtime import compiled as stages

    assert compile_options(False, "cuda") is None
    assert compile_options(True, "cpu") == {"options": {"fallback_random": True}}
    assert compile_options({"mode": "max-autotune-no-cudagraphs"}, "cuda") == {
        "mode": "max-autotune-no-cudagraphs",
        "options": {"fallback_random": True},
    }
    mine = {"options": {"fallback_random": False}}
    assert compile_options(mine, "cuda") == mine
    assert compile_options(AOT_EAGER, "cuda") == AOT_EAGER
    with pytest.raises(TypeError, match="a bool, None or a dict of torch.compile's arguments"):
        compile_options("inductor", "cuda")
    # The default: CUDA with Triton and torch >= 2.5 only.
    monkeypatch.setattr(stages, "_has_triton", lambda: True)
    assert compile_options(None, "cuda") == {"options": {"fallback_random": True}}
    assert compile_options(None, "cpu") is None
    assert compile_options(None, "emu") is None
    monkeypatch.setattr(stages, "_has_triton", lambda: False)
    assert compile_options(None, "cuda") is None
    monkeypatch.setattr(stages, "_has_triton", lambda: True)
    monkeypatch.setattr(stages, "_torch_version", lambda: (2, 4))
    assert compile_options(None, "cuda") is None
    with pytest.raises(RuntimeError, match=r"needs torch>=2.5.*or pass compile=False"):
        compile_options(True, "cuda")


def test_the_default_runs_eagerly_off_cuda():
    """wrap's default compiles on CUDA only: a CPU or emulated pool compiles nothing."""
    for devices in ("cpu", "emu"):
        model = roundpipe.hf.wrap(build(config("qwen3")), devices=devices)
        ids = torch.randint(96, (2, 12), generator=torch.Generator().manual_seed(0))
        model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    assert compiled_graphs() == 0


def test_batches_of_varied_lengths_and_padding_reuse_a_few_graphs(recwarn):
    """Ten batches of different lengths, rows and padding: after the first shapes, torch makes
    the sizes symbolic, so the graphs stop growing well inside the limit wrap sets."""
    from roundpipe.runtime.compiled import LAYER_GRAPHS

    model = wrap(build(config("qwen3")), AOT_EAGER)
    assert torch._dynamo.config.recompile_limit >= LAYER_GRAPHS
    g = torch.Generator().manual_seed(0)
    graphs = []
    for i, tokens in enumerate([12, 16, 20, 9, 31, 24, 40, 17, 64, 13]):
        ids = torch.randint(96, (6 if i % 3 else 5, tokens), generator=g)
        mask = torch.ones_like(ids)
        if i % 2:
            mask[1, : tokens // 2] = 0
        model.forward_backward(
            input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids}
        )
        graphs.append(compiled_graphs())
    assert graphs[-1] == graphs[len(graphs) // 2] <= 12, graphs
    assert not [w for w in recwarn if "recompile" in str(w.message)]


@pytest.mark.parametrize("tile", [0, 8])
def test_a_compiled_layer_is_one_graph_with_or_without_tiles(tile):
    """No graph break inside a layer (each would be one more compiled call per layer and
    microbatch), with its MLP untiled and in tiles of 8 tokens."""
    model = wrap(build(config("qwen3")), AOT_EAGER, M=2, mlp_tile_tokens=tile)
    ids = torch.randint(96, (4, 12), generator=torch.Generator().manual_seed(0))
    model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    assert compiled_graphs() > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_compiled_layer_runs_on_swapped_device_copies_with_one_graph():
    """The accelerator path's mechanism on the CPU: each call swaps fresh copies of the layer's
    weights in (as each upload does; see [Note: the layer's device tensors]); the compiled
    layer reuses its graph, computes with the copies (the module's own weights are never
    read), and its gradients land on the copies."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from roundpipe.devices.accelerator import run_swapped, swaps_of

    cfg = config("qwen3")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layers = [Qwen3DecoderLayer(cfg, i) for i in range(2)]
    compiled = {id(layer): torch.compile(layer, **AOT_EAGER) for layer in layers}
    x = torch.randn(2, 12, 64)
    positions = torch.arange(12)[None]
    rotary = Qwen3RotaryEmbedding(cfg)(x, positions)
    kwargs = dict(attention_mask=None, position_ids=positions, position_embeddings=rotary)
    for step in range(3):
        for layer in layers:
            swaps = swaps_of(layer, lambda t, _: (t * (1 + step)).detach().requires_grad_())
            out = run_swapped(compiled[id(layer)], swaps, (x,), kwargs)
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
            eager_copies = [copy.detach().requires_grad_() for _, _, copy in swaps]
            eager_swaps = [(owner, key, c) for (owner, key, _), c in zip(swaps, eager_copies)]
            ref = run_swapped(layer, eager_swaps, (x,), kwargs)
            ref = ref[0] if isinstance(ref, tuple) else ref
            ref.sum().backward()
            torch.testing.assert_close(out, ref)
            for (_, _, copy), eager in zip(swaps, eager_copies):
                torch.testing.assert_close(copy.grad, eager.grad)
    assert compiled_graphs() == 1
