"""GradScaler's async (lag-one) mode against a small pure-Python reference of the contract in
docs/scaler.md."""

import math
import os
import random
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from roundpipe import GradScaler, optim_thread

GROWTH, BACKOFF = 2.0, 0.5


class LagOneReference:
    """docs/scaler.md, "Sync and async update", written out: s_0 = s_1 = init; async update k
    hands out the newest scale after U on step k-1 and then runs U on step k, whose overflow sets
    the scale to min(newest, s_k * backoff). A sync update runs U on step k and hands out its
    result."""

    def __init__(self, init, interval):
        self.newest = self.back = self.front = self.published = init
        self.tracker, self.interval = 0, interval
        self.growth = GROWTH

    def _rule(self, overflow):
        if overflow:
            self.newest = min(self.newest, self.back * BACKOFF)
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                if self.newest * self.growth <= torch.finfo(torch.float32).max:
                    self.newest *= self.growth
                self.tracker = 0

    def update_async(self, overflow, new_scale=None):
        handed = self.published if new_scale is None else new_scale
        if new_scale is None:
            self._rule(overflow)
        else:
            self.newest = new_scale
        self.back = self.front = handed
        self.published = self.newest

    def update_sync(self, overflow):
        self._rule(overflow)
        self.back = self.front = self.published = self.newest


class Harness:
    """A loop whose steps run on the optimizer thread like model.step: gradients are computed on
    the main thread from constants (so they do not race with the step) and moved to the master
    by the launched step itself."""

    def __init__(self, scaler, lr=0.1):
        self.scaler = scaler
        self.master = nn.Parameter(torch.ones(4))
        self.opt = torch.optim.SGD([self.master], lr=lr, momentum=0.9)
        self.const = torch.linspace(0.5, 2.0, 4, requires_grad=True)
        self.used, self.stepped_with, self.skipped = [], [], []

    def iteration(
        self,
        overflow,
        wait=False,
        step_error=None,
        new_scale=None,
        is_async=None,
        before_update=None,
    ):
        scaler = self.scaler
        self.used.append(scaler.get_scale())
        loss = scaler.scale((self.const * self.const).sum() * (math.inf if overflow else 1.0))
        (grad,) = torch.autograd.grad(loss, [self.const])

        def step():
            if step_error is not None:
                raise step_error
            self.master.grad = grad
            self.stepped_with.append(scaler.get_scale())  # back scale, on the optimizer thread
            scaler.step(self.opt)
            self.skipped.append(scaler.step_was_skipped(self.opt))
            self.opt.zero_grad()

        optim_thread.launch(step)
        if wait:
            optim_thread.synchronize()
        if before_update is not None:
            before_update()
        scaler.update(new_scale, is_async=is_async)


def _flags(n, seed, p=0.08):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def test_async_lag_one_matches_reference_with_scale_dependent_overflows():
    # Gradients overflow whenever the scale used is above 2**12 (like a real fp16 run that grows
    # into overflow), plus random spikes: a stale scale repeats the overflow, which must not be
    # backed off twice.
    n, interval = 300, 5
    spikes = _flags(n, seed=0)
    ref, run = (
        LagOneReference(2.0**10, interval),
        Harness(GradScaler("cpu", init_scale=2.0**10, growth_interval=interval)),
    )
    ref_used = []
    for k in range(n):
        ref_used.append(ref.front)
        overflow = spikes[k] or ref.front > 2.0**12
        ref.update_async(overflow)
        run.iteration(overflow)
    optim_thread.synchronize()
    assert run.used == ref_used
    assert run.stepped_with == run.used  # the back scale is the one that produced the gradients
    assert run.used[:2] == [2.0**10, 2.0**10]
    assert max(run.used) == 2.0**13  # it grew into overflow and was pulled back
    assert run.scaler.get_scale(up_to_date=True) == ref.newest
    snap = run.scaler.snapshot()
    assert snap.steps == n and snap.skipped_steps == sum(run.skipped)


def test_a_stale_overflow_is_not_backed_off_twice():
    # Iterations 0 and 1 both use init_scale (lag one) and both overflow. U of step 0 halves the
    # scale; step 1 overflowed at the same stale scale, so U of step 1 leaves it at
    # min(S/2, S * 0.5) = S/2, where backing off from min(newest, s_k) would give S/4.
    S = 2.0**10
    run = Harness(GradScaler("cpu", init_scale=S, growth_interval=100))
    for _ in range(2):
        run.iteration(overflow=True)
    assert run.used == [S, S]
    assert run.scaler.get_scale(up_to_date=True) == S / 2
    run.iteration(overflow=True)  # iteration 2 used S/2 and overflowed again: a real backoff
    assert run.used[-1] == S / 2
    assert run.scaler.get_scale(up_to_date=True) == S / 4
    assert run.skipped == [True, True, True]


def test_ten_thousand_async_iterations_with_random_overflows():
    n = 10_000
    flags = _flags(n, seed=1, p=0.03)
    ref = LagOneReference(2.0**8, 7)
    run = Harness(GradScaler("cpu", init_scale=2.0**8, growth_interval=7), lr=1e-3)
    ref_used = []
    overflows = []
    for k in range(n):
        ref_used.append(ref.front)
        overflows.append(flags[k] or ref.front >= 2.0**20)  # fp16-like ceiling plus spikes
        ref.update_async(overflows[k])
        run.iteration(overflows[k])
    optim_thread.synchronize()
    assert run.used == ref_used
    assert run.stepped_with == ref_used
    assert run.skipped == overflows
    assert run.scaler.get_scale(up_to_date=True) == ref.newest
    assert run.scaler._get_growth_tracker(up_to_date=True) == ref.tracker


def test_mixed_sync_and_async_iterations_follow_the_reference():
    n = 120
    flags, waits = _flags(n, seed=2, p=0.15), _flags(n, seed=3, p=0.4)
    ref, run = (
        LagOneReference(2.0**6, 3),
        Harness(GradScaler("cpu", init_scale=2.0**6, growth_interval=3)),
    )
    ref_used = []
    for k in range(n):
        ref_used.append(ref.front)
        (ref.update_sync if waits[k] else ref.update_async)(flags[k])
        run.iteration(flags[k], wait=waits[k])
    optim_thread.synchronize()
    assert run.used == ref_used
    assert run.stepped_with == ref_used


def test_forced_modes():
    # is_async=False waits for the launched step and behaves like torch.
    flags = _flags(40, seed=4, p=0.2)
    ref, run = (
        LagOneReference(2.0**6, 2),
        Harness(GradScaler("cpu", init_scale=2.0**6, growth_interval=2)),
    )
    for _k, flag in enumerate(flags):
        assert run.scaler.get_scale() == ref.front
        ref.update_sync(flag)
        run.iteration(flag, is_async=False)
    # is_async=True with steps that were waited for is still lag-one.
    for _k, flag in enumerate(flags):
        assert run.scaler.get_scale() == ref.front
        ref.update_async(flag)
        run.iteration(flag, wait=True, is_async=True)
    optim_thread.synchronize()
    assert run.stepped_with == run.used


def test_new_scale_in_async_mode_is_used_from_the_next_iteration():
    ref, run = (
        LagOneReference(2.0**6, 1000),
        Harness(GradScaler("cpu", init_scale=2.0**6, growth_interval=1000)),
    )
    plan = [(False, None), (True, None), (False, 5.0), (True, None), (False, None), (False, None)]
    for overflow, new_scale in plan:
        assert run.scaler.get_scale() == ref.front
        ref.update_async(overflow, new_scale)
        run.iteration(overflow, new_scale=new_scale)
    optim_thread.synchronize()
    assert 5.0 in run.used and run.stepped_with == run.used
    assert run.scaler.get_scale(up_to_date=True) == ref.newest


def test_setters_apply_in_launch_order_and_getters_see_them():
    interval = 2
    ref, run = (
        LagOneReference(1.0, interval),
        Harness(GradScaler("cpu", init_scale=1.0, growth_interval=interval)),
    )
    for k in range(12):
        if k == 5:
            run.scaler.set_growth_factor(4.0)
            ref.growth = 4.0
            assert run.scaler.get_growth_factor() == 4.0  # the compute side sees it at once
        assert run.scaler.get_scale() == ref.front
        ref.update_async(False)
        run.iteration(False)
        assert run.scaler.get_growth_factor() == (4.0 if k >= 5 else 2.0)
    assert run.scaler.get_growth_factor(up_to_date=True) == 4.0
    assert run.scaler.get_scale(up_to_date=True) == ref.newest


def test_setter_on_the_optimizer_thread_reaches_the_getters_after_an_update():
    run = Harness(GradScaler("cpu", init_scale=8.0, growth_interval=1000))
    run.iteration(False)
    optim_thread.launch(run.scaler.set_backoff_factor, 0.25)
    run.iteration(False)
    run.iteration(False)
    assert run.scaler.get_backoff_factor() == 0.25
    assert run.scaler.get_backoff_factor(up_to_date=True) == 0.25


def test_update_and_snapshot_do_not_wait_for_a_running_step():
    scaler = GradScaler("cpu", init_scale=8.0)
    run = Harness(scaler)
    run.iteration(False)
    release = threading.Event()
    watchdog = threading.Timer(30.0, release.set)  # only so a broken scaler fails, not hangs
    watchdog.start()
    try:
        optim_thread.launch(release.wait)  # a long step is running...
        run.iteration(False)  # ...and this update() returns anyway
        snap = scaler.snapshot()
        assert not release.is_set()
        assert snap.scale_in_use == 8.0
        assert scaler.get_scale() == 8.0  # non-blocking getter
    finally:
        release.set()
        watchdog.cancel()
    assert scaler.get_scale(up_to_date=True) == 8.0


class StepBroke(Exception):
    pass


def test_update_without_a_step_since_the_last_is_refused_at_that_call():
    interval = 2
    ref, run = (
        LagOneReference(2.0**6, interval),
        Harness(GradScaler("cpu", init_scale=2.0**6, growth_interval=interval)),
    )
    for k in range(6):
        ref.update_async(k == 3)
        run.iteration(k == 3)
        if k in (1, 3):
            with pytest.raises(
                RuntimeError,
                match=r"no step that uses this scaler since the previous update\(\).*once per "
                r"iteration, after model\.step",
            ):
                run.scaler.update()  # misplaced: a second update in the iteration
    optim_thread.synchronize()  # nothing failed on the optimizer thread either
    # The refused calls changed nothing: the run follows the reference of a correct loop.
    assert run.scaler.get_scale() == ref.front
    assert run.stepped_with == run.used
    assert run.scaler.get_scale(up_to_date=True) == ref.newest
    # update(new_scale=...) needs no step, as in torch.
    run.scaler.update(new_scale=3.0)
    assert run.scaler.get_scale() == 3.0


def test_step_error_is_reraised_on_main_as_its_own_type_and_training_continues():
    ref, run = (
        LagOneReference(2.0**4, 1000),
        Harness(GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)),
    )
    for k in range(3):
        ref.update_async(k == 1)
        run.iteration(k == 1)
    raised = []
    for k in (3, 4):  # the failure surfaces at the first update() after it happened
        try:
            run.iteration(False, step_error=StepBroke("step 3 failed") if k == 3 else None)
        except StepBroke as exc:
            raised.append(exc)
    assert len(raised) == 1 and "step 3 failed" in str(raised[0])
    optim_thread.synchronize()  # reported once
    # Training goes on; every step still divides by the scale that produced its gradients.
    for k in range(4):
        run.iteration(k == 2)
    optim_thread.synchronize()
    assert run.stepped_with == [u for i, u in enumerate(run.used) if i != 3]


def test_unscale_on_main_while_a_launched_step_is_pending_is_refused():
    scaler = GradScaler("cpu")
    run = Harness(scaler)
    run.iteration(False)
    release = threading.Event()
    optim_thread.launch(release.wait)
    try:
        with pytest.raises(RuntimeError, match="inside the step function"):
            scaler.unscale_(run.opt)
    finally:
        release.set()
        optim_thread.synchronize()


def _plain_loop(scaler, steps=6, overflow_at=2):
    """A plain PyTorch AMP loop on this thread; returns the scales used and the parameter."""
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    c = torch.linspace(0.5, 1.5, 3)
    scales = []
    for k in range(steps):
        scales.append(scaler.get_scale())
        loss = (p * c).sum() * (math.inf if k == overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scales, p.detach()


def _torch_plain_loop():
    return _plain_loop(torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2))


def test_a_failed_step_does_not_hold_up_an_unrelated_scaler_on_the_main_thread():
    run = Harness(GradScaler("cpu", init_scale=2.0**4))
    run.iteration(False)
    reported = []
    try:
        run.iteration(False, step_error=StepBroke("step failed"))
    except StepBroke as exc:
        reported.append(exc)
    ran = threading.Event()
    optim_thread.launch_item(ran.set)
    assert ran.wait(timeout=30)  # the failed step ran; no call waited for it
    try:
        optim_thread.raise_failures()
    except StepBroke as exc:
        reported.append(exc)
    assert len(reported) == 1
    # A scaler of a plain loop on the main thread: refused before ("work launched on the
    # optimizer thread ... has not been waited for"), now exactly torch.amp.GradScaler.
    ours, theirs = (
        _plain_loop(GradScaler("cpu", init_scale=2.0**4, growth_interval=2)),
        _torch_plain_loop(),
    )
    assert ours[0] == theirs[0] and torch.equal(ours[1], theirs[1])


def test_only_a_scaler_that_launched_steps_use_is_refused_while_one_runs():
    scaler = GradScaler("cpu")
    run = Harness(scaler)
    run.iteration(False)
    release = threading.Event()
    optim_thread.launch(release.wait)
    try:
        # Another model's loop on this thread, with its own scaler, runs as torch's would, without
        # waiting for the blocked step.
        ours, theirs = (
            _plain_loop(GradScaler("cpu", init_scale=2.0**4, growth_interval=2)),
            _torch_plain_loop(),
        )
        assert ours[0] == theirs[0] and len(set(ours[0])) > 1 and torch.equal(ours[1], theirs[1])
        assert not release.is_set()
        with pytest.raises(RuntimeError, match="which uses this scaler, has not finished"):
            scaler.unscale_(run.opt)
    finally:
        release.set()
        optim_thread.synchronize()


def test_a_scaler_named_in_a_launched_step_is_refused_before_that_step_ran():
    scaler = GradScaler("cpu")
    run = Harness(scaler)
    release = threading.Event()
    optim_thread.launch(release.wait)
    try:
        run.iteration(False)  # its step, queued behind the blocked one, has not touched the scaler
        with pytest.raises(RuntimeError, match="inside the step function"):
            scaler.unscale_(run.opt)
    finally:
        release.set()
        optim_thread.synchronize()


CHECKPOINT_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from test_scaler_async import Harness, _flags
from roundpipe import GradScaler, optim_thread
ckpt = torch.load({path!r})
run = Harness(GradScaler("cpu"))
run.scaler.load_state_dict(ckpt["scaler"])
run.opt.load_state_dict(ckpt["opt"])
with torch.no_grad():
    run.master.copy_(ckpt["master"])
flags = _flags(60, seed=5, p=0.15)
for k in range(30, 60):
    run.iteration(flags[k])
optim_thread.synchronize()
torch.save({{"used": run.used, "master": run.master.detach()}}, {out!r})
"""


@pytest.mark.slow
def test_async_run_resumes_bit_for_bit_in_a_new_process(tmp_path):
    flags = _flags(60, seed=5, p=0.15)
    full = Harness(GradScaler("cpu", init_scale=2.0**6, growth_interval=3))
    for k in range(60):
        full.iteration(flags[k])
        if k == 29:
            # A checkpoint after iteration 29: state_dict waits for the optimizer thread.
            scaler_state = full.scaler.state_dict()
            torch.save(
                {
                    "scaler": scaler_state,
                    "opt": full.opt.state_dict(),
                    "master": full.master.detach().clone(),
                },
                tmp_path / "ckpt.pt",
            )
    optim_thread.synchronize()
    # The checkpoint falls where the lag shows: the compute side still uses the older scale.
    assert scaler_state["roundpipe"]["front_scale"] != scaler_state["scale"]
    script = CHECKPOINT_SCRIPT.format(
        tests=os.path.dirname(__file__),
        path=str(tmp_path / "ckpt.pt"),
        out=str(tmp_path / "out.pt"),
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    resumed = torch.load(tmp_path / "out.pt")
    assert resumed["used"] == full.used[30:]
    assert torch.equal(resumed["master"], full.master.detach())


class _Blocked:
    """Another loop's step that stays running (unwaited) until released."""

    def __init__(self):
        self.release = threading.Event()
        self.watchdog = threading.Timer(30.0, self.release.set)  # a broken scaler fails, not hangs

    def launch(self):
        self.watchdog.start()
        other = GradScaler("cpu", init_scale=2.0**3)
        opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        optim_thread.launch(lambda: (self.release.wait(), other, opt))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.watchdog.cancel()
        optim_thread.synchronize()


def test_another_loops_unwaited_step_does_not_make_this_scalers_update_async():
    # [Note: which update]: only steps that use this scaler decide its mode. Its own step was
    # waited for, so the update is sync even though another loop launched a step since (still
    # running, unwaited): the overflow backs off at once, as torch's scaler does, and the update
    # does not wait for the other step.
    run = Harness(GradScaler("cpu", init_scale=2.0**6))
    with _Blocked() as blocked:
        run.iteration(True, wait=True, before_update=blocked.launch)
        assert not blocked.release.is_set()
        assert run.scaler.get_scale() == 2.0**5  # sync: the backoff is in effect now
        assert optim_thread.has_unwaited_launch()
    ref, run = LagOneReference(2.0**6, 2000), Harness(GradScaler("cpu", init_scale=2.0**6))
    for k in range(3):  # its own unwaited steps make it async
        ref.update_async(k == 1)
        run.iteration(k == 1)
        assert run.scaler.get_scale() == ref.front
    optim_thread.synchronize()


def test_a_checkpoint_of_the_scaler_is_not_refused_for_another_loops_step():
    run = Harness(GradScaler("cpu", init_scale=2.0**6))
    run.iteration(False)
    with _Blocked() as blocked:  # after this scaler's update(): not this scaler's half iteration
        blocked.launch()
        state_in_order = run.scaler.state_dict_in_order()
    state = state_in_order()
    assert state["scale"] == 2.0**6


def test_a_scaler_the_launch_cannot_see_is_refused_at_update_with_the_fix():
    scaler = GradScaler("cpu", init_scale=2.0**6)
    hidden = [[scaler]]  # two containers deep: beyond what the launch searches
    master = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([master], lr=0.1)
    const = torch.ones(4, requires_grad=True)
    (grad,) = torch.autograd.grad(scaler.scale((const * const).sum()), [const])

    def step():
        master.grad = grad
        hidden[0][0].step(opt)

    optim_thread.launch(step)
    with pytest.raises(RuntimeError, match=r"name the scaler in the step function"):
        scaler.update()
    optim_thread.synchronize()
