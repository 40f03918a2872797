"""On a CUDA GPU: the streaming path held to the real device (skipped without one).

The suite's conftest.py installs the emulated device, which then is torch's accelerator for the
whole process, so these tests run in a process that never installs it:

    ROUNDPIPE_DEVICES=cuda:0 python -m pytest --noconftest -p no:cacheprovider tests/test_cuda.py

What they check: training on the GPU follows the CPU pool (losses and parameters), also with
compiled layers; the model's state stays in pinned host memory and a call leaves nothing on the
device; HF wrap equals plain transformers (loss and every gradient), also with compiled layers;
the memory plan's device peak against the allocator's measured one; a checkpoint resumes bit
for bit on the GPU (tiny_lm).
"""

import gc
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.testing import emu

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        emu.is_installed(),
        reason="the emulated device is installed in this process: run with --noconftest",
    ),
]

DEVICE = os.environ.get("ROUNDPIPE_DEVICES", "cuda:0")
if not DEVICE.startswith("cuda"):
    DEVICE = "cuda:0"


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 matmuls in full precision on the GPU (no TF32), so the CPU is a fair reference."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def mlp(seed=0, width=256, depth=4):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def train(devices, steps=3, M=4, dtype=torch.float32, compile=False):
    model = RoundPipe(
        mlp().to(dtype),
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=M),
        compile=compile,
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 256, generator=g).to(dtype)
        y = torch.randint(10, (32,), generator=g)
        loss = model.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda out, lbl: F.cross_entropy(out.float(), lbl.to(out.device)) / M,
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
    model.synchronize()
    with OptimizerCtx():
        masters = [p.detach().clone() for p in model.parameters()]
    return losses, masters, model


def settled_memory():
    """Bytes allocated on the device once everything ran, without cuBLAS's workspaces (torch
    keeps one per stream that ran a matmul, 32 MiB each on Hopper: not roundpipe's)."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def test_training_on_the_gpu_follows_the_cpu_pool():
    gpu_losses, gpu_masters, _ = train(DEVICE)
    cpu_losses, cpu_masters, _ = train("cpu")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for a, b in zip(gpu_masters, cpu_masters):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_layers_on_the_gpu_follow_the_cpu_pool():
    """RoundPipe(compile=True): inductor's kernels on the streamed layers, one graph per
    layer class and grad mode."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gpu_losses, gpu_masters, _ = train(DEVICE, compile=True)
    cpu_losses, cpu_masters, _ = train("cpu")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for a, b in zip(gpu_masters, cpu_masters):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert 0 < counters["frames"]["ok"] <= 4, dict(counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_stays_in_pinned_host_memory_and_a_call_leaves_the_device_empty(dtype):
    base = settled_memory()
    losses, _, model = train(DEVICE, steps=2, dtype=dtype)
    assert all(torch.isfinite(torch.tensor(losses)))
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.is_pinned(), name
    left = settled_memory() - base
    assert left <= 64 * 1024, f"{left} bytes stay allocated on the device after the calls"


def test_the_memory_plan_matches_the_allocators_peak():
    seq = mlp(width=1024, depth=6).half()
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=DEVICE,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    x, y = torch.randn(512, 1024).half(), torch.randint(10, (512,))
    loss_fn = lambda out, lbl: F.cross_entropy(out.float(), lbl.to(out.device))  # noqa: E731
    plan = model.memory_plan(input_args=(x,), label=y, loss_fn=loss_fn)
    # A first call makes cuBLAS's workspaces (32 MiB per stream on Hopper), which the plan
    # does not count: measure the second.
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    planned = plan.devices[0].peak
    print(f"planned {planned} measured {measured} ratio {planned / measured:.3f}")
    assert 0.9 * measured <= planned <= 1.15 * measured, (planned, measured)


@pytest.mark.parametrize(
    "family,M,side,compile",
    [
        *((f, M, side, None) for f in ("llama", "qwen3", "qwen3_moe")
          for M, side in ((1, "right"), (4, "left"))),
        ("qwen3", 4, "left", False),
    ],
)  # fmt: skip
def test_hf_wrap_equals_plain_transformers_on_the_gpu(family, M, side, compile):
    """At wrap's defaults (decoder layers compiled on CUDA: inductor's kernels on the worker,
    the recompute and AOTAutograd's backward on autograd's device thread, the uploads swapped
    in) and with eager layers."""
    pytest.importorskip("transformers")
    from test_hf import config, master_grads, padded_batch, twins
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    extra = {"output_router_logits": True} if family == "qwen3_moe" and M == 1 else {}
    wrapped, plain = twins(config(family, **extra))
    batch = padded_batch(side)
    ref = plain(**batch)
    ref.loss.backward()
    model = roundpipe.hf.wrap(
        wrapped,
        devices=DEVICE,
        compile=compile,
        model_run_config=RoundPipeRunConfig(num_microbatch=M),
    )
    loss = model.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-4, atol=1e-5)
    grads = master_grads(model)
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)
    if compile is False:
        assert not counters["stats"]
    else:
        assert counters["stats"]["unique_graphs"] >= 1
        if family != "qwen3_moe":  # in fp32 the MoE's grouped matmul falls back in places
            assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_optimizer_thread_leaves_the_device_threads_their_cores():
    from roundpipe import optim_thread

    optim_thread.set_num_threads(None)
    train(DEVICE, steps=1)
    main = torch.get_num_threads()
    on_thread = optim_thread.launch_item(torch.get_num_threads).result()
    assert on_thread == optim_thread.get_num_threads() == max(1, main - 2)
    assert torch.get_num_threads() == main


def test_a_checkpoint_resumes_bit_for_bit_on_the_gpu(tmp_path):
    from test_examples import TINY, _iteration_losses, run_example

    n = 3
    full, _ = run_example("tiny_lm.py", "--steps", 2 * n, *TINY, devices=DEVICE)
    ckpt = tmp_path / "ckpt.pt"
    run_example("tiny_lm.py", "--steps", n, "--save", ckpt, *TINY, devices=DEVICE)
    second, _ = run_example("tiny_lm.py", "--steps", 2 * n, "--resume", ckpt, *TINY, devices=DEVICE)
    resumed = _iteration_losses(second)
    assert sorted(map(int, resumed)) == list(range(n, 2 * n))
    full_losses = _iteration_losses(full)
    assert {k: full_losses[k] for k in resumed} == resumed
    digest = lambda out: re.search(r"params sha256: (\w+)", out)[1]  # noqa: E731
    assert digest(second) == digest(full)
