"""measure_layer_costs: one positive cost per layer, an expensive layer measured as such and given
a stage of its own by stages_by_size, and the model (and the RNG) left as it was; on the CPU
and on the emulated accelerator. No wall-clock threshold is asserted: only costs relative to
each other, with a wide margin."""

import pytest
import torch
from torch import nn

from roundpipe import measure_layer_costs, stages_by_size


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    # On a busy machine, an op split over two threads waits for whichever is descheduled; one
    # thread keeps the timings of small layers steadier.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Repeated(nn.Module):
    """``times`` matmuls with one weight: about ``times`` Linears' work for one Linear's bytes."""

    def __init__(self, width: int, times: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = x @ self.weight
        return x


class Fails(nn.Module):
    def forward(self, x):
        raise KeyError("broken layer")


def _state(seq):
    """Everything measure_layer_costs must leave alone."""
    return (
        [(p, p.detach().clone(), p.requires_grad, p.grad) for p in seq.parameters()],
        [(b, b.clone()) for b in seq.buffers()],
        [(m, m.training) for m in seq.modules()],
    )


def _assert_same(seq, before):
    params, buffers, flags = before
    assert list(seq.parameters()) == [p for p, *_ in params]  # the same objects
    for p, value, requires_grad, grad in params:
        assert torch.equal(p, value) and p.device.type == "cpu"
        assert p.requires_grad == requires_grad and p.grad is grad
    assert list(seq.buffers()) == [b for b, _ in buffers]
    for b, value in buffers:
        assert torch.equal(b, value)
    for m, training in flags:
        assert m.training == training


@pytest.mark.parametrize("device", ["cpu", "emu"])
def test_one_positive_cost_per_layer_and_the_model_is_left_as_it_was(device):
    torch.manual_seed(0)
    frozen = nn.Linear(16, 16)
    frozen.bias.requires_grad_(False)
    quiet = nn.Dropout(0.5).eval()  # one module in eval mode, the rest in training mode
    seq = nn.Sequential(
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.BatchNorm1d(16),
        frozen,
        nn.Sequential(quiet, nn.Tanh()),
    )
    x = torch.randn(8, 16)
    before, rng = _state(seq), torch.get_rng_state()
    costs = measure_layer_costs(seq, x, device=device, repeats=2)
    assert len(costs) == len(seq)
    assert all(isinstance(c, float) and c > 0 for c in costs)  # parameterless layers too
    _assert_same(seq, before)
    # Dropout drew and BatchNorm updated running statistics, but not the global generator's
    # state nor the model's buffers.
    assert torch.equal(torch.get_rng_state(), rng)
    assert not x.requires_grad


@pytest.mark.parametrize("device", ["cpu", "emu"])
def test_an_expensive_layer_costs_more_and_gets_a_stage_of_its_own(device):
    torch.manual_seed(0)
    width = 64
    seq = nn.Sequential(
        nn.Linear(width, width),
        nn.Linear(width, width),
        Repeated(width, times=50),
        nn.Linear(width, width),
        nn.Linear(width, width),
        nn.Linear(width, width),
    )
    costs = measure_layer_costs(seq, torch.randn(16, width), device=device, repeats=7)
    heavy, cheap = costs[2], costs[:2] + costs[3:]
    assert heavy > 5 * max(cheap), costs
    # By bytes the six layers are alike; by time the expensive one is a stage of its own.
    assert stages_by_size(seq, num_stages=3) == [2, 2, 2]
    assert stages_by_size(seq, num_stages=3, costs=costs) == [2, 1, 3], costs


def test_forward_only_and_a_dtype_measure_without_casting_the_model():
    seq = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    before = _state(seq)
    for kwargs in ({"backward": False}, {"dtype": torch.bfloat16}):
        costs = measure_layer_costs(seq, torch.randn(4, 8), device="cpu", repeats=1, **kwargs)
        assert len(costs) == 3 and all(c > 0 for c in costs)
    _assert_same(seq, before)
    assert all(p.dtype == torch.float32 for p in seq.parameters())


def test_nested_outputs_flow_to_the_next_layer():
    class Split(nn.Module):
        def forward(self, x):
            return {"a": x, "pair": (x * 2, torch.arange(3))}

    class Join(nn.Module):
        def forward(self, tree):
            assert tree["pair"][1].dtype == torch.int64
            return tree["a"] + tree["pair"][0]

    seq = nn.Sequential(nn.Linear(4, 4), Split(), Join(), nn.Linear(4, 1))
    assert len(measure_layer_costs(seq, torch.randn(2, 4), device="cpu", repeats=1)) == 4


def test_a_failing_layer_is_named_and_the_model_is_restored():
    seq, x = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Fails()), torch.randn(2, 4)
    before, rng = _state(seq), torch.get_rng_state()
    with pytest.raises(KeyError, match="broken layer") as info:
        measure_layer_costs(seq, x, device="cpu")
    assert any("layer 2 (Fails), forward" in note for note in info.value.__notes__)
    _assert_same(seq, before)
    assert torch.equal(torch.get_rng_state(), rng)
    # The layer's own tensors are back in place, not the measurement's copies.
    assert seq[1].running_mean is before[1][0][0] and seq[0].weight is before[0][0][0]


def test_misuse_is_rejected_with_the_fix():
    from roundpipe import RoundPipe

    seq = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="nn.Sequential"):
        measure_layer_costs(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="repeats"):
        measure_layer_costs(seq, torch.randn(1, 2), repeats=0)
    with pytest.raises(ValueError, match="dtype"):
        measure_layer_costs(seq, torch.randn(1, 2), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"model\.module"):
        measure_layer_costs(
            RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices="cpu"), torch.randn(1, 2)
        )
