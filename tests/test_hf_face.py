"""The wrapped model answers as the HF model it wraps: ``config``, ``generation_config``,
``device``, ``dtype``, ``get_input_embeddings()``, ``num_parameters()``, ``can_generate()``;
``generate`` with the newest weights; transformers' ``pipeline`` built on it; a Trainer
callback that generates from its ``model=`` at each log; and it stays an ``nn.Module`` of its
own (parameters, state dict, train/eval)."""

import logging
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from trainer_common import sentences, tiny_llama, word_tokenizer  # noqa: E402


def _model(tokenizer):
    model = tiny_llama()
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def _plain_copy(tokenizer, masters):
    """A plain HF model holding ``masters`` (the trained weights)."""
    model = _model(tokenizer)
    model.load_state_dict(masters)
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    """A Trainer run with a callback that generates at every log, its tokenizer, and what the
    callback got (module-wide: the tests below read it)."""
    tokenizer, words = word_tokenizer()
    prompt = tokenizer("the cat", return_tensors="pt", return_token_type_ids=False)
    generated = []

    class SampleOnLog(transformers.TrainerCallback):
        def on_log(self, args, state, control, model=None, **kwargs):
            if "loss" not in kwargs.get("logs", {}):
                return
            out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
            masters = model.master_state_dict()  # the weights generate used: the newest
            generated.append((out, masters))

    data = datasets.Dataset.from_dict({"text": sentences(words, n=12)}).map(
        lambda b: tokenizer(b["text"]), batched=True
    )
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        trainer = roundpipe.hf.Trainer(
            model=_model(tokenizer),
            args=transformers.TrainingArguments(
                output_dir=out,
                per_device_train_batch_size=2,
                max_steps=3,
                logging_steps=1,
                learning_rate=5e-3,
                save_strategy="no",
                report_to="none",
            ),
            train_dataset=data,
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
            processing_class=tokenizer,
            callbacks=[SampleOnLog()],
        )
        trainer.train()
    return trainer, tokenizer, prompt, generated


def test_a_callback_generates_from_its_model_argument_with_the_newest_weights(trained):
    trainer, tokenizer, prompt, generated = trained
    assert len(generated) == 3  # one per logged step
    for out, masters in generated:
        want = _plain_copy(tokenizer, masters).generate(**prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, want)
    assert not torch.equal(generated[0][1]["lm_head.weight"], generated[-1][1]["lm_head.weight"])


def test_a_pipeline_on_trainer_model_generates_as_on_the_trained_hf_model(trained):
    trainer, tokenizer, _, _ = trained
    records = []

    class Record(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Record(level=logging.ERROR)
    transformers.utils.logging.get_logger("transformers").addHandler(handler)
    try:
        pipe = transformers.pipeline("text-generation", model=trainer.model, tokenizer=tokenizer)
    finally:
        transformers.utils.logging.get_logger("transformers").removeHandler(handler)
    assert not [r for r in records if "not supported" in r], records
    got = pipe("the cat sees", max_new_tokens=5, do_sample=False)
    reference = _plain_copy(tokenizer, trainer.model.master_state_dict())
    want = transformers.pipeline("text-generation", model=reference, tokenizer=tokenizer)(
        "the cat sees", max_new_tokens=5, do_sample=False
    )
    assert got == want


def test_the_wrapped_model_reads_as_the_hf_model_and_stays_a_module_of_its_own():
    tokenizer, _ = word_tokenizer()
    hf = _model(tokenizer)
    model = roundpipe.hf.wrap(hf, devices="cpu")
    assert model.config is hf.config
    assert model.generation_config is hf.generation_config
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.get_input_embeddings() is hf.get_input_embeddings()
    assert model.get_output_embeddings() is hf.get_output_embeddings()
    assert model.num_parameters() == hf.num_parameters() > 0
    assert model.can_generate()
    assert model.name_or_path == hf.name_or_path
    # A method that changes the model would not reach the stages: refused, naming the way.
    with pytest.raises(AttributeError, match=r"resize_token_embeddings\(\).*hf_model"):
        model.resize_token_embeddings(80)
    assert not hasattr(model, "no_such_attribute")
    # nn.Module's own behaviour is the wrapped model's, as before
    assert [p for _, p in model.named_parameters()] == list(hf.parameters())
    assert list(model.state_dict()) == list(hf.state_dict())
    model.eval()
    assert not model.training and not hf.training
    model.train()
    assert model.training and hf.training
    with OptimizerCtx():
        masters = list(model.parameters())
    assert masters and all(m.dtype == torch.float32 for m in masters)


def test_generate_synchronizes_first():
    """A step launched without waiting: generate waits for it and generates with its result."""
    tokenizer, _ = word_tokenizer()
    model = roundpipe.hf.wrap(_model(tokenizer), devices="cpu")
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.randint(3, 18, (2, 8))
    for _ in range(2):
        model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        model.step(lambda: (opt.step(), opt.zero_grad()))  # async: the model lags a step
    prompt = ids[:1, :3]
    out = model.generate(prompt, max_new_tokens=3, do_sample=False)
    want = _plain_copy(tokenizer, model.master_state_dict()).generate(
        prompt, max_new_tokens=3, do_sample=False
    )
    assert torch.equal(out, want)
