"""Which kernel CUDA's scaled_dot_product_attention takes (roundpipe.testing.cuda_attention, see
[Note: CUDA's attention backends]), and the emulated device holding the math path's scores
exactly where CUDA takes it (see [Note: emulated attention] in roundpipe.testing.emu)."""

import gc

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from roundpipe.testing.cuda_attention import cuda_sdpa_backend
from roundpipe.testing.emu import rules_set

FLASH, EFFICIENT, MATH = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
memory = torch.get_device_module("emu")


def _qkv(dtype, dim, heads=4, tokens=32, kv_heads=None, kv_tokens=None, device="meta"):
    q = torch.empty(2, heads, tokens, dim, dtype=dtype, device=device)
    kv = (2, kv_heads or heads, kv_tokens or tokens, dim)
    return (
        q,
        torch.empty(kv, dtype=dtype, device=device),
        torch.empty(kv, dtype=dtype, device=device),
    )


MASK = torch.zeros(2, 1, 32, 32, device="meta")


@pytest.mark.parametrize(
    "inputs, kwargs, expected",
    [
        (_qkv(bf16, 64), {"is_causal": True}, FLASH),
        (_qkv(fp16, 4), {}, FLASH),  # torch pads the head dim for flash itself
        (_qkv(fp16, 4), {"attn_mask": MASK}, MATH),  # a mask: not flash; 4 % 8: not efficient
        (_qkv(fp16, 8), {"attn_mask": MASK}, EFFICIENT),
        (_qkv(fp32, 16), {"is_causal": True}, EFFICIENT),  # flash takes fp16/bf16 only
        (_qkv(fp32, 6), {}, MATH),  # 6 % 4
        (_qkv(bf16, 320), {}, EFFICIENT),  # flash: head dims up to 256
        (_qkv(bf16, 64, kv_tokens=16), {"is_causal": True}, EFFICIENT),  # causal, not square
        (_qkv(bf16, 64, kv_heads=2), {"enable_gqa": True}, FLASH),
        (_qkv(bf16, 64, kv_heads=2), {}, MATH),  # fewer key heads without enable_gqa
        (_qkv(torch.float64, 64), {}, MATH),
    ],
)
def test_the_backend_cuda_takes(inputs, kwargs, expected):
    assert cuda_sdpa_backend(*inputs, **kwargs) == expected


def test_storage_offsets_strides_capabilities_and_switches_count():
    q, k, v = _qkv(fp16, 8, heads=2)
    packed = torch.empty(2, 2, 32, 3 * 8 + 4, dtype=fp16, device="meta")
    q_off = packed[..., 4:12]  # offset 4 elements: the efficient kernel's pointers misaligned
    assert cuda_sdpa_backend(q_off, q_off, q_off, attn_mask=MASK) == MATH
    transposed = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    assert cuda_sdpa_backend(transposed, k, v) == MATH
    assert cuda_sdpa_backend(*_qkv(bf16, 64), capability=(7, 5)) == MATH  # no bf16 before sm80
    assert cuda_sdpa_backend(*_qkv(fp16, 64), capability=(7, 5)) == EFFICIENT
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert cuda_sdpa_backend(*_qkv(fp16, 4), attn_mask=MASK) == SDPBackend.ERROR
    big = torch.empty(1, 1, 4, 200, dtype=bf16, device="meta", requires_grad=True)
    assert cuda_sdpa_backend(big, big, big, capability=(8, 6)) == EFFICIENT  # flash's backward
    assert cuda_sdpa_backend(big, big, big, capability=(8, 0)) == FLASH


def _attention_peak(dtype, dim, causal, with_mask):
    """Device 0's peak bytes for one attention forward and backward on emu, and the result."""
    heads, tokens = 4, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, dim).to(dtype) for _ in range(3))
    mask = None
    if with_mask:  # left padding, as a batch with a shorter sequence has
        mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril()
        mask[..., :10] = False
        mask[..., :10, 0] = True
    leaves = [t.to("emu").requires_grad_() for t in (q, k, v)]
    gc.collect()
    memory.reset_peak_memory_stats(0)
    before = memory.memory_allocated(0)
    out = torch.nn.functional.scaled_dot_product_attention(
        *leaves, attn_mask=None if mask is None else mask.to("emu"), is_causal=causal
    )
    out.float().sum().backward()
    return memory.max_memory_allocated(0) - before, heads * tokens * tokens


@pytest.mark.parametrize(
    "dtype, dim, causal, with_mask, held",
    [
        pytest.param(fp16, 4, False, True, True, id="fp16-dim4-mask-math"),
        pytest.param(bf16, 64, True, False, False, id="bf16-dim64-causal-flash"),
        pytest.param(fp16, 8, False, True, False, id="fp16-dim8-mask-efficient"),
    ],
)
def test_the_scores_are_held_where_cuda_takes_the_math_path(dtype, dim, causal, with_mask, held):
    peak, scores = _attention_peak(dtype, dim, causal, with_mask)
    with sdpa_kernel([SDPBackend.MATH]):  # every kernel's choice: the math path
        math_peak, _ = _attention_peak(dtype, dim, causal, with_mask)
    if held:
        assert peak == math_peak
    else:  # at least the fp32 scores (the math path upcasts 16-bit inputs) fewer
        assert peak <= math_peak - 4 * scores, (peak, math_peak, scores)


def test_without_the_rule_the_cpu_choice_decides():
    with rules_set(cuda_attention=False):
        peak, scores = _attention_peak(fp16, 4, False, True)
    with sdpa_kernel([SDPBackend.MATH]):
        math_peak, _ = _attention_peak(fp16, 4, False, True)
    assert peak <= math_peak - 4 * scores  # the CPU's fused kernel takes the mask: no scores


class Attention(torch.nn.Module):
    """One attention layer; ``mask``: a left-padded causal mask (a buffer), else ``is_causal``."""

    def __init__(self, width, heads, tokens, mask):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.heads = heads
        if mask:
            m = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril()
            m[..., :10] = False
            m[..., :10, 0] = True
            self.register_buffer("mask", m)
        else:
            self.mask = None

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.mask is None
        )
        return self.proj(a.transpose(1, 2).reshape(B, T, D))


def _model_peaks(dtype, width, heads, mask):
    """The planned and the measured peak of device 0 for one forward_backward of an attention
    model on emu (2 microbatches of 2 sequences of 128 tokens)."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    model = RoundPipe(
        torch.nn.Sequential(Attention(width, heads, 128, mask), torch.nn.Linear(width, width)).to(
            dtype
        ),
        optim_dtype=torch.float32,
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    x = torch.randn(4, 128, width).to(dtype)

    def loss_fn(out, _):
        return out.float().square().mean()

    plan = model.memory_plan(input_args=(x,), loss_fn=loss_fn)
    gc.collect()
    base = memory.memory_allocated(0)
    memory.reset_peak_memory_stats(0)
    model.forward_backward(input_args=(x,), loss_fn=loss_fn)
    return plan.devices[0].peak, memory.max_memory_allocated(0) - base


@pytest.mark.parametrize(
    "dtype, width, heads, mask, held",
    [
        pytest.param(fp16, 16, 4, True, True, id="fp16-dim4-mask"),
        pytest.param(bf16, 128, 2, False, False, id="bf16-dim64-causal"),
    ],
)
def test_a_model_holds_the_scores_in_its_plan_and_its_run_where_cuda_would(
    dtype, width, heads, mask, held
):
    planned, measured = _model_peaks(dtype, width, heads, mask)
    with rules_set(cuda_attention=False):  # the CPU's fused kernel, no scores
        planned_fused, measured_fused = _model_peaks(dtype, width, heads, mask)
    scores = 2 * heads * 128 * 128 * 4  # one microbatch's fp32 scores
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)
    if held:
        assert measured - measured_fused >= scores, (measured, measured_fused, scores)
        assert planned - planned_fused >= scores, (planned, planned_fused, scores)
    else:
        assert (planned, measured) == (planned_fused, measured_fused)
