"""Helpers shared by the spill tests (tests/test_optim_spill.py, tests/test_masters_on_disk.py):
a small fp16 classifier with fp32 masters, its batches and its training loop with a
GradScaler."""

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def model(placement=None, devices="cpu"):
    """The classifier, seeded, wrapped with ``placement`` on ``devices``."""
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )
    return RoundPipe(
        seq.half(),
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        state_placement=placement,
    )


def batches(n):
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(n)
    ]


def train(model, opt, scaler, batches, is_async=True):
    """forward_backward, step (async by default: on the optimizer thread behind the next
    iteration), scaler.update per batch; then synchronize."""

    def loss_fn(out, label):
        return scaler.scale(F.cross_entropy(out.float(), label)) / 2

    def step_fn():
        scaler.step(opt)
        opt.zero_grad()

    for x, y in batches:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(step_fn, is_async=is_async)
        scaler.update()
    model.synchronize()


def dead_pid():
    """The pid of a process that has just exited (and been reaped): no process has it now."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)
