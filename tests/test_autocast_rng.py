"""Autocast and RNG state carried into the workers: forward, recompute and loss_fn under the
caller's autocast, backward never; dropout masks reproducible and independent of the workers."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, device_type):
        ctx.log, ctx.device_type = log, device_type
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(("backward", torch.is_autocast_enabled(ctx.device_type)))
        return g, None, None


class Probe(nn.Module):
    """Records the autocast state (of the pool's device type) of every forward, and of the
    backward through it."""

    def __init__(self, log, name, device_type):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log, self.name, self.device_type = log, name, device_type

    def forward(self, x):
        self.log.append(
            (
                self.name,
                torch.is_autocast_enabled(self.device_type),
                torch.get_autocast_dtype(self.device_type),
                threading.current_thread().name,
            )
        )
        return _RecordBackward.apply(self.lin(x), self.log, self.device_type)


def _run(device_type, run_config=None, caller_autocast=None):
    log = []
    torch.manual_seed(0)
    model = RoundPipe(
        nn.Sequential(Probe(log, "stage0", device_type), Probe(log, "stage1", device_type)),
        devices="cpu:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        # The first call's device-memory check runs each stage once on fake tensors, which the
        # probes would log: this test counts the real runs only.
        memory_check=False,
    )

    def loss_fn(out, y):
        log.append(
            (
                "loss_fn",
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
                threading.current_thread().name,
            )
        )
        return out.float().pow(2).mean()

    x = torch.randn(4, 4)
    if caller_autocast is not None:
        with torch.autocast(device_type, dtype=caller_autocast):
            model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=run_config)
    else:
        model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=run_config)
    return log


def test_caller_autocast_in_forward_recompute_and_loss_fn_never_in_backward(pool_kind):
    log = _run(pool_kind, caller_autocast=torch.bfloat16)
    kinds = [e[0] for e in log]
    # stage 0: forward + recompute; stage 1 (last): forward; loss_fn per microbatch.
    assert kinds.count("stage0") == 4 and kinds.count("stage1") == 2
    assert kinds.count("loss_fn") == 2 and kinds.count("backward") == 4
    # Stage 1 and loss_fn run on the worker of device 1, where the caller's autocast would not
    # reach without the runtime. On the CPU, stage 0 runs on the calling thread (CPU device 0),
    # forward and recompute. On an accelerator, stage 0's forward and its recompute both run on
    # device 0's worker: the streamed backward re-runs the stage itself before it takes the
    # gradients, rather than inside autograd (whose device thread has no worker state).
    main = threading.current_thread().name
    stage0_threads = set()
    for e in log:
        if e[0] == "backward":
            assert e[1] is False
            continue
        assert e[1:3] == (True, torch.bfloat16), e
        if e[0] == "stage0":
            stage0_threads.add(e[3])
        else:
            assert e[3] == (
                "roundpipe-worker-cpu#1" if pool_kind == "cpu" else "roundpipe-worker-emu:1"
            ), e
    if pool_kind == "cpu":
        assert stage0_threads == {main}
    else:
        assert stage0_threads == {"roundpipe-worker-emu:0"}


def test_autocast_false_disables_and_dtype_enables(pool_kind):
    log = _run(pool_kind, RoundPipeRunConfig(autocast=False), caller_autocast=torch.bfloat16)
    assert all(e[1] is False for e in log)
    log = _run(pool_kind, RoundPipeRunConfig(autocast=torch.bfloat16))
    assert all(e[1:3] == (True, torch.bfloat16) for e in log if e[0] != "backward")
    assert all(e[1] is False for e in log if e[0] == "backward")


def dropout_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Dropout(0.5),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, 2),
    )


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(6, 6, generator=g), torch.randint(0, 2, (6,), generator=g)


@pytest.mark.parametrize("recompute", [True, False])
def test_one_microbatch_one_worker_matches_plain_pytorch_with_dropout(recompute):
    x, y = data()
    model = RoundPipe(
        dropout_net(),
        devices="cpu",
        model_run_config=RoundPipeRunConfig(recompute=recompute, execute_plan=[2, 3, 2]),
    )
    torch.manual_seed(123)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
    state_after = torch.get_rng_state()

    ref = dropout_net()
    torch.manual_seed(123)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    assert torch.equal(state_after, torch.get_rng_state())  # the global RNG advanced the same
    assert torch.equal(loss, ref_loss.detach())
    for (n, master), (_, p) in zip(model.optim_named_parameters(), ref.named_parameters()):
        assert torch.equal(master.grad, p.grad), n


def test_recompute_reproduces_masks_with_several_microbatches():
    x, y = data()
    grads = []
    for recompute in (True, False):
        model = RoundPipe(
            dropout_net(),
            devices="cpu:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=3, recompute=recompute),
        )
        torch.manual_seed(5)
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
        grads.append([m.grad for m in model.optim_parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _train(devices, steps=3):
    model = RoundPipe(
        dropout_net(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    with OptimizerCtx():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(11)
    x, y = data()
    for _ in range(steps):
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return [m.detach().clone() for m in model.optim_parameters()], torch.get_rng_state()


def test_bitwise_identical_for_one_two_and_three_cpu_workers_with_dropout():
    base, rng = _train("cpu")
    for devices in ("cpu:2", "cpu:3"):
        params, rng_n = _train(devices)
        assert torch.equal(rng, rng_n)
        for a, b in zip(base, params):
            assert torch.equal(a, b), devices


def test_different_seeds_give_different_masks():
    torch.manual_seed(0)
    a = RoundPipe(dropout_net(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    b = RoundPipe(dropout_net(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    torch.manual_seed(1)
    a.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
    torch.manual_seed(2)
    b.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
    assert not torch.equal(next(a.optim_parameters()).grad, next(b.optim_parameters()).grad)


class Noise(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


def test_preserve_rng_state_covers_custom_random_layers():
    outs = []
    for devices in ("cpu", "cpu:3"):
        torch.manual_seed(0)
        model = RoundPipe(
            nn.Sequential(Noise(), Noise(), Noise()),
            devices=devices,
            model_run_config=RoundPipeRunConfig(num_microbatch=3, preserve_rng_state=True),
        )
        torch.manual_seed(3)
        with torch.no_grad():
            outs.append(model(torch.zeros(6, 2)))
    assert torch.equal(outs[0], outs[1])


class FunctionalDropout(nn.Module):
    """Randomness without an nn.Dropout module, as in hand-written attention code."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return F.dropout(torch.tanh(self.lin(x)), p=0.5, training=self.training)


def functional_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(FunctionalDropout(), nn.Linear(6, 6), FunctionalDropout(), nn.Linear(6, 3))


def test_functional_randomness_is_found_without_configuration():
    # Default config: the stages are probed on their first call and found to draw, so every
    # call, the first and the later ones, recomputes with the forward's masks.
    x, y = data()
    model = RoundPipe(functional_net(), devices="cpu")
    ref = functional_net()
    for seed in (7, 8, 9):
        torch.manual_seed(seed)
        model.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
        torch.manual_seed(seed)
        F.cross_entropy(ref(x), y).backward()
        for (n, master), (_, p) in zip(model.optim_named_parameters(), ref.named_parameters()):
            assert torch.equal(master.grad, p.grad), (seed, n)
            master.grad, p.grad = None, None


def test_functional_randomness_is_identical_across_workers():
    x, y = data()
    grads = []
    for devices in ("cpu", "cpu:2", "cpu:3"):
        model = RoundPipe(
            functional_net(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3)
        )
        for seed in (4, 5):  # the second call runs after the probe has classified the stages
            torch.manual_seed(seed)
            model.forward_backward(input_args=(x,), label=y, loss_fn=F.cross_entropy)
        grads.append([m.grad for m in model.optim_parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


def test_an_rng_scope_can_be_entered_again_after_an_error():
    # checkpoint enters a stage's recompute scope once per recompute; if a recompute fails, a
    # later one enters the same object again and must start from the same state (a one-use
    # context manager reported that as AttributeError instead of the first error).
    from roundpipe.devices import CPUBackend, WorkerDevice
    from roundpipe.runtime.rng import RNGState, rng_scope

    torch.manual_seed(3)
    start = RNGState(torch.get_rng_state())
    scope = rng_scope(start, CPUBackend(WorkerDevice("cpu", 0)))
    with pytest.raises(KeyError):
        with scope:
            torch.rand(3)
            raise KeyError("first recompute fails")
    with scope as result:
        again = torch.rand(3)
    torch.set_rng_state(start.cpu)
    assert torch.equal(again, torch.rand(3))
    assert result.drew and torch.equal(result.end.cpu, torch.get_rng_state())
