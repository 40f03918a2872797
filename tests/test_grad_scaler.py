"""GradScaler in sync mode against torch.amp.GradScaler, misuse, bad input, extras."""

import math
import warnings

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import GradScaler, ScaleCollapseWarning, optim_thread

# Iterations whose loss is multiplied by inf, so their gradients overflow.
OVERFLOW_AT = {3, 4, 9, 17, 18, 19, 30}


def _make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen))
        for _ in range(n)
    ]


def _loss(model, x, y, it):
    loss = nn.functional.cross_entropy(model(x), y)
    return loss * math.inf if it in OVERFLOW_AT else loss


def _plain_loop(scaler, make_opts, iters=36, clip=False, step_on_thread=False):
    """A plain AMP loop; returns the scale before each iteration and the final params."""
    model = _make_model()
    opts = make_opts(model)
    scales = []
    for it, (x, y) in enumerate(_batches(iters)):
        scales.append(scaler.get_scale())
        scaler.scale(_loss(model, x, y, it)).backward()

        def step():
            for opt in opts:
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(opt)
                opt.zero_grad()

        if step_on_thread:
            optim_thread.launch(step)
            optim_thread.synchronize()  # a step that was waited for: sync mode
        else:
            step()
        scaler.update()
    return scales, [p.detach().clone() for p in model.parameters()]


def _sgd(model):
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]


def _adam(model):
    return [torch.optim.Adam(model.parameters(), lr=1e-2)]


def _fused_adam(model):
    return [torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)]


def _two_optimizers(model):
    params = list(model.parameters())
    return [
        torch.optim.SGD(params[:2], lr=0.1, momentum=0.5),
        torch.optim.Adam(params[2:], lr=1e-2),
    ]


def _torch_scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)


def _our_scaler():
    return GradScaler("cpu", init_scale=2.0**10, growth_interval=4)


@pytest.mark.parametrize(
    "make_opts",
    [_sgd, _adam, _fused_adam, _two_optimizers],
    ids=["sgd-momentum", "adam", "fused-adam", "two-optimizers"],
)
@pytest.mark.parametrize("clip", [False, True], ids=["", "clip-after-unscale"])
@pytest.mark.parametrize("step_on_thread", [False, True], ids=["main", "optimizer-thread-waited"])
def test_sync_mode_reproduces_torch_bit_for_bit(make_opts, clip, step_on_thread):
    ref_scales, ref_params = _plain_loop(_torch_scaler(), make_opts, clip=clip)
    scales, params = _plain_loop(_our_scaler(), make_opts, clip=clip, step_on_thread=step_on_thread)
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the run grew and backed off
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


def test_sync_state_dict_matches_torch_after_a_run():
    torch_scaler, ours = _torch_scaler(), _our_scaler()
    _plain_loop(torch_scaler, _adam, iters=21)
    _plain_loop(ours, _adam, iters=21)
    theirs, mine = torch_scaler.state_dict(), ours.state_dict()
    assert {k: mine[k] for k in theirs} == theirs


def test_state_dicts_load_both_ways():
    ours = _our_scaler()
    _plain_loop(ours, _sgd, iters=11)
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(ours.state_dict())  # torch ignores the extra "roundpipe" key
    assert torch_scaler.get_scale() == ours.get_scale()
    assert torch_scaler._get_growth_tracker() == ours._get_growth_tracker()

    back = GradScaler("cpu")
    back.load_state_dict(torch_scaler.state_dict())
    assert back.get_scale() == ours.get_scale()
    assert back.get_growth_interval() == 4
    assert back._get_growth_tracker() == ours._get_growth_tracker()


def test_sparse_gradients_as_torch():
    def run(scaler):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        for it in range(8):
            idx = torch.randint(0, 20, (5,))
            loss = emb(idx).pow(2).sum() * (math.inf if it == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return emb.weight.detach(), scaler.get_scale()

    w_ref, s_ref = run(torch.amp.GradScaler("cpu", init_scale=64.0))
    w, s = run(GradScaler("cpu", init_scale=64.0))
    assert s == s_ref == 32.0
    assert torch.equal(w, w_ref)


def test_scale_accepts_tensors_and_iterables_like_torch():
    scaler = GradScaler("cpu", init_scale=4.0)
    ref = torch.amp.GradScaler("cpu", init_scale=4.0)
    a, b = torch.ones(2), torch.full((3,), 2.0)
    for got, want in zip(scaler.scale([a, (b,)]), ref.scale([a, (b,)])):
        got = got if isinstance(got, torch.Tensor) else got[0]
        want = want if isinstance(want, torch.Tensor) else want[0]
        assert torch.equal(got, want)
    assert scaler.scale(a).dtype == ref.scale(a).dtype
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        scaler.scale(3.0)


def test_disabled_scaler_is_a_passthrough_like_torch():
    scaler = GradScaler("cpu", enabled=False)
    model = _make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    loss = nn.functional.cross_entropy(model(x), y)
    assert scaler.scale(loss) is loss
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}
    enabled = GradScaler("cpu")
    with pytest.raises(RuntimeError, match="saved from a disabled instance"):
        enabled.load_state_dict(scaler.state_dict())


def test_leading_device_string_and_default_device():
    assert GradScaler("cpu", init_scale=8.0).get_scale() == 8.0
    assert GradScaler(torch.device("cpu")).is_enabled()
    assert GradScaler().is_enabled()  # no CUDA here: the default picks the CPU
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not GradScaler("cuda").is_enabled()


# -- misuse ---------------------------------------------------------------------------------------


def _one_backward(scaler):
    model = _make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    return model, opt


def test_unscale_twice_raises_torch_error():
    scaler = GradScaler("cpu")
    _, opt = _one_backward(scaler)
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(opt)
    scaler.update()  # usable again
    assert scaler.get_scale() == 2.0**16


def test_step_without_scale_raises_torch_message():
    scaler = GradScaler("cpu")
    model = _make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="did not use scaler.scale"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="did not use scaler.scale"):
        scaler.update()


@pytest.mark.parametrize(
    "make_fused",
    [
        lambda params: torch.optim.Adam(params, lr=0.1, fused=True),
        lambda params: roundpipe.optim.Adam(params, lr=0.1),
    ],
    ids=["torch-fused-adam", "roundpipe-adam"],
)
def test_fused_step_without_grads_returns_like_torch(make_fused):
    """An optimizer that unscales in its own kernel, whose params got no gradient this iteration
    (here: a frozen head), next to one that did: torch's step returns and steps nothing."""
    results = []
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        scaler = scaler_cls("cpu", init_scale=4.0, growth_interval=1)
        torch.manual_seed(0)
        body, head = nn.Linear(3, 3), nn.Linear(3, 1)
        plain = torch.optim.SGD(body.parameters(), lr=0.1)
        fused = make_fused(head.parameters())
        head_before = [p.detach().clone() for p in head.parameters()]
        scaler.scale(body(torch.ones(2, 3)).sum()).backward()
        assert all(p.grad is None for p in head.parameters())
        assert scaler.step(fused) is None
        scaler.step(plain)
        scaler.update()
        assert all(torch.equal(a, b) for a, b in zip(head.parameters(), head_before))
        results.append((scaler.get_scale(), [p.detach().clone() for p in body.parameters()]))
    (torch_scale, torch_body), (scale, body_params) = results
    assert scale == torch_scale == 8.0  # one good step grew it
    assert all(torch.equal(a, b) for a, b in zip(body_params, torch_body))


def test_closure_is_rejected_like_torch():
    scaler = GradScaler("cpu")
    _, opt = _one_backward(scaler)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)


def test_update_on_the_optimizer_thread_raises_instead_of_deadlocking():
    scaler = GradScaler("cpu")
    _, opt = _one_backward(scaler)
    scaler.step(opt)
    optim_thread.launch(scaler.update)
    with pytest.raises(RuntimeError, match="optimizer thread"):
        optim_thread.synchronize()
    scaler.update()


def test_fp16_gradients_are_refused_like_torch():
    scaler = GradScaler("cpu")
    layer = nn.Linear(4, 4).half()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler.scale(layer(torch.randn(2, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_scale=math.inf), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=1.5), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(min_scale=-1.0), "min_scale"),
        (dict(init_scale=1.0, min_scale=2.0), "within"),
    ],
)
def test_bad_constructor_input_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradScaler("cpu", **kwargs)


def test_bad_setter_input_is_a_clear_value_error():
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(scale=-5.0), "scale"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=2.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(_growth_tracker=-1), "_growth_tracker"),
        (dict(roundpipe=dict(hysteresis=0)), "hysteresis"),
        (dict(roundpipe=dict(hysteresis=2, hysteresis_left=3)), "hysteresis_left"),
        (dict(roundpipe=dict(front_scale=float("inf"))), "front_scale"),
        (dict(roundpipe=dict(min_scale=8.0, max_scale=4.0)), "must not exceed"),
    ],
)
def test_a_bad_state_dict_is_refused_before_anything_changes(change, match):
    scaler = _our_scaler()
    _plain_loop(scaler, _sgd, iters=7)
    before = scaler.state_dict()
    bad = dict(before, **{k: v for k, v in change.items() if k != "roundpipe"})
    bad["roundpipe"] = dict(before["roundpipe"], **change.get("roundpipe", {}))
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before
    assert scaler.get_scale() == before["roundpipe"]["front_scale"]
    assert scaler.get_backoff_factor() == before["backoff_factor"]


def test_a_state_dict_missing_torchs_keys_is_refused():
    scaler = _our_scaler()
    with pytest.raises(ValueError, match="lacks"):
        scaler.load_state_dict({"scale": 2.0})
    assert scaler.get_scale() == 2.0**10


def test_not_picklable_with_a_pointer_to_state_dict():
    import pickle

    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(GradScaler("cpu"))


# -- extras ---------------------------------------------------------------------------------------


def _drive(scaler, overflows):
    """One parameter, one optimizer; returns (scale before each iteration, skipped per step)."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    scales, skipped = [], []
    for overflow in overflows:
        scales.append(scaler.get_scale())
        scaler.scale((w * (math.inf if overflow else 1.0)).sum()).backward()
        scaler.step(opt)
        skipped.append(scaler.step_was_skipped(opt))
        scaler.update()
        opt.zero_grad()
    return scales, skipped


def test_hysteresis_tolerates_consecutive_overflows_before_backing_off():
    flags = [True, False, True, True, True, False, False]
    scales, skipped = _drive(
        GradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=2), flags
    )
    # 1st overflow tolerated; a success resets; then the 2nd consecutive backs off, and so does
    # every consecutive one after it.
    assert scales == [64, 64, 64, 64, 32, 16, 16]
    assert skipped == flags


def test_min_and_max_scale_bound_the_scale_and_a_collapse_warns():
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales, _ = _drive(scaler, [False, False, False] + [True] * 7)
    assert scales == [8, 16, 16, 16, 8, 4, 2, 2, 2, 2]
    collapse = [w for w in caught if issubclass(w.category, ScaleCollapseWarning)]
    assert len(collapse) == 1 and "min_scale=2.0" in str(collapse[0].message)
    assert scaler.get_scale() == 2.0


def test_defaults_raise_no_collapse_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _drive(GradScaler("cpu", init_scale=8.0), [True] * 6)


def test_step_was_skipped_needs_a_step():
    scaler = GradScaler("cpu")
    _, opt = _one_backward(scaler)
    with pytest.raises(RuntimeError, match="step_was_skipped"):
        scaler.step_was_skipped(opt)
    scaler.step(opt)
    assert scaler.step_was_skipped(opt) is False


def test_snapshot_counts_steps_and_skips():
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=100)
    _drive(scaler, [False, True, False, True, True])
    snap = scaler.snapshot()
    assert (snap.steps, snap.skipped_steps) == (5, 3)
    assert snap.scale_in_use == snap.newest_scale == 2.0
    assert snap.growth_tracker == 0
    state = scaler.state_dict()["roundpipe"]
    assert (state["steps"], state["skipped_steps"]) == (5, 3)


def test_new_scale_in_sync_mode_as_torch():
    ours, ref = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for scaler in (ours, ref):
        _, opt = _one_backward(scaler)
        scaler.step(opt)
        scaler.update(new_scale=123.0)
    assert ours.get_scale() == ref.get_scale() == 123.0
    assert ours._get_growth_tracker() == ref._get_growth_tracker()
    ours.update(new_scale=torch.tensor(7.0))
    assert ours.get_scale() == 7.0
    with pytest.raises(ValueError, match="new_scale"):
        ours.update(new_scale=torch.ones(2))


def test_public_names():
    assert roundpipe.GradScaler is GradScaler
    for name in (
        "scale",
        "unscale_",
        "step",
        "update",
        "get_scale",
        "get_growth_factor",
        "set_growth_factor",
        "get_backoff_factor",
        "set_backoff_factor",
        "get_growth_interval",
        "set_growth_interval",
        "is_enabled",
        "state_dict",
        "load_state_dict",
    ):
        assert callable(getattr(torch.amp.GradScaler, name))
        assert callable(getattr(GradScaler, name))
