"""What a launched step shares with the main thread: a torch.amp.GradScaler in a step function
is refused with an error naming roundpipe.GradScaler (at launch, else when it steps), and the
roundpipe scalers and torch optimizers found there are recognised. See [Note: what a step
shares] in roundpipe/step_check.py."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread
from roundpipe.step_check import check_step_fn

FIX = r"Use roundpipe\.GradScaler, a drop-in with the same constructor and methods"

torch_scaler = torch.amp.GradScaler("cpu")  # a global a step function may name


def _model():
    torch.manual_seed(0)
    model = RoundPipe(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)),
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _forward_backward(model, scaler):
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    return model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(F.cross_entropy(o, l)) / 2
    )


class Trainer:
    def __init__(self, scaler, opt):
        self.scaler, self.opt = scaler, opt

    def step(self):
        self.scaler.step(self.opt)
        self.opt.zero_grad()


def _step_functions(scaler, opt):
    """Step functions that reach ``scaler`` in each way the launch-time search looks."""
    holder = Trainer(scaler, opt)

    def helper():
        scaler.step(opt)

    return {
        "closure": lambda: (scaler.step(opt), opt.zero_grad()),
        "global": lambda: (torch_scaler.step(opt), opt.zero_grad()),
        "bound method": holder.step,
        "partial": functools.partial(lambda s, o: s.step(o), scaler, opt),
        "nested callable": lambda: helper(),
        "object attribute": lambda: holder.scaler.step(opt),
        "list element": (lambda scalers=[scaler]: scalers[0].step(opt)),
    }


@pytest.mark.parametrize("how", list(_step_functions(None, None)))
def test_a_torch_grad_scaler_in_the_step_function_is_refused_at_model_step(how):
    model, opt = _model()
    scaler = torch_scaler if how == "global" else torch.amp.GradScaler("cpu")
    _forward_backward(model, scaler)
    # Before: torch's "AssertionError: No inf checks were recorded prior to update." at the
    # update that follows, or, when the step ran first, a silent race.
    with pytest.raises(
        RuntimeError,
        match=r"a torch\.amp\.GradScaler \(.*\) is used by a step "
        r"launched on roundpipe's optimizer thread.*" + FIX,
    ):
        model.step(_step_functions(scaler, opt)[how])
    optim_thread.synchronize()  # nothing was launched
    model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)  # the gradients are kept


def test_the_error_names_where_the_scaler_was_found():
    _, opt = _model()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match=r"closure variable 'scaler' of the step function"):
        check_step_fn(lambda: scaler.step(opt))
    holder = Trainer(scaler, opt)
    with pytest.raises(
        RuntimeError, match=r"attribute 'scaler' of the object of the step function"
    ):
        check_step_fn(holder.step)


def test_optim_thread_launch_refuses_it_too():
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match=FIX):
        optim_thread.launch(lambda: scaler.update())


_DEEP = {}


def _deeper():
    _DEEP["fn"]()


def test_out_of_sight_of_the_launch_the_step_fails_with_the_same_error():
    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu")
    _DEEP["fn"] = Trainer(scaler, opt).step  # three levels down: the launch does not look there
    try:
        _forward_backward(model, scaler)
        with pytest.raises(
            RuntimeError,
            match=r"torch\.amp\.grad_scaler\.GradScaler stepping "
            r"AdamW.*" + FIX,
        ):
            model.step(lambda: _deeper(), is_async=False)
    finally:
        _DEEP.clear()
    _forward_backward(model, GradScaler("cpu"))  # the model is usable again


def test_a_disabled_torch_scaler_and_roundpipe_scalers_pass():
    model, opt = _model()
    off = torch.amp.GradScaler("cpu", enabled=False)
    _forward_backward(model, off)
    model.step(lambda: (off.step(opt), opt.zero_grad()))
    off.update()
    ours = GradScaler("cpu")
    _forward_backward(model, ours)
    model.step(lambda: (ours.step(opt), opt.zero_grad()))
    ours.update()
    model.synchronize()
    assert ours._used_by_steps  # found in the step function at launch


class _Hostile:
    """An object whose every attribute access raises (a lazy proxy, say)."""

    def __getattribute__(self, name):
        raise RuntimeError(f"no {name} here")


def test_the_search_never_fails_a_launch_that_would_work():
    hostile = _Hostile()
    ran = []
    optim_thread.launch(lambda: ran.append(hostile is not None))
    optim_thread.synchronize()
    assert ran == [True]
