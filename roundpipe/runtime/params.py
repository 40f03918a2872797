"""Parameters and their masters: one :class:`ParamRecord` per parameter of the wrapped model (its
name, the model's low-precision parameter, its fp32 master), the master->model copy with its
per-layer "params ready" events (:class:`ParamsReady`; see [Note: staleness] in
:mod:`roundpipe.runtime.model`), and the state dict helpers.

Threads: see each class.

Threads: the records and ``masters`` are fixed at construction (any thread reads them); the
masters' values and ``.grad`` belong to the optimizer thread; ``Params.ready`` is replaced,
never mutated, by the main thread; the model parameters are written by the copy, on the
optimizer thread, and read by the workers after the events.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from roundpipe.devices.pinned import PinnedAllocator
from roundpipe.memory.host import master_dtype_of
from roundpipe.runtime.grad_access import MasterParameter, guard_wrapped_params
from roundpipe.runtime.placement import MasterPlacement
from roundpipe.runtime.step_copy import StepCopies
from roundpipe.threads import optimizer_thread

__all__ = [
    "ParamRecord",
    "ParamsCopyFailed",
    "ParamsReady",
    "Params",
    "StateAccess",
    "check_state_dict",
    "raise_copy_failure",
]


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """One parameter of the wrapped model, each once, named as ``named_parameters()`` names it.
    ``master``: its master copy in ``optim_dtype``, None if it was frozen at wrap time."""

    name: str
    param: nn.Parameter
    master: nn.Parameter | None
    #: whether this process holds the master; else ``master`` is a stand-in that only collects
    #: this process's gradient (see [Note: state placement] in roundpipe.runtime.placement)
    held: bool = True


class ParamsCopyFailed(Exception):
    """A worker found the master->model copy of its stage failed; resolved on the main thread."""

    def __init__(self, ready: ParamsReady) -> None:
        super().__init__("master->model parameter copy failed")
        self.ready = ready


class ParamsReady:
    """Per-layer "params ready" events of one master->model copy.

    Written by the optimizer thread (``error``, ``failed_from``, then the events); read by workers
    and the main thread after waiting on an event. ``item`` is set by the main thread at launch.
    """

    def __init__(self, num_layers: int, done: bool = False) -> None:
        self._events = [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None
        self.failed_from = num_layers
        self.item: Any = None
        if done:
            for e in self._events:
                e.set()

    def set(self, layer: int) -> None:
        self._events[layer].set()

    def fail(self, layer: int, exc: BaseException) -> None:
        self.error, self.failed_from = exc, layer
        for e in self._events[layer:]:
            e.set()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s params are ready; raise if their copy failed."""
        self._events[layer].wait()
        if layer >= self.failed_from:
            raise ParamsCopyFailed(self)

    def is_set(self, layer: int) -> bool:
        """Whether ``layer``'s params are ready (their copy done and not failed). Never
        blocks."""
        return self._events[layer].is_set() and layer < self.failed_from

    def wait_all(self) -> None:
        for layer in range(len(self._events)):
            self.wait(layer)

    def failed(self) -> bool:
        return all(e.is_set() for e in self._events) and self.error is not None


class Params:
    """The wrapped model's parameter records, the masters this process holds (by name, in
    ``named_parameters()`` order; all of them unless the placement shards them), every
    gradient target (``grad_targets``: the masters and the stand-ins of the masters other
    processes hold), and the master->model copy (``layer_copies``: per layer, the (param,
    master, held) triples it copies, each param once, in its first layer), run through the
    ``placement`` (see [Note: state placement] in roundpipe.runtime.placement)."""

    def __init__(
        self,
        module: nn.Module,
        layer_modules: Sequence[nn.Module],
        optim_dtype: torch.dtype | None,
        owner: Any = None,
        placement: MasterPlacement | None = None,
        pinned: PinnedAllocator | None = None,
    ) -> None:
        # The model whose work this launches (see [Note: error reporting] in roundpipe.threads.optimizer_thread).
        self.owner = owner
        self.placement = placement if placement is not None else MasterPlacement()
        named = list(module.named_parameters())
        trainable = [p for _, p in named if p.requires_grad]
        dtypes = [master_dtype_of(p, optim_dtype) for p in trainable]
        held = self.placement.assign(
            trainable, [p.numel() * dtype.itemsize for p, dtype in zip(trainable, dtypes)]
        )
        made = iter(
            self.placement.make_masters(
                [(p, dtype) for p, dtype, mine in zip(trainable, dtypes, held) if mine]
            )
        )
        standins = {id(p): dtype for p, dtype, mine in zip(trainable, dtypes, held) if not mine}
        self.records: list[ParamRecord] = []
        for name, p in named:
            master, mine = None, True
            if p.requires_grad:
                dtype = standins.get(id(p))
                mine = dtype is None
                if mine:
                    master = next(made)
                else:  # one element of storage: it only collects this process's gradient
                    master = MasterParameter(torch.zeros((), dtype=dtype).expand(p.shape))
            self.records.append(ParamRecord(name, p, master, mine))
        self._by_param = {id(r.param): r for r in self.records}
        self.masters: dict[str, nn.Parameter] = {
            r.name: r.master for r in self.records if r.master is not None and r.held
        }
        self.grad_targets: list[nn.Parameter] = [
            r.master for r in self.records if r.master is not None
        ]
        self.cast_dtype = low_precision_dtype(module)
        seen: set = set()
        self.layer_copies: list[list[tuple[nn.Parameter, nn.Parameter, bool]]] = []
        for layer in layer_modules:
            pairs = []
            for rec in self.records_of(layer):
                if rec.master is not None and rec not in seen:
                    seen.add(rec)
                    pairs.append((rec.param, rec.master, rec.held))
            self.layer_copies.append(pairs)
        self.ready = ParamsReady(len(self.layer_copies), done=True)
        #: what a one-pass step writes instead of the copy (see [Note: the copy in the step])
        self.step_copies = StepCopies(
            [(r.param, r.master) for r in self.records if r.master is not None and r.held],
            pinned,
        )
        guard_wrapped_params(self, [r.param for r in self.records if r.master is not None])

    def record_of(self, param: Any) -> ParamRecord | None:
        """The record of a model parameter; None for any other tensor. Any thread."""
        rec = self._by_param.get(id(param))
        return rec if rec is not None and rec.param is param else None

    def records_of(self, module: nn.Module) -> list[ParamRecord]:
        """The records of ``module``'s parameters (a layer of the wrapped model), each once."""
        return [self._by_param[id(p)] for p in module.parameters()]

    # -- the master->model copy (see [Note: staleness] in model.py) -------------------------------
    def launch_copy(self) -> ParamsReady:
        """Main thread: launch the copy on the optimizer thread; its events become ``ready``."""
        ready = ParamsReady(len(self.layer_copies))
        ready.item = self.launch(self.copy_masters_to_model, ready, touches=("params",))
        self.ready = ready
        return ready

    def launch(self, fn: Any, *args: Any, touches: Sequence[str]) -> optimizer_thread.WorkItem:
        """Any thread: launch library work of this model that changes ``touches`` (see
        [Note: holds] in :mod:`roundpipe.threads.optimizer_thread`)."""
        return optimizer_thread.launch_work(fn, args, owners=(self.owner,), touches=touches)

    def synchronize(self) -> None:
        """Main thread: wait for everything launched, then raise this model's failures."""
        optimizer_thread.wait_all()
        optimizer_thread.raise_failures(self.owner)

    def copy_masters_to_model(self, ready: ParamsReady) -> None:
        """Optimizer thread: masters -> low-precision params, layer by layer; what the last
        step wrote already is swapped in or kept (see [Note: the copy in the step])."""
        layer = 0
        try:
            for layer, pairs in enumerate(self.layer_copies):
                self.placement.copy_layer(pairs, self.step_copies.install(pairs))
                ready.set(layer)
        except BaseException as exc:  # noqa: B036 -- published to the workers, then re-raised
            ready.fail(layer, exc)
            raise

    def wait_ready(self) -> None:
        """Main thread: block until the last copy is done; raise if it failed."""
        try:
            self.ready.wait_all()
        except ParamsCopyFailed as exc:
            raise_copy_failure(exc.ready)

    # -- state dicts ---------------------------------------------------------------------------
    def refresh_masters(self) -> None:
        """Main thread: the model params' values into the masters; blocks until done."""
        pairs = [(m, p) for layer in self.layer_copies for p, m, held in layer if held]
        self.launch(self._write_masters, pairs, touches=("masters",)).wait()

    def load_masters(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Main thread: copy ``state_dict`` into the masters in place, after everything launched
        before; blocks until done. Raises ``ValueError`` if the names or shapes differ."""
        missing = sorted(set(self.masters) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.masters))
        if missing or unexpected:
            raise ValueError(
                f"master state dict does not match the masters: missing "
                f"{missing}, unexpected {unexpected}"
            )
        pairs = []
        for n, m in self.masters.items():
            v = state_dict[n]
            if tuple(v.shape) != tuple(m.shape):
                raise ValueError(
                    f"master {n!r} has shape {tuple(m.shape)}, the state dict "
                    f"gives {tuple(v.shape)}"
                )
            pairs.append((m, v))
        self.synchronize()
        self.launch(self._write_masters, pairs, touches=("masters",)).wait()

    def _write_masters(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Optimizer thread: ``(master, value)`` pairs copied, then the placement told."""
        try:
            copy_pairs(pairs)
        finally:
            self.placement.release()


@dataclasses.dataclass(frozen=True)
class StateAccess:
    """What :mod:`roundpipe.checkpoint` reads and restores of a model, without reaching into
    it: the wrapped module, the parameter records and masters (``params``), the device
    backends (their generators), and the model's main-thread flag "gradients accumulated since
    the last step" (``pending_grads``/``set_pending_grads``). Made by
    :meth:`roundpipe.RoundPipe.state_access`; main thread."""

    module: nn.Module
    params: Params
    backends: Sequence[Any]
    owner: Any
    pending_grads: Callable[[], bool]
    set_pending_grads: Callable[[bool], None]


def check_state_dict(module: nn.Module, state_dict: Any, strict: bool) -> None:
    """Main thread, before ``module.load_state_dict(state_dict, strict)`` changes anything:
    raise what torch would raise part way through (after copying the tensors that match),
    now, so that a refused load leaves the model and its masters as they were. Checked: a
    mapping; with ``strict``, missing and unexpected keys; for every key the module has, a
    tensor of its shape (torch takes a one-element 1-d tensor for a 0-d one)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    expected = module.state_dict(keep_vars=True)
    errors = []
    if strict:
        unexpected = [k for k in state_dict if k not in expected and k != "_metadata"]
        missing = [k for k in expected if k not in state_dict]
        if unexpected:
            errors.append(
                "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected)
            )
        if missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
    for key, current in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            errors.append(
                f'While copying the parameter named "{key}", expected torch.Tensor or '
                f"Tensor-like object from checkpoint but received {type(value)}"
            )
            continue
        shape = tuple(value.shape)
        if current.dim() == 0 and shape == (1,):
            continue
        if shape != tuple(current.shape):
            errors.append(
                f"size mismatch for {key}: copying a param with shape {torch.Size(shape)} from "
                f"checkpoint, the shape in current model is {current.shape}."
            )
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__} (nothing was loaded: "
            f"the model and its masters are unchanged):\n\t" + "\n\t".join(errors)
        )


def raise_copy_failure(ready: ParamsReady) -> None:
    """Main thread: report a failed master->model copy (its error was reported earlier). With
    it, the failures of the work launched so far that it caused (the step launched behind it,
    whose collectives a broken data-parallel group refuses), as notes of one report."""
    item = ready.item
    if item is not None:
        if item.wait(report=False):
            raise AssertionError("params copy reported failed but succeeded; please report")
        optimizer_thread.wait_all()
        optimizer_thread.raise_failures(item.owners[0] if item.owners else None)
    raise RuntimeError(
        "copying the masters into the model parameters failed (reported earlier); the model "
        "parameters may be partly updated: call model.synchronize() to copy them again"
    )


def low_precision_dtype(module: nn.Module) -> torch.dtype | None:
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) == 1 and next(iter(dtypes)) in (torch.float16, torch.bfloat16):
        return next(iter(dtypes))
    return None


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
