"""The emulated device's kernels where they differ from the CPU's: CUDA's autocast policy (or
the lenient one), dropout drawn as on the CPU, attention that takes the math path where CUDA
would, and ops whose CPU kernel lacks a dtype CUDA's has. See [Note: emulated autocast] and
[Note: emulated attention]."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention import SDPBackend

from roundpipe.testing.cuda_attention import cuda_sdpa_backend
from roundpipe.testing.emu.native import NAME, STATE, aten

__all__ = ["DEVICE_KERNELS", "attention", "dropout", "set_cuda_autocast"]

# Ops that the lenient autocast runs in the lower-precision dtype (see [Note: emulated autocast]).
_AUTOCAST_LOWER = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "_convolution",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
)


def _histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``histc`` of an integer tensor, which CUDA computes and the CPU refuses (code that
    counts on the GPU path takes integers for determinism): counted in float, returned in the
    input's dtype as CUDA returns it."""
    if input.is_floating_point():
        return torch.histc(input, bins, min, max)
    return torch.histc(input.double(), bins, min, max).to(input.dtype)


# Ops whose CPU kernel lacks a dtype CUDA's has: what the device computes instead.
DEVICE_KERNELS: dict[Any, Any] = {aten.histc.default: _histc}


# [Note: emulated autocast]
# torch.autocast("emu") runs CUDA's cast policy (Rules.cuda_autocast): the op lists torch
# registers for AutocastCUDA, which ATen/autocast_mode.h keeps for other backends to share,
# registered for the emulated device by a small C++ library (_emu_autocast.cpp) with torch's own
# wrappers. So matmul-like ops run in the autocast dtype; softmax, log_softmax, layer_norm,
# rms_norm, sum, pow, exp, the losses (nll_loss, mse_loss, ...) and the norms run in fp32;
# addcmul, dot, index_put, scatter_add and the like promote mixed inputs to the widest dtype;
# binary_cross_entropy is refused; fp32 leaf weights' casts are cached for the autocast region,
# as on CUDA. Only device tensors are cast (a host tensor in the call is left alone, as CUDA's
# policy leaves it). Switched off, only the matmul-like ops (_AUTOCAST_LOWER) are lowered, by a
# Python kernel: the lenient policy the emulated device had first.
_lenient_autocast: torch.library.Library | None = None


def set_cuda_autocast(on: bool) -> None:
    """Register CUDA's autocast policy, or the lenient one, for the emulated device (the caller
    holds _INSTALL_LOCK)."""
    global _lenient_autocast
    if on:
        if _lenient_autocast is not None:
            _lenient_autocast._destroy()
            _lenient_autocast = None
        if STATE.autocast.roundpipe_emu_cuda_autocast(1):
            raise RuntimeError(
                "could not register CUDA's autocast policy for the emulated device: "
                + STATE.autocast.roundpipe_emu_autocast_error().decode()
            )
        return
    STATE.autocast.roundpipe_emu_cuda_autocast(0)
    if _lenient_autocast is None:
        _lenient_autocast = torch.library.Library("aten", "IMPL")
        _lower_matmuls(_lenient_autocast)


def _lower_matmuls(aten_lib: torch.library.Library) -> None:
    """The lenient ``torch.autocast("emu")``: matmul-like ops cast their floating inputs to the
    autocast dtype; every other op passes through untouched."""
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]
    for name in _AUTOCAST_LOWER:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)

            def kernel(*args: Any, _op: Any = op, **kwargs: Any) -> Any:
                dtype = torch.get_autocast_dtype(NAME)
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: t.to(dtype) if t.is_floating_point() else t,
                    (args, kwargs),
                )
                with torch._C._ExcludeDispatchKeyGuard(excluded):
                    return _op(*args, **kwargs)

            qualified = name if overload == "default" else f"{name}.{overload}"
            aten_lib.impl(qualified, kernel, "AutocastPrivateUse1")


def dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` on emu tensors, as torch computes it for CPU tensors: torch would take
    its fused ``native_dropout`` kernel for an accelerator, which draws other masks from the same
    generator state. With this, an emu run and a CPU run draw the same masks."""
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise


# [Note: emulated attention]
# torch decomposes scaled_dot_product_attention into its math path for any PrivateUse1 device,
# which holds the (query x key) scores that a GPU's fused kernels never allocate. The emulated
# device instead computes what the CPU computes, with the CPU's fused (flash) kernel where the
# CPU takes it (no scores), else the math composite. Under Rules.cuda_attention it also takes
# the math path wherever CUDA would (roundpipe.testing.cuda_attention,
# [Note: CUDA's attention backends]: a mask with a head dim that is no multiple of 8 in fp16,
# 3-D inputs, fp64, ...), so device memory holds the scores exactly where a GPU's does; the
# results then are the math path's, which may differ from the CPU's fused kernel in the last
# bits. Where CUDA would fuse but the CPU would not (dropout: the CPU's fused kernel draws no
# dropout), the math path runs and its scores are counted, more than a GPU holds.
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` on emu tensors (see [Note: emulated attention]):
    the math path where CUDA would take it, else the CPU's fused kernel where the CPU takes it,
    which never holds the (query x key) scores."""
    cpu_fused = dropout_p == 0.0  # a memory trace (fake tensors): the CPU's choice, roughly
    if not is_fake(query):
        cpu_fused = (
            torch.ops.aten._fused_sdp_choice(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            == SDPBackend.FLASH_ATTENTION.value
        )
    fused = cpu_fused
    if STATE.rules.cuda_attention:
        backend = cuda_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if backend == SDPBackend.ERROR:
            raise RuntimeError(
                "scaled_dot_product_attention: no kernel CUDA would run takes these inputs "
                f"(query {tuple(query.shape)} {query.dtype}, attn_mask "
                f"{'none' if attn_mask is None else tuple(attn_mask.shape)}), and the math path "
                "is switched off (torch.nn.attention.sdpa_kernel or torch.backends.cuda); allow "
                "SDPBackend.MATH, or see roundpipe.testing.cuda_attention for what the fused "
                "kernels take"
            )
        fused = cpu_fused and backend != SDPBackend.MATH
    if not fused:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it first
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf")
        )
    # The CPU kernel takes fewer key/value heads than query heads itself (grouped queries).
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]
