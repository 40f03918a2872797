"""QLoRA through roundpipe.hf.wrap: a peft LoRA model over a base transformers loaded in 4 bits
with bitsandbytes (saved, then loaded with BitsAndBytesConfig on device_map="cpu", as users get
one). The loss and every LoRA gradient equal peft's own model on the same quantized weights (CPU
pool and emulated device, 1 and 4 microbatches, both paddings, NF4 and FP4, with and without
double quantization, three compute dtypes); the adapters roundpipe saves load in peft; the
frozen weights stay packed and pinned and travel packed with their quantization state (counted
exactly on the emulated device); the refusals change nothing."""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipeRunConfig  # noqa: E402
from roundpipe.devices.packed import carried, is_packed  # noqa: E402
from roundpipe.devices.pinned import module_tensors, pinned_layout  # noqa: E402
from roundpipe.testing import emu  # noqa: E402

VOCAB = 96
# Every weight a whole number of 64-value blocks.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
TARGETS = ["q_proj", "v_proj", "down_proj"]

# (quant type, double quantization, compute dtype, the dtype the rest of the model loads in)
NF4_DQ_BF16 = ("nf4", True, torch.bfloat16, torch.bfloat16)
FP4_FP32 = ("fp4", False, torch.float32, torch.float32)
NF4_FP16 = ("nf4", False, torch.float16, torch.bfloat16)
FP4_DQ_BF16 = ("fp4", True, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama's directory, as from_pretrained reads a published one."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).save_pretrained(
        path
    )
    return path


def load(path, quant):
    kind, double, compute, dtype = quant
    return transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=kind,
            bnb_4bit_use_double_quant=double,
            bnb_4bit_compute_dtype=compute,
        ),
    )


def qlora(path, quant, prepare=False, r=4):
    base = load(path, quant)
    if prepare:
        base = peft.prepare_model_for_kbit_training(base)
    torch.manual_seed(1)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS)
    )
    # As after some training: with B at zero (peft's start) every lora_A gradient is zero.
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def padded_batch(side, rows=4, tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (rows, tokens), generator=g)
    lengths = torch.tensor([tokens, 5, tokens - 2, 3][:rows])
    pos = torch.arange(tokens)
    real = pos < lengths[:, None] if side == "right" else pos >= tokens - lengths[:, None]
    return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~real, -100)}


TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def tolerance(quant):
    """The coarser of the compute dtype's and the model's (norms, embeddings, activations)."""
    return max(TOLERANCE[quant[2]], TOLERANCE[quant[3]])


def close(ours, theirs, tol, name=""):
    """Within ``tol`` of the reference's largest value."""
    scale = max(float(theirs.abs().max()), 1e-12)
    err = float((ours.float() - theirs.float()).abs().max())
    assert err <= tol * scale, f"{name}: off by {err:.3g}, {err / scale:.3g} of its largest value"


@pytest.fixture(scope="module")
def reference(saved):
    """peft's own loss and LoRA gradients, per quantization and padding side."""
    found = {}

    def get(quant, side, prepare=False):
        key = (quant, side, prepare)
        if key not in found:
            model = qlora(saved, quant, prepare)
            model.train()
            out = model(**padded_batch(side))
            out.loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            found[key] = (out.loss.detach(), grads)
        return found[key]

    return get


@pytest.mark.parametrize(
    "quant,devices,M,side",
    [
        (NF4_DQ_BF16, "cpu", 1, "right"),
        (NF4_DQ_BF16, "cpu", 4, "left"),
        (NF4_DQ_BF16, "cpu", 1, "left"),
        (NF4_DQ_BF16, "cpu", 4, "right"),
        (NF4_DQ_BF16, "emu", 1, "right"),
        (NF4_DQ_BF16, "emu", 4, "left"),
        (NF4_DQ_BF16, "emu:2", 4, "right"),
        (FP4_FP32, "cpu", 4, "left"),
        (FP4_FP32, "emu", 1, "right"),
        (NF4_FP16, "emu", 4, "left"),
        (FP4_DQ_BF16, "emu:2", 4, "left"),
    ],
)
def test_loss_and_every_lora_gradient_equal_peft_on_the_same_quantized_weights(
    saved, reference, quant, devices, M, side
):
    ref_loss, ref_grads = reference(quant, side)
    model = roundpipe.hf.wrap(
        qlora(saved, quant), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=M)
    )
    loss = model.forward_backward(input_kwargs=padded_batch(side))
    tol = tolerance(quant)
    close(loss, ref_loss, tol, "loss")
    with OptimizerCtx():
        grads = {n: p.grad for n, p in model.optim_named_parameters()}
    assert set(grads) == set(ref_grads) and all("lora_" in n for n in grads)
    for name, g in ref_grads.items():
        close(grads[name], g, tol, name)


def test_prepare_model_for_kbit_training_trains_as_peft_trains_it(saved, reference):
    """peft.prepare_model_for_kbit_training: its fp32 casts and input-gradient hook are kept,
    its gradient checkpointing is turned off (roundpipe recomputes each stage itself)."""
    ref_loss, ref_grads = reference(NF4_DQ_BF16, "right", prepare=True)
    hf = qlora(saved, NF4_DQ_BF16, prepare=True)
    assert hf.get_base_model().is_gradient_checkpointing
    model = roundpipe.hf.wrap(
        hf, devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    assert not hf.get_base_model().is_gradient_checkpointing
    loss = model.forward_backward(input_kwargs=padded_batch("right"))
    # prepare_model_for_kbit_training casts what is not quantized to fp32: the compute dtype's
    # tolerance (bf16) is the coarsest left.
    tol = TOLERANCE[torch.bfloat16]
    close(loss, ref_loss, tol, "loss")
    with OptimizerCtx():
        grads = {n: p.grad for n, p in model.optim_named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        close(grads[name], g, tol, name)


def test_adapters_roundpipe_saves_load_in_peft_on_the_quantized_base(saved, tmp_path):
    hf = qlora(saved, NF4_DQ_BF16)
    model = roundpipe.hf.wrap(
        hf, devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    before = {n: p.detach().clone() for n, p in hf.named_parameters() if "lora_" in n}
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2)
    batch = padded_batch("right")
    for _ in range(2):
        model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.save_pretrained(tmp_path)
    trained = {n: p for n, p in hf.named_parameters() if "lora_" in n}
    assert all(not torch.equal(trained[n], before[n]) for n in before)
    reloaded = peft.PeftModel.from_pretrained(load(saved, NF4_DQ_BF16), tmp_path)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        ours = model(**inputs).logits.cpu()
        theirs = reloaded(**inputs).logits
    real = batch["attention_mask"].bool()
    close(ours[real], theirs[real], tolerance(NF4_DQ_BF16), "logits")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A QLoRA model (NF4, double quantization, r=16) whose weights are large enough that
    each weight's fixed 1 KiB of codes is small beside it (as in a real model), wrapped on the
    emulated device; the pinned bytes wrapping it took."""
    path = tmp_path_factory.mktemp("tiny_llama_128")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "hidden_size": 128, "intermediate_size": 256})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    hf = qlora(path, NF4_DQ_BF16, r=16)
    layout = pinned_layout(hf)  # what pinning it will take, computed before
    before = emu.pinned_memory_stats().allocated_bytes
    model = roundpipe.hf.wrap(
        hf, devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    return hf, model, (layout, emu.pinned_memory_stats().allocated_bytes - before)


def _decoder_stages(model):
    return [stage for stage in model.module if type(stage).__name__ == "Decoder"]


def test_frozen_weights_stay_packed_in_pinned_host_memory(counted):
    hf, model, pinned = counted
    weights = [p for p in hf.parameters() if is_packed(p)]
    assert weights and all(p.dtype == torch.uint8 for p in weights)
    assert all(p.numel() * 2 == p.quant_state.shape.numel() for p in weights)  # two per byte
    tensors = {id(t): t for p in hf.parameters() for t in (p, *carried(p))}
    tensors.update({id(b): b for b in hf.buffers()})
    assert all(t.is_pinned() for t in tensors.values())  # the quantization state too
    exact = sum(t.numel() * t.element_size() for t in tensors.values())
    layout, measured = pinned
    # The pool holds the packed bytes and the state, each once, and took what its layout says:
    # no full-precision copy of a quantized weight was made.
    assert layout.item_bytes == exact
    assert measured == layout.taken
    assert model.memory_plan().host.weights <= layout.taken
    for stage in _decoder_stages(model):
        frozen = [p for p in stage.parameters() if not p.requires_grad]
        numel = sum(p.quant_state.shape.numel() if is_packed(p) else p.numel() for p in frozen)
        nbytes = sum(t.numel() * t.element_size() for p in frozen for t in (p, *carried(p)))
        per_param = nbytes / numel
        print(f"host bytes per frozen parameter of a decoder layer: {per_param:.3f} (bf16: 2)")
        assert per_param <= 0.6


def test_each_stage_travels_packed_with_its_quantization_state(counted):
    """One iteration's uploads, counted on the emulated device: every decoder layer crosses
    twice (forward, then recompute and backward), each time its packed weights with every
    tensor of their quantization state and nothing else: the plan's upload of the stage,
    under 0.6 bytes per frozen parameter."""
    hf, model, _ = counted
    plan = model.memory_plan(input_kwargs=padded_batch("right"))
    with emu.record_copies() as log:
        model.forward_backward(input_kwargs=padded_batch("right"))
    uploads = [c for c in log if c.direction == "h2d"]
    for s, stage in enumerate(model.module):
        tensors = {t.data_ptr(): t for t in module_tensors(stage)}  # with the buffers
        mine = [c for c in uploads if c.host_ptr in tensors]
        crossings = 1 if s == len(model.module) - 1 else 2
        counts = {ptr: sum(c.host_ptr == ptr for c in mine) for ptr in tensors}
        assert set(counts.values()) == {crossings}, (s, counts)
        crossed = sum(c.numel * c.dtype.itemsize for c in mine) // crossings
        assert crossed == plan.stages[s].weights, s
        if type(stage).__name__ != "Decoder":
            continue
        frozen = [p for p in stage.parameters() if not p.requires_grad]
        numel = sum(p.quant_state.shape.numel() if is_packed(p) else p.numel() for p in frozen)
        frozen_bytes = sum(
            c.numel * c.dtype.itemsize
            for c in mine
            if c.host_ptr not in {p.data_ptr() for p in stage.parameters() if p.requires_grad}
        )
        per_param = frozen_bytes / crossings / numel
        print(f"bytes uploaded per frozen parameter, stage {s}: {per_param:.3f} per crossing")
        assert per_param <= 0.6


def test_the_device_plan_counts_the_packed_weights(counted):
    hf, model, _ = counted
    batch = padded_batch("left")
    plan = model.memory_plan(input_kwargs=batch)
    memory = torch.get_device_module("emu")
    import gc

    gc.collect()
    base = memory.memory_allocated(0)
    memory.reset_peak_memory_stats(0)
    model.forward_backward(input_kwargs=batch)
    measured = memory.max_memory_allocated(0) - base
    assert 0.99 * measured <= plan.devices[0].peak <= 1.01 * measured, (
        plan.devices[0].peak,
        measured,
    )


@pytest.mark.slow
def test_bitsandbytes_is_imported_only_for_a_quantized_model():
    code = (
        "import sys, torch, transformers, roundpipe.hf\n"
        "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "model = roundpipe.hf.wrap(transformers.AutoModelForCausalLM.from_config(cfg),"
        " devices='cpu')\n"
        "assert 'bitsandbytes' not in sys.modules, 'imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def _untouched(hf):
    """What wrap would have changed: the cache flag, pinned weights."""
    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    return base.config.use_cache, any(p.is_pinned() for p in hf.parameters())


def test_a_quantized_model_without_adapters_is_refused_and_left_as_it_was(saved):
    base = load(saved, NF4_DQ_BF16)
    before = _untouched(base)
    with pytest.raises(ValueError, match=r"no adapters.*nothing to train.*get_peft_model"):
        roundpipe.hf.wrap(base, devices="emu")
    assert _untouched(base) == before


def test_a_peft_model_with_nothing_trainable_is_refused(saved):
    model = qlora(saved, NF4_DQ_BF16)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        roundpipe.hf.wrap(model, devices="cpu")


def test_eight_bit_weights_are_refused_by_name(saved):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        saved,
        device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True),
    )
    before = _untouched(model)
    with pytest.raises(NotImplementedError, match=r"load_in_8bit.*load_in_4bit=True"):
        roundpipe.hf.wrap(model, devices="emu")
    assert _untouched(model) == before


def test_another_quantization_method_is_refused_by_name(saved):
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    # What a GPTQ checkpoint's config says (its kernels are not installed here).
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(NotImplementedError, match=r"'gptq'.*bitsandbytes' 4-bit"):
        roundpipe.hf.wrap(model, devices="cpu")


def test_a_bitsandbytes_outside_the_supported_range_names_the_extra(saved, monkeypatch):
    model = qlora(saved, NF4_DQ_BF16)
    before = _untouched(model)
    monkeypatch.setattr(bnb, "__version__", "0.46.1")
    with pytest.raises(ImportError, match=r"0\.46\.1 is outside.*qlora"):
        roundpipe.hf.wrap(model, devices="emu")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(ImportError, match=r"needs bitsandbytes.*qlora"):
        roundpipe.hf.wrap(model, devices="emu")
    assert _untouched(model) == before


def test_a_bitsandbytes_without_the_kernels_the_pool_needs_is_refused(saved, monkeypatch):
    model = qlora(saved, NF4_DQ_BF16)
    before = _untouched(model)

    def no_kernel(*args, **kwargs):  # what torch raises for an op with no kernel there
        raise NotImplementedError(
            "Could not run 'bitsandbytes::dequantize_4bit' with arguments from the 'emu' backend"
        )

    monkeypatch.setattr(bnb.functional, "dequantize_4bit", no_kernel)
    with pytest.raises(RuntimeError, match=r"cannot run its nf4 kernels on emu.*qlora"):
        roundpipe.hf.wrap(model, devices="emu")
    assert _untouched(model) == before


@pytest.mark.parametrize("quant", [NF4_DQ_BF16, FP4_FP32])
def test_packed_weight_bytes_are_what_a_loaded_weight_holds(saved, quant):
    from roundpipe.hf.quantized import packed_weight_bytes

    model = load(saved, quant)
    weights = [p for p in model.parameters() if is_packed(p)]
    assert len(weights) == 7 * TINY["num_hidden_layers"]
    for p in weights:
        held = sum(t.numel() * t.element_size() for t in (p, *carried(p)))
        assert held == packed_weight_bytes(p.quant_state.shape.numel(), quant[0], quant[1])


def test_the_plan_from_a_config_is_the_loaded_qlora_models_plan(saved):
    """``python -m roundpipe plan CONFIG --lora 4 --quantize nf4``'s model, built on the meta
    device, holds what the model transformers loads in 4 bits holds, and plans the same peak."""
    from roundpipe.hf.memory_cli import ConfigPlanner
    from roundpipe.memory.host import host_terms

    planner = ConfigPlanner(str(saved / "config.json"), lora=4, quantize="nf4", devices="emu")
    base = load(saved, NF4_DQ_BF16)
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the planner's
    real = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert planner.host.weights == host_terms(real, torch.float32, None).weights
    assert planner.host.masters == host_terms(real, torch.float32, None).masters
    model = roundpipe.hf.wrap(real, devices="emu", optim_dtype=torch.float32)
    ids = torch.zeros((1, 48), dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    ours, theirs = planner.plan(48), model.memory_plan(input_kwargs=batch)
    assert [s.weights for s in ours.stages] == [s.weights for s in theirs.stages]
    assert ours.devices[0].peak == theirs.devices[0].peak


def test_the_plan_command_refuses_8_bits_and_a_quantized_base_without_lora(saved, capsys):
    from roundpipe.hf import memory_cli

    path = str(saved / "config.json")
    for args, message in (
        (["--lora", "4", "--quantize", "int8"], "load_in_8bit"),
        (["--quantize", "nf4"], "give --lora"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            memory_cli.main([path, "--seq-len", "16", "--devices", "emu", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_qlora_sft_script_runs_by_swapping_the_class(tmp_path):
    """The script users write for QLoRA (a model from_pretrained in 4 bits, TRL's SFTTrainer
    with peft_config) with roundpipe.hf.SFTTrainer in place of trl.SFTTrainer: the same
    losses, within bf16 (TRL keeps QLoRA adapters in bf16; roundpipe steps fp32 masters of
    them), and the adapters train."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_common import sentences, step_losses, tiny_llama, word_tokenizer

    tokenizer, words = word_tokenizer()
    source = tmp_path / "base"
    base = tiny_llama()
    base.config.pad_token_id = tokenizer.pad_token_id
    base.config.eos_token_id = tokenizer.eos_token_id
    base.save_pretrained(source)
    data = datasets.Dataset.from_dict({"text": sentences(words)})

    def script(trainer_class, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source,
            device_map="cpu",
            quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            ),
        )
        torch.manual_seed(7)  # the adapters' initialisation
        trainer = trainer_class(
            model=model,
            args=trl.SFTConfig(
                output_dir=str(out),
                max_length=16,
                per_device_train_batch_size=4,
                max_steps=6,
                learning_rate=1e-2,
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                seed=0,
                disable_tqdm=True,
                bf16=False,
            ),
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        trainer.train()
        return trainer

    theirs = script(trl.SFTTrainer, tmp_path / "trl")
    ours = script(roundpipe.hf.SFTTrainer, tmp_path / "rp")
    got, want = step_losses(ours.state.log_history), step_losses(theirs.state.log_history)
    assert len(got) == len(want) == 6
    close(torch.tensor(got), torch.tensor(want), TOLERANCE[torch.bfloat16], "losses")
    assert got[-1] < got[0]
    trained = {n: p for n, p in ours.hf_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
