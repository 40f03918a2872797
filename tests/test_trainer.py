"""roundpipe.hf.Trainer and roundpipe.hf.SFTTrainer against transformers' Trainer and TRL's
SFTTrainer on a tiny Llama built from a config (nothing downloaded): the same per-step losses,
gradient norms, learning rates and final weights (synchronous step), the lag-one reference
(asynchronous step), LoRA, the exact resume in a new process, the evaluation loss, the refusals."""

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from trainer_common import (  # noqa: E402
    collate,
    sentences,
    step_losses,
    tiny_llama,
    token_dataset,
    training_args,
    word_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]


class RecordingTrainer(transformers.Trainer):
    """The plain Trainer, recording each optimizer step's loss (the sum of its batches')."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        losses = self.__dict__.setdefault("step_losses", {})
        losses[self.state.global_step] = losses.get(self.state.global_step, 0.0) + float(loss)
        return loss


def _logged(history, key):
    return [e[key] for e in history if key in e and "train_loss" not in e and "eval_loss" not in e]


@pytest.mark.timeout(300)
def test_trainer_equals_the_plain_trainer_with_the_synchronous_step(tmp_path):
    data, evals = token_dataset(), token_dataset(n=9, seed=5)
    plain = RecordingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path / "plain"),
        train_dataset=data,
        eval_dataset=evals,
        data_collator=collate,
    )
    plain.train()
    ours = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path / "rp"),
        train_dataset=data,
        eval_dataset=evals,
        data_collator=collate,
        async_step=False,
    )
    ours.train()
    want = torch.tensor(list(plain.step_losses.values()))
    got = torch.tensor(step_losses(ours.state.log_history))
    assert len(got) == len(want) == 20  # 13 batches an epoch: windows of 2, 2, 2, 2, 2, 2, 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for key in ("grad_norm", "learning_rate"):
        torch.testing.assert_close(
            torch.tensor(_logged(ours.state.log_history, key), dtype=torch.float64),
            torch.tensor(_logged(plain.state.log_history, key), dtype=torch.float64),
            rtol=1e-5,
            atol=1e-7,
        )
    assert max(_logged(ours.state.log_history, "grad_norm")) > 0.5  # clipping was active
    assert all(e["tokens_per_second"] > 0 for e in ours.state.log_history if "loss" in e)
    reference = plain.model.state_dict()
    for name, param in ours.hf_model.named_parameters():
        torch.testing.assert_close(param.detach(), reference[name], rtol=1e-5, atol=1e-6)
    # the evaluation: transformers' own eval loss, through the wrapped model
    want_eval = plain.evaluate()["eval_loss"]
    assert ours.evaluate()["eval_loss"] == pytest.approx(want_eval, rel=1e-5)


def _lag_one_reference(batches, steps, args):
    """A plain-torch loop with roundpipe's staleness: the batch of step k computes with the
    weights after step k-2 (the first two with the initial ones), its gradient is applied to
    the newest fp32 weights (the masters)."""
    model = tiny_llama()
    compute = copy.deepcopy(model)
    trainer = transformers.Trainer(model=model, args=args)
    decay = set(trainer.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=args.learning_rate,
    )
    sched = transformers.get_scheduler(
        "cosine", opt, num_warmup_steps=args.warmup_steps, num_training_steps=steps
    )
    losses = []
    for batch in batches[:steps]:
        out = compute(**batch)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        before = {n: p.detach().clone() for n, p in named}
        for (_, p), c in zip(named, compute.parameters()):
            p.grad = c.grad
            c.grad = None
        torch.nn.utils.clip_grad_norm_([p for _, p in named], args.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():  # the next batch computes with the weights before this step
            for (n, _), c in zip(named, compute.parameters()):
                c.copy_(before[n])
    return losses, dict(named)


@pytest.mark.timeout(300)
def test_spill_dir_trains_bitwise_as_the_state_in_ram(tmp_path):
    # The masters and Adam's state in files (MastersOnDisk, roundpipe.optim.AdamW(state_dir=))
    # built from the Trainer's own optimizer choice and arguments.
    data = token_dataset()
    runs = {}
    for name, spill in (("ram", None), ("disk", tmp_path / "nvme")):
        trainer = roundpipe.hf.Trainer(
            model=tiny_llama(),
            args=training_args(tmp_path / name, max_steps=6, optim="adamw_torch_fused"),
            train_dataset=data,
            data_collator=collate,
            spill_dir=spill,
        )
        trainer.train()
        runs[name] = trainer
    disk, ram = runs["disk"], runs["ram"]
    assert isinstance(disk.model.state_placement, roundpipe.MastersOnDisk)
    assert isinstance(disk.optimizer, roundpipe.optim.AdamW)
    assert disk.optimizer.param_groups[0]["weight_decay"] == 0.1  # the Trainer's arguments
    assert step_losses(disk.state.log_history) == step_losses(ram.state.log_history)
    for (name, a), (_, b) in zip(
        disk.model.optim_named_parameters(), ram.model.optim_named_parameters()
    ):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="spill_dir= streams the masters"):
        roundpipe.hf.Trainer(
            model=tiny_llama(),
            args=training_args(tmp_path / "sgd", optim="sgd"),
            train_dataset=data,
            data_collator=collate,
            spill_dir=tmp_path / "nvme",
        ).create_optimizer()


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:.*fewer than 4096")
def test_an_8bit_optim_name_trains_with_roundpipes_8bit_adamw(tmp_path):
    # transformers' names of 8-bit AdamW build roundpipe's AdamW(state_dtype="8bit") with the
    # Trainer's arguments, without bitsandbytes: the same run as naming that optimizer.
    from transformers import AutoModelForCausalLM

    data = token_dataset()
    runs = {}
    config = tiny_llama().config
    config.intermediate_size = 128  # MLP weights of 4096 elements: 8-bit blocks
    for name in ("adamw_8bit", "adamw_bnb_8bit", "explicit"):
        args = training_args(
            tmp_path / name, max_steps=4, optim="adamw_torch" if name == "explicit" else name
        )
        explicit = (
            roundpipe.optim.AdamW,
            dict(lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, state_dtype="8bit"),
        )
        torch.manual_seed(0)
        trainer = roundpipe.hf.Trainer(
            model=AutoModelForCausalLM.from_config(config),
            args=args,
            train_dataset=data,
            data_collator=collate,
            optimizer_cls_and_kwargs=explicit if name == "explicit" else None,
        )
        trainer.train()
        runs[name] = trainer
    opt = runs["adamw_8bit"].optimizer
    assert type(opt) is roundpipe.optim.AdamW
    assert all(g["state_dtype"] == "8bit" for g in opt.param_groups)
    assert opt.param_groups[0]["weight_decay"] == 0.1  # the Trainer's arguments
    assert any(s["exp_avg"].dtype == torch.uint8 for s in opt.state.values())
    losses = step_losses(runs["explicit"].state.log_history)
    for name in ("adamw_8bit", "adamw_bnb_8bit"):
        assert step_losses(runs[name].state.log_history) == losses
        for (n, a), (_, b) in zip(
            runs[name].model.optim_named_parameters(),
            runs["explicit"].model.optim_named_parameters(),
        ):
            assert torch.equal(a, b), n


@pytest.mark.timeout(300)
def test_the_async_step_equals_the_lag_one_reference(tmp_path):
    args = training_args(tmp_path / "rp")
    ours = roundpipe.hf.Trainer(
        model=tiny_llama(), args=args, train_dataset=token_dataset(), data_collator=collate
    )
    assert ours.async_step
    seen = []
    forward_backward = ours.model.forward_backward

    def recording(*a, **kw):
        seen.append({k: v for k, v in kw["input_kwargs"].items()})
        return forward_backward(*a, **kw)

    ours.model.forward_backward = recording
    ours.train()
    losses, weights = _lag_one_reference(seen, 20, args)
    torch.testing.assert_close(
        torch.tensor(step_losses(ours.state.log_history)),
        torch.tensor(losses),
        rtol=1e-5,
        atol=1e-5,
    )
    for name, master in ours.model.optim_named_parameters():
        torch.testing.assert_close(master.detach(), weights[name].detach(), rtol=1e-5, atol=1e-6)
    # and it differs from the synchronous run: the staleness is real
    sync = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=token_dataset(),
        data_collator=collate,
        async_step=False,
    )
    sync.train()
    assert step_losses(sync.state.log_history)[2:] != step_losses(ours.state.log_history)[2:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trainer_equals_trls_with_the_synchronous_step(tmp_path, lora):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer, words = word_tokenizer()
    data = datasets.Dataset.from_dict({"text": sentences(words)})
    evals = datasets.Dataset.from_dict({"text": sentences(words, n=8, seed=9)})

    def config(out):
        base = training_args(out).to_dict()
        base = {
            k: v
            for k, v in base.items()
            if k
            in {
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "max_steps",
                "learning_rate",
                "lr_scheduler_type",
                "warmup_steps",
                "weight_decay",
                "max_grad_norm",
                "logging_steps",
                "save_strategy",
                "report_to",
                "seed",
                "disable_tqdm",
            }
        }
        return trl.SFTConfig(output_dir=str(out), max_length=16, packing=False, bf16=False, **base)

    def peft_config():
        if not lora:
            return None
        from peft import LoraConfig

        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    def model():
        m = tiny_llama()
        m.config.pad_token_id = tokenizer.pad_token_id
        m.config.eos_token_id = tokenizer.eos_token_id
        torch.manual_seed(7)  # the adapters' initialisation
        return m

    plain = trl.SFTTrainer(
        model=model(),
        args=config(tmp_path / "plain"),
        train_dataset=data,
        eval_dataset=evals,
        processing_class=tokenizer,
        peft_config=peft_config(),
    )
    plain.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = roundpipe.hf.SFTTrainer(
            model=model(),
            args=config(tmp_path / "rp"),
            train_dataset=data,
            eval_dataset=evals,
            processing_class=tokenizer,
            peft_config=peft_config(),
            async_step=False,
        )
        ours.train()
    # peft reading transformers' old checkpointing name warns from transformers 5.24: not ours
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    want = _logged(plain.state.log_history, "loss")
    got = step_losses(ours.state.log_history)
    assert len(got) == len(want) == 20
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-4
    )
    reference = dict(plain.model.named_parameters())
    trained = [(n, p) for n, p in ours.hf_model.named_parameters() if p.requires_grad]
    assert trained and (not lora or all("lora_" in n for n, _ in trained))
    for name, param in trained:
        torch.testing.assert_close(param.detach(), reference[name].detach(), rtol=1e-5, atol=1e-6)
    # TRL's token metrics, logged at every step as TRL logs them (from roundpipe's head)
    for key in ("entropy", "mean_token_accuracy", "num_tokens"):
        got, want = _logged(ours.state.log_history, key), _logged(plain.state.log_history, key)
        assert len(got) == len(want) == 20, key
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-6,
        )
    assert 0 < max(_logged(ours.state.log_history, "mean_token_accuracy")) < 1
    # and in the evaluation, with TRL's eval loss
    got_eval, want_eval = ours.evaluate(), plain.evaluate()
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert got_eval[key] == pytest.approx(want_eval[key], rel=1e-5), key


def _worker(mode, out, result, new_process=True):
    """trainer_worker's run: in a new process, or in this one where the process is not the
    point (the uninterrupted run, the run that saves)."""
    if not new_process:
        import trainer_worker

        trainer_worker.main(mode, str(out), str(result))
        return json.loads(Path(str(result) + ".json").read_text()), torch.load(str(result) + ".pt")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("ROUNDPIPE_DEVICES", None)
    # This process's thread count, so that it computes what the runs in this process did.
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "trainer_worker.py"), mode, str(out), str(result)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(Path(str(result) + ".json").read_text()), torch.load(str(result) + ".pt")


@pytest.mark.slow  # a new process
@pytest.mark.timeout(600)
def test_resume_from_checkpoint_in_a_new_process_equals_the_uninterrupted_run(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("ROUNDPIPE_DEVICES", raising=False)  # as the new process has it
    full, full_masters = _worker("full", tmp_path / "full", tmp_path / "full-result", False)
    stopped, _ = _worker("stop", tmp_path / "run", tmp_path / "stop-result", False)
    assert stopped["step"] == 10 and (tmp_path / "run" / "checkpoint-10").is_dir()
    resumed, masters = _worker("resume", tmp_path / "run", tmp_path / "resume-result")
    assert resumed["step"] == 20
    assert resumed["losses"] == full["losses"]  # the resumed history holds steps 1..10 too
    assert masters.keys() == full_masters.keys()
    for name in masters:
        assert torch.equal(masters[name], full_masters[name]), name
    # save_total_limit=2 kept both checkpoints; the resumed run saved the second
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [
        "checkpoint-10",
        "checkpoint-20",
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "option, value",
    [
        ("label_smoothing_factor", 0.1),
        ("load_best_model_at_end", True),
        ("neftune_noise_alpha", 5.0),
    ],
)
def test_options_it_cannot_honour_are_refused_at_construction(tmp_path, option, value):
    extra = (
        {"eval_strategy": "steps", "save_strategy": "steps"} if option.startswith("load") else {}
    )
    args = training_args(tmp_path, **{option: value}, **extra)
    with pytest.raises(ValueError, match=option):
        roundpipe.hf.Trainer(
            model=tiny_llama(), args=args, train_dataset=token_dataset(), data_collator=collate
        )


@pytest.mark.timeout(300)
def test_torch_compile_compiles_the_decoder_layers_and_trains_as_eager(tmp_path, fresh_dynamo):
    """TrainingArguments(torch_compile=True, torch_compile_backend=...): wrap's compile, with
    the Trainer's backend, on the CPU pool too; with aot_eager the run is the eager one bit for
    bit."""
    runs = {}
    for name, extra in (
        ("eager", {}),
        ("compiled", {"torch_compile": True, "torch_compile_backend": "aot_eager"}),
    ):
        trainer = roundpipe.hf.Trainer(
            model=tiny_llama(),
            args=training_args(tmp_path / name, max_steps=4, **extra),
            train_dataset=token_dataset(),
            data_collator=collate,
        )
        trainer.train()
        runs[name] = trainer
    assert fresh_dynamo["stats"]["unique_graphs"] > 0
    assert step_losses(runs["compiled"].state.log_history) == step_losses(
        runs["eager"].state.log_history
    )
    for (name, a), (_, b) in zip(
        runs["compiled"].model.optim_named_parameters(),
        runs["eager"].model.optim_named_parameters(),
    ):
        assert torch.equal(a, b), name


@pytest.mark.timeout(120)
def test_an_optimizer_over_the_model_parameters_is_refused(tmp_path):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs"):
        roundpipe.hf.Trainer(
            model=model,
            args=training_args(tmp_path),
            optimizers=(opt, None),
            train_dataset=token_dataset(),
            data_collator=collate,
        )


@pytest.mark.timeout(120)
def test_the_model_stays_in_host_memory_and_save_model_writes_a_loadable_model(tmp_path):
    ours = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=3, bf16=True, use_cpu=True),
        train_dataset=token_dataset(),
        data_collator=collate,
    )
    assert isinstance(ours.model, roundpipe.hf.HFRoundPipe)
    ours.train()
    assert {p.device.type for p in ours.hf_model.parameters()} == {"cpu"}
    assert {p.dtype for p in ours.hf_model.parameters()} == {torch.bfloat16}  # fp32 masters
    assert {p.dtype for p in ours.model.optim_parameters()} == {torch.float32}
    ours.save_model(str(tmp_path / "final"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    masters = ours.model.master_state_dict()
    for name, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), masters[name])


@pytest.mark.timeout(300)
def test_fp16_trains_with_roundpipes_scaler_and_a_skipped_step_leaves_the_schedule(
    tmp_path, monkeypatch
):
    # A scale too large for fp16 gradients: the first steps overflow and are skipped (the
    # scale backs off, the learning-rate schedule does not advance), then training goes on.
    import functools

    from roundpipe.hf import trainer as rp_trainer

    monkeypatch.setattr(
        rp_trainer, "GradScaler", functools.partial(roundpipe.GradScaler, init_scale=2.0**28)
    )
    ours = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=14, fp16=True, use_cpu=True),
        train_dataset=token_dataset(),
        data_collator=collate,
        async_step=False,
    )
    ours.train()
    assert {p.dtype for p in ours.hf_model.parameters()} == {torch.float16}
    logs = [e for e in ours.state.log_history if "loss" in e and "train_loss" not in e]
    scales = [e["loss_scale"] for e in logs]
    rates = [e["learning_rate"] for e in logs]
    assert scales[0] <= 2.0**28 and scales[-1] < scales[0], scales  # it backed off
    # A step's log holds the learning rate it used and the scale after its update: a step whose
    # scale fell was skipped, and the next step used the same learning rate.
    skipped = [i for i in range(len(scales) - 1) if scales[i] < (scales[i - 1] if i else 2.0**28)]
    assert skipped, scales
    for i in skipped:
        assert rates[i + 1] == rates[i], (i, rates)
    assert rates[-1] != rates[0]  # later steps ran
    assert all(torch.isfinite(m).all() for m in ours.model.optim_parameters())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "model_dtype, flag, fix",
    [
        (torch.float16, "bf16", "fp16=True, bf16=False"),
        (torch.bfloat16, "fp16", "bf16=True, fp16=False"),
    ],
)
def test_a_half_model_of_the_other_dtype_than_the_arguments_is_refused(
    tmp_path, model_dtype, flag, fix
):
    with pytest.raises(ValueError, match=rf"the model is in .*{flag}=True.*float32.*{fix}"):
        roundpipe.hf.Trainer(
            model=tiny_llama(dtype=model_dtype),
            args=training_args(tmp_path, use_cpu=True, **{flag: True}),
            train_dataset=token_dataset(),
            data_collator=collate,
        )


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not hasattr(torch.empty(0), "grad_dtype"), reason="torch's grad_dtype needs torch 2.10+"
)
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_grad_dtype_hands_the_step_the_bf16_sums_as_they_are(tmp_path, max_grad_norm):
    # Trainer(grad_dtype=torch.bfloat16): the device sums in bf16, the sums become the
    # masters' .grad as they are, and the Trainer's AdamW is roundpipe's, which reads them;
    # against the same bf16 sums widened to fp32 for roundpipe's AdamW. Unclipped (max_grad_norm=0) the masters
    # are bitwise the same; clipped (the default 1.0), the scaled bf16 gradients are rounded.
    data = token_dataset()
    runs = {}
    for name in ("bf16 grads", "fp32 grads"):
        args = training_args(
            tmp_path / name,
            max_steps=4,
            bf16=True,
            use_cpu=True,
            max_grad_norm=max_grad_norm,
            gradient_accumulation_steps=4,  # 4 microbatches: their sums differ in bf16 and fp32
        )
        kwargs = dict(lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8)
        trainer = roundpipe.hf.Trainer(
            model=tiny_llama(),
            args=args,
            train_dataset=data,
            data_collator=collate,
            devices="emu",
            grad_dtype=torch.bfloat16 if name == "bf16 grads" else None,
            # the reference sums in bf16 on the device, as grad_dtype makes it by itself
            wrap_kwargs=None
            if name == "bf16 grads"
            else {
                "model_run_config": roundpipe.RoundPipeRunConfig(device_grad_dtype=torch.bfloat16)
            },
            optimizer_cls_and_kwargs=(
                None if name == "bf16 grads" else (roundpipe.optim.AdamW, kwargs)
            ),
        )
        trainer.train()
        runs[name] = trainer
    low, ref = runs["bf16 grads"], runs["fp32 grads"]
    assert (
        type(low.optimizer) is roundpipe.optim.AdamW and low.optimizer.grad_dtype == torch.bfloat16
    )
    assert all(m.grad_dtype == torch.bfloat16 for m in low.model.optim_parameters())
    low_losses, ref_losses = step_losses(low.state.log_history), step_losses(ref.state.log_history)
    pairs = zip(low.model.optim_named_parameters(), ref.model.optim_named_parameters())
    if max_grad_norm == 0.0:
        assert low_losses == ref_losses
        for (name, a), (_, b) in pairs:
            assert torch.equal(a, b), name
    else:
        assert low_losses == pytest.approx(ref_losses, rel=1e-2)
        norms = [_logged(r.state.log_history, "grad_norm") for r in (low, ref)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-3)  # summed in fp32 on both sides
        for (name, a), (_, b) in pairs:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4, msg=name)


def test_grad_dtype_is_refused_where_the_step_cannot_take_it(tmp_path, monkeypatch):
    data = token_dataset()

    def build(**options):
        return roundpipe.hf.Trainer(
            model=tiny_llama(),
            args=training_args(tmp_path / "out", optim=options.pop("optim", "adamw_torch")),
            train_dataset=data,
            data_collator=collate,
            **options,
        )

    with pytest.raises(ValueError, match="takes torch.bfloat16 or torch.float16"):
        build(grad_dtype=torch.float32)
    if hasattr(torch.empty(0), "grad_dtype"):
        with pytest.raises(ValueError, match="with spill_dir: the streamed step reads fp32"):
            build(grad_dtype=torch.bfloat16, spill_dir=tmp_path / "nvme")
        with pytest.raises(ValueError, match="grad_dtype= steps on gradients in bf16 or fp16"):
            build(grad_dtype=torch.bfloat16, optim="sgd").create_optimizer()
        import roundpipe.hf.trainer as trainer_module

        monkeypatch.setattr(trainer_module, "_world_size", lambda args: 2)  # as under torchrun
        with pytest.raises(ValueError, match="under torchrun: roundpipe.distributed.DataParallel"):
            build(grad_dtype=torch.bfloat16)
    else:
        with pytest.raises(ValueError, match="needs a torch whose tensors have grad_dtype"):
            build(grad_dtype=torch.bfloat16)


@pytest.mark.skipif(
    not hasattr(torch.empty(0), "grad_dtype"), reason="torch's grad_dtype needs torch 2.10+"
)
def test_grad_dtype_keeps_the_8bit_adamw_the_optim_name_asks_for(tmp_path):
    # optim="adamw_8bit" is roundpipe's AdamW with 8-bit moments already: grad_dtype adds
    # itself to it instead of refusing it or replacing its moments.
    trainer = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path, optim="adamw_8bit"),
        train_dataset=token_dataset(),
        data_collator=collate,
        devices="emu",
        grad_dtype=torch.bfloat16,
    )
    opt = trainer.create_optimizer()
    assert type(opt) is roundpipe.optim.AdamW and opt.grad_dtype == torch.bfloat16
    assert opt.defaults["state_dtype"] == "8bit"
