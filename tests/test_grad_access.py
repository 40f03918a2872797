"""The masters' .grad is never touched by the main thread while launched work may use it: a
torch optimizer's zero_grad() anywhere in the loop trains as the documented loop does, the
guard waits and warns, and the masters still work with torch's optimizers, state dicts,
pickling and deep copies. See [Note: guarded master gradients] in roundpipe/runtime/grad_access.py."""

import copy
import io
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread
from roundpipe.runtime.grad_access import MasterParameter


def _batches(n):
    g = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)
    ]
    return [data[k % 4] for k in range(n)]  # epochs of four batches: the loss must fall


def _loss_fn(out, y):
    return F.cross_entropy(out, y) / 2


def _train(devices, position, batches):
    """The standard PyTorch loop around model.step with opt.zero_grad() at ``position``; returns
    the losses and the masters as every step left them (recorded by the step itself, on the
    optimizer thread, so the record adds no wait on the main thread)."""
    torch.manual_seed(0)
    model = RoundPipe(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stepped, losses = [], []

    def record():
        stepped.append(torch.cat([m.detach().flatten() for m in model.optim_parameters()]))

    for x, y in batches:
        if position == "before":
            opt.zero_grad()
        losses.append(model.forward_backward(input_args=(x,), label=y, loss_fn=_loss_fn).item())
        if position == "between":
            opt.zero_grad()
        if position == "inside":
            model.step(lambda: (opt.step(), record(), opt.zero_grad()))
        else:
            model.step(lambda: (opt.step(), record()))
        if position == "after":
            opt.zero_grad()
    model.synchronize()
    return losses, stepped


@pytest.mark.parametrize("devices", ["cpu", "cpu:2", "emu:2"])
def test_zero_grad_anywhere_in_the_loop_trains_as_the_documented_loop(devices):
    # Before the guard: zero_grad before forward_backward or after model.step raced with the
    # running step ('NoneType' object has no attribute 'is_sparse' in adam's _init_group, a
    # crash, or a step that silently applied nothing). The reference is the documented loop
    # (zero_grad inside the step function), which test_staleness checks against a plain PyTorch
    # computation; every position must give its losses and its masters after every step, bit
    # for bit, except "between", where plain PyTorch trains nothing either.
    iterations = 40
    batches = _batches(iterations)
    reference_losses, reference = _train(devices, "inside", batches)  # the documented loop
    assert sum(reference_losses[-4:]) < 0.8 * sum(reference_losses[:4])
    for k in range(1, iterations):
        assert not torch.equal(reference[k], reference[k - 1]), f"step {k} changed nothing"
    # Twice, for more chances at the race, which is the host's (the guard, the optimizer
    # thread); the emulated pool, whose iterations are slower, adds its device path once.
    repeats = 1 if devices.startswith("emu") else 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard's overlap warning; tested below
        for repeat in range(repeats):
            for position in ("before", "after"):
                losses, stepped = _train(devices, position, batches)
                assert losses == reference_losses, (position, repeat)
                assert len(stepped) == iterations, (position, repeat)  # every step ran
                assert all(torch.equal(a, b) for a, b in zip(stepped, reference)), (
                    position,
                    repeat,
                )
            # Cleared between forward_backward and the step, as in plain PyTorch: nothing trains.
            losses, stepped = _train(devices, "between", batches)
            assert all(torch.equal(s, stepped[0]) for s in stepped) and len(stepped) == iterations
            assert losses[4:] == losses[:-4]  # every epoch sees the initial parameters


@pytest.fixture
def opens_the_queue_when_waited(monkeypatch):
    """The blocked launched work is released by the very wait the guard makes, so a test can
    tell for certain that the guard waited (and that it read only afterwards)."""
    release = threading.Event()
    real_wait_all = optim_thread.wait_all
    waits = []

    def wait_all():
        waits.append(threading.current_thread().name)
        release.set()
        real_wait_all()

    # The guard waits through the queue module that roundpipe's own modules use.
    monkeypatch.setattr(roundpipe.threads.optimizer_thread, "wait_all", wait_all)
    yield release, waits
    release.set()
    optim_thread.synchronize()


def test_main_thread_access_waits_for_pending_work_then_warns(opens_the_queue_when_waited):
    release, waits = opens_the_queue_when_waited
    master = MasterParameter(torch.zeros(3))

    def step():
        release.wait()
        master.grad = torch.full((3,), 2.0)

    optim_thread.launch(step)
    with pytest.warns(
        UserWarning,
        match=r"master parameter was read on thread 'MainThread' "
        r"while work launched.*inside the step function",
    ) as rec:
        grad = master.grad
    assert torch.equal(grad, torch.full((3,), 2.0))  # what the step wrote: it waited
    assert waits == ["MainThread"]
    assert rec[0].filename == __file__  # the warning points at the code that touched .grad

    release.clear()
    optim_thread.launch(step)
    with pytest.warns(UserWarning, match="master parameter was set"):
        master.grad = None  # as opt.zero_grad() does: after the step, not before it
    assert master.grad is None

    release.clear()
    optim_thread.launch(step)
    with pytest.warns(UserWarning, match="master parameter was deleted"):
        del master.grad
    assert master.grad is None and waits == ["MainThread"] * 3


def test_no_wait_and_no_warning_on_the_optimizer_thread_or_with_nothing_pending():
    master = MasterParameter(torch.zeros(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim_thread.synchronize()
        master.grad = torch.ones(2)  # nothing pending: torch's own access
        seen = []
        release = threading.Event()

        def on_the_thread():
            # Launched work is pending (this very item, and the one behind it): no wait here.
            seen.append(master.grad.clone())
            master.grad = None

        item = optim_thread.launch_item(on_the_thread)
        optim_thread.launch_item(release.wait)
        item.wait()
        assert len(seen) == 1 and torch.equal(seen[0], torch.ones(2))
        assert optim_thread.has_pending_work()
        release.set()
        optim_thread.synchronize()
        assert master.grad is None


@pytest.mark.parametrize("kind", ["default", "foreach", "fused", "roundpipe"])
def test_masters_step_like_plain_parameters_with_every_optimizer_path(kind):
    make = {
        "default": lambda ps: torch.optim.AdamW(ps, lr=0.1),
        "foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
        "fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
        "roundpipe": lambda ps: roundpipe.optim.AdamW(ps, lr=0.1),
    }[kind]
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(5, 4, generator=g), torch.randn(4, generator=g)]
    grads = [[torch.randn_like(v) for v in values] for _ in range(3)]
    results = []
    for cls in (nn.Parameter, MasterParameter):
        params = [cls(v.clone()) for v in values]
        opt = make(params)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in params], opt.state_dict()))
    (plain, plain_state), (masters, master_state) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, masters))
    assert plain_state["param_groups"] == master_state["param_groups"]
    for i, state in plain_state["state"].items():
        for key, value in state.items():
            assert torch.equal(master_state["state"][i][key], value), (i, key)
    if kind == "roundpipe":  # the masters take roundpipe Adam's fused kernel, as plain params do
        assert opt._step_supports_amp_scaling


def test_masters_pickle_as_plain_parameters_and_deep_copy_as_masters():
    master = MasterParameter(torch.arange(4.0))
    master.grad = torch.ones(4)
    buffer = io.BytesIO()
    torch.save({"m": master}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["m"]
    assert type(loaded) is nn.Parameter and torch.equal(loaded, master)  # no roundpipe needed
    clone = copy.deepcopy(master)
    assert type(clone) is MasterParameter and torch.equal(clone, master)
    assert clone.requires_grad and clone.grad is None  # as nn.Parameter's deepcopy


def test_the_model_masters_are_guarded_and_the_model_param_are_not_replaced():
    seq = nn.Sequential(nn.Linear(2, 2))
    model = RoundPipe(seq)
    assert all(type(m) is MasterParameter for m in model.optim_parameters())
    assert model.module is seq


def test_optimizer_state_dict_on_the_main_thread_waits_for_a_running_step(
    opens_the_queue_when_waited,
):
    release, waits = opens_the_queue_when_waited
    model = RoundPipe(nn.Sequential(nn.Linear(3, 2)))
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.forward_backward(input_args=(torch.randn(4, 3),), loss_fn=lambda o, _: o.sum())
    model.step(lambda: (release.wait(), opt.step(), opt.zero_grad()))  # opt: found at launch
    state = copy.deepcopy(opt.state_dict())  # waits; unguarded, it was taken before the step
    assert waits == ["MainThread"]
    assert len(state["state"]) == 2 and all(s["step"].item() == 1 for s in state["state"].values())
    release.clear()
    model.forward_backward(input_args=(torch.randn(4, 3),), loss_fn=lambda o, _: o.sum())
    model.step(lambda: (release.wait(), opt.step(), opt.zero_grad()))
    opt.load_state_dict(state)  # waits, so the running step cannot overwrite what it loads
    model.synchronize()
    assert all(s["step"].item() == 1 for s in opt.state_dict()["state"].values())


def test_a_step_with_no_gradient_warns_that_it_changes_nothing():
    model = RoundPipe(nn.Sequential(nn.Linear(3, 2)))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.forward_backward(input_args=(torch.randn(4, 3),), loss_fn=lambda o, _: o.sum())
    opt.zero_grad()  # between forward_backward and the step: clears this iteration's gradients
    with pytest.warns(UserWarning, match=r"SGD.step\(\) runs in a RoundPipe step with no gradient"):
        model.step(lambda: opt.step(), is_async=False)


# -- clipping and schedulers: inside the step function, on the masters -------------------------


def _clip_data():
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(8, 6, generator=g) * 4, torch.randint(0, 3, (8,), generator=g))
        for _ in range(6)
    ]


def _clip_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_clipping_and_a_scheduler_in_the_step_function_match_plain_pytorch():
    data = _clip_data()
    # Plain PyTorch: two microbatches of gradient accumulation, torch's scaler, unscale_, clip,
    # step, scheduler step.
    ref = _clip_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref_norms = []
    for x, y in data:
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            ref_scaler.scale(_loss_fn(ref(xm), ym)).backward()
        ref_scaler.unscale_(ref_opt)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_sched.step()
        ref_opt.zero_grad()

    model = RoundPipe(_clip_net(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = roundpipe.GradScaler("cpu", init_scale=2.0**8)
    norms = []

    def step_fn():  # on the optimizer thread, where model.parameters() are the masters
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        scaler.step(opt)
        sched.step()
        opt.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented place: nothing to warn about
        for x, y in data:
            model.forward_backward(
                input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(_loss_fn(o, l))
            )
            model.step(step_fn, is_async=False)  # zero-stale: comparable with plain PyTorch
            scaler.update()
        model.synchronize()
    assert norms == pytest.approx(ref_norms, rel=1e-5) and max(norms) > 1.0  # it clipped
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    for m, r in zip(model.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)

    # The same step function with the asynchronous step trains, clipping real gradients.
    norms.clear()
    for x, y in data * 3:
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(_loss_fn(o, l))
        )
        model.step(step_fn)
        scaler.update()
    model.synchronize()
    assert len(norms) == 18 and min(norms) > 0


def test_reading_the_wrapped_models_gradients_warns_where_they_are_none():
    seq = _clip_net()
    model = RoundPipe(seq, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _clip_data()[0]
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss_fn)
    match = (
        r"the \.grad of a parameter of a module wrapped by RoundPipe was read, and it is None.*"
        r"inside the step function, where model\.parameters\(\) gives the masters"
    )
    with pytest.warns(UserWarning, match=match) as rec:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips nothing
    assert norm.item() == 0.0
    assert rec[0].filename == __file__  # at this line, not inside torch
    with pytest.warns(UserWarning, match=match):
        model.zero_grad()  # clears nothing: the masters keep their gradients
    with pytest.warns(UserWarning, match=match):
        assert seq[0].weight.grad is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(m.grad is not None for m in model.optim_parameters())  # nothing pending
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        # A set gradient reads back without a warning (e.g. a plain backward of the module).
        seq[0].weight.grad = torch.ones_like(seq[0].weight)
        assert seq[0].weight.grad is not None
        seq[0].weight.grad = None


def test_the_wrapped_parameters_stay_parameters_everywhere_else():
    from roundpipe.runtime.grad_access import WrappedParameter

    seq = _clip_net()
    model = RoundPipe(seq)
    weight = seq[0].weight
    assert type(weight) is WrappedParameter and isinstance(weight, nn.Parameter)
    assert seq.state_dict(keep_vars=True)["0.weight"] is weight
    assert type(seq.state_dict()["0.weight"]) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(seq.state_dict(), buffer)
    copied = copy.deepcopy(seq)  # e.g. an EMA or a teacher: not wrapped, so plain parameters
    assert type(copied[0].weight) is nn.Parameter and torch.equal(copied[0].weight, weight)
    out = torch.func.functional_call(
        seq, {n: p.detach() * 0 for n, p in seq.named_parameters()}, (torch.ones(2, 6),)
    )
    assert torch.equal(out, torch.zeros(2, 3))
    del model
    import gc

    gc.collect()
    assert type(weight) is nn.Parameter  # the RoundPipe is gone: nothing wraps it any more


def test_roundpipes_own_fake_tensor_probe_does_not_warn_about_grad_reads():
    """device_memory_budget="auto" probes the stage inputs on fake tensors, which copies each
    parameter's metadata (its .grad included): roundpipe's own read, no warning."""
    model = RoundPipe(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)),
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, device_memory_budget="auto"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.forward_backward(
            input_args=(torch.randn(4, 8),),
            label=torch.randint(0, 2, (4,)),
            loss_fn=F.cross_entropy,
        )
    assert not [w for w in caught if ".grad" in str(w.message)], [str(w.message) for w in caught]
