"""The token-tiled MLP and norms of a decoder layer (roundpipe.hf.tiling): the same numbers as
the untiled layer, a smaller working set on the emulated device, by what the memory plan
predicts, and the tile length chosen from the device (roundpipe.hf.defaults)."""

import gc
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe.hf import tiling  # noqa: E402
from roundpipe.hf.defaults import (  # noqa: E402
    MIN_MLP_TILE_TOKENS,
    MLP_TILE_BYTES,
    default_mlp_tile_tokens,
)
from roundpipe.testing import emu  # noqa: E402  (installed by conftest)

memory = torch.get_device_module("emu")
MIB = 1 << 20


def _config(family, layers=2, hidden=64, intermediate=192, vocab=512, heads=4, kv=2, **extra):
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **extra,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
    raise ValueError(family)


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _batch(rows, seq_len, vocab=512):
    ids = torch.randint(vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_the_tile_is_a_share_of_the_device_in_intermediates():
    # Qwen3-1.7B (intermediate 6144) in bf16: no device, the 256 MiB cap: 7,281 -> 4,096.
    assert default_mlp_tile_tokens(6144, 2) == 4096
    assert default_mlp_tile_tokens(6144, 2) * 3 * 6144 * 2 <= MLP_TILE_BYTES
    # On 23.5 GiB the share (376 MiB) is above the cap; on 2 GiB it is 32 MiB: 910 -> 512.
    assert default_mlp_tile_tokens(6144, 2, 23 << 30) == 4096
    assert default_mlp_tile_tokens(6144, 2, 2 << 30) == 512
    assert default_mlp_tile_tokens(6144, 2, 8 * MIB) == MIN_MLP_TILE_TOKENS  # the floor


def _layer_run(layer, rotary, hidden, tile):
    x = hidden.clone().requires_grad_()
    positions = torch.arange(x.shape[1]).unsqueeze(0)
    cos_sin = rotary(x, positions)
    with tiling.tiles(tile):
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [x, *params], grad_out)
    return out.detach(), grads[0], dict(zip([n for n, _ in layer.named_parameters()], grads[1:]))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("only_mlp", [True, False])
def test_a_tiled_layer_computes_what_the_untiled_one_does(family, only_mlp):
    """CPU, fp32, 2 rows x 100 tokens in tiles of 48 (tiles across the rows, the last one
    short): the output bitwise (each row of a matmul and of a norm is computed alone); the
    input's gradient bitwise with the MLP alone tiled, within a few ulps (1e-6) with the norms
    tiled too (autograd adds the norm's and the residual's contributions in another order);
    the weights' gradients (sums over the tiles) within 1e-5."""
    model = _model(_config(family))
    layer = model.model.layers[0]
    names = ("mlp",) if only_mlp else roundpipe.hf.Family("x", ("x",)).tiled
    expected = ["mlp"] if only_mlp else ["input_layernorm", "post_attention_layernorm", "mlp"]
    assert tiling.install(layer, names) == expected
    hidden = torch.randn(2, 100, 64, generator=torch.Generator().manual_seed(0))
    out0, gx0, gw0 = _layer_run(layer, model.model.rotary_emb, hidden, None)
    out1, gx1, gw1 = _layer_run(layer, model.model.rotary_emb, hidden, 48)
    assert torch.equal(out0, out1)
    if only_mlp:
        assert torch.equal(gx0, gx1)
    else:
        torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for name, g in gw0.items():
        torch.testing.assert_close(gw1[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert gw0["mlp.down_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("pool", ["cpu", "emu"])
def test_a_wrapped_model_in_tiles_trains_as_untiled(family, pool):
    """Two wraps of one model, tiles of 32 tokens and untiled (0), one forward_backward of
    2 x 80 tokens each: the loss bitwise, every master's gradient within 1e-5."""
    cfg = _config(family)
    batch = _batch(2, 80)
    losses, grads = [], []
    for tile in (0, 32):
        model = roundpipe.hf.wrap(_model(cfg), devices=pool, check=False, mlp_tile_tokens=tile)
        assert all(s.mlp_tile_tokens == (tile or None) for s in model.module[1:-1])
        losses.append(model.forward_backward(input_kwargs=batch))
        model.synchronize()
        grads.append({n: m.grad.clone() for n, m in model.optim_named_parameters()})
        del model
    assert torch.equal(losses[0], losses[1])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_the_hf_model_itself_and_moe_blocks_are_not_tiled():
    model = _model(_config("llama"))
    wrapped = roundpipe.hf.wrap(model, devices="cpu", check=False, mlp_tile_tokens=16)
    layer = model.model.layers[0]
    assert sorted(tiling.tiled_modules(layer)) == [
        "input_layernorm",
        "mlp",
        "post_attention_layernorm",
    ]
    assert "mlp_tile_tokens=16" in repr(wrapped.module[1])
    # Outside the stages (the user calling the HF model) the modules' own forward runs.
    calls = []
    layer.mlp.down_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape))
    model(input_ids=torch.zeros((1, 40), dtype=torch.long))
    assert calls == [torch.Size([1, 40, 192])]
    moe = roundpipe.hf.wrap(_model(_config("qwen3_moe")), devices="cpu", check=False)
    assert all(stage.tiled == [] for stage in moe.module[1:-1])
    assert "mlp_tile_tokens=None" in repr(moe.module[1])
    with pytest.raises(ValueError, match="mlp_tile_tokens must be an int >= 0"):
        roundpipe.hf.wrap(_model(_config("llama")), devices="cpu", check=False, mlp_tile_tokens=-1)


def _measured_peak(model, batch):
    gc.collect()
    memory.reset_peak_memory_stats(0)
    base = memory.memory_allocated(0)
    loss = model.forward_backward(input_kwargs=batch)
    assert torch.isfinite(loss)
    return memory.max_memory_allocated(0) - base


def test_tiles_lower_the_measured_peak_by_what_the_plan_predicts():
    """Llama, hidden 128, MLP 384, 2 layers, one sequence of 1,024 tokens on the emulated
    device, untiled and in tiles of 128: the measured peak falls by more than half, and the
    plan says each peak to the byte but for the loss's few (the microbatch's context on the
    device, rotary tables, positions and labels, counted)."""
    cfg = _config("llama", hidden=128, intermediate=384)
    batch = _batch(1, 1024)
    planned, measured = [], []
    for tile in (0, 128):
        model = roundpipe.hf.wrap(_model(cfg), devices="emu", check=False, mlp_tile_tokens=tile)
        planned.append(model.memory_plan(input_kwargs=batch).devices[0].peak)
        measured.append(_measured_peak(model, batch))
        del model
    print(f"planned {planned}, measured {measured}")
    assert measured[1] < 0.5 * measured[0]
    for plan, measure in zip(planned, measured):
        assert abs(plan - measure) <= 64, (planned, measured)


def test_the_plan_of_a_qwen3_1_7b_shaped_cut_is_the_measured_peak():
    """Two decoder layers of Qwen3-1.7B's shape (hidden 2048, MLP 6144, 16 heads of 128, 8
    key/value heads; a vocabulary of 8192 instead of 151,936, so the CPU runs it), fp32, one
    sequence of 512 tokens at wrap's default tile for a 2 GiB device (256 tokens): the plan's
    device peak within 2% of the emulated device's measured one."""
    cfg = _config(
        "qwen3",
        hidden=2048,
        intermediate=6144,
        vocab=8192,
        heads=16,
        kv=8,
        head_dim=128,
    )
    batch = _batch(1, 512, vocab=8192)
    previous = emu.set_memory_capacity(2 << 30)
    try:
        model = roundpipe.hf.wrap(_model(cfg), devices="emu", check=False)
        tile = model.module[1].mlp_tile_tokens
        assert tile == default_mlp_tile_tokens(6144, 4, model.device_free())
        plan = model.memory_plan(input_kwargs=batch)
        start = time.perf_counter()
        measured = _measured_peak(model, batch)
        took = time.perf_counter() - start
    finally:
        emu.set_memory_capacity(previous)
    planned = plan.devices[0].peak
    print(
        f"tile {tile}: planned {planned} measured {measured} ({planned / measured - 1:+.2%}), {took:.1f} s"
    )
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


def test_the_plan_command_plans_the_tiled_layer(tmp_path, capsys):
    """ConfigPlanner (the plan command) at a target device: the tile chosen for it as wrap
    chooses it, a smaller device peak tiled than with --mlp-tile-tokens 0 at a long sequence,
    and the same peak at a sequence of one tile (a microbatch of one tile runs untiled)."""
    import json

    from roundpipe.hf import memory_cli

    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    device = 1 << 30  # 512 MiB after the CUDA context: 8 MiB / (3 x 256 x 2 bytes) -> 4,096
    tiled = memory_cli.ConfigPlanner(str(path), devices="emu", device_memory=device)
    assert tiled.model.module[1].mlp_tile_tokens == 4096
    untiled = memory_cli.ConfigPlanner(
        str(path), devices="emu", device_memory=device, mlp_tile_tokens=0
    )
    assert untiled.model.module[1].mlp_tile_tokens is None
    long_peaks = [p.plan(16384).devices[0].peak for p in (tiled, untiled)]
    assert long_peaks[0] < 0.8 * long_peaks[1], long_peaks
    short_peaks = [p.plan(4096).devices[0].peak for p in (tiled, untiled)]
    assert short_peaks[0] == short_peaks[1]
    with pytest.raises(SystemExit):
        memory_cli.main([str(path), "--seq-len", "64", "--mlp-tile-tokens", "-1"])
    assert "--mlp-tile-tokens must be >= 0" in capsys.readouterr().err


def test_the_final_norm_runs_in_tiles_in_training_and_lowers_the_heads_peak():
    """The head's final norm in tiles (the decoders' tile), bf16 Llama of one layer whose head
    is the peak untiled (hidden 256, one sequence of 2,048 tokens): in training the norm sees
    tiles and the peak falls from the head's action to a decoder's backward, to the byte as
    the plan says; without labels (inference) the norm runs whole."""
    cfg = _config("llama", layers=1, hidden=256, intermediate=256)
    model = roundpipe.hf.wrap(
        _model(cfg).to(torch.bfloat16), devices="emu", check=False, mlp_tile_tokens=256
    )
    head = model.module[-1]
    assert head.tiled == ["norm"] and "norm_tile_tokens=256" in repr(head)
    seen = []
    head.norm.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[:-1].numel()))
    batch = _batch(1, 2048)
    peaks = {}
    for tile in (256, None):
        head.norm_tile_tokens = tile
        plan = model.memory_plan(input_kwargs=batch).devices[0]
        seen.clear()
        peaks[tile] = (plan.peak, plan.at, _measured_peak(model, batch))
        assert max(seen) == 2048 and (min(seen) == 256) == (tile == 256), (tile, set(seen))
    print(peaks)
    (tiled, tiled_at, tiled_measured), (whole, whole_at, whole_measured) = peaks.values()
    assert tiled_at.startswith("B") and whole_at.startswith("L"), (tiled_at, whole_at)
    assert tiled_measured < 0.9 * whole_measured
    assert abs(tiled - tiled_measured) <= 64 and abs(whole - whole_measured) <= 64
    # Inference: the logits of the whole sequence, the norm called once on all of it.
    head.norm_tile_tokens = 256
    seen.clear()
    with torch.no_grad():
        model(input_ids=batch["input_ids"][:, :512])
    assert seen == [512]
