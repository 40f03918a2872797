"""Run configs: :class:`RoundPipeRunConfig`, what a user sets (every field may be left to
inherit), and :class:`ResolvedRunConfig`, what a call runs with: the call's, the model's and
the default configs merged field by field (:func:`resolve_config`), every field a concrete
value."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from roundpipe.plan import check_execute_plan, partition

__all__ = ["RoundPipeRunConfig", "ResolvedRunConfig", "resolve_config"]


@dataclasses.dataclass
class RoundPipeRunConfig:
    """How a call runs. Every field ``None`` = inherit: call-level config, then the model-level
    config, then the default.

    * ``num_microbatch`` (default 1).
    * ``autocast``: None (the caller's autocast state at the call), False (off), or a dtype (on,
      with that dtype); active in every stage forward, recompute and ``loss_fn``, never backward.
    * ``requires_grad``: whether ``forward()`` output tracks gradients (default
      ``torch.is_grad_enabled()`` at the call).
    * ``preserve_rng_state``: whether stages run in an RNG chain (see [Note: RNG chains]);
      default: the stages with a dropout module in training mode, and those that a probe of
      their first call finds drawing random numbers.
    * ``recompute`` (default True): keep only stage inputs, recompute in backward.
    * ``overlap_recompute`` (default False): on an accelerator, with recompute, a helper
      thread issues a stage's recompute of the next microbatch while autograd's device thread
      issues the backward of this one, so the host's two halves of each backward overlap
      instead of taking turns (see [Note: overlapped recompute] in
      :mod:`roundpipe.runtime.stage_ops`); the device holds one more microbatch's recompute
      during a backward, which the memory plan counts. No effect on the CPU.
    * ``offload_activations`` (default False): on an accelerator, with recompute, keep those
      stage inputs in pinned host memory between the forward and the backward pass instead of
      on the device (see [Note: the program] in :mod:`roundpipe.plan.actions`); no effect on
      the CPU.
    * ``device_memory_budget`` (bytes per device, ``"auto"``, or default None: no budget): on
      an accelerator, the plan prefetches the next stage only where it fits beside the current
      one and the saved stage inputs (a device's first stage of a call only if it fits on its
      own), and sends a saved stage input to the host once keeping it would leave less than two
      stages' room (an estimate: weights, buffers and gradient sums; not the activations inside
      a stage). ``"auto"``: at each call, 90% of the memory the emptiest device of the pool has
      free (``mem_get_info``, plus what torch's allocator caches), the rest left for the
      activations inside a stage.
    * ``device_grad_dtype`` (default None: the masters' dtype, ``optim_dtype``): on an
      accelerator, the dtype each stage's microbatch gradients are summed in on the device
      before their one download. The stage's low-precision dtype (``torch.float16``,
      ``torch.bfloat16``) makes the sums as small as the stage's weights; the sum then rounds
      to that dtype once per microbatch (an fp16 sum may overflow where fp32 would not; the
      GradScaler skips that step). The masters still accumulate in ``optim_dtype``. No effect
      on the CPU, where gradients go straight to the masters.
    * ``split_input`` / ``split_label`` / ``merge_output``: specs (``TensorChunkSpec``, int, a
      pytree of them) or callables, see :mod:`roundpipe.microbatch`.
    * ``output_device`` (default ``"cpu"``): where merged outputs and the loss are returned.
    * ``execute_plan``: the stage partition, layers per stage (default one layer per stage);
      :func:`roundpipe.stages_by_size` makes one, by bytes or by measured costs.

    Plain data; build it on any thread, do not mutate one that a call is using.
    """

    num_microbatch: int | None = None
    autocast: Any = None
    requires_grad: bool | None = None
    preserve_rng_state: bool | None = None
    recompute: bool | None = None
    overlap_recompute: bool | None = None
    offload_activations: bool | None = None
    device_memory_budget: int | str | None = None
    device_grad_dtype: torch.dtype | None = None
    split_input: Any = None
    split_label: Any = None
    merge_output: Any = None
    output_device: Any = None
    execute_plan: Sequence[int] | None = None

    def __post_init__(self) -> None:
        n = self.num_microbatch
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"num_microbatch must be a positive int, got {n!r}")
        if not (
            self.autocast is None
            or self.autocast is False
            or isinstance(self.autocast, torch.dtype)
        ):
            raise ValueError(
                f"autocast must be None (the caller's autocast state), False or a "
                f"torch.dtype such as torch.bfloat16, got {self.autocast!r}"
            )
        budget = self.device_memory_budget
        if (
            budget is not None
            and budget != "auto"
            and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1)
        ):
            raise ValueError(
                f'device_memory_budget must be None, "auto" or a positive int '
                f"(bytes per device), got {budget!r}"
            )
        dtype = self.device_grad_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"device_grad_dtype must be None (the masters' dtype) or a floating "
                f"torch.dtype such as torch.float16, got {dtype!r}"
            )
        for name in (
            "requires_grad",
            "preserve_rng_state",
            "recompute",
            "overlap_recompute",
            "offload_activations",
        ):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be None, True or False, got {v!r}")
        if self.output_device is not None:
            try:
                torch.device(self.output_device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(
                    f"output_device {self.output_device!r} is not a device: {exc}"
                ) from None
        if self.execute_plan is not None:
            check_execute_plan(self.execute_plan)


# The resolved settings that keep a mode rather than a value: the caller's autocast state or
# grad mode (read at the call), a budget read at each call, the masters' dtype.
AutocastSetting = Literal["caller", "off"] | torch.dtype
GradSetting = bool | Literal["caller"]
RngSetting = bool | Literal["auto"]
BudgetSetting = int | Literal["auto", "none"]
GradDtypeSetting = torch.dtype | Literal["masters"]


@dataclasses.dataclass(frozen=True)
class ResolvedRunConfig:
    """What one call runs with (see :class:`RoundPipeRunConfig` for each field's meaning): the
    call's, then the model's, then the default settings, each a concrete value or an explicit
    mode. ``execute_plan`` is the partition itself, ``(first, end)`` layer bounds per stage."""

    num_microbatch: int
    autocast: AutocastSetting
    requires_grad: GradSetting
    preserve_rng_state: RngSetting
    recompute: bool
    overlap_recompute: bool
    offload_activations: bool
    device_memory_budget: BudgetSetting
    device_grad_dtype: GradDtypeSetting
    split_input: Any
    split_label: Any
    merge_output: Any
    output_device: torch.device
    execute_plan: tuple[tuple[int, int], ...]


def _first(field: str, *configs: RoundPipeRunConfig | None) -> Any:
    for cfg in configs:
        if cfg is not None and getattr(cfg, field) is not None:
            return getattr(cfg, field)
    return None


def resolve_config(
    run_config: RoundPipeRunConfig | None, model_config: RoundPipeRunConfig, num_layers: int
) -> ResolvedRunConfig:
    """The config a call runs with: ``run_config`` (checked), then ``model_config``, then the
    defaults; ``execute_plan`` partitions ``num_layers`` layers. Any thread."""
    if run_config is not None and not isinstance(run_config, RoundPipeRunConfig):
        raise TypeError("run_config must be a RoundPipeRunConfig")

    def get(field: str, default: Any) -> Any:
        value = _first(field, run_config, model_config)
        return default if value is None else value

    autocast = get("autocast", "caller")
    budget = get("device_memory_budget", "none")
    return ResolvedRunConfig(
        num_microbatch=get("num_microbatch", 1),
        autocast="off" if autocast is False else autocast,
        requires_grad=get("requires_grad", "caller"),
        preserve_rng_state=get("preserve_rng_state", "auto"),
        recompute=get("recompute", True),
        overlap_recompute=get("overlap_recompute", False),
        offload_activations=get("offload_activations", False),
        device_memory_budget=budget,
        device_grad_dtype=get("device_grad_dtype", "masters"),
        split_input=_first("split_input", run_config, model_config),
        split_label=_first("split_label", run_config, model_config),
        merge_output=_first("merge_output", run_config, model_config),
        output_device=torch.device(get("output_device", "cpu")),
        execute_plan=tuple(partition(num_layers, _first("execute_plan", run_config, model_config))),
    )
