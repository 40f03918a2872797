"""Stages really run at the same time on different CPU workers (proved with a barrier that
only opens when two stages are in flight together; no timing assertions)."""

import threading

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


class Meet(nn.Module):
    """Waits on ``barrier`` once, in the forward of the microbatch whose first value is ``mark``."""

    def __init__(self, barrier, mark):
        super().__init__()
        self.barrier, self.mark, self.used = barrier, mark, False
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if not self.used and x.flatten()[0].item() == self.mark:
            self.used = True
            self.barrier.wait()
        return x * 1.0 + 0.0 * self.lin(x)


def _model(devices, parties, timeout):
    barrier = threading.Barrier(parties, timeout=timeout)
    # Stage s meets microbatch (parties-1-s): all at clock tick parties-1, on different workers.
    layers = [Meet(barrier, mark=float(parties - 1 - s)) for s in range(parties)]
    return RoundPipe(
        nn.Sequential(*layers),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=parties),
    )


def _batch(parties, offset=0.0):
    return torch.arange(parties, dtype=torch.float32).repeat_interleave(2).view(parties, 2) + offset


def _warm_up(model, parties):
    # The first call of a stage runs in the RNG chain (serialised) to learn whether it draws
    # random numbers (see [Note: RNG chains]); no microbatch of this batch meets the barrier.
    with torch.no_grad():
        model(_batch(parties, offset=100.0))


@pytest.mark.parametrize("devices,parties", [("cpu:2", 2), ("cpu:3", 3)])
def test_stages_overlap_in_inference(devices, parties):
    model = _model(devices, parties, timeout=60)
    _warm_up(model, parties)
    with torch.no_grad():
        out = model(_batch(parties))
    assert torch.equal(out, _batch(parties))


def test_stages_overlap_in_forward_backward():
    model = _model("cpu:2", 2, timeout=60)
    model.forward_backward(input_args=(_batch(2, offset=100.0),), loss_fn=lambda o, _: o.sum())
    loss = model.forward_backward(input_args=(_batch(2),), loss_fn=lambda o, _: o.sum())
    assert loss.item() == 2.0 * 1.0  # microbatch 1 holds ones


def test_one_worker_cannot_meet_itself():
    # The same model on one worker serialises the stages: the barrier breaks (it would hang
    # forever without its timeout), which shows the tests above measure real overlap.
    model = _model("cpu", 2, timeout=0.5)
    _warm_up(model, 2)
    with pytest.raises(threading.BrokenBarrierError), torch.no_grad():
        model(_batch(2))
