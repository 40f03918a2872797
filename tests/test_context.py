"""A per-microbatch context (roundpipe.WithContext): what the first layer returns beside its output
reaches every later layer that takes it, on its own device, in its microbatch's slice, and the
recompute sees the very tensors the forward saw."""

import copy

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, WithContext


class Embed(nn.Module):
    """Returns the hidden state and, as context, a per-row scale and an additive bias."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x, scale):
        h = self.proj(x)
        return WithContext(
            h, {"scale": scale.unsqueeze(-1), "bias": torch.full((8,), 0.5, device=h.device)}
        )


class Block(nn.Module):
    takes_context = True
    seen: list = []  # (phase, id of the scale tensor, device) as each call saw them

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, context):
        Block.seen.append((torch.is_grad_enabled(), id(context["scale"]), str(h.device)))
        return torch.tanh(self.lin(h) * context["scale"] + context["bias"])


def _seq():
    torch.manual_seed(0)
    return nn.Sequential(Embed(), Block(), nn.Linear(8, 8), Block(), nn.Linear(8, 1))


def _reference(seq, x, scale):
    embed = seq[0](x, scale)
    h, ctx = embed.output, embed.context
    for layer in list(seq)[1:]:
        h = layer(h, ctx) if getattr(layer, "takes_context", False) else layer(h)
    return h


def _loss(out, _):
    return out.square().sum()


@pytest.mark.parametrize("devices", ["cpu", "cpu:2", "emu", "emu:2"])
@pytest.mark.parametrize("num_microbatch", [1, 4])
def test_context_reaches_later_layers_and_gradients_equal_plain_pytorch(devices, num_microbatch):
    seq = _seq()
    ref = copy.deepcopy(seq)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    scale = torch.linspace(0.5, 2.0, 8)
    model = RoundPipe(
        seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)
    )
    loss = model.forward_backward(input_args=(x, scale), loss_fn=_loss)
    expected = _reference(ref, x, scale).square().sum()
    expected.backward()
    assert torch.allclose(loss, expected.detach(), rtol=1e-5)
    for (name, master), p in zip(model.optim_named_parameters(), ref.parameters()):
        assert torch.allclose(master.grad, p.grad, rtol=1e-5, atol=1e-6), name
    with torch.no_grad():
        out = model(x, scale)
    assert torch.allclose(out, _reference(ref, x, scale).detach(), rtol=1e-5)


@pytest.mark.parametrize("devices", ["cpu", "emu", "emu:2"])
def test_the_recompute_sees_the_forwards_context_tensors(devices):
    Block.seen.clear()
    model = RoundPipe(
        _seq(),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=[1, 1, 1, 2]),
        memory_check=False,  # its fake-tensor trace would call Block too: count real runs only
    )
    x = torch.randn(4, 4)
    model.forward_backward(input_args=(x, torch.ones(4)), loss_fn=_loss)
    # Stage 1's Block runs in the forward and again in its recompute, stage 3's (the last
    # stage, no recompute) once: three calls per microbatch, all with the same context tensor
    # object, on the one device that runs both Blocks.
    by_call = {}
    for grad, ident, device in Block.seen:
        by_call.setdefault((ident, device), []).append(grad)
    assert len(by_call) == 2, by_call  # one context per microbatch
    assert all(len(v) == 3 for v in by_call.values()), by_call


def test_context_is_moved_once_per_device_and_microbatch(monkeypatch):
    from roundpipe.devices import AcceleratorBackend

    moved = []
    to_device = AcceleratorBackend.to_device

    def recording(self, tree, after=None):
        if isinstance(tree, dict) and "scale" in tree:
            moved.append(str(self.torch_device))
        return to_device(self, tree, after)

    monkeypatch.setattr(AcceleratorBackend, "to_device", recording)
    model = RoundPipe(
        _seq(), devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    model.forward_backward(input_args=(torch.randn(8, 4), torch.ones(8)), loss_fn=_loss)
    # The Blocks are stages 1 and 3, both on emu:1: each microbatch's context goes there once,
    # for the forward and the recompute of both.
    assert sorted(moved) == ["emu:1"] * 4


def test_context_carries_no_gradient():
    class LeakyEmbed(Embed):
        def forward(self, x, scale):
            h = self.proj(x)
            return WithContext(
                h, {"scale": (h[:, :1] * 0 + 1), "bias": torch.zeros(8, device=h.device)}
            )

    seq = nn.Sequential(LeakyEmbed(), Block(), nn.Linear(8, 1))
    model = RoundPipe(seq, devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    model.forward_backward(input_args=(torch.randn(4, 4), torch.ones(4)), loss_fn=_loss)
    # The embedding's gradient comes through the hidden state alone: a context made from the
    # hidden state is detached, so it adds nothing.
    ref = copy.deepcopy(seq)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    model.optim_parameters()
    for m in model.optim_parameters():
        m.grad = None
    model.forward_backward(input_args=(x, torch.ones(4)), loss_fn=_loss)
    embed = ref[0](x, torch.ones(4))
    h = ref[1](embed.output, {k: v.detach() for k, v in embed.context.items()})
    ref[2](h).square().sum().backward()
    for master, p in zip(model.optim_parameters(), ref.parameters()):
        assert torch.allclose(master.grad, p.grad, rtol=1e-5, atol=1e-6)
