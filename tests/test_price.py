"""A plan prices itself (roundpipe.plan.price): what the emulated device cannot show, since its
kernels run at once. Which uploads hide behind compute, and how close the iteration comes to
the compute alone."""

import dataclasses
import itertools

import pytest

from roundpipe.plan import HOST_CONTENTION, ActionKind, Costs, PlanSizes, build_plan, price

MB = 2**20


def _costs(
    S, forward, backward=None, upload=100 * MB, grads=None, bandwidth=10_000 * MB, issue=None
):
    return Costs(
        forward=[forward] * S,
        backward=[backward or 2 * forward] * S,
        upload_bytes=[upload] * S,
        grad_bytes=[grads or upload] * S,
        bandwidth=bandwidth,
        issue=issue,
    )


@pytest.mark.parametrize("S,M", [(4, 1), (4, 4), (8, 2), (8, 16)])
def test_on_one_device_every_upload_after_the_first_hides_behind_compute(S, M):
    # A stage's forward takes as long as its upload (10 ms for 100 MiB at 10 GiB/s) and its
    # backward twice that: the compute stream never waits after its first action.
    plan = build_plan(S, M, 1, training=True, stage_major=True)
    upload_time = 100 / 10_000
    timeline = price(plan, _costs(S, forward=upload_time))
    assert timeline.compute_idle(0) == pytest.approx(0.0, abs=1e-12)
    # The compute stream starts once the first upload is in, not before.
    first = timeline.on(0, "compute")[0]
    assert first.action.kind is ActionKind.FORWARD and first.start == pytest.approx(upload_time)


def test_uploads_slower_than_compute_leave_the_compute_stream_waiting():
    # The same plan with compute ten times shorter than an upload: the check above can fail.
    plan = build_plan(4, 1, 1, training=True, stage_major=True)
    timeline = price(plan, _costs(4, forward=0.001))
    assert timeline.compute_idle(0) > 0.01


def test_the_iteration_approaches_the_compute_time_as_microbatches_grow():
    S = 6
    overheads = []
    for M in (1, 2, 4, 8, 16):
        plan = build_plan(S, M, 1, training=True, stage_major=True)
        timeline = price(plan, _costs(S, forward=0.01))
        compute = timeline.compute_time()
        assert compute == pytest.approx(M * S * (0.01 + 0.02) + M * (S - 1) * 0.01)
        overheads.append(timeline.iteration_time / compute - 1)
    # What is not hidden (the first upload and the last gradient download) is a fixed cost.
    assert all(a > b for a, b in zip(overheads, overheads[1:]))
    assert overheads[3] < 0.03


def test_the_host_that_issues_slower_than_the_device_runs_sets_the_pace():
    plan = build_plan(4, 4, 1, training=True, stage_major=True)
    fast = price(plan, _costs(4, forward=0.01))
    slow = price(plan, _costs(4, forward=0.01, issue=[0.05] * 4))
    assert slow.iteration_time > fast.iteration_time
    assert slow.compute_idle(0) > 0


def test_a_prefetch_waits_on_the_host_for_the_run_whose_memory_it_takes():
    # The host waits (S) for the device to finish the run before the current one before it
    # issues the next prefetch: no prefetch starts before that run's compute has ended.
    plan = build_plan(5, 4, 1, training=True, stage_major=True)
    timeline = price(plan, _costs(5, forward=0.01, upload=MB))
    program = plan.program[0]
    ends = {}
    for span in timeline.on(0, "compute"):
        if span.action.kind.computes:
            ends[(span.action.stage, span.action.kind)] = span.end
    syncs = [a for a in program if a.kind is ActionKind.SYNC and a.stage >= 0]
    assert syncs
    for sync in syncs:
        nxt = program[program.index(sync) + 1 :]
        prefetch = next(a for a in nxt if a.kind is ActionKind.PREFETCH)
        span = next(s for s in timeline.on(0, "copy") if s.action == prefetch)
        assert span.start >= ends[(sync.stage, sync.of)] - 1e-12


@pytest.mark.parametrize("S,M,D", list(itertools.product([2, 5], [1, 4], [1, 2, 3])))
def test_every_plan_prices_without_deadlock_and_each_action_once(S, M, D):
    for stage_major in (True, False):
        plan = build_plan(S, M, D, training=True, stage_major=stage_major)
        timeline = price(plan, _costs(S, forward=0.01))
        computed = [s.action for s in timeline.spans if s.action.kind.computes]
        assert sorted(map(str, computed)) == sorted(map(str, plan.actions()))
        assert timeline.iteration_time >= max(s.end for s in timeline.spans)


def test_offloaded_inputs_cost_their_copies():
    sizes = PlanSizes((10 * MB,) * 3, ((50 * MB,) * 2,) * 3, budget=None, offload=True)
    plan = build_plan(3, 2, 1, training=True, stage_major=True, sizes=sizes)
    timeline = price(plan, _costs(3, forward=0.001, upload=10 * MB))
    offloads = [s for s in timeline.spans if s.action.kind is ActionKind.OFFLOAD]
    reloads = [s for s in timeline.spans if s.action.kind is ActionKind.RELOAD]
    assert len(offloads) == len(reloads) == 2 * 2  # stages 0 and 1, two microbatches each
    assert all(s.end - s.start == pytest.approx(50 / 10_000) for s in offloads + reloads)
    assert all(s.stream == "download" for s in offloads)


def test_costs_are_checked():
    plan = build_plan(3, 1, 1, training=True, stage_major=True)
    with pytest.raises(ValueError, match="one value per stage"):
        price(plan, _costs(2, forward=0.01))


def test_the_optimizer_threads_step_bounds_the_iteration_from_below():
    plan = build_plan(4, 4, 1, training=True, stage_major=True)
    devices = price(plan, _costs(4, forward=0.01))
    assert devices.iteration_time == devices.device_time and not devices.optimizer_bound
    short = price(plan, dataclasses.replace(_costs(4, forward=0.01), optimizer=0.1))
    assert short.iteration_time == short.device_time == devices.device_time
    long = dataclasses.replace(_costs(4, forward=0.01), optimizer=10 * devices.device_time)
    bound = price(plan, long)
    assert bound.optimizer_bound and bound.iteration_time == pytest.approx(long.optimizer)
    assert bound.spans == devices.spans  # the devices' timeline itself is the same
    with pytest.raises(ValueError, match="optimizer"):
        price(plan, dataclasses.replace(long, optimizer=-1.0))


@pytest.mark.parametrize("step_over_devices", [0.5, 1.0, 3.0])
def test_contention_slows_the_overlap_of_the_step_and_the_devices(step_over_devices):
    # While both run, each runs 1 + c times slower: the shorter ends at s * (1 + c), the longer
    # after s more of its own work, so the iteration is longer + c * shorter, whichever is which.
    plan = build_plan(4, 4, 1, training=True, stage_major=True)
    costs = _costs(4, forward=0.01)
    devices = price(plan, costs).device_time
    step = step_over_devices * devices
    longer, shorter = max(devices, step), min(devices, step)
    for c in (0.0, HOST_CONTENTION, 1.0):
        timeline = price(plan, dataclasses.replace(costs, optimizer=step, contention=c))
        assert timeline.iteration_time == pytest.approx(longer + c * shorter)
        assert timeline.device_time == pytest.approx(devices)
        assert timeline.optimizer_bound == (step > devices)
    # c = 1 is the two run one after the other.
    serial = price(plan, dataclasses.replace(costs, optimizer=step, contention=1.0))
    assert serial.iteration_time == pytest.approx(devices + step)
    # Without a step to overlap there is nothing to contend with.
    alone = price(plan, dataclasses.replace(costs, contention=HOST_CONTENTION))
    assert alone.iteration_time == pytest.approx(devices)
    with pytest.raises(ValueError, match="contention"):
        price(plan, dataclasses.replace(costs, contention=1.5))
