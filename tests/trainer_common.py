"""What tests/test_trainer.py and its subprocess worker share: a tiny Llama built from a config,
a dataset and a collator made on the machine, a word tokenizer and sentences for TRL,
TrainingArguments."""

import torch

VOCAB = 64
PAD = 0


def tiny_llama(seed=0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def token_dataset(n=26, seed=1):
    """``n`` samples of 6 to 16 token ids (1..VOCAB-1), as a list of dicts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 17, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()})
    return out


def collate(examples):
    """Right-padded to the longest: attention_mask 0 and labels -100 on the padding."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), PAD)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def training_args(output_dir, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=20,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def step_losses(log_history):
    return [e["loss"] for e in log_history if "loss" in e and "train_loss" not in e]


def word_tokenizer():
    """A WordLevel tokenizer of a few words (for TRL's SFTTrainer), and the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog bird sees likes eats runs sleeps big small red green and".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    ), words


def sentences(words, n=24, seed=3):
    """``n`` sentences of 4 to 11 of ``words``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(4, 12, (1,), generator=g))
        out.append(" ".join(words[int(i)] for i in torch.randint(len(words), (k,), generator=g)))
    return out


def stop_at(step):
    """A Trainer callback that stops training at the end of ``step`` (a run cut short, as a
    crash or a preemption would, after its checkpoint of that step)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()
