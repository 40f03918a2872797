"""RoundPipe(compile=...): the layers of a wrapped model through torch.compile (see [Note:
compiled layers] in roundpipe/runtime/compiled.py). Training equals the eager layers bit for
bit (``aot_eager``: torch's autograd graphs with eager kernels), dropout included; one
compilation serves every layer of a class; the default compiles nothing; an emulated pool
runs eagerly and says so. roundpipe.hf.wrap's compiled decoder layers: tests/test_hf_compile.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig

AOT_EAGER = {"backend": "aot_eager"}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


def model(width=32, depth=4):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, width), *(Block(width) for _ in range(depth)), nn.Linear(width, 3)
    )


def train(compile, devices="cpu:2", steps=3):
    rp = RoundPipe(
        model(),
        devices=devices,
        compile=compile,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(rp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randint(3, (16,), generator=g)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy))
        rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()
    with OptimizerCtx():
        return torch.stack(losses), [p.detach().clone() for p in rp.optim_parameters()]


def test_compiled_layers_train_as_the_eager_ones_bit_for_bit():
    """Two workers, four microbatches, dropout in every block: the recompute replays the
    forward's masks inside the compiled blocks."""
    eager_losses, eager_masters = train(False)
    losses, masters = train(AOT_EAGER)
    assert counters["stats"]["unique_graphs"] > 0
    assert torch.equal(losses, eager_losses)
    for ours, theirs in zip(masters, eager_masters):
        assert torch.equal(ours, theirs)


def test_one_compilation_serves_the_layers_of_a_class():
    """Four blocks, two linear layers of different shapes: graphs per class and shape, with
    and without grad, not per layer or per step."""
    train(AOT_EAGER)
    frames = counters["frames"]["ok"]
    assert 0 < frames <= 2 * 3, dict(counters["frames"])


def test_the_default_compiles_nothing():
    train(False)
    rp = RoundPipe(model(), devices="cpu")
    assert all(layer.compiled is None for layer in rp._stages.layers)
    train(None)  # None: CUDA only
    assert not counters["stats"]


def test_an_emulated_pool_runs_the_layers_eagerly_and_says_so():
    with pytest.warns(UserWarning, match=r"emu devices run the layers eagerly"):
        losses, _ = train(True, devices="emu:2", steps=1)
    assert not counters["stats"]
    assert torch.equal(losses, train(False, steps=1)[0])


def test_tracing_the_wrapped_parameters_does_not_warn_about_their_gradients(recwarn):
    """torch.compile reads each parameter's .grad as it traces; that read is roundpipe's own,
    not a training loop reading gradients that live on the masters."""
    train({"backend": "aot_eager"}, devices="cpu", steps=1)
    assert counters["stats"]["unique_graphs"] > 0
    assert not [w for w in recwarn if "was read, and it is None" in str(w.message)]
