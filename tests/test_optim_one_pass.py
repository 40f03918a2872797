"""The one-pass step: roundpipe.optim's Adam writes the master->model copy in the same pass as
the update (see [Note: the copy in the step] in roundpipe/runtime/step_copy.py), with the
compiled kernels of roundpipe.optim.native; masters, moments and low-precision weights are
bitwise those of torch's fused step followed by the separate copy, the staleness rule holds,
and without the kernels (or when their build fails) the step falls back to torch's kernels."""

import warnings

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import GradScaler, RoundPipe
from roundpipe.optim import native

KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# odd sizes around the 256-element pieces the tests cut with, and a 0-d parameter
SIZES = [(), (1,), (7,), (255,), (256,), (257,), (3, 300), (1031,)]


def _tensors(seed, sizes, amsgrad):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in sizes]
    grads = [torch.randn(s, generator=gen) for s in sizes]
    m = [torch.randn(s, generator=gen) * 0.1 for s in sizes]
    v = [torch.rand(s, generator=gen) * 0.01 for s in sizes]
    mx = [t + torch.rand(s, generator=gen) * 0.01 for t, s in zip(v, sizes)] if amsgrad else []
    steps = [torch.tensor(float(3 + i)) for i in range(len(sizes))]
    return params, grads, m, v, mx, steps


def _exact_step(ops, tensors, lows, weight_decay, amsgrad, maximize, adamw, scale, piece):
    """The compiled exact step (KW's hyperparameters) on ``tensors`` (:func:`_tensors`'
    six lists) in pieces of ``piece``, writing the copies ``lows``."""
    ops.exact_step(
        *tensors,
        lows,
        KW["lr"],
        KW["beta1"],
        KW["beta2"],
        weight_decay,
        KW["eps"],
        amsgrad,
        maximize,
        adamw,
        scale,
        piece,
    )


def _clone(ts):
    return [[t.clone() for t in group] for group in ts]


@pytest.mark.cpu_pool_only
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize(
    "weight_decay,maximize,amsgrad,scaled",
    [(0.0, False, False, False), (0.1, False, False, True), (0.1, True, True, False)],
)
def test_exact_kernel_is_torchs_fused_step_then_the_copy(
    ops, low_dtype, adamw, weight_decay, maximize, amsgrad, scaled
):
    a = _tensors(0, SIZES, amsgrad)
    b = _clone(a)
    scale = torch.tensor(1024.0) if scaled else None
    if scaled:
        for g in a[1] + b[1]:
            g.mul_(1024.0)
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel(
        *a,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=scale,
        found_inf=None,
        **KW,
    )
    expected_low = [p.to(low_dtype) for p in a[0]]
    lows = [torch.full(s, float("nan"), dtype=low_dtype) for s in SIZES]
    # pieces of 256: every size above crosses or ends at a piece boundary
    _exact_step(ops, b, lows, weight_decay, amsgrad, maximize, adamw, scale, 256)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)
    for low, want in zip(lows, expected_low):
        assert torch.equal(low.view(torch.int16), want.view(torch.int16))


@pytest.mark.cpu_pool_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
def test_a_step_large_enough_to_stream_its_copies_is_torchs_step_then_the_cast(ops, low_dtype):
    # 16M parameters, the kernels' streaming size ([Note: the copy's streaming stores] in
    # roundpipe/optim/_step_kernels.cpp): the aligned copy is streamed, the one an element past
    # it stored plainly; both are the cast of torch's fused step's masters.
    n = ops.stream_numel()
    sizes = [(n // 2 + 7,), (n // 2 + 301,)]
    a = _tensors(1, sizes, amsgrad=False)
    b = _clone(a)
    torch._fused_adamw_(*a, weight_decay=0.1, amsgrad=False, maximize=False, **KW)
    lows = [torch.empty(sizes[0], dtype=low_dtype), torch.empty(n // 2 + 302, dtype=low_dtype)[1:]]
    _exact_step(ops, b, lows, 0.1, False, False, True, None, 1 << 16)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)
    for low, p in zip(lows, a[0]):
        assert torch.equal(low.view(torch.int16), p.to(low_dtype).view(torch.int16))


@pytest.mark.cpu_pool_only
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd"])
@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
def test_the_copy_is_torchs_cast_bit_for_bit(ops, low_dtype, offset):
    # Rounding ties, subnormals, overflow, infinities and NaNs of both signs; lr=0 leaves the
    # masters as they are, so the copy is the cast of these values; at the allocator's
    # alignment and one element past it.
    info = torch.finfo(low_dtype)
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 2**16, (600,), generator=gen, dtype=torch.int32) << 16 | 0x8000
    values = torch.cat(
        [
            ties.view(torch.float32),
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")]),
            torch.tensor([info.max * 1.01, -info.max * 1.01, info.tiny / 3, 1e-45]),
            torch.randn(1000, generator=gen),
        ]
    )
    n = values.numel()
    steps = [torch.tensor(1.0)]
    low = torch.empty(n + offset, dtype=low_dtype)[offset:]
    ops.exact_step(
        [values.clone()],
        [torch.zeros(n)],
        [torch.zeros(n)],
        [torch.zeros(n)],
        [],
        steps,
        [low],
        0.0,
        0.9,
        0.999,
        0.0,
        1e-8,
        False,
        False,
        True,
        None,
        256,
    )
    assert torch.equal(low.view(torch.int16), values.to(low_dtype).view(torch.int16))


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(37, 300), nn.Tanh(), nn.Linear(300, 29), nn.LayerNorm(29)]
    return nn.Sequential(*layers).to(dtype)


def _train(dtype, steps, is_async, scaler=None, overflow_at=None, seed=0):
    """Losses per iteration, then the final weights, masters and moments."""
    model = RoundPipe(_model(dtype, seed), optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for it in range(steps):
        x = torch.randn(8, 37, generator=gen).to(dtype)
        if overflow_at == it:
            x[0, 0] = float("inf")

        def loss_fn(out, _):
            loss = out.float().pow(2).mean()
            return scaler.scale(loss) if scaler is not None else loss

        loss = model.forward_backward(input_args=(x,), loss_fn=loss_fn)
        losses.append(float(loss))
        if scaler is not None:
            model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=is_async)
            scaler.update()
        else:
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    model.synchronize()
    weights = [p.detach().clone() for p in model.module.parameters()]
    masters = [p.detach().clone() for p in model.optim_parameters()]
    moments = [
        t.clone()
        for p in model.optim_parameters()
        for k, t in sorted(opt.state[p].items())
        if k != "step"
    ]
    return losses, weights, masters, moments, model


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x.dtype in (torch.float16, torch.bfloat16):
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_async", [True, False])
def test_a_model_trains_bitwise_as_with_the_separate_copy(ops, monkeypatch, dtype, is_async):
    one_pass = _train(dtype, 5, is_async)
    model = one_pass[4]
    copies = model._params.step_copies
    # The step wrote the copy: asynchronously into the next weights (2 bytes per parameter).
    expected = sum(p.numel() * p.element_size() for p in model.module.parameters())
    assert copies.next_weights_bytes == (expected if is_async else 0)
    monkeypatch.setenv(native.ENV_VAR, "0")
    two_passes = _train(dtype, 5, is_async)
    assert two_passes[4]._params.step_copies.next_weights_bytes == 0
    # The same losses at every iteration: each iteration computed with the same weights (the
    # staleness rule), then the same weights, masters and moments.
    assert one_pass[0] == two_passes[0]
    for i in (1, 2, 3):
        _same(one_pass[i], two_passes[i])


def test_write_copy_false_leaves_the_copy_to_the_model(ops):
    model = RoundPipe(_model(torch.bfloat16), optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2, write_copy=False)
    x = torch.randn(4, 37).to(torch.bfloat16)
    for _ in range(2):
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    assert model._params.step_copies.next_weights_bytes == 0
    for p, m in zip(model.module.parameters(), model.optim_parameters()):
        assert torch.equal(p.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))


def test_the_async_step_swaps_the_next_weights_in_and_computes_one_step_behind(ops):
    model = RoundPipe(_model(torch.bfloat16), optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2)
    weight = model.module[0].weight
    x = torch.randn(4, 37).to(torch.bfloat16)
    seen = []
    for _ in range(4):
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
        seen.append((weight.data_ptr(), weight.detach().clone()))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    master = next(model.optim_parameters())
    assert torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    # Iterations 0 and 1 compute with the first buffer; step 0 wrote the second, swapped in
    # for iteration 2 while step 1 wrote the first again, swapped in for iteration 3.
    ptrs = [p for p, _ in seen]
    assert ptrs[0] == ptrs[1] == ptrs[3] != ptrs[2]
    # Iterations 0 and 1 computed with the initial weights, iteration 2 with step 0's.
    assert torch.equal(seen[0][1], seen[1][1])
    assert not torch.equal(seen[1][1], seen[2][1])


@pytest.mark.parametrize("is_async", [True, False])
def test_an_overflow_step_leaves_everything_untouched(ops, is_async):
    model = RoundPipe(_model(torch.float16), optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**8)
    x = torch.randn(4, 37).to(torch.float16)

    def snapshot():
        model.synchronize()
        return (
            [p.detach().clone() for p in model.module.parameters()],
            [p.detach().clone() for p in model.optim_parameters()],
            [t.clone() for p in model.optim_parameters() for t in opt.state[p].values()],
        )

    def iteration(x):
        model.forward_backward(
            input_args=(x,), loss_fn=lambda out, _: scaler.scale(out.float().pow(2).mean())
        )
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=is_async)
        scaler.update()

    iteration(x)
    before = snapshot()
    bad = x.clone()
    bad[0, 0] = float("inf")
    iteration(bad)
    after = snapshot()
    assert scaler.get_scale(up_to_date=True) == 2.0**7  # the step was skipped
    for a, b in zip(before, after):
        _same(a, b)


def test_a_master_changed_after_the_step_is_copied_again(ops):
    model = RoundPipe(_model(torch.bfloat16), optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2)
    x = torch.randn(4, 37).to(torch.bfloat16)

    def step_then_clamp():
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():  # the masters, inside the step
                p.clamp_(-0.01, 0.01)

    for is_async in (True, False):
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean())
        model.step(step_then_clamp, is_async=is_async)
    model.synchronize()
    for p, m in zip(model.module.parameters(), model.optim_parameters()):
        assert torch.equal(p.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))
        assert p.abs().max() <= 0.01


@pytest.mark.cpu_pool_only
def test_a_failed_build_warns_once_and_the_step_uses_torchs_kernels(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    builder = native.Builder(str(broken), prefix="roundpipe_optim_broken_test")
    with pytest.warns(RuntimeWarning, match="could not be built.*torch's kernels") as record:
        assert builder.kernels(wait=True) is None
    assert len(record) == 1
    assert "error" in builder.error
    assert builder.status().startswith("torch's kernels (build failed")
    # The optimizer steps on with torch's kernels when the kernels are missing.
    monkeypatch.setattr(native, "_BUILDER", builder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses, weights, masters, _, model = _train(torch.bfloat16, 2, True)
    assert model._params.step_copies.next_weights_bytes == 0
    for p, m in zip(weights, masters):
        assert torch.equal(p.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))
