"""roundpipe.hf's mixture-of-experts families Mixtral, Qwen2-MoE and GPT-OSS: the loss and every
gradient equal plain transformers', with the load-balancing loss and without, per device pool,
microbatch count and padding side; the router's path is checked at wrap."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipeRunConfig  # noqa: E402

VOCAB = 96
FAMILIES = ["mixtral", "qwen2_moe", "gpt_oss"]


def config(family, **extra):
    """A tiny config: 4 experts, top 2; sliding-window layers with a window shorter than the
    rows; Qwen2-MoE with a dense middle layer (mlp_only_layers) and its shared expert; GPT-OSS
    alternating sliding and full layers (config.layer_types), with its attention sinks."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.5,
    )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **{**common, **extra}, num_local_experts=4, sliding_window=5
        )
    if family == "qwen2_moe":
        moe = dict(
            num_hidden_layers=3,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=2,
        )
        return transformers.Qwen2MoeConfig(**{**common, **moe, **extra})
    if family == "gpt_oss":
        # The yarn rope's default factor (32) over its original 4096 positions.
        gpt = dict(max_position_embeddings=131072, head_dim=16, sliding_window=5)
        return transformers.GptOssConfig(**{**common, **gpt, **extra}, num_local_experts=4)
    raise AssertionError(family)


def twins(cfg):
    """Two models with the same weights: one to wrap, one for plain transformers."""
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    b = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    return a, b


def padded_batch(side, batch=4, tokens=12, seed=1):
    """Rows of different real lengths, so microbatches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, tokens), generator=g)
    lengths = torch.tensor([tokens, 5, tokens - 2, 3][:batch])
    pos = torch.arange(tokens)
    real = pos < lengths[:, None] if side == "right" else pos >= tokens - lengths[:, None]
    return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~real, -100)}


def predicted(labels):
    return int((labels[:, 1:] != -100).sum())


def plain_loss_backward(plain, batch, microbatches):
    """transformers' loss of ``batch`` (one microbatch), or with several the microbatches' own
    losses, each load-balancing term its microbatch's, weighted by their shares of the batch's
    predicted tokens (roundpipe's documented semantics, docs/hf.md); backpropagated."""
    if microbatches == 1:
        loss = plain(**batch).loss
    else:
        total = predicted(batch["labels"])
        loss = 0.0
        for rows in torch.arange(len(batch["input_ids"])).chunk(microbatches):
            part = {k: v[rows] for k, v in batch.items()}
            loss = loss + plain(**part).loss * predicted(part["labels"]) / total
    loss.backward()
    return loss.detach()


# Each device pool with 1 and 4 microbatches, each padding side on both pools; without the
# load-balancing term (the stages then carry no router sums) both pools, both counts, both sides.
CASES = [
    pytest.param(True, "cpu", 1, "right", id="router_logits-cpu-1-right"),
    pytest.param(True, "cpu", 4, "left", id="router_logits-cpu-4-left"),
    pytest.param(True, "emu:2", 1, "left", id="router_logits-emu:2-1-left"),
    pytest.param(True, "emu:2", 4, "right", id="router_logits-emu:2-4-right"),
    pytest.param(False, "cpu", 4, "left", id="no_router_logits-cpu-4-left"),
    pytest.param(False, "emu:2", 1, "right", id="no_router_logits-emu:2-1-right"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("aux,devices,M,side", CASES)
def test_loss_and_every_gradient_equal_plain_transformers(family, aux, devices, M, side):
    wrapped, plain = twins(config(family, output_router_logits=aux))
    batch = padded_batch(side)
    # Without the load-balancing term the microbatches add up to transformers' batch loss.
    expected = plain_loss_backward(plain, batch, M if aux else 1)
    model = roundpipe.hf.wrap(
        wrapped, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=M)
    )
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    with OptimizerCtx():
        grads = {n: p.grad for n, p in model.optim_named_parameters()}
    assert set(grads) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        assert p.grad is not None, name  # the router's and every expert's included
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_without_router_is_refused_with_router_logits(family):
    wrapped, _ = twins(config(family, output_router_logits=True))
    with pytest.raises(NotImplementedError, match=r"names no router \(Family\(router="):
        roundpipe.hf.wrap(wrapped, family=roundpipe.hf.Family(family, (family,)), devices="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrong_router_path_is_named(family):
    wrapped, _ = twins(config(family))
    wrong = roundpipe.hf.Family(family, (family,), router="mlp.no_router")
    with pytest.raises(TypeError, match=r"no router module at 'mlp.no_router'.*router="):
        roundpipe.hf.wrap(wrapped, family=wrong, devices="cpu")


def test_the_self_check_names_a_router_path_whose_output_is_not_router_logits():
    # Qwen2-MoE's shared-expert gate is a gate too, of one output per token.
    wrapped, _ = twins(config("qwen2_moe", output_router_logits=True))
    family = roundpipe.hf.Family("qwen2_moe", ("qwen2_moe",), router="mlp.shared_expert_gate")
    with pytest.raises(
        roundpipe.hf.WrapCheckError,
        match=r"router path 'mlp.shared_expert_gate'.*not router logits.*load-balancing loss",
    ):
        roundpipe.hf.wrap(wrapped, family=family, devices="cpu")


def test_the_self_check_catches_a_router_path_with_the_shape_of_router_logits():
    # A shared expert as wide as the experts are many: its projection has the router logits'
    # shape, so only the load-balancing loss tells it apart.
    cfg = config("qwen2_moe", output_router_logits=True, shared_expert_intermediate_size=4)
    wrapped, _ = twins(cfg)
    family = roundpipe.hf.Family("qwen2_moe", ("qwen2_moe",), router="mlp.shared_expert.gate_proj")
    with pytest.raises(
        roundpipe.hf.WrapCheckError,
        match=r"load-balancing loss \(router_aux_loss_coef\) differs: check the family's router=",
    ):
        roundpipe.hf.wrap(wrapped, family=family, devices="cpu")


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_models_counting_num_local_experts_are_treated_as_mixtures_of_experts(family):
    """Mixtral and GPT-OSS name their experts num_local_experts: model(**batch) with labels
    refuses the case it cannot compute, and forward_backward the other setting."""
    wrapped, plain = twins(config(family, output_router_logits=True))
    model = roundpipe.hf.wrap(
        wrapped, devices="cpu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    batch = padded_batch("right")
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="output_router_logits=True"):
            model(**batch)
        ours = model(**batch, output_router_logits=False).loss
        theirs = plain(**batch, output_router_logits=False).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="output_router_logits=False differs"):
        model.forward_backward(input_kwargs={**batch, "output_router_logits": False})


def test_the_families_are_registered_with_their_routers():
    routers = {t: f.router for t, f in roundpipe.hf.families().items() if f.router is not None}
    assert routers == {
        "qwen3_moe": "mlp.gate",
        "mixtral": "mlp.gate",
        "qwen2_moe": "mlp.gate",
        "gpt_oss": "mlp.router",
    }
    assert len(roundpipe.hf.families()) >= 5 + 3  # llama, mistral, qwen2, qwen3, qwen3_moe
