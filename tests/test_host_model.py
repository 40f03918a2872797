"""A model handed to roundpipe on a device (``model.to(device)``, as a script written for the
plain Trainer does) is moved back to host memory with a warning that says so, by
``roundpipe.hf.wrap`` and by ``RoundPipe``: it trains as the same model built in host memory,
with its weights in host memory, and the wrap's self-check passes (no ``WrapCheckError`` whose
advice, ``check=False``, would train with the weights left on the device)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import OptimizerCtx

sys.path.insert(0, str(Path(__file__).parent))

DEVICE = "emu:0"  # the emulated accelerator (tests/conftest.py installs it)


def _train(model, batches, forward_backward):
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        losses.append(float(forward_backward(model, batch)))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return losses


def test_wrap_moves_a_model_on_the_device_to_host_memory_and_trains_it_as_one_built_there():
    pytest.importorskip("transformers")
    from trainer_common import tiny_llama

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 60, (2, 6), generator=g) for _ in range(2)]

    def step(model, ids):
        return model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})

    host = roundpipe.hf.wrap(tiny_llama(), devices="cpu")  # equal to emu's, bit for bit
    want = _train(host, batches, step)
    on_device = tiny_llama().to(DEVICE)
    with pytest.warns(UserWarning, match=r"roundpipe.hf.wrap: the model is on emu:0.*moved") as w:
        model = roundpipe.hf.wrap(on_device, devices="emu")
    assert w[0].filename == __file__  # it points at the user's line
    assert {p.device.type for p in on_device.parameters()} == {"cpu"}
    assert {b.device.type for b in on_device.buffers()} == {"cpu"}
    assert _train(model, batches, step) == want
    assert {p.device.type for p in on_device.parameters()} == {"cpu"}  # still there
    for (name, p), q in zip(on_device.named_parameters(), host.hf_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_roundpipe_moves_a_module_on_the_device_to_host_memory():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = RoundPipeOf(seq, on_device=False)
    moved = RoundPipeOf(seq, on_device=True)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))

    def step(model, _):
        return model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda out, lbl: nn.functional.cross_entropy(out, lbl)
        )

    assert _train(moved.model, [0, 1], step) == _train(reference.model, [0, 1], step)
    assert {p.device.type for p in moved.module.parameters()} == {"cpu"}


class RoundPipeOf:
    """A RoundPipe on the emulated device of a copy of ``seq``, handed over on the device
    (with the warning checked) or in host memory."""

    def __init__(self, seq, on_device):
        import copy

        self.module = copy.deepcopy(seq)
        if not on_device:
            self.model = roundpipe.RoundPipe(self.module, devices="emu")
            return
        self.module.to(DEVICE)
        with pytest.warns(UserWarning, match=r"RoundPipe: the model is on emu:0.*\.to\('cpu'\)"):
            self.model = roundpipe.RoundPipe(self.module, devices="emu")
