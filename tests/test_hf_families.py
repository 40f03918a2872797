"""roundpipe.hf's dense families beyond the Llama layout: Gemma 2, Gemma 3 (text), Phi-3,
OLMo 2, Granite and Cohere. Per family, the loss and every gradient equal plain transformers'
with config values that make the family's own arithmetic matter (soft-capped logits, Gemma's
embedding normalizer, Granite's multipliers, Cohere's logit scale, sliding and full layers with
windows shorter than the rows); a family that claims a feature without implementing it is
caught by the wrap's self-check, naming the part, and one that does not claim it is refused,
naming the config attribute."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import TINY, master_grads, padded_batch, twins  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.hf import compat  # noqa: E402

DENSE = ("gemma2", "gemma3_text", "phi3", "olmo2", "granite", "cohere")
# Registered before these families (tests/test_hf.py covers them).
EARLIER = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

_CONFIGS = {
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "olmo2": "Olmo2Config",
    "granite": "GraniteConfig",
    "cohere": "CohereConfig",
}


def config(family, **extra):
    """A tiny config of ``family`` whose outside-the-layers arithmetic is turned on; ``extra``
    overrides any value."""
    # Every supported transformers has every family's config: a missing one is a failure.
    cls = getattr(transformers, _CONFIGS[family])
    values = dict(
        TINY,
        pad_token_id=0,  # the defaults of some (Phi-3's 32000) are outside a tiny vocabulary
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "gemma2":  # a sliding layer (window 5 < 12 tokens) and a full one
        values.update(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=0.3,  # the logits reach about 0.6: tanh bites
        )
    elif family == "gemma3_text":  # local rotary base 100; global 10000, linearly scaled
        values.update(
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=10000.0,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},  # as Gemma 3's global layers
            final_logit_softcapping=0.3,
        )
    elif family == "phi3":  # fused projections, half the head rotated, a window on every layer
        values.update(sliding_window=5, partial_rotary_factor=0.5)
    elif family == "granite":
        values.update(
            embedding_multiplier=2.0,
            logits_scaling=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
        )
    elif family == "cohere":  # tied embeddings, as Cohere's models
        values.update(tie_word_embeddings=True, logit_scale=0.5, use_qk_norm=True)
    values.update(extra)
    return cls(**values)


def assert_equal_to_plain_transformers(wrapped, plain, batch, **wrap_kwargs):
    ref = plain(**batch)
    ref.loss.backward()
    model = roundpipe.hf.wrap(wrapped, **wrap_kwargs)
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    grads = master_grads(model)
    assert set(grads) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    return model


@pytest.mark.parametrize("family", DENSE)
def test_called_like_the_model_it_gives_the_models_logits_and_loss(family):
    """``model(**batch)``: the transformed logits (soft-capped, scaled) and the loss."""
    wrapped, plain = twins(config(family))
    model = roundpipe.hf.wrap(
        wrapped, devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    batch = padded_batch("left")
    with torch.no_grad():
        ours, theirs = model(**batch), plain(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours.logits.cpu()[real], theirs.logits[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss.cpu(), theirs.loss, rtol=1e-5, atol=1e-6)


# Every pair of values of any two of (devices, microbatches, padding side) once: four wraps per
# family instead of eight, so the file stays fast on two cores.
@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize(
    "devices,M,side",
    [("cpu", 1, "right"), ("cpu", 4, "left"), ("emu:2", 4, "right"), ("emu:2", 1, "left")],
)
def test_loss_and_every_gradient_equal_plain_transformers(family, devices, M, side):
    wrapped, plain = twins(config(family))
    assert_equal_to_plain_transformers(
        wrapped,
        plain,
        padded_batch(side),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=M),
    )


@pytest.mark.parametrize(
    "devices",
    [
        "cpu",
        "emu:2",
    ],
)
def test_phi3_longrope_takes_its_long_factors_beyond_the_original_length(devices):
    """Phi-3's LongRoPE (the 128k models, Phi-3.5, Phi-4-mini) picks its long factors when the
    positions pass original_max_position_embeddings: 12 tokens past 8, then 6 tokens within."""
    factors = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
    cfg = config(
        "phi3",
        original_max_position_embeddings=8,
        rope_scaling={"type": "longrope", **factors},
    )
    wrapped, plain = twins(cfg)
    model = assert_equal_to_plain_transformers(
        wrapped,
        plain,
        padded_batch("right"),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    short = padded_batch("right", tokens=6)
    with torch.no_grad():
        ours, theirs = model(**short), plain(**short)
    torch.testing.assert_close(ours.loss.cpu(), theirs.loss, rtol=1e-5, atol=1e-6)


def _plain_family(family, handles=()):
    """The Llama-layout family for ``family``'s model type, claiming ``handles`` without any of
    the code behind them."""
    return roundpipe.hf.Family(family, (family,), handles=handles)


@pytest.mark.parametrize(
    "family,attributes",
    [
        ("gemma2", ["final_logit_softcapping=0.3"]),
        ("gemma3_text", ["final_logit_softcapping=0.3"]),
        ("granite", ["logits_scaling=4.0", "embedding_multiplier=2.0"]),
        ("cohere", ["logit_scale=0.5"]),
    ],
)
def test_a_family_without_the_features_code_is_refused_naming_the_attribute(family, attributes):
    model, _ = twins(config(family))
    with pytest.raises(NotImplementedError, match="outside its decoder layers") as info:
        roundpipe.hf.wrap(model, family=_plain_family(family), devices="cpu")
    for attribute in attributes:
        assert attribute in str(info.value)


def test_gemma3_as_a_bidirectional_encoder_is_refused():
    """EmbeddingGemma's masks see ahead (built outside the layers, where the stages build
    causal ones): refused by the registered family, naming the attribute."""
    model, _ = twins(config("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention=True"):
        roundpipe.hf.wrap(model, devices="cpu")


@pytest.mark.parametrize(
    "family,part",
    [
        ("gemma2", "embedding"),
        ("gemma2", "logits"),
        ("gemma3_text", "logits"),
        ("granite", "embedding"),
        ("granite", "logits"),
        ("cohere", "logits"),
    ],
)
def test_a_family_claiming_a_feature_without_its_code_fails_the_self_check(family, part):
    """The registered family with one part's code taken away, still claiming every feature."""
    model, plain = twins(config(family))
    field = "embed_scale" if part == "embedding" else "logits"
    wrong = dataclasses.replace(roundpipe.hf.families()[family], **{field: None})
    if part == "embedding" and compat.embedding_scales_itself(model.get_input_embeddings()):
        # This transformers scales Gemma 2's embeddings inside the module: nothing is missing.
        assert_equal_to_plain_transformers(model, plain, padded_batch("right"), family=wrong)
        return
    match = r"embedding's output differs.*embed_scale=" if field == "embed_scale" else None
    with pytest.raises(roundpipe.hf.WrapCheckError, match=match or r"logits differ.*logits="):
        roundpipe.hf.wrap(model, family=wrong, devices="cpu")


def test_the_plain_layout_is_caught_at_the_first_part_that_differs():
    """The Llama-layout family claiming Granite's features: its embedding differs first."""
    model, _ = twins(config("granite"))
    wrong = _plain_family("granite", handles=("embedding_multiplier", "logits_scaling"))
    with pytest.raises(roundpipe.hf.WrapCheckError, match=r"embedding's output differs"):
        roundpipe.hf.wrap(model, family=wrong, devices="cpu")
    model, _ = twins(config("granite", embedding_multiplier=1.0))
    with pytest.raises(roundpipe.hf.WrapCheckError, match=r"logits differ.*logits_scaling=4.0"):
        roundpipe.hf.wrap(model, family=wrong, devices="cpu")


def test_gemma3_without_its_local_rotary_fails_the_self_check_where_the_model_keeps_one():
    """On transformers 4.x Gemma 3 keeps a second rotary for its sliding layers; a family that
    does not name it gives those layers the global one, and the self-check names the rotary.
    Where one rotary takes the layer type (5.x) the family needs no path."""
    model, plain = twins(config("gemma3_text"))
    without = dataclasses.replace(roundpipe.hf.families()["gemma3_text"], rotary_local=None)
    if getattr(model.model, "rotary_emb_local", None) is None:
        assert_equal_to_plain_transformers(model, plain, padded_batch("left"), family=without)
        return
    with pytest.raises(
        roundpipe.hf.WrapCheckError,
        match=r"layer 0 \(sliding_attention\).*rotary embedding \(position_embeddings_local\)",
    ):
        roundpipe.hf.wrap(model, family=without, devices="cpu")


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "granite"])
def test_bf16_embeddings_are_the_models_bit_for_bit(family):
    """The embedding factor rounded as the model rounds it: Gemma multiplies by sqrt(hidden)
    in the embeddings' dtype (sqrt(48) = 6.928 becomes 6.9375 in bf16), Granite by a Python
    float (0.3, which bf16 cannot hold); where the embedding module scales itself (Gemma 3,
    Gemma 2 on newer transformers) nothing is applied twice. The first decoder layer's input
    in roundpipe's forward equals the one in transformers' forward, bit for bit, and so do
    the logits."""
    extra = {"hidden_size": 48, "head_dim": 12}
    if family == "granite":
        extra = {"embedding_multiplier": 0.3}
    wrapped, plain = twins(config(family, **extra), dtype=torch.bfloat16)
    inputs = {}

    def keep(name):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs.setdefault(name, hidden.detach().clone())

        return hook

    model = roundpipe.hf.wrap(wrapped, devices="cpu")  # the self-check copies the layers
    wrapped.model.layers[0].register_forward_pre_hook(keep("roundpipe"), with_kwargs=True)
    plain.model.layers[0].register_forward_pre_hook(keep("transformers"), with_kwargs=True)
    batch = padded_batch("right")
    del batch["labels"]
    with torch.no_grad():
        ours = model(**batch).logits
        theirs = plain(**batch).logits
    assert inputs["roundpipe"].dtype == torch.bfloat16
    assert torch.equal(inputs["roundpipe"], inputs["transformers"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real].float(), theirs[real].float(), rtol=0, atol=0)


def test_the_dense_families_are_registered():
    registered = roundpipe.hf.families()
    for model_type in DENSE:
        assert registered[model_type].name == model_type
    # The five before and these six; other families (mixture of experts) may be registered too.
    assert len(registered) >= len(EARLIER) + len(DENSE)
    assert set(EARLIER) | set(DENSE) <= set(registered)
