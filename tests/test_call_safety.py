"""A call's own mistakes caught: microbatches of different sizes weighted right (or warned about),
and a call that stops at its first failure."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import MicrobatchInfo, RoundPipe, RoundPipeRunConfig, UnevenMicrobatchWarning

POOLS = ["cpu", "cpu:2", "emu", "emu:2"]


def _seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


@pytest.mark.parametrize("devices", POOLS)
def test_a_loss_fn_that_takes_the_microbatch_weights_uneven_splits_to_the_batch_mean(devices):
    seq = _seq()
    ref = copy.deepcopy(seq)
    x, y = _batch(10)  # 3, 3, 2, 2
    model = RoundPipe(seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    seen = []

    def loss_fn(out, label, mb):
        seen.append(mb)
        return F.mse_loss(out, label) * mb.share

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnevenMicrobatchWarning)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    expected = F.mse_loss(ref(x), y)
    expected.backward()
    assert torch.allclose(loss, expected.detach(), rtol=1e-5)
    for master, p in zip(model.optim_parameters(), ref.parameters()):
        assert torch.allclose(master.grad, p.grad, rtol=1e-5, atol=1e-7)
    assert sorted((mb.index, mb.size) for mb in seen) == [(0, 3), (1, 3), (2, 2), (3, 2)]
    assert all(
        isinstance(mb, MicrobatchInfo) and mb.batch_size == 10 and mb.num_microbatch == 4
        for mb in seen
    )


def test_an_uneven_split_with_a_two_argument_loss_fn_warns_once_per_model():
    model = RoundPipe(_seq(), devices="cpu", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    x, y = _batch(10)
    with pytest.warns(UnevenMicrobatchWarning, match=r"microbatches of 3, 3, 2, 2.*mb\.share"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: F.mse_loss(o, t) / 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: F.mse_loss(o, t) / 4)
        even = RoundPipe(
            _seq(), devices="cpu", model_run_config=RoundPipeRunConfig(num_microbatch=4)
        )
        x8, y8 = _batch(8)
        even.forward_backward(input_args=(x8,), label=y8, loss_fn=lambda o, t: F.mse_loss(o, t) / 4)


@pytest.mark.parametrize("devices", POOLS)
def test_a_call_stops_at_its_first_failure(devices):
    # loss_fn fails on microbatch 1 of 4: no loss_fn of a later microbatch runs, and the model
    # trains again afterwards.
    model = RoundPipe(
        _seq(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    x, y = _batch(8)
    calls = []

    def loss_fn(out, label, mb):
        calls.append(mb.index)
        if mb.index == 1:
            raise ValueError("bad microbatch")
        return F.mse_loss(out, label) * mb.share

    with pytest.raises(ValueError, match="bad microbatch"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    assert calls == [0, 1]
    assert all(m.grad is None for m in model.optim_parameters())
    calls.clear()
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda o, t, mb: F.mse_loss(o, t) * mb.share
    )
    assert all(m.grad is not None for m in model.optim_parameters())
