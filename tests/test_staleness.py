"""Async steps are exactly one step stale; a checkpointed async run resumes bit for bit."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 10), nn.Tanh(), nn.Linear(10, 2))


def batch(it):
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(6, 5, generator=g), torch.randint(0, 2, (6,), generator=g)


def loss_fn(out, y):
    return F.cross_entropy(out, y) / 3


@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_async_is_the_one_step_stale_reference(devices):
    model = RoundPipe(mlp(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    # Reference: M_j = masters after j steps. Iteration k computes with M_{max(k-1, 0)} (the
    # params produced by step k-2) and step k applies its grads to the newest masters M_k.
    masters = mlp()
    ref_opt = torch.optim.SGD(masters.parameters(), lr=0.3, momentum=0.9)
    history = [{n: p.detach().clone() for n, p in masters.named_parameters()}]
    compute = mlp()
    for k in range(6):
        x, y = batch(k)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))

        compute.load_state_dict(history[max(k - 1, 0)])
        ref_loss = 0.0
        for xm, ym in zip(x.chunk(3), y.chunk(3)):
            lm = loss_fn(compute(xm), ym)
            ref_loss += lm.item()
            grads = torch.autograd.grad(lm, list(compute.parameters()))
            for p, g in zip(masters.parameters(), grads):
                p.grad = g.clone() if p.grad is None else p.grad + g
        ref_opt.step()
        ref_opt.zero_grad()
        history.append({n: p.detach().clone() for n, p in masters.named_parameters()})
        assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    optim_thread.synchronize()
    for (_, m), (_, r) in zip(model.optim_named_parameters(), masters.named_parameters()):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
    # The model itself is one step behind the masters until synchronize().
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), history[-2][n], rtol=1e-6, atol=1e-7)
    model.synchronize()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), history[-1][n], rtol=1e-6, atol=1e-7)


def test_sync_mode_is_zero_stale():
    model = RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for k in range(2):
        x, y = batch(k)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        for n, p in model.named_parameters():
            assert torch.equal(p, dict(model.optim_named_parameters())[n])


_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn.functional as F
    from torch import nn
    import roundpipe
    from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig

    mode, path, start, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 10), nn.Dropout(0.2), nn.Tanh(), nn.Linear(10, 2))
    model = RoundPipe(seq.half(), optim_dtype=torch.float32, devices="cpu:2",
                      model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    # A tiny growth interval and a huge initial scale: the run sees overflows and growth.
    scaler = GradScaler(init_scale=2.0**17, growth_interval=2)
    if mode == "resume":
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        model.load_master_state_dict(ck["masters"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        torch.set_rng_state(ck["rng"])
    for k in range(start, stop):
        g = torch.Generator().manual_seed(100 + k)
        x, y = torch.randn(6, 5, generator=g), torch.randint(0, 2, (6,), generator=g)
        model.forward_backward(
            input_args=(x,), label=y,
            loss_fn=lambda o, l: scaler.scale(F.cross_entropy(o.float(), l)) / 2)
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        if mode == "save" and k == 2:
            torch.save({"model": model.state_dict(), "masters": model.master_state_dict(),
                        "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                        "rng": torch.get_rng_state()}, path)
    model.synchronize()
    final = {n: p.detach().clone() for n, p in model.optim_named_parameters()}
    final["scale"] = torch.tensor(scaler.get_scale(up_to_date=True))
    torch.save(final, path + ".final")
    print(scaler.snapshot())
""")


@pytest.mark.slow
def test_checkpoint_after_async_iteration_resumes_bit_for_bit_in_a_new_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    full, part = str(tmp_path / "full.pt"), str(tmp_path / "part.pt")
    # The uninterrupted run saves a checkpoint after iteration 2 and goes on to 8 ...
    subprocess.run([sys.executable, str(script), "save", full, "0", "8"], check=True, env=env)
    # ... a new process resumes from that checkpoint for iterations 3..7.
    os.replace(full, part)
    subprocess.run([sys.executable, str(script), "resume", part, "3", "8"], check=True, env=env)
    a, b = torch.load(full + ".final"), torch.load(part + ".final")
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_workers_wait_for_the_params_copy_of_their_stage():
    # Hold the optimizer thread so that the async step's master->model copy cannot run yet.
    model = RoundPipe(mlp(), devices="cpu:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch(0)
    for _ in range(2):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    release, entered, seen = threading.Event(), threading.Event(), []
    optim_thread.launch_item(release.wait)
    model.step(lambda: (opt.step(), opt.zero_grad()))  # queues the copy, then the step
    expected = {n: m.detach().clone() for n, m in model.optim_named_parameters()}

    def record(module, inputs):
        entered.set()
        seen.append(module.weight.detach().to("cpu", copy=True))  # on an accelerator: the upload

    handle = model.module[0].register_forward_pre_hook(record)
    runner = threading.Thread(
        target=lambda: model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    )
    runner.start()
    try:
        # Only a missing wait lets stage 0 start while the copy is held (never a false failure).
        assert not entered.wait(0.3)
    finally:
        release.set()
        runner.join(60)
    handle.remove()
    assert not runner.is_alive()
    assert all(torch.equal(w, expected["0.weight"]) for w in seen)
