"""torch.autocast("emu") with CUDA's cast policy (see [Note: emulated autocast] in
roundpipe.testing.emu): the ops CUDA's autocast runs in fp32 return fp32 on the emulated device,
the matmul-like ones the autocast dtype, mixed inputs of the promote list the widest dtype."""

import pytest
import torch
import torch.nn.functional as F

from roundpipe.testing.emu import rules_set

EMU = torch.device("emu:0")


def _half(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).half().to(EMU)


# (op, what CUDA's autocast returns for fp16 inputs under autocast(dtype=fp16))
FP32_LIST = [
    ("softmax", lambda x: torch.softmax(x, -1)),
    ("log_softmax", lambda x: F.log_softmax(x, -1)),
    ("layer_norm", lambda x: F.layer_norm(x, (8,))),
    ("rms_norm", lambda x: F.rms_norm(x, (8,))),
    ("sum", lambda x: x.sum()),
    ("pow", lambda x: x.pow(2)),
    ("exp", lambda x: x.exp()),
    ("cross_entropy", lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=EMU))),
    ("mse_loss", lambda x: F.mse_loss(x, x.detach())),
    ("cumsum", lambda x: x.cumsum(0)),
    ("norm", lambda x: x.norm()),
]


@pytest.mark.parametrize("name, op", FP32_LIST, ids=[n for n, _ in FP32_LIST])
def test_fp32_list_ops_return_fp32_as_on_cuda(name, op):
    x = _half(4, 8)
    with torch.autocast("emu", dtype=torch.float16):
        out = op(x)
    assert out.dtype == torch.float32, name
    torch.testing.assert_close(out.cpu(), op(x.float()).cpu(), rtol=1e-4, atol=1e-4)


def test_matmuls_take_the_autocast_dtype_and_mixed_inputs_promote():
    a32 = torch.randn(4, 8, device=EMU)
    with torch.autocast("emu", dtype=torch.bfloat16):
        assert (a32 @ a32.T).dtype == torch.bfloat16
        assert F.linear(a32, a32).dtype == torch.bfloat16
        assert torch.addcmul(a32, _half(4, 8), _half(4, 8)).dtype == torch.float32
        assert torch.add(_half(4, 8), 1).dtype == torch.float16  # on no list: as it comes


def test_binary_cross_entropy_is_refused_as_on_cuda():
    p = torch.sigmoid(_half(4, 8))
    with (
        torch.autocast("emu", dtype=torch.float16),
        pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"),
    ):
        F.binary_cross_entropy(p, p.detach())


def test_the_lenient_rule_lowers_matmuls_only():
    x = _half(4, 8)
    with rules_set(cuda_autocast=False), torch.autocast("emu", dtype=torch.float16):
        assert torch.softmax(x, -1).dtype == torch.float16  # passes through
        assert (x.float() @ x.float().T).dtype == torch.float16
    with torch.autocast("emu", dtype=torch.float16):
        assert torch.softmax(x, -1).dtype == torch.float32  # the rule is back
