"""Device specs, the worker threads and their futures."""

import threading

import pytest
import torch

from roundpipe.devices import (
    DevicePool,
    Future,
    WorkerDevice,
    get_worker,
    parse_devices,
    resolve_devices,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_parse_cpu_forms():
    assert parse_devices("cpu") == (WorkerDevice("cpu", 0),)
    assert parse_devices("cpu:3") == tuple(WorkerDevice("cpu", i) for i in range(3))
    assert parse_devices(torch.device("cpu")) == (WorkerDevice("cpu", 0),)


@pytest.mark.parametrize("bad", ["gpu", "cpu:0", "cpu:x", "cuda:a", "", "cpu,cuda"])
def test_bad_spec_names_accepted_forms(bad):
    with pytest.raises(ValueError, match="cpu:N"):
        parse_devices(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_clear():
    with pytest.raises(ValueError, match="CUDA"):
        parse_devices("cuda")
    with pytest.raises(ValueError, match="cuda:1"):
        parse_devices("cuda:1")


def test_argument_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_DEVICES", "cpu:2")
    assert len(resolve_devices()) == 2
    assert len(resolve_devices("cpu:3")) == 3
    monkeypatch.delenv("ROUNDPIPE_DEVICES")
    default = resolve_devices()
    assert default[0].type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert len(default) == 1
    monkeypatch.setenv("ROUNDPIPE_DEVICES", "tpu")
    with pytest.raises(ValueError, match="ROUNDPIPE_DEVICES"):
        resolve_devices()


def test_worker_runs_in_order_and_reraises():
    worker = get_worker(WorkerDevice("cpu", 7))
    seen = []
    futs = [worker.submit(seen.append, i) for i in range(5)]
    err = KeyError("boom")

    def fail():
        raise err

    bad = worker.submit(fail)
    after = worker.submit(lambda: threading.current_thread().name)
    assert after.result() == "roundpipe-worker-cpu#7"
    assert [f.result() for f in futs] == [None] * 5 and seen == list(range(5))
    with pytest.raises(KeyError) as info:
        bad.result()
    assert info.value is err
    assert bad.exception() is err


@pytest.mark.cpu_pool_only
def test_one_worker_per_device_process_wide():
    assert get_worker(WorkerDevice("cpu", 0)) is get_worker(WorkerDevice("cpu", 0))
    pool = DevicePool("cpu:2")
    assert pool.worker(1) is get_worker(WorkerDevice("cpu", 1))


def test_future_set_before_wait():
    f = Future()
    f.set_result(3)
    assert f.done() and f.result() == 3


ACCELERATORS = ["emu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.cpu_pool_only
@pytest.mark.parametrize("kind", ACCELERATORS)
def test_accelerator_pool_and_backend_roundtrip(kind):
    pool = DevicePool(f"{kind}:0" if kind == "cuda" else kind)
    backend = pool.backends[0]
    lin = torch.nn.Linear(3, 2)
    backend.prepare_host(lin)
    assert lin.weight.is_pinned()  # uploads from pinned memory
    with backend.action_context():
        x = backend.to_device((torch.ones(3),))[0]
        resident = backend.upload([lin], [lin.weight, lin.bias], leaves=True)
        y = backend.call_layer(lin, (x,), {}, resident)
        g = torch.autograd.grad(y.sum(), resident.leaves)
        (host_g, _), arrived = backend.download(list(g))
        arrived.synchronize()
        backend.release(resident, write_back=True)
    assert y.device.type == kind and g[0].device.type == kind
    assert host_g.device.type == "cpu" and host_g.is_pinned()
    torch.testing.assert_close(host_g, torch.ones(2, 1).expand(2, 3))


@pytest.mark.cpu_pool_only
@pytest.mark.parametrize("kind", ACCELERATORS)
def test_accelerator_backend_writes_back_batchnorm_stats(kind):
    backend = DevicePool(f"{kind}:0" if kind == "cuda" else kind).backends[0]
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)

    def run(write_back):
        with backend.action_context():
            resident = backend.upload([bn], [], leaves=False)
            backend.call_layer(bn, backend.to_device((x,)), {}, resident)
            backend.release(resident, write_back=write_back)

    run(write_back=False)  # a recompute: its update is dropped
    assert bn.num_batches_tracked.item() == 0
    run(write_back=True)  # a forward run
    assert bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(bn.running_mean, 0.1 * x.mean(0))
    bn.eval()
    before = bn.running_mean.clone()
    run(write_back=True)
    assert torch.equal(bn.running_mean, before)


@pytest.mark.cpu_pool_only
@pytest.mark.parametrize("kind", ACCELERATORS)
def test_accelerator_forward_backward_matches_cpu(kind):
    from roundpipe import RoundPipe, RoundPipeRunConfig

    grads = []
    for devices in ("cpu", kind):
        torch.manual_seed(0)
        seq = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        model = RoundPipe(
            seq, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        loss = model.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).sum())
        assert loss.device.type == "cpu"
        grads.append([m.grad for m in model.optim_parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.cpu_pool_only
def test_emu_installed_after_a_backward_says_how_to_install_it_first():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "w = torch.ones(2, requires_grad=True); (w * 2).sum().backward()\n"
        "from roundpipe import RoundPipe\n"
        "RoundPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), devices='emu')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "ROUNDPIPE_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 1
    assert "installed after this process's first backward()" in proc.stderr
    assert "ROUNDPIPE_DEVICES=emu" in proc.stderr
