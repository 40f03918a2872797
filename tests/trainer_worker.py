"""Subprocess of tests/test_trainer.py: one roundpipe.hf.Trainer run (the full 20 steps, the
first 10 with a checkpoint, or a resume of it), writing its step losses and masters."""

import json
import sys

import torch
import transformers

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trainer_common import collate, step_losses, tiny_llama, token_dataset, training_args  # noqa: E402

import roundpipe  # noqa: E402


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def main(mode, output_dir, result):
    args = training_args(output_dir, save_strategy="steps", save_steps=10, save_total_limit=2)
    callbacks = [StopAt(10)] if mode == "stop" else []
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
