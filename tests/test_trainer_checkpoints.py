"""roundpipe.hf.Trainer's checkpoint folders are what Trainer users expect: ``checkpoint-N``
loads with ``from_pretrained`` (a LoRA model's with ``PeftModel.from_pretrained``); a run
started with transformers' Trainer resumes from its checkpoint's weights, step, schedule and
data position, with a warning that the optimizer's state starts fresh;
``resume_from_checkpoint=True`` takes the newest checkpoint of either kind; a second run into the
same output directory replaces the first run's checkpoints."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import roundpipe  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from trainer_common import sentences, stop_at, tiny_llama, word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def data():
    tokenizer, words = word_tokenizer()
    mapped = datasets.Dataset.from_dict({"text": sentences(words, n=16)}).map(
        lambda b: tokenizer(b["text"]), batched=True
    )
    return mapped, transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)


def _args(output_dir, max_steps, save_steps):
    # TrainingArguments' defaults but the few a script sets.
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=max_steps,
        save_steps=save_steps,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
    )


def _trainer(cls, output_dir, data, max_steps, save_steps, model=None, **kwargs):
    dataset, collator = data
    return cls(
        model=model if model is not None else tiny_llama(),
        args=_args(output_dir, max_steps, save_steps),
        train_dataset=dataset,
        data_collator=collator,
        **kwargs,
    )


def _recording(trainer):
    """The batches of the trainer's steps, as forward_backward gets them."""
    seen = []
    forward_backward = trainer.model.forward_backward

    def record(*args, **kwargs):
        seen.append(dict(kwargs["input_kwargs"]))
        return forward_backward(*args, **kwargs)

    trainer.model.forward_backward = record
    return seen


def _losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.timeout(240)
def test_a_checkpoint_folder_loads_with_from_pretrained_and_a_rerun_replaces_it(tmp_path, data):
    out = tmp_path / "out"
    for seed in (0, 1):  # the second run writes over the first one's checkpoints
        trainer = _trainer(roundpipe.hf.Trainer, out, data, 4, 2, model=tiny_llama(seed))
        trainer.train()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-4")
    masters = trainer.model.master_state_dict()  # the weights after step 4, the checkpoint's
    assert loaded.dtype == torch.float32
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), masters[name]), name
    # and it is roundpipe's checkpoint too: it resumes exactly
    resumed = _trainer(roundpipe.hf.Trainer, out, data, 4, 2)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _losses(resumed) == _losses(trainer)


def _lora(peft, config):
    torch.manual_seed(3)  # the adapters' initialisation
    return peft.get_peft_model(tiny_llama(), config)


@pytest.mark.timeout(240)
def test_a_lora_checkpoint_folder_loads_with_peft_and_a_plain_ones_resumes(tmp_path, data):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(roundpipe.hf.Trainer, tmp_path, data, 2, 2, model=_lora(peft, config))
    trainer.train()
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "checkpoint-2")
    masters = trainer.model.master_state_dict()
    adapters = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert adapters and set(adapters) == set(masters)
    for name, param in adapters.items():
        assert torch.equal(param.detach(), masters[name]), name
    # A plain Trainer's LoRA checkpoint resumes from its adapter (peft's load_adapter)
    plain = _trainer(
        transformers.Trainer, tmp_path / "plain", data, 2, 2, model=_lora(peft, config)
    )
    plain.train()
    ours = _trainer(roundpipe.hf.Trainer, tmp_path / "plain", data, 3, 2, model=_lora(peft, config))
    seen = _recording(ours)
    with pytest.warns(UserWarning, match="transformers' Trainer"):
        ours.train(resume_from_checkpoint=True)
    reference = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "plain" / "checkpoint-2")
    with torch.no_grad():  # the Trainer's loss: over its count of the step's label tokens
        want = reference(**seen[0]).loss
    assert _losses(ours)[2] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.timeout(300)
def test_a_transformers_trainer_checkpoint_resumes_from_its_weights_with_a_warning(tmp_path, data):
    out = tmp_path / "out"
    # roundpipe's checkpoint-2, then a plain Trainer's checkpoint-4 in the same directory (a
    # run of 6 steps, stopped after 4)
    _trainer(roundpipe.hf.Trainer, out, data, 2, 2).train()
    plain = _trainer(transformers.Trainer, out, data, 6, 4, callbacks=[stop_at(4)])
    plain.train()
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()

    ours = _trainer(roundpipe.hf.Trainer, out, data, 6, 2)
    seen = _recording(ours)
    with pytest.warns(UserWarning, match=r"checkpoint of transformers' Trainer.*optimizer") as w:
        ours.train(resume_from_checkpoint=True)  # the newest: the plain Trainer's
    assert "at step 4" in str(w[0].message)
    assert ours.state.global_step == 6
    losses = _losses(ours)
    assert losses[:4] == _losses(plain)  # the plain run's logs go on
    # The first step after the resume computes with the checkpoint's weights ...
    reference = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-4")
    with torch.no_grad():  # the Trainer's loss: over its count of the step's label tokens
        want = reference(**seen[0]).loss
    assert losses[4] == pytest.approx(float(want), rel=1e-5)
    # ... on the batches the plain run had not reached ...
    order = list(plain.get_train_dataloader())
    assert torch.equal(seen[0]["input_ids"], order[4]["input_ids"])
    # ... at the learning rate of step 5 of the run's schedule
    rates = [e["learning_rate"] for e in ours.state.log_history if "loss" in e]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=6)
    for _ in range(4):
        opt.step()
        schedule.step()
    assert rates[4] == pytest.approx(schedule.get_last_lr()[0], rel=1e-6)

    # Now roundpipe's checkpoint-6 is the newest: resumed exactly, without that warning
    again = _trainer(roundpipe.hf.Trainer, out, data, 8, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.train(resume_from_checkpoint=True)
    assert not [c for c in caught if "transformers' Trainer" in str(c.message)]
    assert _losses(again)[:6] == losses and again.state.global_step == 8
