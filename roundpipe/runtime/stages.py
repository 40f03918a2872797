"""The wrapped model's layers and stages, and the plans a call runs.

* :func:`model_layers`: the layers of a wrapped model (an ``nn.Sequential``'s children, else the
  model as one layer, with a warning that says how to make stages).
* :class:`Stage`: consecutive layers, their parameter records, and what the stage holds on an
  accelerator while it runs.
* :class:`ModelStages`: a model's stages per partition and its plans, cached; a plan of an
  accelerator pool is lowered with the sizes of its stages and of their saved inputs
  (:func:`probe_input_bytes`).

Main thread, except :meth:`Stage.device_bytes` (any thread).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from roundpipe.devices.pinned import module_tensors
from roundpipe.microbatch_context import WithContext
from roundpipe.plan import Plan, PlanSizes, build_plan
from roundpipe.runtime.grad_access import internal_grad_reads
from roundpipe.runtime.params import ParamRecord, Params

__all__ = ["Layer", "Stage", "ModelStages", "model_layers", "probe_input_bytes"]


# How many plans a model keeps (per partition, microbatch count, mode and sizes).
_PLANS_KEPT = 32

# Model classes already warned about by _warn_single_stage (each once per process).
_WARNED_SINGLE_STAGE: set = set()


def _warn_single_stage(model: nn.Module) -> None:
    """A model with submodules that is not an nn.Sequential runs as one stage: say so, once per
    model class, with how to make stages. A leaf module (no submodules) is one layer anyway."""
    cls = type(model)
    if cls in _WARNED_SINGLE_STAGE or next(model.children(), None) is None:
        return
    _WARNED_SINGLE_STAGE.add(cls)
    warnings.warn(
        f"RoundPipe runs a {cls.__name__}, which is not an nn.Sequential, as a single stage: it "
        f"is not split over the device pool, each microbatch runs the whole model on one device, "
        f"and recompute re-runs all of it. To make stages, wrap an nn.Sequential whose children "
        f"each take the previous child's output, e.g. nn.Sequential(embedding, *blocks, head) for "
        f'a GPT-style model (docs/devices.md, "A model that is not an nn.Sequential"). To '
        f"keep one stage and silence this warning, wrap nn.Sequential(model).",
        UserWarning,
        stacklevel=4,
    )  # the caller of RoundPipe()


@dataclasses.dataclass
class Layer:
    """One layer of the wrapped model. ``takes_context``: called ``layer(x, context)`` (see
    :mod:`roundpipe.microbatch_context`). ``compiled``: what a run calls instead of ``module`` (the memory
    plan's traces call ``module``)."""

    index: int
    name: str
    module: nn.Module
    takes_context: bool = False
    # ``compiled_layer(module)`` where the model compiles its layers: the runtime calls it in
    # place of the module (see [Note: compiled layers] in roundpipe/runtime/compiled.py).
    compiled: Callable[..., Any] | None = None

    def describe(self) -> str:
        kind = type(self.module).__name__
        return (
            f"layer {self.index} ({kind})"
            if self.name == str(self.index)
            else f"layer {self.index} {self.name!r} ({kind})"
        )


class Stage:
    """Consecutive layers; ``params``: the records of those layers' params, each once;
    ``trainable``: those with a master (the ones a training call computes gradients for)."""

    def __init__(self, index: int, layers: list[Layer], params: Params) -> None:
        self.index = index
        self.layers = layers
        self.modules = [layer.module for layer in layers]
        seen: set = set()
        self.params: list[ParamRecord] = []
        for layer in layers:
            for rec in params.records_of(layer.module):
                if rec not in seen:
                    seen.add(rec)
                    self.params.append(rec)
        # What the stage holds on an accelerator while it runs: its upload (parameters and
        # buffers, each once, a packed weight with its quantization state) and its gradient
        # sums (see device_bytes).
        tensors = {id(t): t for m in self.modules for t in module_tensors(m)}
        self.upload_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        masters = [rec.master for rec in self.params if rec.master is not None]
        self._grad_numel = sum(m.numel() for m in masters)
        self.grad_bytes = sum(m.numel() * m.element_size() for m in masters)

    def device_bytes(self, grad_dtype: torch.dtype | None = None) -> int:
        """The stage's upload plus its gradient sums, in ``grad_dtype`` (None: the masters')."""
        return self.upload_bytes + self.grad_sum_bytes(grad_dtype)

    def grad_sum_bytes(self, grad_dtype: torch.dtype | None = None) -> int:
        return self.grad_bytes if grad_dtype is None else self._grad_numel * grad_dtype.itemsize


def model_layers(model: nn.Module) -> list[Layer]:
    """The layers of a wrapped model: an ``nn.Sequential``'s children, else the model itself."""
    if isinstance(model, nn.Sequential):
        children = list(model.named_children())
        if not children:
            raise ValueError("cannot wrap an empty nn.Sequential")
    else:
        children = [("0", model)]
        _warn_single_stage(model)
    return [
        Layer(i, n, m, bool(getattr(m, "takes_context", False)))
        for i, (n, m) in enumerate(children)
    ]


def _shares_params(stages: list[Stage]) -> bool:
    """Whether a parameter belongs to two stages (tied weights across stages)."""
    records = [rec for stage in stages for rec in stage.params]
    return len(records) != len(set(records))


class ModelStages:
    """A model's stages, per partition, and its plans, cached. Main thread."""

    def __init__(self, layers: list[Layer], params: Params) -> None:
        self.layers = layers
        self._params = params
        self._stage_cache: dict[tuple[tuple[int, int], ...], list[Stage]] = {}
        self._shared: dict[int, bool] = {}  # id(stage list) -> _shares_params
        # The newest plans, least recently used first (an "auto" budget changes per call).
        self._plan_cache: OrderedDict[tuple, Plan] = OrderedDict()

    def stages(self, bounds: tuple[tuple[int, int], ...]) -> list[Stage]:
        """The stages of a partition, ``(first, end)`` layer bounds per stage."""
        stages = self._stage_cache.get(bounds)
        if stages is None:
            stages = [Stage(s, self.layers[a:b], self._params) for s, (a, b) in enumerate(bounds)]
            self._stage_cache[bounds] = stages
            self._shared[id(stages)] = _shares_params(stages)
        return stages

    def plan(
        self,
        stages: list[Stage],
        num_microbatch: int,
        num_devices: int,
        streaming: bool,
        training: bool,
        recompute: bool,
        sizes: PlanSizes | None = None,
        overlap_recompute: bool = False,
    ) -> Plan:
        """The plan of a call. An accelerator pool streams stage by stage (see
        [Note: streaming]), lowered with ``sizes``; one CPU worker fuses each microbatch's
        stages (see [Note: fused stages] in :mod:`roundpipe.runtime.stage_ops`)."""
        fuse = training and not streaming and num_devices == 1 and not self._shared[id(stages)]
        key = (
            id(stages),
            num_microbatch,
            num_devices,
            training,
            fuse,
            streaming,
            recompute,
            sizes,
            overlap_recompute,
        )
        plan = self._plan_cache.get(key)
        if plan is None:
            plan = self._plan_cache[key] = build_plan(
                len(stages),
                num_microbatch,
                num_devices,
                training,
                fuse,
                stage_major=streaming,
                recompute=recompute,
                sizes=sizes,
                overlap_recompute=overlap_recompute,
            )
            if len(self._plan_cache) > _PLANS_KEPT:
                self._plan_cache.popitem(last=False)
        else:
            self._plan_cache.move_to_end(key)
        return plan


def probe_input_bytes(
    stages: Sequence[Stage],
    chunks: Sequence[tuple[tuple, dict]],
    cast_dtype: torch.dtype | None,
    autocast: torch.dtype | None,
) -> tuple[tuple[int, ...], ...] | None:
    """Per stage and microbatch, the bytes of the stage's input on a device: each microbatch's
    inputs as stage 0 gets them, and the output of the stage before, found by running the
    layers on fake tensors (shapes only, no compute, under ``autocast`` if given). None if a
    layer cannot run on fake tensors (an output whose shape depends on the data). Main thread;
    microbatches of the same shapes are probed once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def nbytes(tree: Any) -> int:
        return sum(
            x.numel() * x.element_size()
            for x in pytree.tree_leaves(tree)
            if isinstance(x, torch.Tensor)
        )

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and cast_dtype is not None and x.is_floating_point():
            return x.to(cast_dtype)
        return x

    per_shape: dict[Any, tuple[int, ...]] = {}
    rows: list[tuple[int, ...]] = []
    for chunk in chunks:
        leaves, spec = pytree.tree_flatten(chunk)
        key = (
            spec,
            tuple(
                (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                for x in leaves
            ),
        )
        if key not in per_shape:
            try:
                per_shape[key] = _probe_one(
                    stages, pytree.tree_map(cast, chunk), autocast, FakeTensorMode, nbytes
                )
            except Exception:  # noqa: BLE001 -- a layer fake tensors cannot run: sizes unknown
                return None
        rows.append(per_shape[key])
    return tuple(tuple(row[s] for row in rows) for s in range(len(stages)))


def _probe_one(
    stages: Sequence[Stage],
    chunk: tuple[tuple, dict],
    autocast: torch.dtype | None,
    fake_mode_cls: Any,
    nbytes: Any,
) -> tuple[int, ...]:
    sizes = [nbytes(chunk)]
    with (
        internal_grad_reads(),
        fake_mode_cls(allow_non_fake_inputs=True) as mode,
        torch.no_grad(),
    ):
        args, kwargs = pytree.tree_map(
            lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, chunk
        )
        context: Any = None
        x: Any = None
        amp = (
            torch.autocast("cpu", dtype=autocast)
            if autocast is not None
            else torch.autocast("cpu", enabled=False)
        )
        with amp:
            for s, stage in enumerate(stages[:-1]):  # the last stage's output is no input
                for i, layer in enumerate(stage.layers):
                    if s == 0 and i == 0:
                        x = layer.module(*args, **kwargs)
                        if isinstance(x, WithContext):
                            x, context = x.output, x.context
                    elif layer.takes_context:
                        x = layer.module(x, context)
                    else:
                        x = layer.module(x)
                sizes.append(nbytes(x))
    return tuple(sizes)
