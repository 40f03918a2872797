"""torch's fused Adam/AdamW kernel, as roundpipe.optim calls it: which parameters it can take
and one call of it (see [Note: fused by default] in :mod:`roundpipe.optim.adam`). Any thread
(the optimizer's)."""

from __future__ import annotations

import torch
from torch import Tensor

from roundpipe.runtime.grad_access import MasterParameter, WrappedParameter

__all__ = [
    "COMPLEX_FUSABLE",
    "FUSED_DEVICE_TYPES",
    "fused_only_reason",
    "fused_step",
    "group_allows_fused",
    "hyper_float",
    "param_fits_fused",
    "run_fused_kernel",
]

_FUSABLE_TYPES = (Tensor, torch.nn.Parameter, MasterParameter, WrappedParameter)
COMPLEX_FUSABLE = (torch.complex64, torch.complex128)


def _fused_device_types() -> frozenset[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: the two backends with fused Adam for certain
        return frozenset(("cpu", "cuda"))
    return frozenset(_get_fused_kernels_supported_devices())


FUSED_DEVICE_TYPES = _fused_device_types()


def group_allows_fused(group: dict) -> bool:
    return group["fused"] is not False and not group["foreach"] and not group["differentiable"]


def param_fits_fused(p: Tensor) -> bool:
    """Static part of [Note: fused by default]: can the kernel take this parameter at all."""
    return (
        type(p) in _FUSABLE_TYPES
        and p.layout is torch.strided
        # is_cpu first: it is the common case and much cheaper than building p.device
        and (p.is_cpu or p.device.type in FUSED_DEVICE_TYPES)
        and (p.is_floating_point() or p.dtype in COMPLEX_FUSABLE)
    )


def hyper_float(x: float | Tensor) -> float:
    return float(x) if isinstance(x, Tensor) else x


def fused_step(
    group: dict, buckets: dict, grad_scale: Tensor | None, found_inf: Tensor | None
) -> None:
    """Run torch's fused Adam/AdamW kernel once per (device, dtype) bucket of ``buckets`` (as
    the in-RAM placement of :mod:`roundpipe.optim.placement` splits a group)."""
    for (device, _), lists in buckets.items():
        device_scale = None
        if grad_scale is not None:
            device_scale = grad_scale.to(device=device, dtype=torch.float32)
        device_skip = None
        if found_inf is not None:
            # The CPU kernel skips only when found_inf == 1.0, but a scaler sums the per-device
            # flags (2.0 with two devices), so turn it back into a 0/1 flag.
            device_skip = (found_inf.to(device) != 0).to(torch.float32)
        steps = lists[5]
        torch._foreach_add_(steps, 1)
        run_fused_kernel(group, device, lists, device_scale, device_skip)
        if device_skip is not None:
            # The kernel left everything untouched on overflow; undo the count without a sync.
            torch._foreach_sub_(steps, [device_skip] * len(steps))


def run_fused_kernel(
    group: dict,
    device: torch.device,
    lists: list[list[Tensor]],
    device_scale: Tensor | None,
    device_skip: Tensor | None,
) -> None:
    """One call of torch's fused Adam/AdamW kernel on ``lists`` (params, grads, exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs, steps: the steps already counted) of ``group``."""
    params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = lists
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
    beta1, beta2 = (hyper_float(b) for b in group["betas"])
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.device != device:
        lr = lr.to(device)
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_sqs,
        steps,
        amsgrad=group["amsgrad"],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        grad_scale=device_scale,
        found_inf=device_skip,
    )


def fused_only_reason(group: dict, p: Tensor) -> str | None:
    """Why ``p`` of ``group`` cannot take the fused kernel on the host, or None."""
    if not group_allows_fused(group):
        return "its group sets fused=False, foreach=True or differentiable=True"
    if group.get("capturable"):
        return "its group sets capturable=True"
    if not param_fits_fused(p):
        return f"it is a {type(p).__name__} of {p.dtype} (not a dense float/complex Tensor)"
    if p.device.type != "cpu":
        return f"it lives on {p.device}, not in host memory"
    if not p.is_contiguous():
        return "it is not contiguous"
    return None
