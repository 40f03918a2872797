"""roundpipe.optim.Adam/AdamW against torch.optim's non-fused reference, and their extras."""

import io
import threading
import time

import pytest
import torch

import roundpipe
import roundpipe.optim as rp_optim
from roundpipe import optim_thread

TOL = dict(atol=1e-5, rtol=1e-5)
STEPS = 4

# (shape, dtype): empty, 0-d, odd sizes, a float64 and complex tensors (also 0-d and empty).
SHAPES = [
    ((), torch.float32),
    ((0,), torch.float32),
    ((0, 3), torch.float32),
    ((7,), torch.float32),
    ((3, 5), torch.float32),
    ((2, 3, 4), torch.float32),
    ((1, 1, 33), torch.float32),
    ((6,), torch.float64),
    ((), torch.complex64),
    ((0,), torch.complex64),
    ((4,), torch.complex64),
    ((2, 3), torch.complex128),
]

OPTIONS = {
    "defaults": {},
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "weight_decay": dict(weight_decay=0.1),
    "betas_eps": dict(betas=(0.5, 0.9), eps=1e-3),
    "tensor_lr": dict(lr=torch.tensor(0.02)),
    "all": dict(amsgrad=True, maximize=True, weight_decay=0.05, lr=0.03, betas=(0.8, 0.95)),
    "fused_false": dict(fused=False, amsgrad=True),
    "foreach_true": dict(foreach=True, weight_decay=0.1),
}

PAIRS = {"Adam": (rp_optim.Adam, torch.optim.Adam), "AdamW": (rp_optim.AdamW, torch.optim.AdamW)}


def _make_params(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
        for shape, dtype in shapes
    ]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, gen, scale=1.0):
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale for p in params]


def _groups(params, options):
    """Two param groups with different hyperparameters, as a list for the constructor."""
    half = len(params) // 2
    second = {"params": params[half:], "weight_decay": 0.2}
    if not isinstance(options.get("lr"), torch.Tensor):
        second["lr"] = 0.005
    return [{"params": params[:half]}, second]


def _reference_options(options):
    # The reference is torch's for-loop path: drop implementation choices.
    return {k: v for k, v in options.items() if k not in ("fused", "foreach")}


def _checkpoint(opt):
    """A state dict as a new process would load it (a live one shares tensors with ``opt``)."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _run(opt, params, seed, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, g in zip(params, _grads(params, gen)):
            p.grad = g
        opt.step()


def _assert_same(params_a, params_b, opt_a=None, opt_b=None):
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    if opt_a is not None:
        for a, b in zip(params_a, params_b):
            sa, sb = opt_a.state[a], opt_b.state[b]
            assert sa.keys() == sb.keys()
            for key in sa:
                torch.testing.assert_close(sa[key].to(sb[key].dtype), sb[key], **TOL)


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("option_name", OPTIONS)
def test_matches_torch_reference(name, option_name):
    rp_cls, torch_cls = PAIRS[name]
    options = OPTIONS[option_name]
    params = _make_params(0)
    ref_params = _clone(params)
    opt = rp_cls(_groups(params, options), **options)
    ref = torch_cls(_groups(ref_params, options), foreach=False, **_reference_options(options))
    start = [p.detach().clone() for p in params]
    _run(opt, params, seed=1)
    _run(ref, ref_params, seed=1)
    _assert_same(params, ref_params, opt, ref)
    # The comparison is not vacuous: the non-empty parameters did move.
    assert any(not torch.equal(p.detach(), s) for p, s in zip(params, start) if p.numel())


def test_auto_runs_the_fused_kernel_for_complex_too(monkeypatch):
    calls = []
    real_kernel = torch._fused_adam_

    def counting(params, *args, **kwargs):
        calls.append([p.dtype for p in params])
        return real_kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adam_", counting)
    params = _make_params(0)
    opt = rp_optim.Adam(params, lr=0.01)
    assert opt._step_supports_amp_scaling
    _run(opt, params, seed=1, steps=1)
    fused_dtypes = {dtype for call in calls for dtype in call}
    # complex64/complex128 go through the kernel as their float32/float64 real views
    assert fused_dtypes == {torch.float32, torch.float64}
    assert sum(len(call) for call in calls) == len(params)


@pytest.mark.parametrize(
    "case", ["transposed_param", "expanded_grad", "sliced_param", "size1_strides"]
)
def test_mismatched_layouts_match_reference(case):
    # [Note: fused layout rule]: torch's CPU fused kernel would walk these tensors linearly.
    gen = torch.Generator().manual_seed(3)
    if case == "transposed_param":
        make_p = lambda: torch.randn(6, 4, generator=gen).t()
        make_g = lambda: torch.randn(4, 6, generator=gen)
    elif case == "expanded_grad":
        make_p = lambda: torch.randn(5, 3, generator=gen)
        make_g = lambda: torch.randn(1, 3, generator=gen).expand(5, 3)
    elif case == "sliced_param":
        make_p = lambda: torch.randn(6, 8, generator=gen)[:, :3]
        make_g = lambda: torch.randn(6, 8, generator=gen)[:, :3]
    else:  # dense, same memory order, different strides only on a size-1 dim: still fusable
        make_p = lambda: torch.randn(2, 1, 10, generator=gen)
        make_g = lambda: (
            torch.randn(2, 10, generator=gen).unsqueeze(1).as_strided((2, 1, 10), (10, 1, 1))
        )
    p = torch.nn.Parameter(make_p())
    ref_p = torch.nn.Parameter(p.detach().clone())
    opt = rp_optim.Adam([p], lr=0.1, amsgrad=True)
    ref = torch.optim.Adam([ref_p], lr=0.1, amsgrad=True, foreach=False)
    for _ in range(3):
        g = make_g()
        p.grad, ref_p.grad = g.clone() if case != "expanded_grad" else g, g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), ref_p.detach(), **TOL)


@pytest.mark.parametrize("name", PAIRS)
def test_state_dict_round_trip(name):
    rp_cls, torch_cls = PAIRS[name]
    options = dict(amsgrad=True, weight_decay=0.05)
    params = _make_params(0)
    opt = rp_cls(_groups(params, options), **options)
    _run(opt, params, seed=1)

    # roundpipe -> roundpipe and roundpipe -> torch, then all continue together.
    into_rp_params, into_torch_params = _clone(params), _clone(params)
    into_rp = rp_cls(_groups(into_rp_params, {}))
    into_torch = torch_cls(_groups(into_torch_params, {}), foreach=False)
    into_rp.load_state_dict(_checkpoint(opt))
    into_torch.load_state_dict(_checkpoint(opt))
    assert into_torch.param_groups[0]["amsgrad"] and into_rp.param_groups[0]["weight_decay"] == 0.05
    for o, ps in ((opt, params), (into_rp, into_rp_params), (into_torch, into_torch_params)):
        _run(o, ps, seed=2)
    _assert_same(into_rp_params, params, into_rp, opt)
    _assert_same(into_torch_params, params, into_torch, opt)

    # torch -> roundpipe: the math options come from the checkpoint, the implementation
    # options (here fused=None, foreach=None) stay this optimizer's.
    for group in into_torch.param_groups:
        group["foreach"] = False  # what a torch Adam(foreach=False) checkpoint carries
    torch_params = _clone(into_torch_params)
    from_torch_params = _clone(into_torch_params)
    from_torch = rp_cls(_groups(from_torch_params, {}))
    torch_twin = torch_cls(_groups(torch_params, {}), foreach=False)
    torch_twin.load_state_dict(_checkpoint(into_torch))
    from_torch.load_state_dict(_checkpoint(into_torch))
    assert from_torch.param_groups[0]["foreach"] is None and from_torch._step_supports_amp_scaling
    _run(torch_twin, torch_params, seed=3)
    _run(from_torch, from_torch_params, seed=3)
    _assert_same(from_torch_params, torch_params, from_torch, torch_twin)


def _two_routes(route):
    """A parameter list and optimizer where every parameter takes the given path."""
    params = _make_params(
        0, [((3, 5), torch.float32), ((4,), torch.complex64), ((2, 2), torch.float64)]
    )
    if route == "fused":
        return params, rp_optim.Adam(params, lr=0.05, amsgrad=True)
    return params, rp_optim.Adam(params, lr=0.05, amsgrad=True, fused=False)


@pytest.mark.parametrize("route", ["fused", "torch_path"])
def test_grad_scale_and_found_inf(route):
    params, opt = _two_routes(route)
    assert opt._step_supports_amp_scaling == (route == "fused")
    ref_params = _clone(params)
    ref = torch.optim.Adam(ref_params, lr=0.05, amsgrad=True, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        grads = _grads(params, gen)
        for p, rp, g in zip(params, ref_params, grads):
            p.grad, rp.grad = g * 1024.0, g.clone()
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
        opt.step()
        ref.step()
    _assert_same(params, ref_params, opt, ref)

    # An overflow (also the 2.0 a scaler sums over two devices) leaves everything untouched.
    before = [p.detach().clone() for p in params]
    state_before = {
        i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)
    }
    for flag in (1.0, 2.0):
        for p in params:
            p.grad = torch.full_like(p, float("inf"))
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(flag)
        opt.step()
        for i, p in enumerate(params):
            assert torch.equal(p.detach(), before[i])
            for key, value in state_before[i].items():
                assert torch.equal(opt.state[p][key], value), key


def test_torch_grad_scaler_protocol_end_to_end():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref_model = torch.nn.Linear(8, 4)
    ref_model.load_state_dict(model.state_dict())
    opt = rp_optim.AdamW(model.parameters(), lr=0.01)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, foreach=False)
    scaler, ref_scaler = (
        torch.amp.GradScaler("cpu", init_scale=256.0),
        torch.amp.GradScaler("cpu", init_scale=256.0),
    )
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(getattr(o, "grad_scale", None)))
    for it in range(4):
        x = torch.randn(16, 8)
        if it == 2:
            x[0, 0] = float("inf")  # this iteration overflows and must be skipped by both
        for m, o, s in ((model, opt, scaler), (ref_model, ref, ref_scaler)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    assert scaler.get_scale() == ref_scaler.get_scale() < 256.0
    # The scaler handed the scale to the optimizer instead of unscaling the gradients itself.
    assert all(s is not None and float(s) > 1 for s in seen)
    assert float(opt.state[next(model.parameters())]["step"]) == 3


@pytest.mark.parametrize("where", ["main_thread", "optimizer_thread"])
def test_roundpipe_grad_scaler_matches_torch(where):
    torch.manual_seed(0)
    model, ref_model = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref_model.load_state_dict(model.state_dict())
    opt = rp_optim.Adam(model.parameters(), lr=0.01)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01, foreach=False)
    scaler = roundpipe.GradScaler(init_scale=256.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    handed = []
    opt.register_step_pre_hook(lambda o, a, k: handed.append(getattr(o, "grad_scale", None)))
    # On the optimizer thread the update is asynchronous (one iteration behind), which equals
    # torch's schedule only while nothing overflows, so that variant has no overflow.
    overflow_at = 2 if where == "main_thread" else None
    for it in range(4):
        x = torch.randn(16, 8)
        if it == overflow_at:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if where == "main_thread":
            scaler.step(opt)
        else:
            optim_thread.launch(scaler.step, opt)
        scaler.update()
        optim_thread.synchronize()
        ref.zero_grad()
        ref_scaler.scale(ref_model(x).square().mean()).backward()
        ref_scaler.step(ref)
        ref_scaler.update()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, **TOL)
    assert len(handed) == 4 and all(s is not None and float(s) > 1 for s in handed)
    if overflow_at is not None:
        assert float(opt.state[next(model.parameters())]["step"]) == 3


def test_add_param_group_later_falls_back_or_fuses():
    params = _make_params(0, [((3, 4), torch.float32)])
    opt = rp_optim.Adam(params, lr=0.01)
    assert opt._step_supports_amp_scaling
    complex_params = _make_params(1, [((5,), torch.complex64)])
    opt.add_param_group({"params": complex_params})
    assert opt._step_supports_amp_scaling  # complex is fused through its real view
    loop_params = _make_params(2, [((2, 2), torch.float32)])
    opt.add_param_group({"params": loop_params, "fused": False})
    assert not opt._step_supports_amp_scaling  # a scaler must now unscale by itself

    everything = params + complex_params + loop_params
    ref_all = _clone(everything)
    ref = torch.optim.Adam(
        [{"params": ref_all[:1]}, {"params": ref_all[1:2]}, {"params": ref_all[2:]}],
        lr=0.01,
        foreach=False,
    )
    _run(opt, everything, seed=4)
    _run(ref, ref_all, seed=4)
    _assert_same(everything, ref_all, opt, ref)


def test_fused_true_rejects_what_cannot_be_fused():
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="fused=None"):
        rp_optim.Adam([meta], fused=True)
    opt = rp_optim.Adam(_make_params(0, [((3,), torch.float32)]), fused=True)
    with pytest.raises(
        RuntimeError,
        match=r"param_groups\[1\]\['params'\]\[0\] is a Parameter of torch.float32 on meta",
    ):
        opt.add_param_group({"params": [meta]})
    assert len(opt.param_groups) == 1  # left unchanged
    with pytest.raises(RuntimeError, match="differentiable"):
        rp_optim.Adam(_make_params(0, [((3,), torch.float32)]), fused=True, differentiable=True)
    with pytest.raises(RuntimeError, match="foreach"):
        rp_optim.Adam(_make_params(0, [((3,), torch.float32)]), fused=True, foreach=True)


def test_adamw_defaults_and_decoupling_survive_loading_an_adam_checkpoint():
    p = _make_params(0, [((3,), torch.float32)])
    opt = rp_optim.AdamW(p)
    assert opt.defaults["weight_decay"] == 1e-2 and opt.defaults["decoupled_weight_decay"]
    adam_sd = torch.optim.Adam(_clone(p), weight_decay=0.1).state_dict()
    opt.load_state_dict(adam_sd)
    assert (
        opt.param_groups[0]["decoupled_weight_decay"] and opt.param_groups[0]["weight_decay"] == 0.1
    )
    assert isinstance(opt, torch.optim.Adam)


def test_calls_off_the_optimizer_thread_wait_for_a_launched_step():
    params = _make_params(0, [((64,), torch.float32)])
    opt = rp_optim.Adam(params, lr=0.01)
    params[0].grad = torch.ones(64)
    started = threading.Event()

    def slow_step():
        started.set()
        time.sleep(0.3)
        opt.step()  # on the optimizer thread: must not wait for itself

    optim_thread.launch(slow_step)
    started.wait(5)
    state = opt.state_dict()  # must see the launched step, not a torn or empty state
    assert float(state["state"][0]["step"]) == 1.0
    optim_thread.synchronize()
