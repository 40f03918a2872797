"""roundpipe.hf.wrap: HuggingFace causal LMs as stages. Equality with plain transformers (loss
and every gradient) per family, device pool, microbatch count and padding side; training in
fp16 beside torch.autocast; save_pretrained round trips; LoRA; the chunked loss's peak."""

import gc
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig  # noqa: E402
from roundpipe.testing import emu  # noqa: E402

VOCAB = 96
# The shape every tiny test model of a family starts from.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def config(family, **extra):
    common = {**TINY, **extra}
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # a window shorter than the batch's rows: the mask matters
        return transformers.MistralConfig(**common, sliding_window=5)
    if family == "qwen2":  # the second layer slides, the first attends to everything
        return transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=5, max_window_layers=1
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{**common, "intermediate_size": 64},
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
        )
    raise AssertionError(family)


def build(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def twins(cfg, dtype=torch.float32):
    """Two models with the same weights: one to wrap, one for plain transformers."""
    a = build(cfg, dtype)
    b = build(cfg, dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def padded_batch(side, batch=4, tokens=12, seed=1):
    """Rows of different real lengths, so microbatches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (batch, tokens), generator=g)
    lengths = torch.tensor([tokens, 5, tokens - 2, 3, 7, tokens, 9, 4][:batch])
    pos = torch.arange(tokens)
    real = pos < lengths[:, None] if side == "right" else pos >= tokens - lengths[:, None]
    mask = real.long()
    labels = ids.masked_fill(~real, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def master_grads(model):
    with OptimizerCtx():
        return {n: p.grad.clone() for n, p in model.optim_named_parameters()}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize(
    "devices,M,side",
    [("cpu", 1, "right"), ("cpu", 4, "left"), ("emu", 4, "right"), ("emu:2", 4, "left")],
)
def test_loss_and_every_gradient_equal_plain_transformers(family, devices, M, side):
    extra = {"output_router_logits": True} if family == "qwen3_moe" and M == 1 else {}
    wrapped, plain = twins(config(family, **extra))
    batch = padded_batch(side)
    ref = plain(**batch)
    ref.loss.backward()
    model = roundpipe.hf.wrap(
        wrapped, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=M)
    )
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    grads = master_grads(model)
    expected = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert set(grads) == {n for n, p in plain.named_parameters()}
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_moe_load_balancing_loss_is_per_microbatch_weighted_by_tokens():
    """With several microbatches, each adds its own load-balancing term weighted by its share
    of the batch's predicted tokens (transformers computes one over the whole batch)."""
    cfg = config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    wrapped, plain = twins(cfg)
    batch = padded_batch("right")
    model = roundpipe.hf.wrap(
        wrapped, devices="cpu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    loss = model.forward_backward(input_kwargs=batch)
    labels = batch["labels"]
    total = int((labels[:, 1:] != -100).sum())
    expected = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part = {k: v[rows] for k, v in batch.items()}
        out = plain(**part)
        n = int((part["labels"][:, 1:] != -100).sum())
        ce = out.loss - cfg.router_aux_loss_coef * out.aux_loss
        expected += ce * n / total + cfg.router_aux_loss_coef * out.aux_loss * n / total
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)


def test_tied_embeddings_are_one_master_updated_once():
    wrapped, plain = twins(config("llama", tie_word_embeddings=True))
    assert wrapped.lm_head.weight is wrapped.model.embed_tokens.weight
    batch = padded_batch("right")
    plain(**batch).loss.backward()
    model = roundpipe.hf.wrap(
        wrapped, devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    model.forward_backward(input_kwargs=batch)
    grads = master_grads(model)
    assert "lm_head.weight" not in grads  # one tensor, one master
    torch.testing.assert_close(
        grads["model.embed_tokens.weight"],
        plain.model.embed_tokens.weight.grad,
        rtol=1e-4,
        atol=1e-6,
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    assert wrapped.lm_head.weight is wrapped.model.embed_tokens.weight
    assert not torch.equal(wrapped.lm_head.weight, plain.lm_head.weight)


def test_fp16_training_follows_plain_transformers_with_autocast():
    """30 steps on a small Llama: roundpipe (fp16 weights, fp32 masters, its GradScaler)
    against plain transformers (fp32 weights, fp16 autocast, torch's GradScaler), same data."""
    cfg = config("llama", hidden_size=32, intermediate_size=64)
    wrapped = build(cfg, torch.float16)
    plain = build(cfg, torch.float32)
    plain.load_state_dict({k: v.float() for k, v in wrapped.state_dict().items()})
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(30):
        ids = torch.randint(VOCAB // 4, (4, 12), generator=g)  # a small vocabulary: learnable
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})

    model = roundpipe.hf.wrap(
        wrapped, optim_dtype=torch.float32, devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )  # fmt: skip
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = GradScaler(init_scale=2.0**10)
    ours = []
    for batch in batches:
        scale = scaler.get_scale()
        loss = model.forward_backward(input_kwargs=batch, loss_fn=lambda l, _: scaler.scale(l))
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        ours.append(loss.item() / scale)
    model.synchronize()

    popt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.0)
    pscaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    theirs = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = plain(**batch).loss
        pscaler.scale(loss).backward()
        pscaler.step(popt)
        pscaler.update()
        popt.zero_grad()
        theirs.append(loss.item())
    print("step  roundpipe  transformers")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i:4d}  {a:9.4f}  {b:12.4f}")
    assert ours[-1] < ours[0] - 0.5 and theirs[-1] < theirs[0] - 0.5
    # One step stale: roundpipe's curve lags by about a step; the ends agree closely.
    assert abs(sum(ours[-5:]) / 5 - sum(theirs[-5:]) / 5) < 0.15 * (theirs[0] - theirs[-1])


def test_save_pretrained_round_trip_gives_the_wrapped_models_logits(tmp_path):
    cfg = config("qwen3")
    hf = build(cfg)
    model = roundpipe.hf.wrap(
        hf, devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
    batch = padded_batch("right")
    for _ in range(3):
        model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    hf.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = reloaded(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours.cpu()[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_lora_trains_only_the_adapters_and_merges_to_the_same_logits():
    peft = pytest.importorskip("peft")
    hf = build(config("llama"))
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    lora = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    model = roundpipe.hf.wrap(
        lora, devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    trained = [n for n, _ in model.optim_named_parameters()]
    assert trained and all("lora_" in n for n in trained)
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
    batch = padded_batch("right")
    for _ in range(3):
        model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    for name, p in lora.named_parameters():
        if "lora_" in name:
            continue
        base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(p, before[base_name]), name  # the frozen base did not change
    assert any(
        not torch.equal(p, torch.zeros_like(p)) for n, p in lora.named_parameters() if "lora_B" in n
    )  # the adapters did (B starts at zero)
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        merged = lora.merge_and_unload()
        theirs = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours.cpu()[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_an_unsupported_architecture_names_the_families_and_the_adapter():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)
    with pytest.raises(NotImplementedError, match=r"gpt2.*supported: .*llama.*register_family"):
        roundpipe.hf.wrap(transformers.AutoModelForCausalLM.from_config(cfg), devices="cpu")


def test_a_registered_family_with_other_attribute_paths_is_used():
    class Renamed(torch.nn.Module):  # a Llama whose body is called "decoder"
        def __init__(self, inner):
            super().__init__()
            self.config = inner.config
            self.decoder = inner.model
            self.output = inner.lm_head

    inner, plain = twins(config("llama"))
    family = roundpipe.hf.Family("renamed", ("llama",), body="decoder", head="output")
    # A module without a forward of its own: the self-check has nothing to compare with.
    with pytest.raises(roundpipe.hf.WrapCheckError, match="forward did not run.*check=False"):
        roundpipe.hf.wrap(Renamed(inner), family=family, devices="cpu")
    model = roundpipe.hf.wrap(Renamed(inner), family=family, devices="cpu", check=False)
    batch = padded_batch("right")
    ref = plain(**batch)
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-5, atol=1e-6)


def test_the_chunked_loss_keeps_one_chunks_logits_on_the_device():
    """The head's peak on the emulated device: chunked against the whole (tokens x vocabulary)
    logits at once, one sequence of 512 tokens and a 4096-token vocabulary."""
    cfg = config("llama", vocab_size=4096, num_hidden_layers=1, max_position_embeddings=512)
    ids = torch.randint(4096, (1, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    memory = torch.get_device_module("emu")
    peaks, losses = {}, {}
    for chunk in (64, 10**6):
        model = roundpipe.hf.wrap(build(cfg), devices="emu", loss_chunk_tokens=chunk)
        gc.collect()
        memory.reset_peak_memory_stats(0)
        base = memory.memory_allocated(0)
        losses[chunk] = model.forward_backward(input_kwargs=batch)
        peaks[chunk] = memory.max_memory_allocated(0) - base
        del model
    logits_bytes = 512 * 4096 * 4
    print(f"peak: chunked {peaks[64] / 2**20:.2f} MiB, whole {peaks[10**6] / 2**20:.2f} MiB")
    torch.testing.assert_close(losses[64], losses[10**6])
    # The whole fp32 logits at once against one 64-token chunk's.
    assert peaks[10**6] - peaks[64] >= logits_bytes * (1 - 64 / 512)


def _reference_loss(hidden, head, labels, num_items):
    """transformers' loss: the whole fp32 logits through F.cross_entropy, by autograd."""
    logits = head(hidden.reshape(-1, hidden.shape[-1])).float()
    loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum")
    return loss / num_items


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [7, 10**6], ids=["chunked", "whole"])
def test_the_heads_loss_and_gradients_are_cross_entropys(chunk, bias):
    """The head's own backward (see [Note: the head's backward] in roundpipe/hf/loss.py)
    against autograd through F.cross_entropy over the whole logits: the loss, and the hidden
    states', weight's and bias's gradients, under a loss scaled after the head (as
    GradScaler's), with labels of -100; a frozen weight gets no gradient."""
    from roundpipe.hf import chunked_causal_lm_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 24, bias=bias)
    labels = torch.randint(24, (3, 10), generator=g)
    labels[0, :4] = -100
    ref = _reference_loss(hidden, head, labels, 26)
    (ref * 3.5).backward()
    expected = [t.grad.clone() for t in (hidden, *head.parameters())]
    for t in (hidden, *head.parameters()):
        t.grad = None
    loss = chunked_causal_lm_loss(hidden, head, labels, 26, chunk)
    (loss * 3.5).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip([t.grad for t in (hidden, *head.parameters())], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    head.requires_grad_(False)
    for t in (hidden, *head.parameters()):
        t.grad = None
    chunked_causal_lm_loss(hidden, head, labels, 26, chunk).backward()
    assert hidden.grad is not None and head.weight.grad is None


def test_the_heads_backward_under_autocast_computes_as_autograd_does():
    """fp32 weights under bf16 autocast (the CPU's): the backward recomputes each chunk's
    logits in bf16 as the forward did, and the weight's gradient is bf16 arithmetic summed in
    fp32, as autograd's through autocast's cast."""
    from roundpipe.hf import chunked_causal_lm_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 32, generator=g, requires_grad=True)
    head = torch.nn.Linear(32, 40, bias=False)
    labels = torch.randint(40, (2, 12), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference_loss(hidden, head, labels, 24)
    ref.backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_causal_lm_loss(hidden, head, labels, 24, 5)
    loss.backward()
    assert head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, expected[0], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(head.weight.grad, expected[1], rtol=2e-2, atol=1e-3)


def test_the_heads_backward_holds_one_chunks_logits_and_one_weight_gradient():
    """Device bytes on the emulated device, fp32 (so a chunk's logits are one tensor): the
    forward holds one chunk's logits at a time, the backward one chunk's logits and the
    weight's gradient (autograd's path held three chunks' worth: logits, log-softmax, their
    gradient, and the gradient summed over the chunks besides each chunk's)."""
    from roundpipe.hf import chunked_causal_lm_loss

    vocab, width, tokens, chunk = 4096, 16, 512, 64
    dev = torch.device("emu:0")
    memory = torch.get_device_module("emu")
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False).to(dev)
    hidden = torch.randn(1, tokens, width).to(dev).requires_grad_()
    labels = torch.randint(vocab, (1, tokens)).to(dev)
    gc.collect()
    base = memory.memory_allocated(0)
    memory.reset_peak_memory_stats(0)
    loss = chunked_causal_lm_loss(hidden, head, labels, None, chunk)
    forward = memory.max_memory_allocated(0) - base
    base = memory.memory_allocated(0)
    memory.reset_peak_memory_stats(0)
    loss.backward()
    backward = memory.max_memory_allocated(0) - base
    logits = chunk * vocab * 4
    small = 4 * tokens * 4 + 4096  # per-token rows (labels, maxima, sums), scalars
    assert logits <= forward <= logits + small
    grads = head.weight.numel() * 4 + hidden.numel() * 4
    assert logits + grads <= backward <= logits + grads + small


@pytest.mark.parametrize("chunk", [7, 10**6], ids=["chunked", "whole"])
def test_the_heads_token_statistics_are_those_of_the_whole_logits(chunk):
    """chunked_causal_lm_loss(token_stats=True): per token, the entropy of the softmax, whether
    the top-1 token is the label, and 1, where the label is not -100; the loss and its gradient
    as without them (TRL's entropy and mean_token_accuracy are sums of them)."""
    from roundpipe.hf import chunked_causal_lm_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=g)
    head = torch.nn.Linear(16, 24, bias=False)
    labels = torch.randint(24, (3, 10), generator=g)
    labels[0, :4] = -100
    logits = head(hidden).detach()
    labels[1, 2] = int(logits[1, 2].argmax())  # at least one top-1 hit
    loss, stats = chunked_causal_lm_loss(hidden, head, labels, 20, chunk, token_stats=True)
    loss.backward()
    grad = head.weight.grad.clone()
    head.weight.grad = None
    plain = chunked_causal_lm_loss(hidden, head, labels, 20, chunk)
    plain.backward()
    assert torch.equal(loss, plain) and torch.equal(grad, head.weight.grad)
    valid = labels != -100
    probs = logits.softmax(-1)
    entropy = -(probs * probs.log()).sum(-1)
    assert stats.shape == (3, 10, 3) and not stats.requires_grad
    torch.testing.assert_close(stats[..., 0], entropy * valid)
    assert torch.equal(stats[..., 1], ((logits.argmax(-1) == labels) & valid).float())
    assert torch.equal(stats[..., 2], valid.float())
    assert stats[..., 1].sum() >= 1


@pytest.mark.slow
def test_import_roundpipe_works_without_transformers_and_hf_names_the_install():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import roundpipe\n"
        "try:\n"
        "    roundpipe.hf\n"
        "except ImportError as exc:\n"
        "    print('ERR', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'roundpipe.hf needs transformers: pip install "transformers' in out.stdout


def test_forward_backward_without_labels_says_what_it_needs():
    model = roundpipe.hf.wrap(build(config("llama")), devices="cpu")
    ids = torch.randint(VOCAB, (2, 8))
    with pytest.raises(ValueError, match=r"needs input_kwargs\['labels'\]"):
        model.forward_backward(input_kwargs={"input_ids": ids})
    assert emu.is_installed()


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_memory_plan_of_a_wrapped_model_matches_the_measured_peak(devices):
    """model.memory_plan(batch) before the first step: each device's planned peak against what
    the emulated device measures for the same forward_backward. Known gap: for HF decoder
    layers the trace overestimates (by 3-10% here at 256 tokens, about 20% at 512), never
    under; the generic shapes of tests/test_memory_plan.py are within 10%."""
    cfg = config("llama", vocab_size=512, max_position_embeddings=256)
    model = roundpipe.hf.wrap(
        build(cfg, torch.bfloat16),
        devices=devices,
        loss_chunk_tokens=128,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    ids = torch.randint(512, (2, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plan = model.memory_plan(input_kwargs=batch)
    assert "Largest term" in str(plan)
    memory = torch.get_device_module("emu")
    count = 2 if devices == "emu:2" else 1
    gc.collect()
    bases = [memory.memory_allocated(i) for i in range(count)]
    for i in range(count):
        memory.reset_peak_memory_stats(i)
    model.forward_backward(input_kwargs=batch)
    for i, dev in enumerate(plan.devices[:count]):
        measured = memory.max_memory_allocated(i) - bases[i]
        assert 0.95 * measured <= dev.peak <= 1.15 * measured, (i, dev.peak, measured)


def test_lora_host_bytes_per_frozen_parameter_are_its_own_dtype():
    """The frozen base of a LoRA model keeps its bf16 bytes on the host (pinned from the pool,
    measured with the pinned allocator's rounding) and gets no master."""
    peft = pytest.importorskip("peft")
    hf = build(config("llama", hidden_size=128, intermediate_size=256), torch.bfloat16)
    frozen = sum(p.numel() for n, p in hf.named_parameters())
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = emu.pinned_memory_stats().allocated_bytes
    model = roundpipe.hf.wrap(lora, devices="emu:2")
    pinned = emu.pinned_memory_stats().allocated_bytes - before
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    masters = sum(p.numel() for p in model.optim_parameters())
    assert masters == adapters  # no master for a frozen weight
    per_param = pinned / (frozen + adapters)
    print(f"pinned host bytes per parameter: {per_param:.3f} (bf16: 2)")
    assert 2.0 <= per_param <= 2.0 * 1.05


def test_wrap_turns_off_hfs_own_checkpointing_and_cache():
    hf = build(config("llama"))
    enable = getattr(hf, "activation_checkpointing_enable", None)
    (enable or hf.gradient_checkpointing_enable)()
    hf.config.use_cache = True
    roundpipe.hf.wrap(hf, devices="cpu")
    checkpointing = getattr(hf, "is_activation_checkpointing", None)
    assert not (hf.is_gradient_checkpointing if checkpointing is None else checkpointing)
    assert hf.config.use_cache is False
