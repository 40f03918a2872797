"""roundpipe.hf.Trainer with TrainingArguments' defaults (``remove_unused_columns=True``) feeds
the model what the plain Trainer feeds it: the columns kept are the model's forward's, read from
the wrapped model's signature, for a ``datasets.Dataset`` after ``map`` with extra columns, a
torch ``Dataset`` of dicts and a list of dicts, each with a collator and without one (rows padded
by the tokenizer, with labels, and the Trainer's default collator)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import roundpipe  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from trainer_common import sentences, tiny_llama, word_tokenizer  # noqa: E402

LENGTH = 12  # tokens per row, at most


@pytest.fixture(scope="module")
def texts():
    tokenizer, words = word_tokenizer()
    return tokenizer, sentences(words, n=10)


def _tokenize(tokenizer, padded):
    """What a script's ``map`` does: the tokenizer's ids and mask; padded to one length with
    ``labels`` (-100 on the padding) where no collator will pad them."""

    def tokenize(batch):
        if not padded:
            return tokenizer(batch["text"], truncation=True, max_length=LENGTH)
        out = tokenizer(batch["text"], padding="max_length", truncation=True, max_length=LENGTH)
        out["labels"] = [
            [t if m else -100 for t, m in zip(ids, mask)]
            for ids, mask in zip(out["input_ids"], out["attention_mask"])
        ]
        return out

    return tokenize


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def dataset(kind, tokenizer, texts, padded):
    """The training data as ``kind`` holds it, each row with columns the model does not take
    (its text and an index)."""
    raw = datasets.Dataset.from_dict({"text": texts, "idx": list(range(len(texts)))})
    mapped = raw.map(_tokenize(tokenizer, padded), batched=True)
    if kind == "datasets":
        return mapped
    rows = [dict(row) for row in mapped]
    return Rows(rows) if kind == "torch" else rows


def _args(output_dir):
    # TrainingArguments' defaults but the few a script sets.
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        report_to="none",
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("collator", [True, False], ids=["lm_collator", "default_collator"])
@pytest.mark.parametrize("kind", ["datasets", "torch", "list"])
def test_default_arguments_feed_the_model_the_batches_of_the_plain_trainer(
    tmp_path, texts, kind, collator
):
    tokenizer, lines = texts
    data = dataset(kind, tokenizer, lines, padded=not collator)
    make_collator = (
        (lambda: transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
        if collator
        else (lambda: None)
    )
    keys = ("input_ids", "attention_mask", "labels")

    plain_model = tiny_llama()
    theirs = []
    plain_model.register_forward_pre_hook(
        lambda _, args, kwargs: theirs.append({k: kwargs[k] for k in keys}), with_kwargs=True
    )
    plain = transformers.Trainer(
        model=plain_model,
        args=_args(tmp_path / "plain"),
        train_dataset=data,
        data_collator=make_collator(),
    )
    plain.train()

    ours = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=_args(tmp_path / "rp"),
        train_dataset=data,
        data_collator=make_collator(),
    )
    seen = []
    forward_backward = ours.model.forward_backward

    def recording(*args, **kwargs):
        seen.append(dict(kwargs["input_kwargs"]))
        return forward_backward(*args, **kwargs)

    ours.model.forward_backward = recording
    ours.train()

    assert len(seen) == len(theirs) == 2
    for got, want in zip(seen, theirs):
        assert set(keys) <= set(got), sorted(got)  # nothing the model takes was dropped
        assert not {"text", "idx"} & set(got)  # and the extra columns were
        for key in keys:
            assert torch.equal(got[key], want[key]), key
    # The first step computes with the initial weights in both: the same loss (transformers
    # 4.x logs it rounded to 4 decimals).
    first = [e["loss"] for e in ours.state.log_history if "loss" in e][0]
    want_first = [e["loss"] for e in plain.state.log_history if "loss" in e][0]
    assert first == pytest.approx(want_first, abs=6e-5)


def test_the_wrapped_models_forward_has_the_hf_models_signature():
    """What libraries read (``inspect.signature(model.forward)``): the HF model's parameters, in
    its order, and ``run_config``; a peft model shows its base model's, as transformers'
    Trainer reads a peft model's."""
    peft = pytest.importorskip("peft")
    hf = tiny_llama()
    want = list(inspect.signature(hf.forward).parameters)
    model = roundpipe.hf.wrap(hf, devices="cpu")
    got = list(inspect.signature(model.forward).parameters)
    assert got[: want.index("labels") + 1] == want[: want.index("labels") + 1]
    assert "run_config" in got and set(want) <= set(got)
    lora = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0)
    )
    wrapped = roundpipe.hf.wrap(lora, devices="cpu")
    assert list(inspect.signature(wrapped.forward).parameters) == got
    # positions bind in that order
    ids = torch.randint(1, 60, (2, 6))
    with torch.no_grad():
        by_position = model(ids, torch.ones_like(ids)).logits
        by_keyword = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(by_position, by_keyword)


@pytest.mark.timeout(240)
def test_the_documented_trainer_script_runs_unchanged(tmp_path, monkeypatch):
    """The script of docs/hf.md, "The Trainer", with the model's name pointing at a tiny model
    saved on this machine (nothing is downloaded) and a train.txt in its directory."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "hf.md").read_text()
    section = page.split("## The Trainer\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)[1]
    name = 'model_name = "Qwen/Qwen3-0.6B"'
    assert name in code
    tokenizer, words = word_tokenizer()
    local = tmp_path / "tiny"
    tokenizer.save_pretrained(local)
    tiny_llama().save_pretrained(local)
    (tmp_path / "train.txt").write_text("\n".join(sentences(words, n=40)) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    namespace = {}
    exec(compile(code.replace(name, f"model_name = {str(local)!r}"), "hf.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, roundpipe.hf.Trainer) and trainer.state.global_step == 3
    assert {p.dtype for p in trainer.hf_model.parameters()} == {torch.bfloat16}
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    last = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-3")
    masters = trainer.model.master_state_dict()
    for (name, a), (_, b) in zip(final.named_parameters(), last.named_parameters()):
        assert torch.equal(a.detach(), masters[name]) and torch.equal(b.detach(), masters[name])
