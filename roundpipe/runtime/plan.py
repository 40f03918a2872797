"""The runtime's side of planning: the wrapped model's layers, their stages (``execute_plan``),
and which :class:`roundpipe.schedule.Plan` a call runs (built by :mod:`roundpipe.schedule`, which
decides the order, and cached here). Main thread.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from torch import nn

from roundpipe.devices import DevicePool
from roundpipe.runtime.params import _ParamRecord, _Params
from roundpipe.schedule import Plan, build_plan, partition

__all__: list = []  # private to roundpipe.runtime


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
        f"a GPT-style model (docs/devices.md, \"A model that is not an nn.Sequential\"). To "
        f"keep one stage and silence this warning, wrap nn.Sequential(model).",
        UserWarning, stacklevel=4)  # the caller of RoundPipe()


@dataclasses.dataclass
class _Layer:
    index: int
    name: str
    module: nn.Module

    def describe(self) -> str:
        kind = type(self.module).__name__
        return (f"layer {self.index} ({kind})" if self.name == str(self.index)
                else f"layer {self.index} {self.name!r} ({kind})")


class _Stage:
    """Consecutive layers ``[first, end)``; ``params``: the records of those layers' params,
    each once."""

    def __init__(self, index: int, layers: List[_Layer], params: _Params) -> None:
        self.index = index
        self.layers = layers
        seen: set = set()
        self.params: List[_ParamRecord] = []
        for layer in layers:
            for rec in params.records_of(layer.module):
                if rec not in seen:
                    seen.add(rec)
                    self.params.append(rec)
        # What the stage holds on an accelerator while it runs: its upload (parameters and
        # buffers, each once) and its gradient sums (see device_bytes).
        tensors = {id(t): t for layer in layers
                   for t in list(layer.module.parameters()) + list(layer.module.buffers())}
        self._upload_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        masters = [rec.master for rec in self.params if rec.master is not None]
        self._grad_numel = sum(m.numel() for m in masters)
        self._grad_bytes = sum(m.numel() * m.element_size() for m in masters)

    def device_bytes(self, grad_dtype: Optional[torch.dtype] = None) -> int:
        """The stage's upload plus its gradient sums, in ``grad_dtype`` (None: the masters')."""
        return self._upload_bytes + (self._grad_bytes if grad_dtype is None
                                     else self._grad_numel * grad_dtype.itemsize)


def _model_layers(model: nn.Module) -> List[_Layer]:
    """The layers of a wrapped model: an ``nn.Sequential``'s children, else the model itself."""
    if isinstance(model, nn.Sequential):
        children = list(model.named_children())
        if not children:
            raise ValueError("cannot wrap an empty nn.Sequential")
    else:
        children = [("0", model)]
        _warn_single_stage(model)
    return [_Layer(i, n, m) for i, (n, m) in enumerate(children)]


def _shares_params(stages: List[_Stage]) -> bool:
    """Whether a parameter belongs to two stages (tied weights across stages)."""
    records = [rec for stage in stages for rec in stage.params]
    return len(records) != len(set(records))


class _Planner:
    """A model's stages, by ``execute_plan``, and its plans, cached. Main thread."""

    def __init__(self, layers: List[_Layer], params: _Params, pool: DevicePool) -> None:
        self.layers = layers
        self._params = params
        self._pool = pool
        self._stage_cache: Dict[Tuple[int, ...], List[_Stage]] = {}
        self._shared_cache: Dict[int, bool] = {}  # id(stage list) -> _shares_params
        self._plan_cache: Dict[Tuple, Plan] = {}

    def stages(self, execute_plan: Optional[Sequence[int]]) -> List[_Stage]:
        key = tuple(execute_plan) if execute_plan is not None else ()
        stages = self._stage_cache.get(key)
        if stages is None:
            bounds = partition(len(self.layers), execute_plan)
            stages = [_Stage(s, self.layers[a:b], self._params)
                      for s, (a, b) in enumerate(bounds)]
            self._stage_cache[key] = stages
            self._shared_cache[id(stages)] = _shares_params(stages)
        return stages

    def plan(self, stages: List[_Stage], num_microbatch: int, training: bool,
             recompute: bool) -> Plan:
        # An accelerator pool streams stage by stage (see [Note: streaming] in schedule.py);
        # one CPU worker fuses each microbatch's stages (see [Note: fused stages] in
        # roundpipe/runtime/execute.py).
        streaming = self._pool.device_type != "cpu"
        fuse = (training and not streaming and len(self._pool) == 1
                and not self._shared_cache[id(stages)])
        key = (len(stages), num_microbatch, training, fuse, streaming, recompute)
        plan = self._plan_cache.get(key)
        if plan is None:
            plan = self._plan_cache[key] = build_plan(
                len(stages), num_microbatch, len(self._pool), training, fuse,
                stage_major=streaming, recompute=recompute)
        return plan
