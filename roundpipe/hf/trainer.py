"""``roundpipe.hf.Trainer``: transformers' ``Trainer`` whose training runs on roundpipe.

A Trainer script adopts it by changing its import and its class (docs/hf.md, "The Trainer"):
the model is wrapped by :func:`roundpipe.hf.wrap` at construction and stays in host memory;
:meth:`RoundPipeTrainerMixin.train` is a loop over the Trainer's own pieces (its dataloader,
``get_batch_samples``, optimizer class and decay groups, scheduler, callbacks, ``log``,
``evaluate``, TrainerState) whose steps are roundpipe's: one ``forward_backward`` per optimizer
step and ``model.step`` on the optimizer thread (see [Note: the Trainer's step]). Under
torchrun its processes are roundpipe's data-parallel ranks (see [Note: the Trainer's data
parallelism]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from roundpipe import checkpoint, optim_thread
from roundpipe.checkpoint import files as checkpoint_files
from roundpipe.checkpoint import manifest as checkpoint_manifest
from roundpipe.checkpoint.manifest import MANIFEST
from roundpipe.distributed import DataParallel
from roundpipe.hf import compat
from roundpipe.hf.wrap import HFRoundPipe, wrap
from roundpipe.optim.adam import check_grad_dtype
from roundpipe.optim.master_file import MastersOnDisk
from roundpipe.runtime import RoundPipeRunConfig
from roundpipe.scaler.grad_scaler import GradScaler
from roundpipe.user_frame import user_stacklevel

__all__ = ["RoundPipeTrainerMixin", "Trainer", "unsupported_arguments", "newest_checkpoint"]

logger = transformers.utils.logging.get_logger(__name__)

# [Note: the Trainer's step]
# One optimizer step of transformers' Trainer is gradient_accumulation_steps batches, each a
# forward and backward, then clipping, optimizer.step, scheduler.step and zero_grad. Here the
# batches of one step are joined (right-padded to the longest: attention_mask 0, labels -100)
# into ONE forward_backward call whose microbatches are those batches (num_microbatch = the
# number of batches, or the Trainer's num_microbatch), because roundpipe streams every stage's
# weights through the devices once per call: k calls per step would move the weights k times.
# The loss of every microbatch is its token losses' sum over the Trainer's own
# num_items_in_batch (get_batch_samples, counted as the installed transformers counts it), so
# the call's gradient is the Trainer's accumulated gradient. The clipping (the norm of every
# master's gradient, where the gradients are: the optimizer thread), the optimizer step, the
# scheduler step and zero_grad run in one step function on the optimizer thread, in that order,
# launched by model.step: asynchronously by default (the next step's batches compute with
# weights one step older, see [Note: staleness] in runtime/model.py), or synchronously with
# async_step=False (then every step equals the plain Trainer's). What the step computes for the
# logs (the gradient norm, the learning rate it used, the scale) is written into a _StepRecord on
# the optimizer thread; a log waits for the record of its step at the next step or before an
# evaluation, a save or the end, so a log costs the main thread no wait for the optimizer.

# [Note: the Trainer's data parallelism]
# Under torchrun the Trainer's processes are roundpipe's data-parallel ranks. The Trainer's
# TrainingArguments (accelerate) initialised the process group; the Trainer's own dataloader
# gives each rank its share of every global batch (accelerate's BatchSamplerShard: of the one
# seeded order of batches, rank r takes batches r, r + world, ...), and its get_batch_samples
# counts the label tokens of a step over every rank (average_tokens_across_devices). Each rank's
# loss is then its token losses' sum over that global count, times the world size, as
# transformers' compute_loss does, so that DataParallel's average over the ranks is the
# gradient of the whole global batch; the clipping, run after that average on every rank, sees
# the same averaged gradients everywhere: its norm is the global one. The model gets its
# DataParallel at construction, over a process group of its own (_trainer_group): the Trainer
# issues collectives on the main thread (the token count, the logged loss, the evaluation's
# gather, the flos) while DataParallel's run on the optimizer thread, and the collectives of one
# group must come in the same order on every rank, which two threads cannot promise; two groups
# are independent. Logs show the mean loss over the ranks and the tokens of all of them;
# checkpoints are roundpipe.checkpoint's (every rank calls save at the same step, rank 0 writes;
# every rank loads on resume).

# [Note: TRL's token metrics]
# TRL's SFTTrainer logs, for every batch of the step (each of its compute_loss calls), the mean
# entropy of the model's distribution over the predicted tokens and the share of them whose most
# likely token is the label, each a sum over every rank's batch divided by every rank's count,
# and at a log the mean of those per-batch values since the last log; num_tokens is the running
# count of attended input tokens over every rank. Here the head computes the per-token values
# from each chunk's logits while they exist (chunked_causal_lm_loss(token_stats=True)) and
# returns them summed per row with the loss; the step's loss_fn keeps them, the main thread
# sums the rows of each batch after the call, and the log gathers the batches' sums over the
# ranks (the same batches on every rank, in order) before dividing, as TRL does.

# TrainingArguments that roundpipe cannot honour: (is it set, what to do instead).
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "deepspeed": (
        bool,
        "roundpipe keeps the model in host memory and streams it through the devices itself; "
        "leave deepspeed unset",
    ),
    "fsdp": (
        bool,
        "roundpipe keeps the model in host memory and streams it through the devices itself; "
        "leave fsdp unset",
    ),
    "use_liger_kernel": (
        bool,
        "leave use_liger_kernel=False (roundpipe computes the loss in its own chunked head)",
    ),
    "neftune_noise_alpha": (
        lambda v: v is not None,
        "leave neftune_noise_alpha unset (it hooks the embedding's forward)",
    ),
    "label_smoothing_factor": (
        bool,
        "leave label_smoothing_factor=0 (roundpipe's head computes transformers' plain loss)",
    ),
    "load_best_model_at_end": (
        bool,
        "leave load_best_model_at_end=False and load the checkpoint you choose with "
        "resume_from_checkpoint or roundpipe.checkpoint.load",
    ),
    "fp16_full_eval": (
        bool,
        "leave fp16_full_eval=False: load the model in fp16 (the evaluation uses its dtype)",
    ),
    "bf16_full_eval": (
        bool,
        "leave bf16_full_eval=False: load the model in bf16 (the evaluation uses its dtype)",
    ),
    "auto_find_batch_size": (
        bool,
        "set per_device_train_batch_size yourself; `model.memory_plan(batch)` tells what "
        "a batch takes (docs/memory.md)",
    ),
}


def unsupported_arguments(args: Any) -> list[str]:
    """The problems with ``args`` (TrainingArguments) for :class:`Trainer`, one line each:
    the option set and what to do. Empty when roundpipe honours every option set."""
    problems = []
    for name, (is_set, fix) in _UNSUPPORTED.items():
        value = getattr(args, name, None)
        if value is not None and is_set(value):
            problems.append(f"{name}={value!r}: {fix}")
    if _world_size(args) > 1 and getattr(args, "save_on_each_node", False):
        problems.append(
            "save_on_each_node=True: under data parallelism roundpipe.checkpoint writes on "
            "rank 0 only and every rank reads it; leave save_on_each_node=False and put "
            "output_dir on a file system every node reads"
        )
    if getattr(args, "fp16", False) and getattr(args, "bf16", False):
        problems.append("fp16=True and bf16=True: choose one")
    return problems


def _world_size(args: Any) -> int:
    return int(getattr(args, "world_size", 1) or 1)


# The process group of the Trainers' DataParallel in this process, with the world group it was
# made from (main thread). One per process: roundpipe's checkpoints gather over one group.
_TRAINER_GROUP: dict[str, Any] = {}


def _trainer_group(args: Any) -> Any:
    """The process group the Trainer's DataParallel averages over: every rank of the world,
    apart from the world group the Trainer's own collectives use (see [Note: the Trainer's data
    parallelism]). Made once per process, by every rank (``new_group`` is a collective)."""
    world = dist.group.WORLD
    if _TRAINER_GROUP.get("world") is not world:
        _TRAINER_GROUP["world"] = world
        _TRAINER_GROUP["group"] = dist.new_group(timeout=args.ddp_timeout_delta)
    return _TRAINER_GROUP["group"]


def _data_parallel(args: Any, model: HFRoundPipe) -> DataParallel | None:
    """The DataParallel of a distributed run (``args.world_size > 1``), None in one process."""
    world = _world_size(args)
    if world <= 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"TrainingArguments report world_size={world} but torch.distributed is not "
            f"initialized; launch the script with torchrun (e.g. `torchrun --nproc-per-node "
            f"{world} train.py`), whose TrainingArguments initialise it"
        )
    group = _trainer_group(args)
    if dist.get_world_size(group) != world:
        raise RuntimeError(
            f"TrainingArguments report world_size={world} but the process group has "
            f"{dist.get_world_size(group)} ranks; build TrainingArguments after the process "
            f"group (torchrun's environment) and keep one process group per run"
        )
    return DataParallel(model, process_group=group)


@dataclasses.dataclass
class _StepRecord:
    """What one step computed for the logs. Written on the optimizer thread, then ``done`` is
    set; the main thread reads the fields only after ``done``."""

    grad_norm: float | None = None
    learning_rate: float | None = None
    skipped: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class _PendingLog:
    """A log of step ``global_step`` waiting for its step's record (main thread)."""

    logs: dict[str, float]
    record: _StepRecord
    global_step: int
    epoch: float | None


def _join_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The batches of one optimizer step as one batch: right-padded to the longest sequence
    (attention_mask 0, labels -100, input ids 0 there; nothing attends to or learns from the
    padding) and concatenated, so that they split back into microbatches."""
    if len(batches) == 1:
        return dict(batches[0])
    length = max(b["input_ids"].shape[-1] for b in batches)
    uneven = any(b["input_ids"].shape[-1] != length for b in batches)
    pads = {"input_ids": 0, "attention_mask": 0, "labels": -100, "position_ids": 0}
    joined: dict[str, Any] = {}
    for key in batches[0]:
        found = [b.get(key) for b in batches]
        values = [v for v in found if isinstance(v, torch.Tensor)]
        if key == "num_items_in_batch" or len(values) != len(found):
            joined[key] = found[0]
            continue
        if uneven and values[0].dim() >= 2:
            if key not in pads:
                raise ValueError(
                    f"the batches of one optimizer step differ in length and carry {key!r}, "
                    f"which roundpipe.hf.Trainer cannot pad; pad every batch to one length "
                    f"(the collator's pad_to_multiple_of / max_length) or leave {key!r} out"
                )
            values = [
                nn.functional.pad(v, (0, length - v.shape[-1]), value=pads[key]) for v in values
            ]
        joined[key] = torch.cat(values, dim=0)
    if uneven and "attention_mask" not in joined:
        masks = [
            nn.functional.pad(
                torch.ones_like(b["input_ids"]), (0, length - b["input_ids"].shape[-1])
            )
            for b in batches
        ]
        joined["attention_mask"] = torch.cat(masks, dim=0)
    return joined


def _as_count(num_items: Any) -> Any:
    """The Trainer's num_items_in_batch as a host number (it may be a device tensor)."""
    if isinstance(num_items, torch.Tensor):
        return num_items.detach().to("cpu").reshape(-1)[0].item()
    return num_items


def _input_tokens(batch: dict[str, Any], name: str) -> int:
    ids = batch.get(name)
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


class RoundPipeTrainerMixin:
    """What makes a transformers ``Trainer`` (or a subclass of it, e.g. TRL's ``SFTTrainer``)
    train on roundpipe. Put it first: ``class MyTrainer(RoundPipeTrainerMixin, SomeTrainer)``.

    Keyword arguments it adds to the Trainer's (every other argument is the Trainer's own):

    * ``async_step`` (default True): the optimizer step runs on roundpipe's optimizer thread
      while the next step's batches compute, with weights one step older than a synchronous
      Trainer's (one-step staleness, docs/threads-and-staleness.md); False waits for each step
      (then every step equals the plain Trainer's).
    * ``num_microbatch``: microbatches of one optimizer step (default: one per batch of the
      gradient accumulation, ``gradient_accumulation_steps``).
    * ``devices``: roundpipe's device pool (default ``"cpu"`` with ``use_cpu=True``; under
      torchrun on GPUs, the rank's own GPU, ``args.device``; else ``$ROUNDPIPE_DEVICES``, else
      every CUDA device, else the CPU).
    * ``wrap_kwargs``: more arguments for :func:`roundpipe.hf.wrap` (``loss_chunk_tokens``,
      ``check``, ``model_run_config``, ``memory_check``).
    * ``checkpoint_hf`` (default: True where every master is in this process, i.e. but with
      ``ShardedState``): each checkpoint ``output_dir/checkpoint-N`` also holds the trained
      model as transformers' Trainer writes it (``config.json`` and ``model.safetensors`` in
      fp32, or a peft model's adapter), so ``from_pretrained("output_dir/checkpoint-N")`` (or
      ``PeftModel.from_pretrained(base, ...)``) loads it. It costs 4 bytes per trained
      parameter of disk per checkpoint, written by the checkpoint writer while training goes
      on (the next step waits until it is written). False leaves it out.
    * ``spill_dir``: a directory on a fast local disk for the masters and Adam's state
      (``roundpipe.MastersOnDisk`` and ``roundpipe.optim.AdamW(state_dir=...)``, built from the
      Trainer's ``optim`` and its arguments): the host keeps about 6 bytes per parameter
      instead of 18 (docs/memory.md, "Masters on disk"). Default None: everything in RAM.

    * ``grad_dtype`` (``torch.bfloat16`` or ``torch.float16``; default None: fp32): the
      gradients summed in that dtype on the device and handed to the optimizer step as they
      are, 2 bytes per trained parameter of host RAM instead of 4 (both sets with the async
      step: 32 GB less for an 8B model's full fine-tuning): ``RoundPipeRunConfig(
      device_grad_dtype=...)`` with ``roundpipe.optim.AdamW(grad_dtype=...)``, which the
      Trainer's Adam or AdamW becomes (see [Note: gradients in their summed dtype] in
      :mod:`roundpipe.runtime.grad_router`). The gradient norm is summed in fp32; clipping
      scales the low-precision gradients, rounding each product to that dtype. Needs torch
      2.10 or newer; not with ``spill_dir`` or under torchrun (DataParallel sums in fp32).

    ``TrainingArguments(optim=...)`` naming an 8-bit AdamW (``adamw_8bit``, ``adamw_bnb_8bit``,
    ``adamw_torch_8bit``, ``paged_adamw_8bit``) builds ``roundpipe.optim.AdamW(state_dtype=
    "8bit")`` over the masters: 8-bit blockwise moments in host memory, no bitsandbytes needed
    (docs/memory.md, "Lean optimizer states").

    ``self.model`` is the :class:`roundpipe.hf.HFRoundPipe` (``self.hf_model`` the model given,
    whose parameters hold the trained weights after training). Under torchrun
    (``args.world_size > 1``) ``self.data_parallel`` is the
    :class:`roundpipe.distributed.DataParallel` that averages the gradients over the ranks (None
    in one process; see docs/distributed.md, "The Trainer"). Main thread only.
    """

    # Whether the logs carry TRL's token metrics (entropy, mean_token_accuracy, num_tokens),
    # computed in roundpipe's head (roundpipe.hf.SFTTrainer sets it).
    _token_metrics = False

    def __init__(
        self,
        *args: Any,
        async_step: bool = True,
        num_microbatch: int | None = None,
        devices: Any = None,
        wrap_kwargs: dict[str, Any] | None = None,
        checkpoint_hf: bool | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        grad_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        if grad_dtype is not None:  # before anything is built
            check_grad_dtype(
                grad_dtype, "Trainer(grad_dtype=...)", state_dir=spill_dir, state_option="spill_dir"
            )
        if num_microbatch is not None and (
            isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int)
        ):
            raise ValueError(
                f"num_microbatch must be None or a positive int, got {num_microbatch!r}"
            )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _refuse(training_args)
        optimizers = kwargs.get("optimizers")
        if optimizers is not None and optimizers[0] is not None:
            raise ValueError(
                "optimizers=(optimizer, ...): an optimizer built over the model's parameters "
                "would not step roundpipe's fp32 master copies; pass optimizer_cls_and_kwargs="
                "(torch.optim.AdamW, {...}) or set TrainingArguments(optim=...), and roundpipe "
                "builds it over the masters"
            )
        if optimizers is not None and optimizers[1] is not None:
            raise ValueError(
                "optimizers=(None, scheduler): a scheduler needs the optimizer roundpipe "
                "builds over the masters; set TrainingArguments(lr_scheduler_type=..., "
                "lr_scheduler_kwargs=...) instead"
            )
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "compute_loss_func: roundpipe computes transformers' causal-LM loss in its own "
                "chunked head; leave compute_loss_func unset"
            )
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init: pass the model itself (model=...)")
        if spill_dir is not None and "state_placement" in (wrap_kwargs or {}):
            raise ValueError(
                "spill_dir= keeps the masters in files (wrap's state_placement=MastersOnDisk): "
                "give spill_dir or wrap_kwargs['state_placement'], not both"
            )
        self.async_step = bool(async_step)
        self.num_microbatch = num_microbatch
        self.checkpoint_hf = checkpoint_hf
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self.grad_dtype = grad_dtype
        with compat.quiet_checkpointing_names():  # TRL's get_peft_model (peft_config=)
            super().__init__(*args, **kwargs)
        trainer: Any = self
        _refuse(trainer.args)
        if grad_dtype is not None and _world_size(trainer.args) > 1:
            raise ValueError(
                f"grad_dtype={grad_dtype} under torchrun: roundpipe.distributed.DataParallel "
                f"sums the gradients over the ranks in the masters' dtype (fp32); leave "
                f"grad_dtype=None"
            )
        hf_model = trainer.model
        if hf_model is None:
            raise ValueError("roundpipe.hf.Trainer needs model=")
        if isinstance(hf_model, HFRoundPipe):
            raise ValueError(
                "pass the transformers model (model=hf_model), not the roundpipe.hf.wrap of it: "
                "the Trainer wraps it itself (wrap_kwargs= for wrap's options)"
            )
        low = self._compute_dtype()
        _check_half_dtype(hf_model, low)
        if low is not None:
            # roundpipe's layout: low-precision parameters that compute, fp32 masters.
            for p in hf_model.parameters():
                if p.dtype == torch.float32:
                    p.data = p.data.to(low)
        options = dict(wrap_kwargs or {})
        options.setdefault("optim_dtype", torch.float32)
        if devices is None and trainer.args.use_cpu and "devices" not in options:
            devices = "cpu"  # the Trainer's use_cpu=True: roundpipe's pool is the CPU too
        if (
            devices is None
            and "devices" not in options
            and _world_size(trainer.args) > 1
            and trainer.args.device.type == "cuda"
        ):
            devices = str(trainer.args.device)  # torchrun: one GPU per rank, the rank's own
        if devices is not None:
            options["devices"] = devices
        if self.spill_dir is not None:
            options["state_placement"] = MastersOnDisk(self.spill_dir)
        if trainer.args.torch_compile and "compile" not in options:
            # The Trainer's torch_compile: the decoder layers compiled, on any pool that can
            # (wrap's default compiles them on CUDA already), with its backend and mode.
            targs = trainer.args
            chosen = (("backend", targs.torch_compile_backend), ("mode", targs.torch_compile_mode))
            options["compile"] = {key: value for key, value in chosen if value}
        self.hf_model = hf_model
        self._rp = wrap(hf_model, **options)
        self.data_parallel = _data_parallel(trainer.args, self._rp)
        if self.checkpoint_hf is None:  # the HF export needs every master in this process
            self.checkpoint_hf = self._rp.state_placement.world_size == 1
        self.checkpoint_hf = bool(self.checkpoint_hf)
        # The Trainer's evaluation hands the model to accelerate, which would move it to the
        # device and wrap its forward; the model stays where roundpipe keeps it.
        setattr(self._rp, "_is_accelerate_prepared", True)  # noqa: B010 (an nn.Module attribute)
        trainer.model = trainer.model_wrapped = self._rp

    # -- what the Trainer would do to the model ---------------------------------------------------
    def _move_model_to_device(self, model: Any, device: Any) -> None:
        pass  # the model stays in host memory; roundpipe uploads each stage when it computes

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        return model

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if len(inputs) == 0:
            raise ValueError("The batch received was empty")
        return inputs  # host tensors: roundpipe moves each microbatch to its device

    def _compute_dtype(self) -> torch.dtype | None:
        args: Any = getattr(self, "args", None)
        if args is None:
            return None
        if args.fp16:
            return torch.float16
        if args.bf16:
            return torch.bfloat16
        return None

    # -- the optimizer over the masters -----------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The optimizer the Trainer would build (``args.optim`` or ``optimizer_cls_and_kwargs``,
        weight decay except on biases and norms), over roundpipe's fp32 master copies."""
        trainer: Any = self
        if trainer.optimizer is not None:
            return trainer.optimizer
        decay = set(trainer.get_decay_parameter_names(self.hf_model))
        masters = list(self._rp.optim_named_parameters())
        groups = [
            {
                "params": [p for n, p in masters if n in decay],
                "weight_decay": trainer.args.weight_decay,
            },
            {"params": [p for n, p in masters if n not in decay], "weight_decay": 0.0},
        ]
        cls_and_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
        if cls_and_kwargs is None:
            cls_and_kwargs = _eight_bit_adam(trainer.args)
        if cls_and_kwargs is not None:
            cls, opt_kwargs = cls_and_kwargs
        else:
            cls, opt_kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, self.hf_model)
        opt_kwargs = dict(opt_kwargs)
        if any(k in opt_kwargs for k in ("params", "model", "optimizer_dict")) or not isinstance(
            cls, type
        ):
            raise ValueError(
                f"optim={trainer.args.optim!r} builds its optimizer from the model, not from "
                f"parameter groups; roundpipe steps its fp32 masters: choose a torch optimizer "
                f"(optim='adamw_torch', 'adamw_torch_fused', 'sgd', ...)"
            )
        if self.spill_dir is not None:
            cls, opt_kwargs = _roundpipe_adam(
                cls, opt_kwargs, trainer.args.optim, "spill_dir", state_dir=self.spill_dir
            )
        if self.grad_dtype is not None:
            cls, opt_kwargs = _roundpipe_adam(
                cls, opt_kwargs, trainer.args.optim, "grad_dtype", grad_dtype=self.grad_dtype
            )
        trainer.optimizer = cls([g for g in groups if g["params"]], **opt_kwargs)
        return trainer.optimizer

    # -- training ---------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Train as transformers' ``Trainer.train`` does, on roundpipe ([Note: the Trainer's
        step]); ``resume_from_checkpoint`` (a checkpoint directory, or True: the newest in
        ``output_dir``) resumes a checkpoint this Trainer saved, exactly. Main thread; returns
        transformers' ``TrainOutput``; the model's parameters hold the trained weights."""
        if trial is not None or kwargs:
            raise ValueError(
                "roundpipe.hf.Trainer.train takes resume_from_checkpoint and "
                "ignore_keys_for_eval (no hyperparameter-search trial)"
            )
        trainer: Any = self
        return _TrainLoop(trainer, self._rp).run(resume_from_checkpoint, ignore_keys_for_eval)

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """``save_model``'s write: the model as ``from_pretrained`` loads it (its fp32 masters,
        or the adapter of a peft model), the tokenizer and the training arguments."""
        trainer: Any = self
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        self._rp.save_pretrained(output_dir)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


# transformers' names of 8-bit AdamW (bitsandbytes', torchao's): roundpipe's AdamW with 8-bit
# moments steps the masters in host memory (roundpipe.optim.lean, [Note: lean moments]).
EIGHT_BIT_OPTIM = ("adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit", "paged_adamw_8bit")


def _eight_bit_adam(args: Any) -> tuple[type, dict[str, Any]] | None:
    """``optim`` naming an 8-bit AdamW: roundpipe's AdamW with 8-bit moments and the Trainer's
    Adam arguments; else None (transformers' own choice)."""
    name = getattr(args.optim, "value", args.optim)
    if name not in EIGHT_BIT_OPTIM:
        return None
    from roundpipe import optim as rp_optim

    return rp_optim.AdamW, {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "state_dtype": "8bit",
    }


# What roundpipe's own Adam or AdamW does that the Trainer's may not: the option it takes
# (the Trainer's keyword naming it), for the refusal of an optimizer that is not one.
_ROUNDPIPE_ADAM_FOR = {
    "spill_dir": "streams the masters and Adam's state through files",
    "grad_dtype": "steps on gradients in bf16 or fp16",
}


def _roundpipe_adam(
    cls: type, opt_kwargs: dict[str, Any], optim: Any, option: str, **extra: Any
) -> tuple[type, dict[str, Any]]:
    """The Trainer's Adam or AdamW as roundpipe's, with ``extra`` keyword arguments (the same
    arguments otherwise: roundpipe's take torch's), for the Trainer's ``option``, which only
    roundpipe's honours."""
    from roundpipe import optim as rp_optim

    counterparts = {
        torch.optim.AdamW: rp_optim.AdamW,
        torch.optim.Adam: rp_optim.Adam,
        rp_optim.AdamW: rp_optim.AdamW,
        rp_optim.Adam: rp_optim.Adam,
    }
    if cls not in counterparts:
        raise ValueError(
            f"{option}= {_ROUNDPIPE_ADAM_FOR[option]}, which roundpipe.optim.Adam/AdamW do; "
            f"optim={optim!r} builds {cls.__name__}: choose optim='adamw_torch' (or "
            f"'adamw_torch_fused', 'adam'), or leave {option} out"
        )
    kwargs = {k: v for k, v in opt_kwargs.items() if k not in ("fused", "foreach")}
    return counterparts[cls], {**kwargs, **extra}


def _clip_summed_in_fp32(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for low-precision gradients: each gradient's 2-norm
    taken in fp32 (torch's takes it in the gradient's dtype), their norm, and torch's clip by
    it (``clip_grads_with_norm_``: each product rounded to the gradient's dtype); returns it."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(
        torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _check_half_dtype(model: nn.Module, low: torch.dtype | None) -> None:
    """``ValueError`` if ``model`` has parameters in the other 16-bit dtype than the one the
    TrainingArguments ask for (an fp16 model with ``bf16=True``, a bf16 model with
    ``fp16=True``): roundpipe computes in the parameters' own dtype, and converting one 16-bit
    dtype into the other rounds the weights (bf16 into fp16 may also overflow)."""
    if low is None:
        return
    other = torch.bfloat16 if low == torch.float16 else torch.float16
    if not any(p.dtype == other for p in model.parameters()):
        return
    flag, other_flag = ("fp16", "bf16") if low == torch.float16 else ("bf16", "fp16")
    name = str(other).replace("torch.", "")
    raise ValueError(
        f"the model is in {name} and TrainingArguments({flag}=True) asks for "
        f"{str(low).replace('torch.', '')}: roundpipe.hf.Trainer computes in the parameters' "
        f"dtype, and converting {name} weights to the other 16-bit dtype would round them"
        + (" and overflow values beyond float16's 65504" if low == torch.float16 else "")
        + f". Load the model in float32 (dtype=torch.float32; roundpipe converts it with fp32 "
        f"masters) or in {str(low).replace('torch.', '')}, or train in {name}: "
        f"TrainingArguments({other_flag}=True, {flag}=False)"
    )


def _refuse(args: Any) -> None:
    problems = unsupported_arguments(args)
    if problems:
        raise ValueError(
            "roundpipe.hf.Trainer cannot honour these TrainingArguments:\n  "
            + "\n  ".join(problems)
        )


def _make_step_fn(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: GradScaler | None,
    clip: Callable[[float], torch.Tensor],
    max_grad_norm: float,
    ran: list[bool],
) -> Callable[[_StepRecord], None]:
    """The Trainer's optimizer step, for the optimizer thread: unscale (fp16), clip the whole
    model's gradient norm (``clip(max_norm)``, which returns it), step (skipped on an
    overflow), step the scheduler unless the step was skipped, zero the gradients; the record
    gets the norm and the learning rate used."""
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def step(record: _StepRecord) -> None:
        try:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_grad_norm is not None and max_grad_norm > 0:
                norm = clip(max_grad_norm)
                record.grad_norm = float(norm)
            record.learning_rate = float(scheduler.get_last_lr()[0])
            ran[0] = False
            if scaler is not None:
                scaler.step(optimizer)
                # A fused optimizer is called on an overflow too (its kernel skips the update
                # from found_inf), so the post hook cannot tell: the scaler knows.
                record.skipped = scaler.step_was_skipped(optimizer)
            else:
                optimizer.step()
                record.skipped = not ran[0]
            if not record.skipped and not plateau:
                scheduler.step()
            optimizer.zero_grad()
        finally:
            record.done.set()

    return step


class _TrainLoop:
    """One ``train()`` call (main thread): the Trainer's loop with roundpipe's steps."""

    def __init__(self, trainer: Any, model: HFRoundPipe) -> None:
        self.t = trainer
        self.model = model
        self.pending: list[_PendingLog] = []
        self.scaler: GradScaler | None = None
        self.data_parallel: DataParallel | None = trainer.data_parallel

    # -- setup ------------------------------------------------------------------------------------
    def _sizes(self, dataloader: Any) -> tuple[int, int, int, int | None]:
        """(max_steps, num_update_steps_per_epoch, num_train_epochs, len_dataloader), as the
        Trainer computes them."""
        args = self.t.args
        ga = args.gradient_accumulation_steps
        try:
            len_dl: int | None = len(dataloader)
        except (TypeError, NotImplementedError):
            len_dl = None
        if len_dl is not None:
            per_epoch = max(len_dl // ga + int(len_dl % ga > 0), 1)
            max_steps = (
                args.max_steps
                if args.max_steps > 0
                else math.ceil(args.num_train_epochs * per_epoch)
            )
            if args.max_steps > 0:
                epochs = max_steps // per_epoch + int(max_steps % per_epoch > 0)
            else:
                epochs = math.ceil(args.num_train_epochs)
        elif args.max_steps > 0:
            per_epoch, max_steps, epochs = args.max_steps, args.max_steps, 2**62
        else:
            raise ValueError(
                f"args.max_steps must be set to a positive value if the dataloader has no "
                f"length, was {args.max_steps}"
            )
        return max_steps, per_epoch, epochs, len_dl

    def _resume(self, resume: str | bool | None, scaler: GradScaler | None) -> None:
        """Resume ``resume`` (a checkpoint directory, or True: the newest ``checkpoint-N`` of
        ``output_dir``): roundpipe's exactly, transformers' Trainer's from its weights (see
        [Note: resuming a transformers checkpoint])."""
        t = self.t
        if resume is None or resume is False:
            return
        if resume is True:
            path = newest_checkpoint(t.args.output_dir)
            if path is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({t.args.output_dir}): "
                    f"resume_from_checkpoint=True takes the newest checkpoint-N there that "
                    f"roundpipe.hf.Trainer or transformers' Trainer saved"
                )
        else:
            path = Path(resume)
        if not (path / MANIFEST).is_file():
            self._resume_transformers(path, scaler)
            return
        extra = checkpoint.load(
            path, self.model, t.optimizer, scaler=scaler, scheduler=t.lr_scheduler, progress=False
        )
        if "trainer_state" not in extra:
            raise ValueError(
                f"{path} is a roundpipe checkpoint without the Trainer's state: resume_from_"
                f"checkpoint takes the checkpoint-N directories roundpipe.hf.Trainer saves"
            )
        state = json.loads(extra["trainer_state"])
        t.state = transformers.TrainerState(**state)
        t._load_callback_state()

    def _resume_transformers(self, path: Path, scaler: GradScaler | None) -> None:
        """A checkpoint that transformers' Trainer saved (no roundpipe manifest): its weights,
        TrainerState (the schedule stepped to its step), scaler and RNG state; the optimizer's
        state fresh, with a warning (see [Note: resuming a transformers checkpoint])."""
        t, model = self.t, self.model
        if not path.is_dir():
            raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint directory at {path}")
        model.synchronize()  # nothing in flight while the weights change under the masters
        try:
            t._load_from_checkpoint(str(path), model=t.hf_model)
        except ValueError as exc:
            raise ValueError(
                f"{path} is not a checkpoint: it has neither roundpipe's {MANIFEST} nor the "
                f"model weights of a transformers checkpoint ({exc}); resume_from_checkpoint "
                f"takes the checkpoint-N directories that roundpipe.hf.Trainer or transformers' "
                f"Trainer saved"
            ) from None
        # The model's parameters hold the checkpoint's weights now: the masters start from
        # them (a load of the model's own state refreshes the masters).
        model.load_state_dict(model.state_dict())
        fresh = [
            "the optimizer's state (e.g. Adam's moments: optimizer.pt is over the model's "
            "parameters, not roundpipe's fp32 masters)"
        ]
        state_file = path / transformers.trainer.TRAINER_STATE_NAME
        if state_file.is_file():
            t.state = transformers.TrainerState.load_from_json(str(state_file))
            t._load_callback_state()
        else:
            fresh.append("the step count (no trainer_state.json: training starts at step 0)")
        step = t.state.global_step if state_file.is_file() else 0
        if isinstance(t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            fresh.append("ReduceLROnPlateau's state (it follows the evaluations to come)")
        else:
            # transformers' schedules are functions of the step: stepped to it, the rate is the
            # schedule's at the step (scheduler.pt may hold other param groups than these).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
                for _ in range(step):
                    t.lr_scheduler.step()
        scaler_file = path / transformers.trainer.SCALER_NAME
        if scaler is not None:
            if scaler_file.is_file():
                scaler.load_state_dict(torch.load(scaler_file, weights_only=True))
            else:
                fresh.append("the fp16 loss scale (no scaler.pt)")
        load_rng = getattr(t, "_load_rng_state", None)
        if callable(load_rng):
            load_rng(str(path))
        warnings.warn(
            f"resume_from_checkpoint: {path} is a checkpoint of transformers' Trainer (it has "
            f"no roundpipe {MANIFEST}): training goes on from its model weights at step "
            f"{step}, with its data position, logs and learning-rate schedule; these start "
            f"fresh: {'; '.join(fresh)}, so the first steps differ from an uninterrupted run. "
            f"The checkpoints this run saves resume exactly",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, resume: str | bool | None, ignore_keys_for_eval: Any) -> Any:
        t, model = self.t, self.model
        args = t.args
        t._memory_tracker.start()
        t.is_in_train = True
        dataloader = t.get_train_dataloader()
        max_steps, per_epoch, num_epochs, len_dl = self._sizes(dataloader)
        ga = args.gradient_accumulation_steps
        exportable: list[Any] = [
            cb
            for cb in t.callback_handler.callbacks + [t.control]
            if isinstance(cb, transformers.trainer_callback.ExportableState)
        ]
        t.state = transformers.TrainerState(stateful_callbacks=exportable)
        t.state.train_batch_size = t._train_batch_size
        t.state.compute_steps(args, max_steps)
        t.optimizer = None
        t.lr_scheduler = None
        t.create_optimizer()
        t.create_scheduler(num_training_steps=max_steps, optimizer=t.optimizer)
        scaler = GradScaler() if args.fp16 else None
        if scaler is not None and self.data_parallel is not None:
            scaler.join_data_parallel(self.data_parallel)  # every rank skips the same steps
        self.scaler = scaler
        self._resume(resume, scaler)
        t.state.init_training_references(t, max_steps, num_epochs, None)
        epochs_trained = t.state.global_step // per_epoch
        skip = (t.state.global_step % per_epoch) * ga if not args.ignore_data_skip else 0
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(t.callback_handler, attr, getattr(t, attr))
        t.callback_handler.train_dataloader = dataloader

        ran = [False]
        t.optimizer.register_step_post_hook(lambda *_: ran.__setitem__(0, True))
        masters = [p for g in t.optimizer.param_groups for p in g["params"]]
        # The global norm: under data parallelism the DataParallel's clip, which with sharded
        # state gathers the norms of the gradients other ranks own.
        dp = self.data_parallel
        clip: Callable[[float], torch.Tensor] = (
            dp.clip_grad_norm_
            if dp is not None
            else functools.partial(
                torch.nn.utils.clip_grad_norm_ if t.grad_dtype is None else _clip_summed_in_fp32,
                masters,
            )
        )
        self.step_fn = _make_step_fn(
            t.optimizer, t.lr_scheduler, scaler, clip, args.max_grad_norm, ran
        )
        main_input = getattr(self.t.hf_model, "main_input_name", "input_ids")
        self.main_input = main_input if isinstance(main_input, str) else "input_ids"

        start = time.time()
        initial_step = t.state.global_step
        self.loss_since_log = 0.0
        self.total_loss = 0.0
        self.last_logged = t.state.global_step
        self.tokens_since_log = 0
        self.tokens_total = 0
        self.batch_stats: list[torch.Tensor] = []  # per batch since the last log: TRL's sums
        self.attended_since_log = 0
        self.attended_total = 0  # TRL's num_tokens (not restored on resume, as TRL's)
        self.log_clock = time.perf_counter()
        model.train()
        t.control = t.callback_handler.on_train_begin(args, t.state, t.control)
        if getattr(args, "eval_on_start", False):
            self._evaluate(ignore_keys_for_eval)
        for epoch in range(epochs_trained, num_epochs):
            epoch_dl = dataloader
            if hasattr(epoch_dl, "set_epoch"):
                epoch_dl.set_epoch(epoch)
            steps_in_epoch = len(epoch_dl) if len_dl is not None else max_steps * ga
            t.control = t.callback_handler.on_epoch_begin(args, t.state, t.control)
            skipped = 0
            if epoch == epochs_trained and skip > 0:
                from accelerate import skip_first_batches

                epoch_dl = skip_first_batches(epoch_dl, skip)
                skipped = skip
            self._epoch(epoch, epoch_dl, steps_in_epoch, skipped, ignore_keys_for_eval)
            t.control = t.callback_handler.on_epoch_end(args, t.state, t.control)
            self._log_save_evaluate(ignore_keys_for_eval)
            if t.control.should_training_stop:
                break
        model.synchronize()
        self._flush_logs(wait=True)
        checkpoint.wait()
        remaining, self.tokens_total = self._over_ranks(self.loss_since_log, self.tokens_total)
        self.total_loss += remaining
        steps = t.state.global_step - initial_step
        train_loss = self.total_loss / max(steps, 0.001)
        runtime = time.time() - start
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(
                steps * t._train_batch_size * ga * _world_size(args) / max(runtime, 1e-9), 3
            ),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "train_tokens_per_second": round(self.tokens_total / max(runtime, 1e-9), 3),
            "train_loss": train_loss,
        }
        t._memory_tracker.stop_and_update_metrics(metrics)
        t.log(metrics)
        t.control = t.callback_handler.on_train_end(args, t.state, t.control)
        t.is_in_train = False
        return transformers.trainer_utils.TrainOutput(t.state.global_step, train_loss, metrics)

    def _epoch(
        self, epoch: int, dataloader: Any, steps_in_epoch: int, skipped: int, ignore_keys: Any
    ) -> None:
        t = self.t
        args = t.args
        ga = args.gradient_accumulation_steps
        remainder = steps_in_epoch % ga or ga
        total_updates = steps_in_epoch // ga + int(remainder < ga)
        iterator = iter(dataloader)
        step = skipped - 1
        for update in range(skipped // ga, total_updates):
            num_batches = ga if update != total_updates - 1 else remainder
            batches, num_items = t.get_batch_samples(iterator, num_batches, args.device)
            if not batches:
                break
            t.control = t.callback_handler.on_step_begin(args, t.state, t.control)
            loss = self._step(batches, num_items)
            # Before on_step_end: a log's on_log resets control.should_log, which on_step_end
            # then sets for this step.
            self._flush_logs(wait=False)
            for _ in batches[:-1]:
                t.control = t.callback_handler.on_substep_end(args, t.state, t.control)
            step += len(batches)
            if args.logging_nan_inf_filter and not math.isfinite(loss):
                loss = self.loss_since_log / (1 + t.state.global_step - self.last_logged)
            self.loss_since_log += loss
            tokens = sum(_input_tokens(b, self.main_input) for b in batches)
            self.tokens_since_log += tokens
            self.tokens_total += tokens
            if args.include_num_input_tokens_seen not in (False, "no", None):
                # every rank's, as the Trainer counts them (a collective per step, as its)
                t.state.num_input_tokens_seen += int(self._over_ranks(0.0, tokens)[1])
            t.state.global_step += 1
            t.state.epoch = epoch + (step + 1) / steps_in_epoch
            t.control = t.callback_handler.on_step_end(args, t.state, t.control)
            self._log_save_evaluate(ignore_keys)
            if t.control.should_epoch_stop or t.control.should_training_stop:
                break

    def _step(self, batches: list[dict[str, Any]], num_items: Any) -> float:
        """One optimizer step of the Trainer: the batches in one forward_backward, then the
        step launched ([Note: the Trainer's step]); returns the step's loss (unscaled)."""
        t, model = self.t, self.model
        batch = _join_batches(batches)
        if num_items is not None:
            batch["num_items_in_batch"] = _as_count(num_items)
        run_config = RoundPipeRunConfig(
            num_microbatch=t.num_microbatch or len(batches), device_grad_dtype=t.grad_dtype
        )
        # Over the ranks the token count is the global one: each rank's loss is its share of
        # the global mean times the world size ([Note: the Trainer's data parallelism]).
        factor = 1
        if (
            self.data_parallel is not None
            and num_items is not None
            and t.args.average_tokens_across_devices
        ):
            factor = self.data_parallel.world_size
        scaler = self.scaler
        scale = scaler.get_scale() if scaler is not None else 1.0
        stages: Any = model.module
        head = stages[-1]
        # Each microbatch's rows of token statistics (the head's, [Note: TRL's token metrics]),
        # by microbatch index; written by the workers, read after the call has returned.
        mb_stats: dict[int, torch.Tensor] = {}

        def loss_fn(out: Any, _: Any, mb: Any) -> torch.Tensor:
            if isinstance(out, tuple):
                out, mb_stats[mb.index] = out[0], out[1].detach()
            out = out * factor if factor != 1 else out
            return scaler.scale(out) if scaler is not None else out

        head.token_stats = t._token_metrics
        try:
            loss = model.forward_backward(
                input_kwargs=batch, loss_fn=loss_fn, run_config=run_config
            )
        finally:
            head.token_stats = False
        value = float(loss) / scale
        if t._token_metrics:
            rows = torch.cat([mb_stats[i] for i in sorted(mb_stats)]).cpu()
            sizes = [int(b["input_ids"].shape[0]) for b in batches]
            self.batch_stats.extend(part.sum(dim=0) for part in rows.split(sizes))
            self.attended_since_log += sum(
                int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                for b in batches
            )
        record = _StepRecord()
        self.record = record
        step_fn = self.step_fn
        model.step(lambda: step_fn(record), is_async=t.async_step)
        if scaler is not None:
            scaler.update()
        return value

    # -- logs, evaluation, checkpoints ------------------------------------------------------------
    def _log_save_evaluate(self, ignore_keys: Any) -> None:
        t = self.t
        if t.control.should_log and t.state.global_step > self.last_logged:
            loss, tokens = self._over_ranks(self.loss_since_log, self.tokens_since_log)
            now = time.perf_counter()
            steps = t.state.global_step - self.last_logged
            logs: dict[str, float] = {"loss": loss / steps}
            logs["tokens_per_second"] = tokens / max(now - self.log_clock, 1e-9)
            if self.scaler is not None:
                logs["loss_scale"] = self.scaler.get_scale()
            self.total_loss += loss
            self.loss_since_log = 0.0
            self.tokens_since_log = 0
            self.log_clock = now
            if t._token_metrics:
                logs.update(self._token_metric_logs())
            self.last_logged = t.state.global_step
            t.store_flos()
            self.pending.append(_PendingLog(logs, self.record, t.state.global_step, t.state.epoch))
            if not t.async_step:
                self._flush_logs(wait=True)
        if t.control.should_evaluate:
            self._evaluate(ignore_keys)
        if t.control.should_save:
            self._save()
            t.control = t.callback_handler.on_save(t.args, t.state, t.control)

    def _token_metric_logs(self) -> dict[str, float]:
        """TRL's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` of the batches since
        the last log (see [Note: TRL's token metrics]); every rank at the same log."""
        t = self.t
        sums = torch.stack(self.batch_stats) if self.batch_stats else torch.zeros(0, 3)
        attended = torch.tensor([float(self.attended_since_log)], dtype=torch.float64)
        self.batch_stats = []
        self.attended_since_log = 0
        if self.data_parallel is not None:
            device = t.args.device
            sums = t.accelerator.gather(sums.to(device)[None]).reshape(-1, *sums.shape).sum(0)
            attended = t.accelerator.gather(attended.to(device)).sum().reshape(1)
        sums, attended = sums.cpu(), attended.cpu()
        valid = sums[:, 2]
        ratios = torch.where((valid > 0)[:, None], sums[:, :2] / valid.clamp(min=1)[:, None], 0.0)
        self.attended_total += int(attended.item())
        logs = {"num_tokens": float(self.attended_total)}
        if len(ratios):
            logs["entropy"] = float(ratios[:, 0].mean())
            logs["mean_token_accuracy"] = float(ratios[:, 1].mean())
        return logs

    def _over_ranks(self, loss: float, tokens: int) -> tuple[float, int]:
        """(the mean of ``loss`` over the ranks, the sum of ``tokens``): what the plain Trainer
        logs under torchrun. One gather on the Trainer's process group, on the main thread, at
        the same point on every rank; in one process the values themselves."""
        if self.data_parallel is None:
            return loss, tokens
        local = torch.tensor([loss, float(tokens)], dtype=torch.float64, device=self.t.args.device)
        every = self.t.accelerator.gather(local).reshape(-1, 2).cpu()
        return float(every[:, 0].mean()), int(every[:, 1].sum())

    def _flush_logs(self, wait: bool) -> None:
        """Emit the pending logs whose step has run (``wait``: every pending log, after
        waiting for the launched steps), each under the step it belongs to."""
        t = self.t
        if wait and self.pending:
            optim_thread.synchronize()
        while self.pending and self.pending[0].record.done.is_set():
            entry = self.pending.pop(0)
            logs = dict(entry.logs)
            logs["grad_norm"] = entry.record.grad_norm  # type: ignore[assignment]
            logs["learning_rate"] = entry.record.learning_rate  # type: ignore[assignment]
            if logs["grad_norm"] is None:
                del logs["grad_norm"]
            order = ["loss", "grad_norm", "learning_rate", "tokens_per_second", "loss_scale"]
            order += ["entropy", "mean_token_accuracy", "num_tokens"]
            logs = {k: logs[k] for k in order if k in logs}
            now_step, now_epoch = t.state.global_step, t.state.epoch
            t.state.global_step, t.state.epoch = entry.global_step, entry.epoch
            try:
                t.log(logs)
            finally:
                t.state.global_step, t.state.epoch = now_step, now_epoch

    def _evaluate(self, ignore_keys: Any) -> None:
        # The evaluation sees the newest weights, as the plain Trainer's does; the iteration
        # after it computes with them too.
        self.model.synchronize()
        self._flush_logs(wait=True)
        self.t.evaluate(ignore_keys=ignore_keys)
        self.model.train()

    def _save(self) -> None:
        """A checkpoint ``output_dir/checkpoint-<step>`` through roundpipe.checkpoint, written
        while training goes on; it holds the Trainer's state for resume_from_checkpoint and,
        with ``checkpoint_hf``, the model as ``from_pretrained`` loads it (in the directory
        itself, as transformers' Trainer writes it). A ``checkpoint-<step>`` of an earlier run
        is replaced, as transformers' Trainer overwrites it."""
        t = self.t
        self._flush_logs(wait=True)
        if not t.args.should_save and self.data_parallel is None:
            return  # under data parallelism every rank saves; rank 0 writes
        t.store_flos()
        name = f"checkpoint-{t.state.global_step}"
        t.state.stateful_callbacks = {}
        for cb in t.callback_handler.callbacks + [t.control]:
            if isinstance(cb, transformers.trainer_callback.ExportableState):
                state = cb.state()
                t.state.stateful_callbacks.setdefault(cb.__class__.__name__, []).append(state)
        for key, value in list(t.state.stateful_callbacks.items()):
            if len(value) == 1:
                t.state.stateful_callbacks[key] = value[0]
        trainer_state = json.dumps(dataclasses.asdict(t.state), sort_keys=True)
        limit = t.args.save_total_limit
        _replace_earlier(Path(t.args.output_dir) / name)
        checkpoint.save(
            t.args.output_dir,
            self.model,
            t.optimizer,
            scaler=self.scaler,
            scheduler=t.lr_scheduler,
            extra={"trainer_state": trainer_state},
            name=name,
            keep_last=limit if limit and limit > 0 else None,
            hf=t.checkpoint_hf,
            hf_dir=".",
        )


# [Note: resuming a transformers checkpoint]
# A checkpoint that transformers' Trainer saved (a run started with the plain Trainer, then
# moved to roundpipe) has the model's weights, its TrainerState, the scaler's state in torch's
# format (which roundpipe's GradScaler reads), the scheduler's, and the optimizer's state as a
# state dict over the model's parameters, by their positions in the plain optimizer's groups
# (which keep an empty group that roundpipe's leave out). roundpipe's optimizer steps its fp32
# masters, so that state starts fresh, with a warning that says so. The weights are loaded into
# the model's parameters as transformers loads them (Trainer._load_from_checkpoint, peft
# adapters included) and the masters start from those parameters, in the model's dtype, as at a
# fresh start from the same weights; the TrainerState gives the step, so the data position and
# the logs go on where the plain run stopped, and the learning-rate schedule (a function of the
# step in transformers) is stepped to it. resume_from_checkpoint=True takes the newest
# checkpoint-N of either kind (newest_checkpoint).


def newest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The ``checkpoint-N`` directory of ``output_dir`` with the highest N that is complete:
    roundpipe's (a readable manifest) or transformers' Trainer's (a ``trainer_state.json``, and
    no roundpipe manifest); None if there is none. Any thread; reads the manifests."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    ours = {c.path.name for c in checkpoint_manifest.list_checkpoints(root)}
    found = []
    for child in root.iterdir():
        match = _CHECKPOINT_NAME.fullmatch(child.name)
        if match is None or not child.is_dir():
            continue
        theirs = (
            not (child / MANIFEST).exists()
            and (child / transformers.trainer.TRAINER_STATE_NAME).is_file()
        )
        if child.name in ours or theirs:
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def _replace_earlier(path: Path) -> None:
    """Remove ``path``, a checkpoint of an earlier run under the name the next save takes
    (every rank may try: the first removes it)."""
    if not path.is_dir():
        return
    logger.warning(f"{path} exists (an earlier run's checkpoint): replacing it")
    with contextlib.suppress(FileNotFoundError):
        checkpoint_files.remove_dir(path)


class Trainer(RoundPipeTrainerMixin, transformers.Trainer):
    """transformers' ``Trainer`` on roundpipe: the model stays in host memory in its
    low-precision dtype with fp32 masters, and each step runs through roundpipe's stages and
    optimizer thread. Takes the Trainer's arguments and those of
    :class:`RoundPipeTrainerMixin`; refuses at construction, naming each, the
    TrainingArguments it cannot honour (:func:`unsupported_arguments`). See docs/hf.md."""
