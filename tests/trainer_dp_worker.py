"""One rank of tests/test_trainer_dp.py's data-parallel Trainer runs (under torchrun), or the
one-process run at the same global batch (without torchrun's environment).

    torchrun --nproc-per-node 2 tests/trainer_dp_worker.py MODE OUTPUT_DIR RESULT
    python tests/trainer_dp_worker.py MODE OUTPUT_DIR RESULT

or ``main()`` in a rank process of the test session (tests/rank_pool_worker.py), with the same
arguments and torchrun's variables: each run leaves the process as it found it (its
DataParallel closed, its process group destroyed, accelerate's state reset).

MODE: ``full`` (12 steps, a checkpoint at step 7), ``resume`` (from the newest checkpoint in
OUTPUT_DIR), ``fp16`` (``full`` in fp16, with a first loss scale so large
that the first steps overflow and are skipped): a global batch of 8 samples, 2 ranks x 2
samples x 2 accumulated batches or 1 process x 2 samples x 4 batches; or ``sft`` (roundpipe.hf.SFTTrainer
on sentences, 6 steps of 2 accumulated batches of 8 / 2 / world samples). Each rank writes
``RESULT-rank{R}.pt``: its log history, masters, evaluation loss and what it saw of the run.
"""

import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trainer_common import (  # noqa: E402
    collate,
    sentences,
    tiny_llama,
    token_dataset,
    training_args,
    word_tokenizer,
)

import roundpipe  # noqa: E402

STEPS, STOP, PER_DEVICE, GLOBAL_BATCH = 12, 7, 2, 8


def sft_trainer(output_dir, per_device):
    """roundpipe.hf.SFTTrainer on 24 sentences, 6 steps of 2 accumulated batches."""
    import datasets
    import trl

    tokenizer, words = word_tokenizer()
    base = training_args(output_dir, use_cpu=True).to_dict()  # the CPU, as the config below
    keep = {"learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm"}
    config = trl.SFTConfig(
        output_dir=str(output_dir),
        max_length=16,
        packing=False,
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **{k: v for k, v in base.items() if k in keep},
    )
    model = tiny_llama()
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    return roundpipe.hf.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": sentences(words)}),
        eval_dataset=datasets.Dataset.from_dict({"text": sentences(words, n=8, seed=9)}),
        processing_class=tokenizer,
    )


def run(mode, output_dir, result):
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; TrainingArguments reads it too
    ga = GLOBAL_BATCH // (PER_DEVICE * world)
    if mode == "sft":
        # TRL's token metrics are per batch, each pooled over the ranks: batch i of a step on
        # two ranks (2 samples each) pools the samples of batch i of one process with 4.
        trainer = sft_trainer(output_dir, GLOBAL_BATCH // 2 // world)
        trainer.train()
        torch.save(
            {
                "log_history": trainer.state.log_history,
                "masters": trainer.model.master_state_dict(),
                "eval": trainer.evaluate(),
            },
            f"{result}-rank{trainer.args.process_index}.pt",
        )
        _close(trainer)
        return
    if mode != "fp16":
        return _run(mode, output_dir, result, ga, {})
    import functools

    from roundpipe.hf import trainer as rp_trainer

    # The first scale so large that the first steps overflow; put back afterwards, since the
    # one-process run is in the test's own process.
    scaler = rp_trainer.GradScaler
    rp_trainer.GradScaler = functools.partial(roundpipe.GradScaler, init_scale=2.0**28)
    try:
        return _run(mode, output_dir, result, ga, {"fp16": True})
    finally:
        rp_trainer.GradScaler = scaler


def _run(mode, output_dir, result, ga, fp16):
    args = training_args(
        output_dir,
        **fp16,
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ga,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=STOP,
        save_total_limit=2,
        use_cpu=True,
    )
    trainer = roundpipe.hf.Trainer(
        model=tiny_llama(),
        args=args,
        # 24 samples: 12 batches of 2, so every rank gets 6 and no batch is repeated to even
        # out the ranks; 8 evaluation samples: one batch of 4 per rank.
        train_dataset=token_dataset(n=24),
        eval_dataset=token_dataset(n=8, seed=5),
        data_collator=collate,
    )
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    record = {
        "world": args.world_size,
        "log_history": trainer.state.log_history,
        "step": trainer.state.global_step,
        "masters": trainer.model.master_state_dict(),
        "eval_loss": trainer.evaluate()["eval_loss"],
        "is_world_process_zero": trainer.state.is_world_process_zero,
        "model_type": type(trainer.model).__name__,
        "wrapped_is_model": trainer.model_wrapped is trainer.model,
        "accelerate_models": [type(m).__name__ for m in trainer.accelerator._models],
        "param_devices": sorted({str(p.device) for p in trainer.hf_model.parameters()}),
        "data_parallel": None
        if trainer.data_parallel is None
        else [trainer.data_parallel.rank, trainer.data_parallel.world_size],
        "replicas_identical": None
        if trainer.data_parallel is None
        else trainer.data_parallel.replicas_identical(),
    }
    torch.save(record, f"{result}-rank{args.process_index}.pt")
    _close(trainer)


def _close(trainer):
    """Detach the Trainer's DataParallel once its run is recorded: this process may run more
    (tests/rank_pool_worker.py), and a DataParallel of the next run's process group refuses to
    attach beside one of this run's."""
    if trainer.data_parallel is not None:
        trainer.data_parallel.close()


def main():
    """One run in a rank process of the test session, with this process's argv and torchrun's
    variables: the process group and accelerate's state that the run's TrainingArguments set
    up are let go afterwards, so that the next run sets up its own, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    run(*sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


if __name__ == "__main__":
    run(*sys.argv[1:])
