"""Lean Adam moments (roundpipe.optim.AdamW(state_dtype=torch.bfloat16 / "8bit")): the compiled
kernels and torch's reference give the same bits, the 8-bit maps and quantizer are what [Note:
lean moments] says, the state saves and loads exactly, a state of one kind is refused by another,
and bad input gets a clear error that changes nothing."""

import contextlib
import copy
import io
import math

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe
from roundpipe.optim import lean, native
from roundpipe.optim.lean import StateKind

KINDS = [StateKind.BF16, StateKind.EIGHT_BIT]
# odd sizes around the blocks (256) and the pieces the direct kernel tests cut with (512)
SIZES = [(1,), (255,), (256,), (257,), (3, 301), (1100,), (4, 1024)]


def _state(kind, p, gen):
    """A non-trivial lean state: a few reference steps from zeros."""
    state = lean.init_lean_state(kind, p)
    for _ in range(2):
        state["step"] += 1
        lean.lean_reference_step(
            kind,
            p,
            torch.randn(p.shape, generator=gen),
            state,
            None,
            step_size=1e-3,
            bias_correction2_sqrt=0.5,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
            adamw=True,
            grad_scale=None,
        )
    return state


def _step_both_ways(
    ops, kind, params, grads, states, lows, *, adamw, weight_decay, maximize, scale
):
    """One step of the compiled kernels on ``params``, ``states`` and ``lows`` (in place, pieces
    of 512) and one of torch's reference on copies; returns the copies."""
    ref_params = [p.clone() for p in params]
    ref_states = [{k: t.clone() for k, t in s.items()} for s in states]
    ref_lows = [torch.empty_like(low) if low is not None else None for low in lows]
    sizes = [1e-3 / (1 - 0.9**3) * (1 + i) for i in range(len(params))]
    bc2 = [math.sqrt(1 - 0.999**3)] * len(params)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8)
    for p, g, st, low, size, b in zip(ref_params, grads, ref_states, ref_lows, sizes, bc2):
        lean.lean_reference_step(
            kind,
            p,
            g,
            st,
            low,
            step_size=size,
            bias_correction2_sqrt=b,
            maximize=maximize,
            adamw=adamw,
            grad_scale=scale,
            **hyper,
        )
    m = lean.maps()
    eight = kind is StateKind.EIGHT_BIT
    ops.lean_step(
        1 if kind is StateKind.BF16 else 2,
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["exp_avg_absmax"] for s in states] if eight else [],
        [s["exp_avg_sq_absmax"] for s in states] if eight else [],
        [low if low is not None else torch.empty(0) for low in lows],
        sizes,
        bc2,
        hyper["lr"],
        hyper["beta1"],
        hyper["beta2"],
        weight_decay,
        hyper["eps"],
        maximize,
        adamw,
        scale,
        m.signed_table,
        m.unsigned_table,
        512,
    )
    return ref_params, ref_states, ref_lows


def _bits(t):
    """``t``'s bits, NaNs made one (the kernels and torch may give NaNs different signs)."""
    if t.dtype.is_floating_point:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return t


def _copy(shape, dtype, copy_at):
    """An empty copy of ``shape``: at the allocator's alignment (``"aligned"``, which a large
    step streams to, see [Note: the copy's streaming stores]) or one element past it (``"odd"``,
    which every step stores to plainly)."""
    if copy_at == "aligned":
        return torch.empty(shape, dtype=dtype)
    return torch.empty(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize(
    "low_dtype,copy_at",
    [
        (None, None),
        (torch.bfloat16, "aligned"),
        (torch.bfloat16, "odd"),
        (torch.float16, "aligned"),
        (torch.float16, "odd"),
    ],
)
@pytest.mark.parametrize(
    "adamw,weight_decay,maximize,scale", [(True, 0.1, False, None), (False, 0.1, True, 512.0)]
)
def test_compiled_lean_step_is_the_reference_bit_for_bit(
    ops, kind, low_dtype, copy_at, adamw, weight_decay, maximize, scale
):
    lows = [_copy(s, low_dtype, copy_at) if low_dtype else None for s in SIZES]
    _assert_kernels_are_the_reference(
        ops,
        kind,
        SIZES,
        lows,
        0,
        adamw=adamw,
        weight_decay=weight_decay,
        maximize=maximize,
        scale=scale,
    )


def _assert_kernels_are_the_reference(ops, kind, sizes, lows, seed, **hyper):
    """One step of the compiled kernels and one of torch's reference from the same state of
    ``sizes`` (seeded): masters, moments and copies (``lows``, None: none) bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in sizes]
    states = [_state(kind, p, gen) for p in params]
    grads = [torch.randn(s, generator=gen) * (hyper["scale"] or 1.0) for s in sizes]
    ref_params, ref_states, _ = _step_both_ways(ops, kind, params, grads, states, lows, **hyper)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for a, b in zip(states, ref_states):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(_bits(a[key]), _bits(b[key])), key
    for low, p in zip(lows, ref_params):
        if low is not None:
            assert torch.equal(low.view(torch.int16), p.to(low.dtype).view(torch.int16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_a_step_large_enough_to_stream_its_copies_is_the_reference_bit_for_bit(ops, kind):
    """A step of the kernels' streaming size (16M parameters, [Note: the copy's streaming
    stores]) writes its copies with non-temporal stores where they are aligned: the same bits
    as the reference, for an aligned copy (streamed) and one a bf16 element past it (plain),
    each ending in a partial vector."""
    n = ops.stream_numel()
    sizes = [(n // 2 + 7,), (n // 2 + 301,)]
    lows = [_copy(sizes[0], torch.bfloat16, "aligned"), _copy(sizes[1], torch.bfloat16, "odd")]
    _assert_kernels_are_the_reference(
        ops, kind, sizes, lows, 5, adamw=True, weight_decay=0.1, maximize=False, scale=None
    )


@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16])
def test_8bit_blocks_with_nan_inf_zero_and_extreme_absmax_step_as_the_reference(ops, low_dtype):
    """Each block of 256 below takes another of the compiled step's ways (see [Note: the fast
    quantizer] in _step_kernels.cpp): ordinary; a NaN gradient; an infinite one; a second
    moment that overflows; all zeros (absmax 0); a subnormal and a huge stored absmax; a
    negative stored absmax (a corrupt state); and a partial block."""
    kind = StateKind.EIGHT_BIT
    gen = torch.Generator().manual_seed(3)
    n = 8 * 256 + 100
    p = torch.randn(n, generator=gen)
    state = _state(kind, p, gen)
    g = torch.randn(n, generator=gen)
    g[256 + 7] = float("nan")
    g[512 + 3] = float("inf")
    g[768:1024] *= 1e25
    g[1024:1280] = 0.0
    state["exp_avg"][1024:1280] = 0
    state["exp_avg_sq"][1024:1280] = 0
    state["exp_avg_absmax"][4] = state["exp_avg_sq_absmax"][4] = 0.0
    state["exp_avg_absmax"][5], state["exp_avg_sq_absmax"][5] = 1e-45, 3e38
    state["exp_avg_absmax"][6], state["exp_avg_sq_absmax"][6] = 3e38, 1e-45
    state["exp_avg_sq_absmax"][7] = -1e-3
    low = torch.empty(n, dtype=low_dtype)
    (ref_p,), (ref_state,), (ref_low,) = _step_both_ways(
        ops,
        kind,
        [p],
        [g],
        [state],
        [low],
        adamw=True,
        weight_decay=0.1,
        maximize=False,
        scale=None,
    )
    assert torch.equal(_bits(p), _bits(ref_p))
    assert torch.equal(_bits(low), _bits(ref_low))
    for key in state:
        assert torch.equal(_bits(state[key]), _bits(ref_state[key])), key


def _special_inputs(signed):
    m = lean.maps()
    mids = m.signed_mids if signed else m.unsigned_mids
    values = m.signed_values[:128] if signed else m.unsigned_values
    bits = mids.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.rand(20000, generator=gen) ** 8  # many decades
    specials = torch.tensor([0.0, -0.0, 1e-45, 1.0, 1.0000001, 2.0, float("inf"), float("nan")])
    x = torch.cat([near, values, rand, specials])
    return torch.cat([x, -x]) if signed else x


@pytest.mark.parametrize("signed", [True, False])
def test_the_vectorized_quantizer_finds_the_nearest_code_as_the_reference(ops, signed):
    m = lean.maps()
    table = m.signed_table if signed else m.unsigned_table
    x = _special_inputs(signed)
    vectorized = ops.quantize(x, 1.0, table, signed, 1)
    scalar = ops.quantize(x, 1.0, table, signed, 0)
    reference = lean.quantize(x, torch.ones(()), signed)
    assert torch.equal(vectorized, scalar)
    assert torch.equal(scalar, reference)
    # the nearest value, but for the last bits of the fp32 arithmetic that finds it
    values = (m.signed_values if signed else m.unsigned_values).double()
    finite = torch.isfinite(x) & (x.abs() <= 1)
    y = x[finite].double()
    got = (values[reference[finite].long()] - y).abs()
    best = (values[None, :] - y[:, None]).abs().amin(dim=1)
    assert bool((got <= best + y.abs() * 2e-4).all())
    assert bool((lean.quantize(torch.tensor([float("nan")]), torch.ones(()), signed) == 0).all())


@pytest.mark.parametrize("signed", [True, False])
def test_the_fast_quantizer_gives_the_general_quantizers_codes(ops, signed):
    """Path 2 (the 8-bit step's encoder for ordinary blocks, see [Note: the fast quantizer] in
    _step_kernels.cpp) against the scalar path over its domain, |x| * inv in [0, 1 + 2^-15]:
    every 251st float there, every float within 64 of the maps' midpoints, of the groups'
    edges and of 1, and values scaled by absmaxes whose inverses round far (subnormal)."""
    m = lean.maps()
    table = m.signed_table if signed else m.unsigned_table
    top = int(torch.tensor(1 + 2**-15).view(torch.int32))
    mids = (m.signed_mids if signed else m.unsigned_mids).view(torch.int32)
    edges = torch.tensor([16.0**-e for e in range(9)]).view(torch.int32)
    marks = torch.cat([mids, edges, torch.tensor([0], dtype=torch.int32)])
    near = (marks[:, None] + torch.arange(-64, 65, dtype=torch.int32)[None, :]).reshape(-1)
    bits = torch.cat([torch.arange(0, top + 1, 251, dtype=torch.int32), near.clamp(0, top)])
    x = bits.view(torch.float32)
    x = torch.cat([x, -x]) if signed else x
    assert torch.equal(
        ops.quantize(x, 1.0, table, signed, 2), ops.quantize(x, 1.0, table, signed, 0)
    )
    gen = torch.Generator().manual_seed(0)
    for absmax in (3.7e-3, 1e-30, 2.5e37, 2e38, 3.4e38):
        a = torch.tensor(absmax)
        inv = float(1.0 / a)
        y = torch.cat([torch.rand(20000, generator=gen) ** 6 * a, a[None]])
        y = torch.cat([y, -y]) if signed else y
        assert torch.equal(
            ops.quantize(y, inv, table, signed, 2), ops.quantize(y, inv, table, signed, 0)
        )
    with pytest.raises(RuntimeError, match="path 2 takes"):
        ops.quantize(torch.tensor([1.5]), 1.0, table, signed, 2)
    if not signed:
        with pytest.raises(RuntimeError, match="path 2 takes"):
            ops.quantize(torch.tensor([-0.0]), 1.0, table, signed, 2)


@pytest.mark.parametrize("signed", [True, False])
def test_the_vectorized_dequantizer_is_the_scalar_one_bit_for_bit(ops, signed):
    m = lean.maps()
    table = m.signed_table if signed else m.unsigned_table
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)
    values = m.signed_values if signed else m.unsigned_values
    assert torch.equal(ops.dequantize(codes[:256], 1.0, table, signed, True), values)
    for absmax in (1.0, 0.37, 1e-30, 1e-45, 0.0, -2.0, 3e38, float("inf"), float("nan")):
        vectorized = ops.dequantize(codes, absmax, table, signed, True)
        scalar = ops.dequantize(codes, absmax, table, signed, False)
        assert torch.equal(vectorized.view(torch.int32), scalar.view(torch.int32)), absmax


def test_the_maps_are_the_dynamic_trees_of_the_note():
    m = lean.maps()
    for values, groups in ((m.signed_values[:128], 7), (m.unsigned_values, 8)):
        assert values[0] == 0 and values[-1] == 1.0
        assert bool((values[1:] > values[:-1]).all())
        assert float(values[1]) == 16.0 ** -(groups - 1)  # the deepest group's one value
        top = values[2 ** (groups - 1) :]  # the top group: 2^(groups-1) steps in [1/16, 1]
        assert len(top) == 2 ** (groups - 1)
        assert float(top[0]) == 1 / 16 + 15 / 16 / len(top)
        steps = top[1:] - top[:-1]
        assert torch.allclose(steps, torch.full_like(steps, 15 / 16 / len(top)))
    assert torch.equal(m.signed_values[128:], -m.signed_values[:128])


def _masters(seed=0, sizes=((64, 80), (80,), (80, 96), (7,))):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]


def _run(opt, params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.filterwarnings("ignore:.*fewer than 4096")
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "bf16", "8bit"])
def test_the_state_is_lean_and_saves_and_loads_exactly(state_dtype):
    a = _masters()
    opt = roundpipe.optim.AdamW(a, lr=1e-2, state_dtype=state_dtype)
    _run(opt, a, 3)
    kind = lean.kind_of_state_dtype(state_dtype)
    big = opt.state[a[0]]
    if kind is StateKind.BF16:
        assert big["exp_avg"].dtype == torch.bfloat16
    else:
        assert big["exp_avg"].dtype == torch.uint8 and big["exp_avg_absmax"].numel() == 20
        assert opt.state[a[1]]["exp_avg"].dtype == torch.float32  # 80 elements: kept exact
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt2 = roundpipe.optim.AdamW(b, lr=1e-2, state_dtype=state_dtype)
    saved.seek(0)
    opt2.load_state_dict(torch.load(saved))
    _run(opt, a, 2, seed=7)
    _run(opt2, b, 2, seed=7)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, t in opt.state[p].items():
            assert opt2.state[q][key].dtype == t.dtype
            assert torch.equal(opt2.state[q][key], t)


@pytest.mark.filterwarnings("ignore:.*fewer than 4096")
@pytest.mark.parametrize(
    "saved_kind,loading_kind", [(None, "8bit"), ("8bit", None), ("bf16", "8bit"), (None, "bf16")]
)
def test_a_state_of_another_kind_is_refused_by_name_and_nothing_changes(saved_kind, loading_kind):
    a = _masters()
    opt = roundpipe.optim.AdamW(a, lr=1e-2, state_dtype=saved_kind)
    _run(opt, a, 1)
    b = _masters()
    opt2 = roundpipe.optim.AdamW(b, lr=1e-2, state_dtype=loading_kind)
    _run(opt2, b, 1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="moments are not converted") as info:
        opt2.load_state_dict(opt.state_dict())
    named = {None: "exact", "bf16": "bf16", "8bit": "8bit"}
    assert named[saved_kind] in str(info.value) and named[loading_kind] in str(info.value)
    after = opt2.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key, state in before["state"].items():
        for name, t in state.items():
            assert torch.equal(after["state"][key][name], t)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(capturable=True), "capturable"),
        (dict(foreach=True), "foreach"),
        (dict(fused=False), "fused"),
        (dict(differentiable=True), "differentiable"),
    ],
)
def test_unsupported_combinations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        roundpipe.optim.AdamW(_masters(), state_dtype="8bit", **kwargs)


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    with pytest.raises(ValueError, match="state_dtype='4bit' is not a kind"):
        roundpipe.optim.AdamW(_masters(), state_dtype="4bit")
    with pytest.raises(ValueError, match="pass one of state_dir and state_dtype"):
        roundpipe.optim.AdamW(_masters(), state_dir=tmp_path, state_dtype="bf16")
    opt = roundpipe.optim.AdamW(_masters(), state_dtype="bf16")
    with pytest.raises(ValueError, match="float64"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(9, dtype=torch.float64))]})
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(9))], "amsgrad": True})
    assert len(opt.param_groups) == 1
    # a group of exact moments beside lean ones is fine
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(9))], "state_dtype": None})
    assert "state_dtype" not in opt.param_groups[1]


def test_small_parameters_keep_exact_moments_said_once():
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) of fewer than 4096") as record:
        opt = roundpipe.optim.AdamW(_masters(sizes=((64, 80), (80,), (3,))), state_dtype="8bit")
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(9))]})
    assert len([w for w in record if "fewer than" in str(w.message)]) == 1


@pytest.mark.parametrize("state_dtype", ["bf16", "8bit"])
def test_lean_moments_train_close_to_exact_ones(state_dtype):
    """A least-squares fit: the lean optimizers reach the exact one's loss within 5%."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen)
    w_true = torch.randn(64, 96, generator=gen)
    y = x @ w_true

    def fit(kind):
        w = nn.Parameter(torch.zeros(64, 96))
        opt = roundpipe.optim.AdamW([w], lr=3e-2, weight_decay=0.0, state_dtype=kind)
        for _ in range(300):
            loss = (x @ w - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float((x @ w - y).pow(2).mean().detach())

    exact, lean_loss = fit(None), fit(state_dtype)
    assert exact < 0.05 * float(y.pow(2).mean())  # it did fit
    assert abs(lean_loss - exact) <= 0.05 * exact + 1e-4


@pytest.mark.parametrize("state_dtype", ["bf16", "8bit"])
@pytest.mark.parametrize("is_async", [True, False])
def test_a_model_with_lean_moments_trains_the_same_with_or_without_the_kernels(
    ops, monkeypatch, state_dtype, is_async
):
    def train():
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48)).to(torch.bfloat16)
        model = RoundPipe(seq, optim_dtype=torch.float32, devices="cpu")
        said = pytest.warns(UserWarning, match="fewer than 4096")
        with said if state_dtype == "8bit" else contextlib.nullcontext():
            opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2, state_dtype=state_dtype)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
            loss = model.forward_backward(
                input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean()
            )
            losses.append(float(loss))
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        model.synchronize()
        for p, m in zip(model.module.parameters(), model.optim_parameters()):
            assert torch.equal(p.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))
        return losses, [m.detach().clone() for m in model.optim_parameters()]

    compiled = train()
    monkeypatch.setenv(native.ENV_VAR, "0")
    reference = train()
    assert compiled[0] == reference[0]
    for a, b in zip(compiled[1], reference[1]):
        assert torch.equal(a, b)


def _ckpt_model(state_dtype, seed=0):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 4)).to(torch.float16)
    model = RoundPipe(seq, optim_dtype=torch.float32, devices="cpu")
    opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-2, state_dtype=state_dtype)
    return model, opt, roundpipe.GradScaler("cpu", init_scale=2.0**8)


def _ckpt_iteration(model, opt, scaler, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 64, generator=g).to(torch.float16)
    model.forward_backward(
        input_args=(x,), loss_fn=lambda out, _: scaler.scale(out.float().pow(2).mean())
    )
    model.step(lambda: (scaler.step(opt), opt.zero_grad()))
    scaler.update()


def _ckpt_state(model, opt):
    model.synchronize()
    tensors = [p.detach().clone() for p in model.optim_parameters()]
    for p in model.optim_parameters():
        tensors += [t.clone() for _, t in sorted(opt.state[p].items())]
    return tensors


@pytest.mark.filterwarnings("ignore:.*fewer than 4096")
@pytest.mark.parametrize("state_dtype", ["bf16", "8bit"])
def test_a_checkpoint_of_lean_moments_resumes_bit_for_bit(tmp_path, state_dtype):
    import roundpipe.checkpoint as ckpt

    model, opt, scaler = _ckpt_model(state_dtype)
    for i in range(2):
        _ckpt_iteration(model, opt, scaler, i)
    path = ckpt.save(tmp_path, model, opt, scaler=scaler).wait()
    other, opt2, scaler2 = _ckpt_model(state_dtype, seed=7)
    ckpt.load(path, other, opt2, scaler=scaler2, progress=False)
    for i in range(2, 4):
        _ckpt_iteration(model, opt, scaler, i)
        _ckpt_iteration(other, opt2, scaler2, i)
    for a, b in zip(_ckpt_state(model, opt), _ckpt_state(other, opt2)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # Loaded into an optimizer of another kind: refused by name, nothing changed.
    exact, opt3, scaler3 = _ckpt_model(None, seed=7)
    before = [p.detach().clone() for p in exact.optim_parameters()]
    with pytest.raises(ckpt.CheckpointFormatError, match=f"keeps {state_dtype} moments"):
        ckpt.load(path, exact, opt3, scaler=scaler3, progress=False)
    for a, p in zip(before, exact.optim_parameters()):
        assert torch.equal(a, p)
    assert not opt3.state
