"""roundpipe.hf.wrap proves itself: the self-check (roundpipe/hf/check.py) compares the stages
with the model's own forward on a cut of it and names the part that differs; features outside
the decoder layers that a family does not implement are refused at wrap, by name."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import build, config  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe.hf import Family, WrapCheckError, check_stages, compat  # noqa: E402
from roundpipe.hf.families import layer_attention_types  # noqa: E402


def llama_family(**fields):
    return Family("llama", ("llama",), **fields)


def test_the_check_compares_a_cut_of_the_model_and_reports_it():
    model = build(config("llama", num_hidden_layers=4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = check_stages(model, llama_family(), layer_attention_types(model.config), 128)
    assert report is not None
    assert report.layers == (0, 1)  # the first two layers of the one attention type
    assert report.logits_difference < roundpipe.hf.check.TOLERANCE
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-6)
    assert report.seconds > 0
    # The model is untouched: same weights, no hooks left, its config as it was.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.num_hidden_layers == 4
    for layer in model.model.layers:
        assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_the_cut_takes_the_first_two_layers_of_each_attention_type():
    model = build(config("qwen2", num_hidden_layers=6))  # layer 0 full, the others sliding
    kinds = layer_attention_types(model.config)
    assert kinds == ["full_attention"] + ["sliding_attention"] * 5
    report = check_stages(model, Family("qwen2", ("qwen2",)), kinds, 128)
    assert report is not None and report.layers == (0, 1, 2)


def test_a_wrong_embedding_scale_is_named():
    with pytest.raises(WrapCheckError, match="embedding's output differs.*embed_scale="):
        roundpipe.hf.wrap(
            build(config("llama")), family=llama_family(embed_scale=lambda c: 2.0), devices="cpu"
        )


def test_a_wrong_logits_transform_is_named():
    doubled = llama_family(logits=lambda c: lambda logits: logits * 2)
    with pytest.raises(WrapCheckError, match="the logits differ.*logits="):
        roundpipe.hf.wrap(build(config("llama")), family=doubled, devices="cpu")


def test_a_wrong_rotary_embedding_is_named():
    # A second rotary for the sliding layers, of another base: their (cos, sin) differ from the
    # ones the model gives them.
    model = build(config("qwen2"))  # layer 0 full, layer 1 sliding
    other = copy.deepcopy(model.model.rotary_emb)
    other.inv_freq.mul_(3.0)  # other frequencies
    model.model.rotary_emb_other = other
    family = Family("qwen2", ("qwen2",), rotary_local="rotary_emb_other")
    with pytest.raises(WrapCheckError, match=r"layer 1 \(sliding_attention\).*rotary embedding"):
        roundpipe.hf.wrap(model, family=family, devices="cpu")


def test_a_wrong_attention_mask_is_named(monkeypatch):
    real = compat.build_mask

    def without_padding(builder, config, embeds, attention_mask, position_ids):
        return real(builder, config, embeds, None, position_ids)

    monkeypatch.setattr(compat, "build_mask", without_padding)
    with pytest.raises(WrapCheckError, match=r"layer 0 \(full_attention\).*attention mask"):
        roundpipe.hf.wrap(build(config("llama")), devices="cpu")


def test_check_false_skips_the_check():
    wrong = llama_family(embed_scale=lambda c: 2.0)
    model = roundpipe.hf.wrap(build(config("llama")), family=wrong, devices="cpu", check=False)
    assert isinstance(model, roundpipe.hf.HFRoundPipe)


def test_weights_on_the_meta_device_skip_the_check_with_a_warning():
    with torch.device("meta"):
        model = build(config("llama"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_stages(model, llama_family(), layer_attention_types(model.config), 128)
    assert report is None
    assert any("meta device" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    "feature, value",
    [
        ("final_logit_softcapping", 30.0),
        ("logit_scale", 0.5),
        ("logits_scaling", 4.0),
        ("embedding_multiplier", 12.0),
    ],
)
def test_a_feature_outside_the_layers_that_the_family_lacks_is_refused_by_name(feature, value):
    model = build(config("llama"))
    setattr(model.config, feature, value)
    with pytest.raises(NotImplementedError, match=f"{feature}={value!r}.*'llama'"):
        roundpipe.hf.wrap(model, devices="cpu")


def test_the_router_loss_without_a_router_is_refused():
    model = build(config("qwen3_moe", output_router_logits=True))
    family = Family("moe_without_router", ("qwen3_moe",))
    with pytest.raises(NotImplementedError, match="load-balancing loss.*router="):
        roundpipe.hf.wrap(model, family=family, devices="cpu")


def test_learned_positions_are_named_in_the_layout_error():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    )
    family = Family("gpt2", ("gpt2",), body="transformer", embed="wte", layers="h", norm="ln_f")
    with pytest.raises(TypeError, match="learned positions"):
        roundpipe.hf.wrap(model, family=family, devices="cpu")


def test_a_cut_of_dense_layers_takes_the_first_layer_with_a_router_too():
    # Qwen2-MoE whose first two layers are dense (mlp_only_layers): the first two layers of
    # their attention type have no router, so the load-balancing loss needs one more layer.
    from test_hf_moe import config as moe_config

    cfg = moe_config(
        "qwen2_moe", mlp_only_layers=[0, 1], use_sliding_window=False, output_router_logits=True
    )
    model = build(cfg)
    kinds = layer_attention_types(model.config)
    assert set(kinds) == {"full_attention"}  # one type: the cut would be layers 0 and 1
    report = check_stages(model, roundpipe.hf.family_of(model), kinds, 128)
    assert report is not None and report.layers == (0, 1, 2)
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-6)
