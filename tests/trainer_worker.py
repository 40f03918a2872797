"""Subprocess of tests/test_trainer.py: one roundpipe.hf.Trainer run (the full 20 steps, the
first 10 with a checkpoint, or a resume of it), writing its step losses and masters."""

import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trainer_common import (  # noqa: E402
    collate,
    step_losses,
    stop_at,
    tiny_llama,
    token_dataset,
    training_args,
)

import roundpipe  # noqa: E402


def main(mode, output_dir, result):
    args = training_args(output_dir, save_strategy="steps", save_steps=10, save_total_limit=2)
    callbacks = [stop_at(10)] if mode == "stop" else []
    trainer = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=token_dataset(),
        data_collator=collate,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    masters = trainer.model.master_state_dict()
    torch.save(masters, result + ".pt")
    with open(result + ".json", "w") as f:
        json.dump(
            {"losses": step_losses(trainer.state.log_history), "step": trainer.state.global_step}, f
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
