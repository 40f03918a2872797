"""Which kernel CUDA's ``scaled_dot_product_attention`` takes for given inputs, so that the
emulated device (:mod:`roundpipe.testing.emu`) holds what a GPU holds: the fused kernels (flash,
memory-efficient) never materialise the (query tokens x key tokens) scores, the math path does.

[Note: CUDA's attention backends]
torch picks the first backend whose constraints the inputs meet, in the order flash,
memory-efficient, math (sdp_utils for CUDA; on Hopper and Blackwell with a recent cuDNN, cuDNN
attention is tried first, but what it takes the other two fused kernels take too, so whether the
scores exist does not change). :func:`cuda_sdpa_backend` applies those constraints to shapes,
strides, dtypes and the mask alone, for a dense (non-nested) call on a given compute capability
(default 9.0, Hopper), honouring ``torch.backends.cuda``'s switches (``sdpa_kernel``):

* flash: query, key and value 4-D, of one dtype, fp16 or bf16 (sm80 and newer); no explicit
  ``attn_mask``; one head dim for all three, at most 256 (torch pads it to a multiple of 8
  itself); with ``is_causal``, as many query as key tokens; the same batch and number of heads
  (grouped queries with ``enable_gqa``); no empty sequence; the last dim contiguous; on sm86,
  sm89 and sm120/121, when an input requires grad, a head dim of at most 192 (or above 224
  without dropout); sm80 to sm121.
* memory-efficient: 4-D, one dtype of fp16, bf16 or fp32 (fp16 and fp32 before sm80); masks of
  any shape are taken; query and key of one head dim, query's and value's head dims multiples of
  the GEMM alignment (8 elements for fp16/bf16, 4 for fp32 on sm80 and newer) and their storage
  offsets too; no empty sequence; the last dims of the inputs and of the mask contiguous; the
  same batch and number of heads (grouped queries with ``enable_gqa``); sm50 to sm121.
* math: everything else (an error if the math path is switched off too).

So an fp16 model with a head dim of 4 and a padding mask runs the math path on a GPU and holds
a (batch x heads x tokens x tokens) fp32 scores tensor per layer, while a bf16 causal model with
a head dim of 64 runs flash and holds none.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

__all__ = ["cuda_sdpa_backend", "HOPPER"]

HOPPER = (9, 0)  # H100, H200


def _heads_and_batch_ok(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> bool:
    if not query.size(0) == key.size(0) == value.size(0):
        return False
    q_heads, k_heads, v_heads = query.size(-3), key.size(-3), value.size(-3)
    if enable_gqa:
        return k_heads == v_heads and q_heads % k_heads == 0
    return q_heads == k_heads == v_heads


def _dense_ok(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
    ignore_singleton_dim: bool,
) -> bool:
    """The constraints both fused kernels put on dense inputs."""
    if query.size(-2) == 0 or key.size(-2) == 0:
        return False
    strides_one = all(t.stride(-1) == 1 for t in (query, key, value))
    if ignore_singleton_dim:
        strides_one = strides_one or query.size(-1) == 1
    if not strides_one or (attn_mask is not None and attn_mask.stride(-1) != 1):
        return False
    return _heads_and_batch_ok(query, key, value, enable_gqa)


def _gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    half = dtype in (torch.float16, torch.bfloat16)
    major = capability[0]
    tensor_cores = major >= 8 or (major >= 7 and half)
    alignment = 4 if major >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def _flash_ok(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    capability: tuple[int, int],
) -> bool:
    if not torch.backends.cuda.flash_sdp_enabled() or attn_mask is not None:
        return False
    head_dim = query.size(-1)
    if not (head_dim == key.size(-1) == value.size(-1) and head_dim <= 256):
        return False
    if not (8, 0) <= capability <= (12, 1):
        return False
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if requires_grad and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)):
        if not (head_dim <= 192 or (dropout_p == 0.0 and head_dim > 224)):
            return False
    if is_causal and query.size(-2) != key.size(-2):
        return False
    if not query.dtype == key.dtype == value.dtype or query.dtype not in (
        torch.float16,
        torch.bfloat16,
    ):
        return False
    return _dense_ok(query, key, value, None, enable_gqa, ignore_singleton_dim=True)


def _efficient_ok(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
    capability: tuple[int, int],
) -> bool:
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not (5, 0) <= capability <= (12, 1):
        return False
    alignment = _gemm_alignment(query.dtype, capability)
    q_dim, v_dim = query.size(-1), value.size(-1)
    if not (q_dim == key.size(-1) and q_dim > 0 and v_dim > 0 and q_dim % alignment == 0) or (
        v_dim % alignment != 0
    ):
        return False
    if capability[0] >= 8:  # the CUTLASS kernels' pointer alignment, set by the storage offset
        for t in (query, key, value):
            if t.numel() and (t.storage_offset() * t.element_size()) % (
                alignment * t.element_size()
            ):
                return False
    if not _dense_ok(query, key, value, attn_mask, enable_gqa, ignore_singleton_dim=False):
        return False
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability[0] >= 8 else ())
    return query.dtype == key.dtype == value.dtype and query.dtype in allowed


def cuda_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    *,
    capability: tuple[int, int] = HOPPER,
) -> SDPBackend:
    """The backend CUDA's ``scaled_dot_product_attention`` takes for these arguments on a GPU of
    compute ``capability`` (see [Note: CUDA's attention backends]): ``FLASH_ATTENTION``,
    ``EFFICIENT_ATTENTION``, ``MATH``, or ``ERROR`` when the math path is switched off and no
    fused kernel fits. Reads shapes, strides, dtypes and flags only, so real, fake and meta
    tensors all work. Any thread."""
    if query.dim() == key.dim() == value.dim() == 4:
        if _flash_ok(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, capability):
            return SDPBackend.FLASH_ATTENTION
        if _efficient_ok(query, key, value, attn_mask, enable_gqa, capability):
            return SDPBackend.EFFICIENT_ATTENTION
    return SDPBackend.MATH if torch.backends.cuda.math_sdp_enabled() else SDPBackend.ERROR
