"""TrainingMonitor: what it records, that record() never waits for the optimizer thread, where it
places skipped steps, and the PNG plot."""

import math
import sys
import threading

import pytest
import torch
from torch import nn

from roundpipe import GradScaler, TrainingMonitor, optim_thread

OVERFLOW_AT = {3, 4, 9, 15}


class Loop:
    """A tiny AMP loop whose step runs on the optimizer thread (as model.step launches it) or on
    the main thread. Gradients are computed on the main thread from constants and handed to the
    master inside the step, so the two threads never share a tensor that is being written."""

    def __init__(self, scaler, on_thread):
        self.scaler, self.on_thread = scaler, on_thread
        self.master = nn.Parameter(torch.ones(4))
        self.opt = torch.optim.SGD([self.master], lr=0.01)
        self.const = torch.linspace(0.5, 2.0, 4, requires_grad=True)
        self.monitor = TrainingMonitor(scaler)
        self.true_loss, self.scale_used, self.skipped = [], [], []

    def iteration(self, it, barrier=False):
        if barrier:
            optim_thread.synchronize()  # the previous update has finished: see the note in the test
        scaler = self.scaler
        raw = (self.const * self.const).sum() * (math.inf if it in OVERFLOW_AT else 1.0 + it)
        self.true_loss.append(raw.item())
        self.scale_used.append(scaler.get_scale())
        loss = scaler.scale(raw)
        (grad,) = torch.autograd.grad(loss, [self.const])
        self.monitor.record(loss.detach(), scaled=True)

        def step():
            self.master.grad = grad
            scaler.step(self.opt)
            self.skipped.append(scaler.step_was_skipped(self.opt))
            self.opt.zero_grad()

        if self.on_thread:
            optim_thread.launch(step)
        else:
            step()
        scaler.update()


def _run(on_thread, iters=20, barrier=False, **scaler_kwargs):
    loop = Loop(
        GradScaler("cpu", init_scale=2.0**10, growth_interval=3, **scaler_kwargs), on_thread
    )
    for it in range(iters):
        loop.iteration(it, barrier=barrier)
    optim_thread.synchronize()
    return loop


def test_sync_loop_records_unscaled_loss_scale_in_use_and_skipped_iterations():
    loop = _run(on_thread=False)
    hist = loop.monitor.history()
    assert hist.iterations == list(range(20))
    assert hist.scale == loop.scale_used
    assert len(set(hist.scale)) > 2  # it backed off and grew: the test sees a changing scale
    for got, want in zip(hist.loss, loop.true_loss):
        assert got == pytest.approx(want, rel=1e-6) or (math.isinf(got) and math.isinf(want))
    assert hist.skipped_iterations == sorted(OVERFLOW_AT)
    assert [i for i, s in enumerate(loop.skipped) if s] == sorted(OVERFLOW_AT)
    assert hist.skipped_steps == len(OVERFLOW_AT)


def test_async_loop_places_skipped_steps_on_the_iteration_that_was_skipped():
    # In async mode the scaler's counters come from an update that runs behind the loop. With a
    # barrier before each record, every record sees exactly one more update than the one before,
    # so the placement must be exact: the monitor counts by update number, not by when it saw it.
    loop = _run(on_thread=True, barrier=True)
    hist = loop.monitor.history()
    assert [i for i, s in enumerate(loop.skipped) if s] == sorted(OVERFLOW_AT)
    assert hist.skipped_iterations == sorted(OVERFLOW_AT)
    assert hist.scale == loop.scale_used
    assert loop.scale_used[:2] == [2.0**10, 2.0**10]  # lag one: the first overflow shows late


def test_async_loop_without_barrier_counts_every_skipped_step():
    loop = _run(on_thread=True, iters=40)
    hist = loop.monitor.history()
    assert hist.skipped_steps == sum(loop.skipped) == len(OVERFLOW_AT)
    assert len(hist.skipped_iterations) == len(OVERFLOW_AT)
    for it in hist.skipped_iterations:  # the snapshot lags at most two updates behind
        assert min(abs(it - s) for s in OVERFLOW_AT) <= 1


def test_record_never_waits_for_a_running_step():
    scaler = GradScaler("cpu")
    monitor = TrainingMonitor(scaler)
    scaler.scale(torch.ones(()))
    release, started = threading.Event(), threading.Event()

    def slow_step():
        started.set()
        assert release.wait(timeout=30), "the test never released the step"

    optim_thread.launch(slow_step)
    assert started.wait(timeout=30)
    try:
        monitor.record(torch.tensor(1.5))  # would hang until the timeout if it waited
        assert not release.is_set()
        assert len(monitor) == 1
    finally:
        release.set()
        optim_thread.synchronize()
    assert monitor.history().loss == [1.5]


def test_record_stores_a_detached_tensor_and_converts_lazily():
    monitor = TrainingMonitor()
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    monitor.record(loss)
    stored = monitor._records[0].loss._value
    assert isinstance(stored, torch.Tensor) and not stored.requires_grad
    monitor.record(2.5)
    hist = monitor.history()
    assert hist.loss == [6.0, 2.5] and hist.scale == [] and hist.skipped_iterations == []
    assert isinstance(monitor._records[0].loss._value, float)  # converted once, by history()


def test_bad_input():
    with pytest.raises(ValueError, match="scalar"):
        TrainingMonitor().record(torch.ones(2))
    with pytest.raises(ValueError, match="TrainingMonitor\\(scaler\\)"):
        TrainingMonitor().record(torch.ones(()), scaled=True)


def test_first_iteration_and_disabled_scaler():
    monitor = TrainingMonitor(GradScaler("cpu", enabled=False), first_iteration=100)
    monitor.record(torch.tensor(3.0), scaled=True)
    monitor.record(torch.tensor(2.0), scaled=True)
    hist = monitor.history()
    assert hist.iterations == [100, 101]
    assert hist.loss == [3.0, 2.0] and hist.scale == [1.0, 1.0]


def test_save_plot_writes_a_png(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    loop = _run(on_thread=True, barrier=True)
    path = tmp_path / "training.png"
    loop.monitor.save_plot(path, title="test run")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.shape[:2] == (600, 800)
    # Skipped steps are drawn in red (tab:red = #d62728): some strongly red pixels exist.
    red = (pixels[..., 0] > 0.75) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)
    assert red.sum() > 20


def test_save_plot_without_scaler(tmp_path):
    pytest.importorskip("matplotlib")
    monitor = TrainingMonitor()
    for v in (3.0, 2.0, 1.5):
        monitor.record(v)
    monitor.save_plot(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_save_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    monitor = TrainingMonitor()
    monitor.record(1.0)
    with pytest.raises(ImportError, match=r"pip install matplotlib.*pip install -e '\.\[plot\]'"):
        monitor.save_plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_long_run_does_not_keep_a_tensor_per_iteration(monkeypatch):
    import roundpipe.monitor as monitor_module

    monkeypatch.setattr(monitor_module, "_KEEP_LAZY", 8)
    monitor = TrainingMonitor()
    for i in range(40):
        monitor.record(torch.tensor(float(i)))
    values = [r.loss._value for r in monitor._records]
    assert all(isinstance(v, float) for v in values[:24])  # compacted without being asked
    assert all(isinstance(v, torch.Tensor) for v in values[-8:])  # the newest stay lazy
    assert monitor.history().loss == [float(i) for i in range(40)]


def _pool_run(devices, num_stages, iters=8, overflow_at=(2, 5)):
    """A RoundPipe loop (fp16 stages, async step) that records with a monitor; returns the
    history and every snapshot taken. The scaler lives where the loss is: on the last stage's
    device."""
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(6, 6) for _ in range(num_stages)]).half()
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler(init_scale=2.0**8, growth_interval=2)
    monitor = TrainingMonitor(scaler)
    x, y = torch.randn(4, 6).half(), torch.randn(4, 6)
    factor, snapshots = [1.0], []

    def loss_fn(out, label):
        loss = nn.functional.mse_loss(out.float(), label.to(out.device)) * factor[0]
        return scaler.scale(loss) / 2

    for it in range(iters):
        factor[0] = math.inf if it in overflow_at else 1.0
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        monitor.record(loss, scaled=True)
        snapshots.append(scaler.snapshot())
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
    model.synchronize()
    snapshots.append(scaler.snapshot())
    return monitor.history(), snapshots


@pytest.mark.parametrize("num_stages", [2, 3])  # the last stage on emu:1, then on emu:0
def test_history_and_snapshots_wherever_the_last_stage_sits(num_stages):
    # The scaler's published numbers and the recorded losses are copied from the last stage's
    # device; reading them must wait for that device's copy, not device 0's.
    reference, ref_snaps = _pool_run("cpu:2", num_stages)
    hist, snaps = _pool_run("emu:2", num_stages)
    assert hist == reference and snaps == ref_snaps
    assert hist.skipped_iterations == [2, 5] and hist.skipped_steps == 2
    assert [it for it, v in enumerate(hist.loss) if not math.isfinite(v)] == [2, 5]
    assert hist.scale == [s.scale_in_use for s in snaps[:-1]]
