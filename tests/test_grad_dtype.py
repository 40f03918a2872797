"""Gradients handed to the step in the dtype the device summed them in (roundpipe.optim.Adam's
``grad_dtype``; see [Note: gradients in their summed dtype] in roundpipe/runtime/grad_router.py
and [Note: low-precision gradients] in roundpipe/optim/_step_kernels.cpp): the same masters,
moments and weights, bit for bit, as the fp32 gradients they would have been converted to, for
exact, bf16 and 8-bit moments, with the compiled kernels and with torch's; half the host bytes
of the gradients, which the plan counts; clear refusals where they cannot be taken."""

import contextlib

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.optim import native
from roundpipe.testing import EMU_PINNED

pytestmark = pytest.mark.skipif(
    not hasattr(torch.empty(0), "grad_dtype"), reason="torch without Tensor.grad_dtype"
)


def _model():
    # Large enough for 8-bit blocks (4096 elements and more), a bias too small for them.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(512, 64),
        nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
        nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 512)),
    ).to(torch.bfloat16)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 512, (4, 16), generator=g)

    def loss_fn(out, lbl):
        return nn.functional.cross_entropy(out.float().flatten(0, 1), lbl.flatten())

    return dict(input_args=(x,), label=torch.roll(x, 1, 1), loss_fn=loss_fn)


def _wrapped(grad_dtype, state_dtype=None, num_microbatch=None):
    """The model on the emulated device, its gradients summed in bf16 there, and its AdamW."""
    model = RoundPipe(
        _model(),
        optim_dtype=torch.float32,
        devices="emu",
        model_run_config=RoundPipeRunConfig(
            num_microbatch=num_microbatch, device_grad_dtype=torch.bfloat16
        ),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(
            model.parameters(), lr=1e-2, state_dtype=state_dtype, grad_dtype=grad_dtype
        )
    return model, opt


def _train(state_dtype, grad_dtype, steps=3):
    model, opt = _wrapped(grad_dtype, state_dtype, num_microbatch=2)
    masters = list(model.optim_parameters())
    seen = {}
    for i in range(steps):
        model.forward_backward(**_batch(i))
        if i == 0:
            roundpipe.optim_thread.synchronize()  # the first call's sums are the masters'
            seen["dtypes"] = {m.grad.dtype for m in masters}
            seen["grads"] = {
                m.grad.untyped_storage().data_ptr(): m.grad.untyped_storage().nbytes()
                for m in masters
            }
            seen["pinned"] = all(m.grad.is_pinned() for m in masters)
            seen["plan"] = model.memory_plan(**_batch(0))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    state = [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    weights = [p.detach().clone() for p in model.module.parameters()]
    return [m.detach().clone() for m in masters], state, weights, seen


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-kernels"])
@pytest.mark.parametrize(
    "state_dtype", [None, torch.bfloat16, "8bit"], ids=["exact", "bf16", "8bit"]
)
def test_bf16_gradients_step_as_the_fp32_ones_they_equal(
    state_dtype, compiled, monkeypatch, request
):
    if compiled:
        request.getfixturevalue("ops")  # fails, naming why, where the kernels did not build
    else:
        monkeypatch.setenv(native.ENV_VAR, "0")
    with pytest.warns(UserWarning) if state_dtype == "8bit" else contextlib.nullcontext():
        fp32 = _train(state_dtype, None)
    with pytest.warns(UserWarning) if state_dtype == "8bit" else contextlib.nullcontext():
        bf16 = _train(state_dtype, torch.bfloat16)
    assert fp32[3]["dtypes"] == {torch.float32} and bf16[3]["dtypes"] == {torch.bfloat16}
    for before, after in zip(fp32[:3], bf16[:3]):
        assert len(before) == len(after)
        for a, b in zip(before, after):
            assert torch.equal(a, b)
    # The downloads themselves became .grad (pinned, 2 bytes a parameter), and the plan
    # counts those blocks, half the fp32 gradients' bytes but for the blocks' rounding.
    assert bf16[3]["pinned"]
    for run in (fp32, bf16):
        host = run[3]["plan"].host
        if run is bf16:
            held = sum(EMU_PINNED.allocation_bytes(n) for n in run[3]["grads"].values())
            assert host.grads == held == host.next_grads
    assert bf16[3]["plan"].host.grads * 2 <= fp32[3]["plan"].host.grads * 1.05


def test_the_refusals_name_what_cannot_take_low_precision_gradients(tmp_path):
    model = RoundPipe(_model(), optim_dtype=torch.float32, devices="emu")
    masters = list(model.optim_parameters())
    with pytest.raises(ValueError, match="takes torch.bfloat16 or torch.float16"):
        roundpipe.optim.AdamW(masters, grad_dtype=torch.float64)
    with pytest.raises(ValueError, match="state_dir"):
        roundpipe.optim.AdamW(masters, grad_dtype=torch.bfloat16, state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="fp32 masters in host memory"):
        roundpipe.optim.AdamW(list(model.module.parameters()), grad_dtype=torch.bfloat16)
    model.forward_backward(**_batch(0))  # the masters now hold fp32 gradients
    with pytest.raises(ValueError, match="before the first forward_backward, or after"):
        roundpipe.optim.AdamW(masters, grad_dtype=torch.bfloat16)
    assert all(m.grad_dtype == torch.float32 for m in masters)  # a refusal changes nothing


def _train_fp16_scaled(grad_dtype, steps=3):
    model = RoundPipe(
        _model().half(),
        optim_dtype=torch.float32,
        devices="emu",
        model_run_config=RoundPipeRunConfig(device_grad_dtype=torch.float16),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-2, grad_dtype=grad_dtype)
    scaler = roundpipe.GradScaler(init_scale=2.0**10)
    for i in range(steps):
        batch = _batch(i)
        loss_fn = batch.pop("loss_fn")
        model.forward_backward(**batch, loss_fn=lambda o, y: scaler.scale(loss_fn(o, y)))
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
    model.synchronize()
    return [m.detach().clone() for m in model.optim_parameters()], scaler.get_scale()


def test_fp16_gradients_under_a_grad_scaler_step_as_the_fp32_ones():
    # The scaler checks the fp16 sums for inf/NaN as they are and the fused kernel unscales
    # each value in fp32: the same steps and scales as with the gradients converted first.
    fp32, scale32 = _train_fp16_scaled(None)
    fp16, scale16 = _train_fp16_scaled(torch.float16)
    assert scale32 == scale16
    assert all(torch.equal(a, b) for a, b in zip(fp32, fp16))


def test_data_parallel_refuses_gradients_in_another_dtype(group_of_one):
    # Its reduction sums in the masters' dtype: bf16 gradients would come back rounded.
    from roundpipe import distributed as rpd

    model, opt = _wrapped(torch.bfloat16)
    dp = rpd.DataParallel(model)
    model.forward_backward(**_batch(0))
    model.step(lambda: (opt.step(), opt.zero_grad()))
    with pytest.raises(ValueError, match="leave grad_dtype=None under DataParallel"):
        model.synchronize()
    dp.close()


@pytest.mark.parametrize("resume_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_a_checkpoint_with_bf16_gradients_pending_resumes_them(tmp_path, resume_dtype):
    # Saved between forward_backward and step (gradients accumulated, not yet stepped), then
    # loaded into an optimizer that takes bf16 gradients or fp32 ones: the same values either way.
    from roundpipe import checkpoint

    model, opt = _wrapped(torch.bfloat16)
    model.forward_backward(**_batch(0))
    model.synchronize()
    pending = [m.grad.clone() for m in model.optim_parameters()]
    checkpoint.save(tmp_path, model, opt, name="pending").wait()
    again, opt2 = _wrapped(resume_dtype)
    checkpoint.load(tmp_path / "pending", again, opt2)
    resumed = [m.grad for m in again.optim_parameters()]
    assert len(resumed) == len(pending)
    for grad, back in zip(pending, resumed):
        assert grad.dtype == torch.bfloat16
        assert back.dtype == (resume_dtype or torch.float32)
        assert torch.equal(back.float(), grad.float())
