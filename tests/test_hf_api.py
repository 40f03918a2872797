"""A wrapped HF model called and named like the HF model: ``model(**batch)`` returns
transformers' output (logits and the exact batch loss), the batch's keys are checked with errors
that say what to do, the state dicts use the HF names, and ``save_pretrained`` writes a
directory plain transformers (or peft) loads."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import VOCAB, build, config, master_grads, padded_batch, twins  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipeRunConfig  # noqa: E402

CausalLMOutputWithPast = transformers.modeling_outputs.CausalLMOutputWithPast


def wrap(hf, M=2, **kwargs):
    kwargs.setdefault("devices", "cpu")
    return roundpipe.hf.wrap(hf, model_run_config=RoundPipeRunConfig(num_microbatch=M), **kwargs)


def train(model, batch, steps=2, lr=1e-2):
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=lr)
    losses = [model_step(model, opt, batch) for _ in range(steps)]
    return opt, losses


def model_step(model, opt, batch):
    loss = model.forward_backward(input_kwargs=batch)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    return loss


def inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


# -- model(**batch) ------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("devices,M", [("cpu", 1), ("cpu", 4), ("emu:2", 4)])
def test_a_call_returns_transformers_output_with_the_exact_batch_loss(side, devices, M):
    """The microbatches hold different numbers of real tokens: the mean of their means would
    differ from the batch's loss."""
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped, M, devices=devices)
    batch = padded_batch(side)
    with torch.no_grad():
        ours = model(**batch)
        theirs = plain(**batch)
    assert isinstance(ours, CausalLMOutputWithPast)
    assert ours.logits.shape == (4, 12, VOCAB)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0.0)
    if M == 4:
        per_row = [plain(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(4)]
        assert abs(sum(per_row) / 4 - theirs.loss) > 1e-3  # the wrong answer is far away


def test_a_call_is_differentiable_and_its_gradients_reach_the_masters():
    wrapped, plain = twins(config("qwen3"))
    model = wrap(wrapped, 4, devices="emu:2")
    batch = padded_batch("left")
    plain(**batch).loss.backward()
    out = model(**batch)
    assert out.loss.requires_grad
    out.loss.backward()
    grads = master_grads(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
    model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    model.synchronize()
    assert not torch.equal(wrapped.model.norm.weight, plain.model.norm.weight)


def test_return_dict_false_gives_transformers_tuples():
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    batch = padded_batch("right")
    with torch.no_grad():
        with_loss = model(**batch, return_dict=False)
        logits_only = model(**inputs(batch), return_dict=False)
        theirs = plain(**batch, return_dict=False)
    assert len(with_loss) == len(theirs) == 2
    torch.testing.assert_close(with_loss[0], theirs[0], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(with_loss[1], theirs[1], rtol=1e-6, atol=1e-6)
    assert len(logits_only) == 1 and torch.equal(logits_only[0], with_loss[1])


def test_positional_input_ids_as_transformers_takes_them():
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    ids = padded_batch("right")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-6, atol=1e-6)


def test_num_items_in_batch_divides_the_loss_as_transformers_does():
    """A Trainer accumulating gradients passes the count over several batches."""
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    batch = padded_batch("right")
    count = int((batch["labels"][:, 1:] != -100).sum())
    n = torch.tensor(3 * count)
    with torch.no_grad():
        theirs = plain(**batch, num_items_in_batch=n).loss
        ours = model(**batch, num_items_in_batch=n).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)
    loss = model.forward_backward(input_kwargs={**batch, "num_items_in_batch": n})
    torch.testing.assert_close(loss, theirs, rtol=1e-5, atol=0.0)
    assert abs(loss.item() * 3 - plain(**batch).loss.item()) < 1e-4


# -- the batch's keys ----------------------------------------------------------------------------
def test_keys_that_change_nothing_are_accepted():
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    batch = padded_batch("right")
    T = batch["input_ids"].shape[1]
    extra = {
        "token_type_ids": torch.zeros_like(batch["input_ids"]),
        "return_dict": True,
        "use_cache": False,
        "output_attentions": False,
        "output_hidden_states": False,
        "position_ids": torch.arange(T).unsqueeze(0),  # one row for the batch
        "cache_position": torch.arange(T),
        "past_key_values": transformers.DynamicCache(),
        "inputs_embeds": None,
        "logits_to_keep": 0,
    }
    with torch.no_grad():
        ours = model(**batch, **extra)
        theirs = plain(**batch)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-6, atol=1e-6)
    loss = model.forward_backward(input_kwargs={**batch, **extra})
    torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-6)


def test_position_ids_are_honoured():
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    batch = padded_batch("left")
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # count real tokens only
    with torch.no_grad():
        ours = model(**batch, position_ids=positions)
        theirs = plain(**batch, position_ids=positions)
        default = plain(**batch)
    assert not torch.allclose(theirs.logits, default.logits)  # they change the result
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0.0)


def _full_cache(plain, ids):
    out = plain(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert cache.get_seq_length() > 0
    return cache


@pytest.mark.parametrize(
    "key,value,fix",
    [
        ("inputs_embeds", lambda plain, ids: torch.zeros(4, 12, 64), "pass input_ids instead"),
        ("output_attentions", lambda plain, ids: True, "output_attentions=False"),
        ("output_hidden_states", lambda plain, ids: True, "output_hidden_states=False"),
        ("use_cache", lambda plain, ids: True, "use_cache=False"),
        ("past_key_values", _full_cache, "leave past_key_values out"),
        ("logits_to_keep", lambda plain, ids: 1, "slice the returned logits"),
        ("cache_position", lambda plain, ids: torch.arange(3, 15), "leave cache_position out"),
        ("pixel_values", lambda plain, ids: torch.zeros(1), "remove them from the batch"),
    ],
)
def test_keys_roundpipe_cannot_honour_raise_a_value_error_naming_the_fix(key, value, fix):
    wrapped, plain = twins(config("llama"))
    model = wrap(wrapped)
    batch = padded_batch("right")
    bad = {**batch, key: value(plain, batch["input_ids"])}
    for call in (lambda: model(**bad), lambda: model.forward_backward(input_kwargs=bad)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert key in message and fix in message
        assert "Accepted keys" in message and "input_ids" in message and "attention_mask" in message
        assert "Embed" not in message


def test_a_positional_batch_is_told_to_pass_it_as_input_kwargs_first():
    model = wrap(build(config("llama")))
    batch = inputs(padded_batch("right"))  # no labels either: the positional message comes first
    with pytest.raises(ValueError, match="pass it as input_kwargs=batch"):
        model.forward_backward(batch)
    with pytest.raises(ValueError, match=r"needs input_kwargs\['labels'\]"):
        model.forward_backward(input_kwargs=batch)
    with pytest.raises(ValueError, match=r"model\(\*\*batch\)"):
        model(batch)


def test_moe_with_router_logits_refuses_a_call_with_labels_and_gives_the_cross_entropy_alone():
    cfg = config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    wrapped, plain = twins(cfg)
    model = wrap(wrapped)
    batch = padded_batch("right")
    with torch.no_grad():
        with pytest.raises(
            NotImplementedError, match="output_router_logits=True.*forward_backward"
        ):
            model(**batch)
        ours = model(**batch, output_router_logits=False)
        theirs = plain(**batch, output_router_logits=False)
        logits = model(**inputs(batch)).logits
        with_aux = plain(**batch).loss
    assert abs(with_aux - theirs.loss) > 1e-4  # the term the call would miss
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(logits, theirs.logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="output_router_logits=False differs.*before roundpipe"):
        model.forward_backward(input_kwargs={**batch, "output_router_logits": False})


def test_moe_without_router_logits_calls_match_transformers():
    wrapped, plain = twins(config("qwen3_moe"))
    model = wrap(wrapped, 4)
    batch = padded_batch("left")
    with torch.no_grad():
        ours = model(**batch)
        theirs = plain(**batch)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)


# -- HF names in and out -------------------------------------------------------------------------
def test_state_dicts_and_parameters_have_the_hf_names():
    hf = build(config("llama"))
    plain = build(config("llama"), seed=1)
    model = wrap(hf)
    train(model, padded_batch("right"))
    model.synchronize()
    assert list(model.state_dict()) == list(hf.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in hf.named_parameters()]
    with OptimizerCtx():
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in hf.named_parameters()]
    masters = model.master_state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in masters
    plain.load_state_dict(masters)  # strict: every key, and nothing else
    for name, p in plain.named_parameters():
        assert torch.equal(p, masters[name]), name
        assert torch.equal(p, hf.get_parameter(name)), name  # fp32: the masters are the model's


def test_tied_embeddings_are_under_both_names_as_in_hfs_state_dict():
    hf = build(config("llama", tie_word_embeddings=True))
    model = wrap(hf)
    train(model, padded_batch("right"))
    masters = model.master_state_dict()
    assert set(masters) == set(hf.state_dict())
    assert masters["lm_head.weight"] is masters["model.embed_tokens.weight"]
    plain = build(config("llama", tie_word_embeddings=True), seed=1)
    plain.load_state_dict(masters)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert torch.equal(plain.lm_head.weight, masters["lm_head.weight"])
    # Either name loads the one master; two different values are refused.
    one_name = {k: v for k, v in masters.items() if k != "model.embed_tokens.weight"}
    one_name["lm_head.weight"] = torch.zeros_like(masters["lm_head.weight"])
    model.load_master_state_dict(one_name)
    assert torch.equal(
        model.master_state_dict()["model.embed_tokens.weight"], one_name["lm_head.weight"]
    )
    masters["lm_head.weight"] = masters["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="one tied parameter"):
        model.load_master_state_dict(masters)


def test_a_master_state_dict_that_does_not_match_names_the_keys_in_hf_names():
    model = wrap(build(config("llama")))
    masters = model.master_state_dict()
    masters.pop("model.norm.weight")
    masters["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"missing \['model.norm.weight'\].*\['model.extra.weight'\]"
    ):
        model.load_master_state_dict(masters)


def test_state_dicts_with_the_stages_names_still_load():
    """Checkpoints written when the state dicts had the stages' names."""
    source = wrap(build(config("llama")))
    train(source, padded_batch("right"))
    source.synchronize()  # the module's own parameters hold the newest values after it
    stage_params = source.module.state_dict()
    stage_masters = dict(roundpipe.RoundPipe.master_state_dict(source))
    assert "0.embed_tokens.weight" in stage_params and "0.embed_tokens.weight" in stage_masters
    hf = build(config("llama"), seed=1)
    model = wrap(hf)
    model.load_state_dict(stage_params)
    model.load_master_state_dict(stage_masters)
    for name, value in source.state_dict().items():
        assert torch.equal(hf.state_dict()[name], value), name
    for name, value in source.master_state_dict().items():
        assert torch.equal(model.master_state_dict()[name], value), name


def test_a_checkpoint_from_one_wrap_resumes_exactly_in_another(tmp_path):
    """docs/checkpointing.md's exact resume with the HF names: 2 + 2 iterations in two wraps
    give the losses and masters of 4 in one, bit for bit."""
    cfg = config("llama", tie_word_embeddings=True)
    batches = [padded_batch(side, seed=s) for s, side in enumerate(["right", "left"] * 2)]

    def start(seed):
        model = wrap(build(cfg, seed=seed))
        with OptimizerCtx():
            opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt

    model, opt = start(0)
    whole = [model_step(model, opt, b) for b in batches]
    expected = model.master_state_dict()

    model, opt = start(0)
    first = [model_step(model, opt, b) for b in batches[:2]]
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "masters": model.master_state_dict(),
            "optimizer": opt.state_dict(),
        },
        path,
    )
    state = torch.load(path, weights_only=True)
    assert "model.embed_tokens.weight" in state["model"] and "lm_head.weight" in state["masters"]
    model, opt = start(1)  # other initial weights: everything comes from the checkpoint
    model.load_state_dict(state["model"])
    model.load_master_state_dict(state["masters"])
    opt.load_state_dict(state["optimizer"])
    second = [model_step(model, opt, b) for b in batches[2:]]
    assert [x.item() for x in first + second] == [x.item() for x in whole]
    for name, value in model.master_state_dict().items():
        assert torch.equal(value, expected[name]), name


# -- save_pretrained -----------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_writes_what_plain_transformers_loads(tmp_path, tied):
    hf = build(config("qwen3", tie_word_embeddings=tied))
    model = wrap(hf)
    batch = padded_batch("right")
    train(model, batch)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        ours = model(**batch)
        theirs = reloaded(**batch)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-6, atol=1e-6)
    for name, value in model.master_state_dict().items():
        assert torch.equal(reloaded.get_parameter(name), value), name
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied


def test_save_pretrained_of_an_fp16_model_writes_the_fp32_masters_or_the_fp16_weights(tmp_path):
    hf = build(config("llama", hidden_size=32, intermediate_size=64), torch.float16)
    model = wrap(hf, optim_dtype=torch.float32)
    config_dtype = hf.config.dtype  # None where from_config does not record it (before 5.x)
    train(model, padded_batch("right"), lr=1e-3)
    masters = model.master_state_dict()
    # The masters hold more than fp16 does, so writing the fp16 weights would fail below.
    assert any(not torch.equal(m, m.half().float()) for m in masters.values())
    model.save_pretrained(tmp_path / "fp32")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    for name, value in masters.items():
        assert reloaded.get_parameter(name).dtype == torch.float32
        assert torch.equal(reloaded.get_parameter(name), value), name
    model.save_pretrained(tmp_path / "fp16", dtype=torch.float16)
    # dtype="auto": the config's dtype (transformers 4.x loads fp32 without it).
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp16", dtype="auto")
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.get_parameter(name), value), name
    assert hf.config.dtype == config_dtype  # the wrapped model's config is unchanged


def test_save_pretrained_of_a_lora_model_writes_the_trained_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(build(config("llama")), lora_config)
    model = wrap(lora)
    batch = padded_batch("right")
    train(model, batch)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    assert not (tmp_path / "config.json").exists()  # the adapter only, as peft saves it
    reloaded = peft.PeftModel.from_pretrained(build(config("llama")), tmp_path)
    with torch.no_grad():
        ours = model(**batch)
        theirs = reloaded(**batch)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    adapters = dict(model.optim_named_parameters())
    assert adapters and all("lora_" in n for n in adapters)
    for name, value in adapters.items():
        assert torch.equal(reloaded.get_parameter(name), value), name


def test_save_pretrained_refuses_a_state_dict_of_its_own(tmp_path):
    model = wrap(build(config("llama")))
    with pytest.raises(ValueError, match="writes the masters' values itself"):
        model.save_pretrained(tmp_path, state_dict={})
    with pytest.raises(ValueError, match="floating torch.dtype"):
        model.save_pretrained(tmp_path, dtype=torch.int8)
