"""Lean Adam moments (``roundpipe.optim.AdamW(..., state_dtype=...)``): bf16 moments and 8-bit
blockwise moments, their state layout, their 8-bit maps, and the torch reference of their step
(what runs without the compiled kernels, bit for bit the same). See [Note: lean moments].

Any thread (the optimizer's).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "MIN_8BIT_NUMEL",
    "StateKind",
    "Maps",
    "dequantize",
    "init_lean_state",
    "kind_of_state_dtype",
    "lean_reference_step",
    "maps",
    "quantize",
    "state_kind_of_group",
]

# [Note: lean moments]
# Adam keeps two moments per parameter, 8 bytes in fp32. Two leaner kinds, chosen per optimizer
# (``state_dtype``), each computing the update in fp32 from moments read and written in fewer
# bytes:
#   * bf16 (``state_dtype=torch.bfloat16``): exp_avg and exp_avg_sq stored as bfloat16 (4 bytes
#     per parameter): read, widened to fp32, updated, rounded to nearest even on the way back.
#   * 8-bit (``state_dtype="8bit"``): blockwise dynamic quantization, as bitsandbytes' 8-bit
#     Adam keeps them (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"). Each
#     moment is cut into blocks of BLOCK (256) elements; a block stores one fp32 absmax (its
#     largest magnitude) and one byte per element, the index of the nearest value of a fixed
#     map of 256 values in [-1, 1] (exp_avg) or [0, 1] (exp_avg_sq) after dividing by the
#     absmax: 2 bytes per parameter plus 8/256. The map is a "dynamic tree", as bitsandbytes'
#     maps are: for a magnitude code c (7 bits signed, the 8th is the sign; 8 bits unsigned,
#     G = 7 or 8 groups), the position k = floor(log2(c)) of its leading one gives its group
#     (depth e = G-1-k) and the bits below it a linear fraction f in that group:
#     value = 16^-e * (1/16 + 15/16 * (f + 1) / 2^k). So the largest values (the ones that
#     drive the update) get the finest steps, 64 (signed) or 128 (unsigned) across [1/16, 1],
#     and the range reaches 16^-6 (signed) or 16^-7 (unsigned) of the block's absmax; code 0 is
#     0 and the top code is 1.0, so the absmax is kept exactly. Groups are 16x wide (four
#     octaves) where bitsandbytes' are 10x: a value's group is then its float exponent divided
#     by four, and its code is found by a few integer and float operations on its bits instead
#     of a search among the 256 values (a step of memory-bound speed cannot afford a search):
#     y = |x| / absmax, e = floor((-exponent(y) - 1) / 4) (deeper than the last group: code
#     0), z = y * 16^e (exact), f = round-half-even(z * A[k] + B[k]), code = 2^k + f, where
#     f = -1 is the top value of the group below (code 0 below the deepest group's value); the
#     nearest value but for the last bits of that fp32 arithmetic. Absmax 0 gives all zeros;
#     a NaN anywhere in a block makes its absmax NaN (the moments stay poisoned, as fp32 ones
#     do).
#     Parameters of fewer than MIN_8BIT_NUMEL elements keep exact fp32 moments (their blocks
#     would cost more than they save; said once per optimizer).
# The arithmetic, per element, in fp32, each operation rounded once (no FMA), in this order:
#     g = grad [/ grad_scale] [* -1 if maximize]; AdamW: p = p * f32(1 - lr*wd);
#     Adam with weight decay: g = g + p * f32(wd)
#     m = m * f32(beta1) + g * f32(1 - beta1);  v = v * f32(beta2) + (g * g) * f32(1 - beta2)
#     p = p + (f32(-lr / bc1 * sqrt(bc2)) * m) / (sqrt(v) + f32(eps * sqrt(bc2)))
# with m and v the stored moments widened (8-bit: value * absmax) and the new m and v (before
# they are narrowed) in the update, and bc1 = 1 - beta1^step, bc2 = 1 - beta2^step in double as
# torch computes them: Adam's update, with the bias corrections folded into two constants per
# tensor so that each element takes one division and one square root (the costliest
# operations of the step once it moves this few bytes). The compiled kernels (roundpipe/optim/_step_kernels.cpp; AVX2 and
# scalar) and lean_reference_step below give the same bits; the tests check it. They differ
# from exact Adam in the last bits even before narrowing (torch's kernel updates exp_avg with
# a fused multiply-add lerp), which the narrowing dwarfs. Unlike torch's fused step, the lean
# step does not write the unscaled gradient back (a GradScaler's grad_scale).

BLOCK = 256
MIN_8BIT_NUMEL = 4096


class StateKind(enum.Enum):
    """How Adam's moments are stored: exact (the parameter's dtype, torch's), bf16 or 8-bit."""

    EXACT = "exact"
    BF16 = "bf16"
    EIGHT_BIT = "8bit"

    @property
    def moment_bytes(self) -> float:
        """Host bytes per parameter of both moments (fp32 masters for EXACT)."""
        return {"exact": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / BLOCK}[self.value]


_STATE_DTYPES = {
    None: StateKind.EXACT,
    "exact": StateKind.EXACT,
    torch.bfloat16: StateKind.BF16,
    "bf16": StateKind.BF16,
    "bfloat16": StateKind.BF16,
    "8bit": StateKind.EIGHT_BIT,
}


def kind_of_state_dtype(state_dtype: Any) -> StateKind:
    """The :class:`StateKind` a ``state_dtype`` argument names; ``ValueError`` otherwise."""
    try:
        return _STATE_DTYPES[state_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"Adam: state_dtype={state_dtype!r} is not a kind of moments roundpipe keeps; pass "
            f"None (exact, the parameters' dtype), torch.bfloat16 (or 'bf16') or '8bit'"
        ) from None


def state_kind_of_group(group: dict) -> StateKind:
    """The kind a param group's moments are kept in (groups of a state dict too: a group
    without the key is exact, as torch's are)."""
    return StateKind(group.get("state_dtype", "exact"))


@dataclasses.dataclass(frozen=True)
class Maps:
    """The two 8-bit maps (see [Note: lean moments]): per map its table (32 fp32: per group k
    the offset O[k] and step S[k] of its values, the scale A[k] and shift B[k] that find a
    fraction), the values of all 256 codes by code, and the midpoints between consecutive
    magnitudes' values (for tests)."""

    signed_table: Tensor
    signed_values: Tensor  # by code: magnitude codes 0..127, then their negatives
    signed_mids: Tensor  # 127 midpoints of the magnitudes
    unsigned_table: Tensor
    unsigned_values: Tensor  # by code 0..255
    unsigned_mids: Tensor  # 255 midpoints


def _map(groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Table, values by magnitude code, and midpoints of the map of ``groups`` groups."""
    offset = [0.0] * 8
    step = [0.0] * 8
    scale = [0.0] * 8
    shift = [0.0] * 8
    for k in range(groups):
        depth = groups - 1 - k
        offset[k] = 16.0**-depth / 16  # exact powers of two
        step[k] = 16.0**-depth * 15 / 16 / 2**k  # 15 times a power of two: exact
        scale[k] = 16 * 2**k / 15  # t = z * scale + shift: f at z = y * 16^depth
        shift[k] = -(2**k) / 15 - 1
    # The deepest group's one value has 0 below it, not a group's top value: f = -1 (code 0)
    # below half of it, f = 0 from there.
    scale[0], shift[0] = 2.0, -1.5
    table = torch.tensor(offset + step + scale + shift, dtype=torch.float32)
    codes = torch.arange(1, 2**groups)
    group = torch.floor(torch.log2(codes.double())).long()
    group = torch.where(2 ** (group + 1) <= codes, group + 1, group)  # exact floor(log2)
    f1 = (codes - 2**group + 1).to(torch.float32)
    # The kernels' own order: step * (f + 1), then + offset (exact here: the values are short
    # binary fractions).
    magnitudes = table[:8][group] + table[8:16][group] * f1
    values = torch.cat([torch.zeros(1), magnitudes])
    mids = (values[:-1] + values[1:]) * 0.5
    return table, values, mids


@functools.lru_cache(maxsize=1)
def maps() -> Maps:
    """The 8-bit maps (built once)."""
    s_table, s_values, s_mids = _map(7)
    u_table, u_values, u_mids = _map(8)
    return Maps(s_table, torch.cat([s_values, -s_values]), s_mids, u_table, u_values, u_mids)


def quantize(x: Tensor, inverse: Tensor, signed: bool) -> Tensor:
    """Codes (uint8) of ``x`` (fp32) times ``inverse`` (broadcast), as the kernels find them
    (see [Note: lean moments])."""
    table = maps().signed_table if signed else maps().unsigned_table
    groups = 7 if signed else 8
    y = x.abs() * inverse  # unsigned: x >= 0 (a -0.0 is 0)
    y = torch.where(torch.isnan(y), torch.zeros((), dtype=y.dtype), y).contiguous()
    bits = y.view(torch.int32).to(torch.int64)
    exponent = (bits >> 23) - 127
    depth = torch.div(-exponent - 1, 4, rounding_mode="floor").clamp(min=0)
    deep = depth >= groups
    depth = torch.where(deep, torch.zeros_like(depth), depth)
    k = groups - 1 - depth
    z = (bits + (4 * depth << 23)).to(torch.int32).view(torch.float32)  # y * 16^depth
    t = z * table[16:24][k]
    t = t + table[24:32][k]
    f = torch.round(t.clamp(-1.0, 255.0)).long()
    f = torch.minimum(f, 2**k - 1)
    codes = torch.where(deep, torch.zeros_like(f), 2**k + f)
    if signed:
        codes = codes + torch.signbit(x).long() * 128
    return codes.to(torch.uint8)


def dequantize(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """fp32 values of ``codes`` times ``absmax`` (broadcast)."""
    m = maps()
    values = m.signed_values if signed else m.unsigned_values
    return values[codes.long()] * absmax


def _bf16_bits(x: Tensor) -> Tensor:
    """fp32 -> bf16, rounding to nearest even and NaN to 0xFFFF, as the kernels (and torch's
    copy_) round."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = torch.where(torch.isnan(x), torch.full_like(r, 0xFFFF), r)
    return r.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _blocks(t: Tensor) -> tuple[Tensor, int]:
    """``t`` (flat) as rows of BLOCK, the last one padded with zeros; and its length."""
    n = t.numel()
    pad = -n % BLOCK
    if pad:
        t = torch.cat([t, torch.zeros(pad, dtype=t.dtype)])
    return t.view(-1, BLOCK), n


def _absmax(rows: Tensor, n: int, signed: bool) -> Tensor:
    """Per block, the largest magnitude; NaN if the block holds one (padding excluded)."""
    mags = rows.abs() if signed else rows
    flat = mags.reshape(-1).clone()
    flat[n:] = 0.0
    return flat.view(rows.shape).amax(dim=1)


def _inverse(absmax: Tensor) -> Tensor:
    one = torch.ones((), dtype=torch.float32)
    inv = torch.where(absmax > 0, one / absmax, torch.zeros((), dtype=torch.float32))
    return torch.where(torch.isnan(absmax), absmax, inv)


def _sqrt(v: Tensor) -> Tensor:
    """The correctly rounded fp32 square root, as the kernels' sqrt instructions give it.
    torch.sqrt on CPU is within an ulp but not always the nearest (it differs in about 15% of
    fp32 values); rounding a float64 root, which is within 2^-52 of the exact one, to fp32 is
    the nearest, since no fp32 square root lies that close to a rounding boundary."""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def _f32(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float32)


def lean_reference_step(
    kind: StateKind,
    p: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    low: Tensor | None,
    *,
    step_size: float,
    bias_correction2_sqrt: float,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    adamw: bool,
    grad_scale: float | None,
) -> None:
    """One lean step of one parameter with torch's ops (see [Note: lean moments]): ``p`` (fp32,
    contiguous) and ``state`` updated in place, ``low`` (the low-precision copy, or None)
    written. Bitwise the compiled kernels' result."""
    with torch.no_grad():
        pf = p.detach().view(-1)
        g = grad.detach().reshape(-1).to(torch.float32)
        if grad_scale is not None:
            g = g / _f32(grad_scale)
        if maximize:
            g = g * _f32(-1.0)
        x = pf.clone()
        if weight_decay != 0:
            if adamw:
                x = x * _f32(1.0 - lr * weight_decay)
            else:
                g = g + x * _f32(weight_decay)
        if kind is StateKind.BF16:
            m = state["exp_avg"].view(-1).to(torch.float32)
            v = state["exp_avg_sq"].view(-1).to(torch.float32)
        else:
            n = pf.numel()
            rows = torch.arange(n) // BLOCK
            m = dequantize(state["exp_avg"].view(-1), state["exp_avg_absmax"][rows], True)
            v = dequantize(state["exp_avg_sq"].view(-1), state["exp_avg_sq_absmax"][rows], False)
        m = m * _f32(beta1) + g * _f32(1.0 - beta1)
        v = v * _f32(beta2) + (g * g) * _f32(1.0 - beta2)
        denom = _sqrt(v) + _f32(eps * bias_correction2_sqrt)
        x = x + (_f32(-step_size * bias_correction2_sqrt) * m) / denom
        pf.copy_(x)
        if low is not None:
            low.detach().view(-1).copy_(x)
        if kind is StateKind.BF16:
            state["exp_avg"].view(-1).copy_(_bf16_bits(m))
            state["exp_avg_sq"].view(-1).copy_(_bf16_bits(v))
            return
        for name, values, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
            rows_, n = _blocks(values)
            absmax = _absmax(rows_, n, signed)
            codes = quantize(rows_, _inverse(absmax)[:, None], signed).view(-1)[:n]
            state[name].view(-1).copy_(codes)
            state[name + "_absmax"].copy_(absmax)


def init_lean_state(kind: StateKind, p: Tensor) -> dict[str, Tensor]:
    """Fresh moments of ``kind`` for parameter ``p`` (zeros), and its step count."""
    state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
    if kind is StateKind.BF16:
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.bfloat16)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.bfloat16)
        return state
    blocks = math.ceil(p.numel() / BLOCK)
    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.uint8)
    state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32)
    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.uint8)
    state["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32)
    return state
