"""Gradient sums checked for inf/NaN on the device (roundpipe.scaler.finite_check): the scaler's host
pass skips the gradients the device checked, and only while they are unchanged; an overflow is
caught either way, with the same steps skipped and the same scales as on the CPU pool."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.scaler import finite_check


def build(devices):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).half()
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, GradScaler(init_scale=2.0**8)


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g).half(), torch.randint(4, (8,), generator=g)


def masters(model):
    with OptimizerCtx():
        return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def host_checks(monkeypatch):
    """The device types of every tensor list torch's inf/NaN pass is given, call by call."""
    calls = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def spy(tensors, found, inv_scale):
        calls.append({t.device.type for t in tensors})
        return real(tensors, found, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", spy)
    return calls


def one_iteration(model, opt, scaler, i, edit=None, poison=False):
    x, y = batch(i)

    def loss_fn(out, lbl):
        loss = scaler.scale(F.cross_entropy(out.float(), lbl.to(out.device))) / 2
        return loss * math.inf if poison else loss

    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)

    def step():
        if edit is not None:
            edit()
        scaler.step(opt)
        opt.zero_grad()

    return step


@pytest.mark.parametrize("devices,host_pass", [("emu", False), ("emu:2", False), ("cpu", True)])
def test_the_step_reads_gradients_on_the_host_only_where_the_device_did_not_check_them(
    devices, host_checks, host_pass
):
    model, opt, scaler = build(devices)
    step = one_iteration(model, opt, scaler, 0)
    roundpipe.optim_thread.synchronize()  # the gradient moves have run
    with OptimizerCtx():
        assert all(finite_check.nonfinite(p.grad) is (False if not host_pass else None)
                   for p in model.parameters())  # fmt: skip
    host_checks.clear()
    model.step(step, is_async=False)
    on_host = [c for c in host_checks if "cpu" in c]
    assert bool(on_host) is host_pass
    model.synchronize()


def test_a_gradient_edited_after_the_device_check_is_checked_on_the_host(host_checks):
    model, opt, scaler = build("emu")
    before = masters(model)

    def plant_inf():  # on the optimizer thread, where the masters' grads live
        with OptimizerCtx():
            next(iter(model.parameters())).grad[0, 0] = math.inf

    step = one_iteration(model, opt, scaler, 0, edit=plant_inf)
    roundpipe.optim_thread.synchronize()
    host_checks.clear()
    model.step(step, is_async=False)
    scaler.update()
    assert any("cpu" in c for c in host_checks)
    assert scaler.get_scale() == 2.0**7  # the overflow was seen: backed off, step skipped
    for a, b in zip(masters(model), before):
        assert torch.equal(a, b)


def test_overflows_found_on_the_device_skip_the_same_steps_as_on_the_cpu_pool():
    results = {}
    for devices in ("cpu", "emu"):
        model, opt, scaler = build(devices)
        scales = []
        for i in range(4):
            step = one_iteration(model, opt, scaler, i, poison=i in (1, 2))
            model.step(step, is_async=False)
            scaler.update()
            scales.append(scaler.get_scale())
        model.synchronize()
        results[devices] = scales, masters(model)
    (cpu_scales, cpu_masters), (emu_scales, emu_masters) = results["cpu"], results["emu"]
    assert emu_scales == cpu_scales == [2.0**8, 2.0**7, 2.0**6, 2.0**6]
    for a, b in zip(emu_masters, cpu_masters):
        torch.testing.assert_close(a, b)


def test_a_record_holds_only_while_the_tensor_is_unchanged():
    g = torch.zeros(4)
    assert finite_check.nonfinite(g) is None
    finite_check.mark(g, False)
    assert finite_check.nonfinite(g) is False
    g[1] = 1.0  # any in-place write moves the version
    assert finite_check.nonfinite(g) is None
    finite_check.mark(g, True)
    assert finite_check.nonfinite(g) is True
    finite_check.mark(g, None)
    assert finite_check.nonfinite(g) is None
    pool = torch.zeros(8)
    a, b = pool[:4], pool[4:]
    finite_check.mark(a, False)
    b.add_(1.0)  # a view of the same storage shares the version: the record is dropped
    assert finite_check.nonfinite(a) is None


def test_a_parameter_two_stages_share_stays_checked_through_the_host_add(host_checks):
    """A tied weight (as a HF model's embedding and head): each stage's sum is checked on the
    device with its largest magnitude, so their sum on the host needs no host pass."""
    grads = {}
    for devices in ("cpu", "emu"):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
        seq[2].weight = seq[0].weight
        model = RoundPipe(
            seq.half(),
            optim_dtype=torch.float32,
            devices=devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        with OptimizerCtx():
            opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
        scaler = GradScaler(init_scale=2.0**8)
        step = one_iteration(model, opt, scaler, 0)
        roundpipe.optim_thread.synchronize()
        with OptimizerCtx():
            (shared,) = [p for p in model.parameters() if p.shape == (8, 8)]
            grads[devices] = shared.grad.clone()
            if devices == "emu":
                assert all(finite_check.nonfinite(p.grad) is False for p in model.parameters())
                assert finite_check.bound(shared.grad) >= shared.grad.abs().max().item() > 0
        host_checks.clear()
        model.step(step, is_async=False)
        assert bool([c for c in host_checks if "cpu" in c]) is (devices == "cpu")
        model.synchronize()
    torch.testing.assert_close(grads["emu"], grads["cpu"])  # both stages' sums, added


def _moved(master, values, flag):
    from roundpipe.runtime.grad_router import move_grads

    flag = None if flag is None else torch.tensor(flag)
    move_grads([(master, torch.tensor(values, dtype=torch.float32))], None, flag)


def test_a_sum_whose_bounds_may_overflow_is_left_to_the_host_check():
    big = torch.finfo(torch.float32).max / 1.5
    master = nn.Parameter(torch.zeros(2))
    _moved(master, [1.0, -2.0], [0.0, 2.0])
    assert finite_check.nonfinite(master.grad) is False
    assert finite_check.bound(master.grad) == 2.0
    _moved(master, [0.5, 3.0], [0.0, 3.0])
    assert finite_check.nonfinite(master.grad) is False  # 2 + 3 cannot overflow
    assert finite_check.bound(master.grad) == 5.0
    assert master.grad.tolist() == [1.5, 1.0]

    master = nn.Parameter(torch.zeros(2))
    _moved(master, [big, 0.0], [0.0, big])
    _moved(master, [big, 0.0], [0.0, big])  # each finite, their sum is not
    assert finite_check.nonfinite(master.grad) is None  # unknown: the scaler's host pass reads it
    assert math.isinf(master.grad[0].item())

    master = nn.Parameter(torch.zeros(2))
    _moved(master, [1.0, 0.0], [0.0, 1.0])
    _moved(master, [1.0, 0.0], None)  # a part the device did not check
    assert finite_check.nonfinite(master.grad) is None
    _moved(master, [math.inf, 0.0], [1.0, 0.0])  # an inf found stays known through adds
    assert finite_check.nonfinite(master.grad) is True
