"""What a checkpoint holds, where each part is taken, and how it is put back.

See [Note: a consistent checkpoint] for the order; :mod:`roundpipe.checkpoint.writer` writes
what :func:`take_on_main_thread` and :meth:`Capture.complete` take, and
:mod:`roundpipe.checkpoint.reader` puts it back with :func:`restore_on_optimizer_thread` and
:func:`restore_on_main_thread`.

Threads: :func:`take_on_main_thread` and :func:`restore_on_main_thread` on the main thread;
:meth:`Capture.complete` and :func:`restore_on_optimizer_thread` on the optimizer thread, in
launch order.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from roundpipe.checkpoint import named
from roundpipe.checkpoint.files import CheckpointFormatError, encode, pack
from roundpipe.runtime.grad_router import grad_dtype_of
from roundpipe.runtime.params import StateAccess

__all__ = [
    "Capture",
    "Completed",
    "take_on_main_thread",
    "model_description",
    "rng_state",
    "restore_rng",
    "restore_on_optimizer_thread",
    "restore_on_main_thread",
    "check_components",
    "check_model",
    "check_optimizer",
    "check_state_kind",
    "refuse",
    "GROUPS",
    "TOUCHES",
]


# [Note: a consistent checkpoint]
# ``save()`` may be called anywhere in the loop, with steps still running on the optimizer
# thread. The checkpoint is the state the loop's next call would see, which is not all in one
# place at the moment of the call:
#   * on the main thread, at the call: the RNG states (the next forward draws from them), the
#     user's ``extra``, the model's buffers (only forwards change them, and none runs now: they
#     are copied, they are small), the scaler's front scale (what the next iteration multiplies
#     by), and whether gradients were accumulated since the last step;
#   * on the optimizer thread, in launch order behind every step, master->model copy and
#     scaler update launched before the call (a work item, ``Capture.complete``): the masters,
#     the model's low-precision parameters (the copy launched with the last step has run: they
#     are what the next iteration computes with), the masters' gradients, the optimizer's and
#     the scheduler's state, the scaler's back side.
# The item takes no copy: it holds (optimizer_thread.hold) the parts the writer thread still has to
# write, "grads", "params", "masters", "optimizer", released one by one as their files are
# written. Until then a later item that would change one of them (the next step, the next
# master->model copy) waits on the optimizer thread, while the main thread computes on; a
# gradient move passes unless the gradients are part of the checkpoint (a save between
# forward_backward and step). A save between model.step() and scaler.update() is refused: the
# scaler would hold half an iteration.
# A model that is not trained yet (no step launched) and the plain state dicts are the same
# rule: whatever has been launched has run when the item runs.

# [Note: sharded checkpoints]
# With sharded state (a placement over several ranks: roundpipe.distributed.ShardedState) the
# masters, their gradients and the optimizer state of a parameter exist on its owner only. Every
# rank's save work item takes its own share (``Capture.complete``), and every rank's writer
# thread writes it into the one temporary directory of the checkpoint (rank 0's name, learnt in
# the save's all-gather), in files of its own (``masters-rank00001-...``); rank 0 also writes
# what is replicated (the model's parameters and buffers, the scaler, the scheduler, every
# rank's RNG state and ``extra``, as a replicated data-parallel checkpoint). Each rank then posts
# its files' sizes, checksums and tensor index to rank 0 (see [Note: messages to rank 0] in
# roundpipe.distributed.exchange); rank 0 waits for all of them, writes the manifest (its world size,
# every file, and the file of every tensor) and renames the directory: as in one process, a
# checkpoint that has its name is complete, and a rank that fails or dies leaves no manifest.
# The optimizer state is stored by master name (roundpipe.checkpoint.named), not by the
# rank-local numbers of optimizer.state_dict(); a replicated checkpoint records the name of
# each number (``optimizer_params``). So a checkpoint of N ranks loads on M: each rank reads
# the masters and the optimizer state of the parameters it holds now, from whichever files
# hold them, and the replicated parts as from a replicated checkpoint. A sharded save between
# forward_backward and step is refused: the gradients are then every rank's own, unreduced.

# The groups of shards, in the order they are written (the parts they hold are released in
# that order; gradients first, so that the next forward_backward's gradient moves can pass).
GROUPS = ("grads", "model", "masters", "optimizer")
# The part of the state each group holds (see [Note: holds] in roundpipe.threads.optimizer_thread).
TOUCHES = {"grads": "grads", "model": "params", "masters": "masters", "optimizer": "optimizer"}


@dataclasses.dataclass
class Completed:
    """The state as the optimizer thread sees it in launch order: the tensors of each group
    (key -> live tensor, or a copy for buffers), the encoded non-tensor state, and every
    rank's per-rank file (None on a data-parallel rank other than 0, which writes nothing)."""

    groups: dict[str, list[tuple[str, torch.Tensor]]]
    tree: dict[str, Any]
    rank_files: list[bytes] | None


@dataclasses.dataclass
class Capture:
    """What ``save()`` took on the main thread (see [Note: a consistent checkpoint])."""

    access: StateAccess
    model_tensors: list[tuple[str, torch.Tensor]]
    description: dict[str, Any]
    pending_grads: bool
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler_state: Callable[[], dict[str, Any]] | None
    rank_file: bytes
    #: this rank, when the state is sharded over ranks (see [Note: sharded checkpoints])
    shard_rank: int | None = None

    def complete(self, gather: Callable[[bytes], list[bytes] | None]) -> Completed:
        """Optimizer thread, in launch order: the rest of the state (live tensors, no copy)
        and every rank's file (``gather``: the data-parallel collective)."""
        params = self.access.params
        if params.ready.failed():
            raise RuntimeError(
                "the master->model parameter copy launched before this checkpoint failed (it "
                "was reported): the model's parameters are partly updated. Call "
                "model.synchronize(), then save again"
            )
        masters = list(params.masters.items())
        # Sharded, rank 0 writes what is replicated; every rank its own masters and state.
        replicated = self.shard_rank in (None, 0)
        groups: dict[str, list[tuple[str, torch.Tensor]]] = {g: [] for g in GROUPS}
        # A parameter's data as it is now, in launch order: the master->model copy launched
        # before this save may have swapped the step's next weights in since save() ran (see
        # [Note: the copy in the step] in roundpipe.runtime.step_copy), and the storage
        # save() saw is then the one the step launched before the save writes.
        groups["model"] = [(k, t.detach()) for k, t in self.model_tensors] if replicated else []
        groups["masters"] = [(f"masters/{n}", m.detach()) for n, m in masters]
        groups["grads"] = [
            (f"grads/{n}", m.grad.detach()) for n, m in masters if m.grad is not None
        ]
        tree: dict[str, Any] = {
            "pending_grads": self.pending_grads,
            "grad_names": [n for n, m in masters if m.grad is not None],
        }
        tensors: dict[str, torch.Tensor] = {}
        if self.optimizer is not None:
            state = self.optimizer.state_dict()
            names = named.param_names(self.optimizer, params.masters)
            if self.shard_rank is None:
                tree["optimizer"] = encode(state, tensors, "optimizer", "optimizer.state_dict()")
                tree["optimizer_params"] = names
            else:
                tree["optimizer_by_name"] = encode(
                    named.by_name(state, names), tensors, "optimizer", "optimizer.state_dict()"
                )
        if self.scheduler is not None and replicated:
            tree["scheduler"] = encode(
                self.scheduler.state_dict(), tensors, "scheduler", "scheduler.state_dict()"
            )
        if self.scaler_state is not None and replicated:
            tree["scaler"] = encode(self.scaler_state(), tensors, "scaler", "scaler.state_dict()")
        groups["optimizer"] = list(tensors.items())
        return Completed(groups, tree, gather(self.rank_file))


def model_description(
    access: StateAccess, copy_buffers: bool = True
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """The model's tensors to write (``model/NAME``: a parameter itself, read when the
    checkpoint completes; a buffer's copy; none without ``copy_buffers``; a tensor under several
    names once) and its description for the
    manifest: every name with its dtype and shape, the aliases, the masters. Main thread."""
    tensors: list[tuple[str, torch.Tensor]] = []
    entries: list[list[Any]] = []
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in access.module.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        is_param = isinstance(t, nn.Parameter)
        if is_param or copy_buffers:
            tensors.append((f"model/{name}", t if is_param else t.detach().clone()))
        entries.append([name, _dtype(t), list(t.shape), "param" if is_param else "buffer"])
    # Every master, held here or not (a stand-in has the master's dtype and shape).
    masters = [
        [r.name, _dtype(r.master), list(r.master.shape)]
        for r in access.params.records
        if r.master is not None
    ]
    return tensors, {"tensors": entries, "aliases": aliases, "masters": masters}


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def rng_state(backends: Sequence[Any]) -> dict[str, Any]:
    """Every generator the run draws from: torch's CPU generator (dropout, the microbatch
    seeds), each device's (None on a CPU pool), Python's ``random`` and, if numpy is imported,
    numpy's global one. Main thread."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "devices": [b.get_rng_state() for b in backends],
        "python": random.getstate(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return state


def restore_rng(state: dict[str, Any], backends: Sequence[Any]) -> None:
    """Put back what :func:`rng_state` took. Main thread."""
    torch.set_rng_state(state["torch"])
    for backend, device_state in zip(backends, state["devices"]):
        backend.set_rng_state(device_state)
    random.setstate(_tuples(state["python"]))
    saved = state.get("numpy")
    if saved is not None:
        import numpy  # the saved run had imported it: so will the resumed one

        kind, keys, pos, has_gauss, gauss = saved
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def take_on_main_thread(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    rank: int,
    world: int = 1,
) -> Capture:
    """What the main thread takes at ``save()`` (see [Note: a consistent checkpoint]); raises
    ``TypeError`` for an ``extra`` a checkpoint cannot hold and ``RuntimeError`` between a step
    and ``scaler.update()``, or, over several data-parallel ranks, between ``forward_backward``
    and the step, before anything is launched."""
    access = model.state_access()
    shard_rank = rank if access.params.placement.world_size > 1 else None
    if (shard_rank is not None or world > 1) and access.pending_grads():
        # Each rank's accumulated gradients are its own until the step averages (or sums onto
        # their owners) them: one rank's copy restored on every rank would train on its data
        # alone for that step.
        what = "with ShardedState" if shard_rank is not None else f"over {world} ranks"
        raise RuntimeError(
            f"a checkpoint of a data-parallel model ({what}) cannot be taken between "
            f"forward_backward and step: each rank's gradients are then its own, not yet "
            f"averaged over the ranks. Save after model.step() and scaler.update()"
        )
    scaler_state = None
    if scaler is not None:
        if not callable(getattr(scaler, "state_dict_in_order", None)):
            raise TypeError(
                f"scaler= takes a roundpipe.GradScaler, got {type(scaler).__module__}."
                f"{type(scaler).__qualname__}"
            )
        scaler_state = scaler.state_dict_in_order()
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra= takes a dict (e.g. the data position), got {type(extra).__name__}")
    rank_tensors: dict[str, torch.Tensor] = {}
    rank_tree = {
        "rng": encode(rng_state(access.backends), rank_tensors, "rng", "the RNG state"),
        "extra": encode(extra or {}, rank_tensors, "extra", "extra"),
    }
    rank_file = pack(
        [(k, t.detach().cpu().contiguous()) for k, t in rank_tensors.items()],
        {"roundpipe_rank": str(rank), "state": json.dumps(rank_tree)},
    )
    model_tensors, description = model_description(access)
    description["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    return Capture(
        access=access,
        model_tensors=model_tensors,
        description=description,
        pending_grads=access.pending_grads(),
        optimizer=optimizer,
        scheduler=scheduler,
        scaler_state=scaler_state,
        rank_file=rank_file,
        shard_rank=shard_rank,
    )


def restore_on_optimizer_thread(
    access: StateAccess,
    read: Callable[[str, torch.Tensor], None],
    description: dict[str, Any],
    grads: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    optimizer_state: Any,
    scheduler: Any,
    scheduler_state: Any,
) -> None:
    """Optimizer thread, behind every launched item and every checkpoint write (it touches
    everything): the model's tensors and the masters read in place (``read(key, into)``), the
    gradients (read before, new tensors) set, the optimizer's and the scheduler's state
    loaded."""
    targets = access.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, *_ in description["tensors"]:
            read(f"model/{name}", targets[name].detach())
        for name, master in access.params.masters.items():
            read(f"masters/{name}", master.detach())
            access.params.placement.release()  # masters in files: out of RAM one by one
    for name, master in access.params.masters.items():
        grad = grads.get(name)
        if grad is not None and grad.dtype != grad_dtype_of(master):
            grad = grad.to(grad_dtype_of(master))  # saved before or after Adam(grad_dtype=...)
        master.grad = grad
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None and scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)


def restore_on_main_thread(
    access: StateAccess,
    scaler: Any,
    scaler_state: Any,
    rng: dict[str, Any],
    pending_grads: bool,
) -> None:
    """Main thread, after :func:`restore_on_optimizer_thread`: the scaler (its
    ``load_state_dict`` waits for the optimizer thread), the RNG states, the pending-gradients
    flag."""
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    restore_rng(rng, access.backends)
    access.set_pending_grads(pending_grads)


def check_components(
    tree: dict[str, Any], optimizer: Any, scheduler: Any, scaler: Any, where: str
) -> list[str]:
    """What differs between the parts in the checkpoint and the parts given to ``load``."""
    problems = []
    for part, given in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        saved = part in tree or (part == "optimizer" and "optimizer_by_name" in tree)
        if saved and given is None:
            problems.append(
                f"{where} holds a {part} state but load() was given no {part}= (pass it, or "
                f"strict=False to leave it out)"
            )
        elif given is not None and not saved:
            problems.append(
                f"{where} holds no {part} state but load() was given a {part} (it was saved "
                f"without one; pass {part}=None, or strict=False to keep yours as it is)"
            )
    return problems


def check_model(description: dict[str, Any], access: StateAccess, where: str) -> list[str]:
    """What differs between the model described in the manifest and ``access``'s model."""
    problems = []
    _, here = model_description(access, copy_buffers=False)
    for kind, saved_rows, live_rows in (
        ("tensor", description["tensors"], here["tensors"]),
        ("master", description["masters"], here["masters"]),
    ):
        saved = {row[0]: row for row in saved_rows}
        live = {row[0]: row for row in live_rows}
        missing = [n for n in live if n not in saved]
        unexpected = [n for n in saved if n not in live]
        if missing:
            problems.append(f"{where} lacks the model's {kind}s {_names(missing)}")
        if unexpected:
            problems.append(f"{where} has {kind}s this model has not: {_names(unexpected)}")
        for name in saved.keys() & live.keys():
            s, l_ = saved[name], live[name]
            if s[1] != l_[1] or list(s[2]) != list(l_[2]):
                problems.append(
                    f"{kind} {name!r} is {s[1]} {tuple(s[2])} in {where}, {l_[1]} {tuple(l_[2])} "
                    f"in this model"
                )
    if description.get("aliases", {}) != here["aliases"]:
        problems.append(
            f"the model's tied parameters differ: {description.get('aliases')} in {where}, "
            f"{here['aliases']} here"
        )
    return problems


def check_optimizer(
    tree: dict[str, Any], optimizer: Any, decode: Callable, where: str
) -> list[str]:
    """Whether the saved optimizer state fits ``optimizer``: as many param groups, each with
    as many parameters, and state only for parameters that exist."""
    if optimizer is None or "optimizer" not in tree:
        return []
    saved = decode(tree["optimizer"], lambda key: None)
    groups = saved.get("param_groups", [])
    live = optimizer.param_groups
    if len(groups) != len(live):
        return [f"the optimizer has {len(live)} param groups here, {len(groups)} in {where}"]
    problems = []
    for i, (g, h) in enumerate(zip(groups, live)):
        if len(g["params"]) != len(h["params"]):
            problems.append(
                f"optimizer param group {i} has {len(h['params'])} parameters here, "
                f"{len(g['params'])} in {where}"
            )
    ids = {p for g in groups for p in g["params"]}
    stray = [k for k in saved.get("state", {}) if k not in ids]
    if stray:
        problems.append(
            f"the optimizer state in {where} is for parameters {stray[:5]} it does not list"
        )
    return problems + check_state_kind(saved, optimizer, where)


def check_state_kind(saved: dict[str, Any], optimizer: Any, where: str) -> list[str]:
    """Adam's moments saved of one kind (exact, bf16, 8-bit: ``roundpipe.optim.AdamW
    (state_dtype=...)``) and an optimizer of another: the problem, named."""
    from roundpipe.optim.adam import state_kind_mismatch

    problem = state_kind_mismatch(saved, optimizer)
    return [] if problem is None else [f"the optimizer state in {where}: {problem}"]


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def refuse(problems: list[str], where: str) -> None:
    """Raise :class:`CheckpointFormatError` listing ``problems`` (none: return)."""
    if problems:
        raise CheckpointFormatError(
            f"cannot load {where}; nothing was changed:\n  " + "\n  ".join(problems)
        )
