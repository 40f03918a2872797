"""os.fork() of a process that has trained: the child's calls never wait for threads that only
the parent has (see [Note: fork] in roundpipe.optim_thread). A CPU pool trains in the child
exactly as in the parent (where torch's autograd has started no device threads: none is
installed here); work the parent had not finished fails with a clear error there; an
accelerator pool, whose backward torch's autograd cannot run in a fork child, says so."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Every test here runs a subprocess (see the slow marker in pyproject.toml).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX only"),
]

# Run in a fresh interpreter (forking pytest's own process would copy its threads too). The
# parent reads one JSON line from the child through a pipe, with a deadline: a child that hangs
# is killed and reported as hung.
PRELUDE = """
import json, os, select, sys, threading, torch
from torch import nn
import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, optim_thread

def build(devices):
    torch.manual_seed(0)
    model = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), devices=devices)
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt

def iteration(model, opt, i, step=None):
    x = torch.full((4, 4), float(i + 1)) / 7
    loss = model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.square().mean())
    model.step(step or (lambda: (opt.step(), opt.zero_grad())))
    return loss.item()

def in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            result = fn()
        except BaseException as exc:
            result = {"raised": type(exc).__name__, "message": str(exc)}
        os.write(w, (json.dumps(result) + "\\n").encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 60)
    if not ready:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return {"hung": True}
    data = os.read(r, 1 << 16).decode()
    os.waitpid(pid, 0)
    return json.loads(data)
"""


def run(body):
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), ROUNDPIPE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_a_cpu_pool_trains_in_a_fork_child_as_in_the_parent(devices):
    # It used to hang: the child's forward_backward waited for workers that did not exist.
    out = run(f"""
        model, opt = build("{devices}")
        for i in range(3):
            iteration(model, opt, i)
        model.synchronize()
        def more():
            losses = [iteration(model, opt, i) for i in range(3, 6)]
            model.synchronize()
            return {{"losses": losses, "w": model.module[0].weight.sum().item()}}
        child = in_child(more)
        parent = more()
        print(json.dumps({{"child": child, "parent": parent}}))
        """)
    assert out["child"] == out["parent"]  # bit for bit (floats through JSON's repr)


@pytest.mark.timeout(180)
def test_work_the_parent_had_not_finished_fails_in_the_child_then_the_child_trains():
    out = run("""
        model, opt = build("cpu")
        iteration(model, opt, 0)
        release, started = threading.Event(), threading.Event()
        def slow_step():
            started.set()
            release.wait()
            opt.step()
            opt.zero_grad()
        iteration(model, opt, 1, step=slow_step)
        started.wait()  # the fork copies a step in the middle of running
        def child():
            try:
                iteration(model, opt, 2)
                return {"first": "no error"}
            except optim_thread.ForkedWithPendingWork as exc:
                first = str(exc)
            model.synchronize()
            iteration(model, opt, 3)
            model.synchronize()
            return {"first": first, "then": "trained"}
        result = in_child(child)
        release.set()
        model.synchronize()
        print(json.dumps(result))
        """)
    assert "then" in out and out["then"] == "trained", out
    assert "os.fork()" in out["first"] and "model.synchronize()" in out["first"], out
    assert "'spawn'" in out["first"]


@pytest.mark.timeout(180)
def test_an_accelerator_pool_in_a_fork_child_says_why_it_cannot_train():
    out = run("""
        from roundpipe.testing import emu
        emu.install()
        model, opt = build("emu:2")
        for i in range(2):
            iteration(model, opt, i)
        model.synchronize()
        print(json.dumps(in_child(lambda: iteration(model, opt, 2))))
        """)
    assert out.get("raised") == "RuntimeError", out
    assert "os.fork()" in out["message"] and "'spawn'" in out["message"], out
