"""The plan is the program (see [Note: the program] in roundpipe/plan/actions.py): the executor
performs exactly the actions ``model.plan()`` lists, in its order, on every pool, and the copies
the emulated device sees are the program's uploads."""

from collections import Counter, defaultdict

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.plan import ActionKind, PlanSizes, build_plan
from roundpipe.runtime import executor
from roundpipe.testing import emu


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Dropout(0.2), nn.Linear(5, 3)
    )


def _batch(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _loss(out, y):
    return (out.float() - y).pow(2).mean()


@pytest.fixture
def performed(monkeypatch):
    """Per device, the actions the executor ran, as text, in order."""
    log = defaultdict(list)
    make = executor._handlers

    def recording(spec):
        table = make(spec)

        def wrap(fn):
            def run(spec, state, a, backend):
                log[a.device].append(str(a))
                return fn(spec, state, a, backend)

            return run

        return {kind: wrap(fn) for kind, fn in table.items()}

    monkeypatch.setattr(executor, "_handlers", recording)
    return log


CONFIGS = {
    "default": {},
    "no-recompute": {"recompute": False},
    "offload": {"offload_activations": True},
    "budget": {"device_memory_budget": 1560},
    "tight-budget": {"device_memory_budget": 1},
}


@pytest.mark.parametrize("devices", ["cpu", "cpu:2", "emu", "emu:2"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_executor_performs_exactly_the_printed_program(performed, devices, config):
    cfg = RoundPipeRunConfig(num_microbatch=4, **CONFIGS[config])
    model = RoundPipe(_model(), devices=devices, model_run_config=cfg)
    x, y = _batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    plan = model.plan(inputs=((x,), {}))
    ran = dict(performed)
    assert ran == {d: [str(a) for a in p] for d, p in enumerate(plan.program) if p}, str(plan)
    performed.clear()
    with torch.no_grad():
        model(x)
    infer = model.plan(training=False)
    assert dict(performed) == {d: [str(a) for a in p] for d, p in enumerate(infer.program) if p}


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_copies_the_device_sees_are_the_programs_uploads_and_downloads(devices, config):
    cfg = RoundPipeRunConfig(num_microbatch=4, **CONFIGS[config])
    model = RoundPipe(_model(), devices=devices, model_run_config=cfg)
    params = dict(model.module.named_parameters())
    stage_of = {p.data_ptr(): int(n.split(".")[0]) for n, p in params.items()}
    x, y = _batch()
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    plan = model.plan(inputs=((x,), {}))
    uploads = Counter(
        stage_of[c.host_ptr] for c in log if c.direction == "h2d" and c.host_ptr in stage_of
    )
    moves = Counter(
        a.stage
        for p in plan.program
        for a in p
        if a.kind in (ActionKind.UPLOAD, ActionKind.PREFETCH)
    )
    per_stage = Counter({s: sum(1 for n in params if n.startswith(f"{s}.")) for s in moves})
    assert uploads == Counter({s: n * per_stage[s] for s, n in moves.items() if per_stage[s]})
    offloads = sum(a.kind is ActionKind.OFFLOAD for p in plan.program for a in p)
    saved = sum(1 for c in log if c.direction == "d2h" and c.pinned and c.numel in (32, 48, 40))
    assert saved == offloads


def test_a_budget_plan_needs_the_inputs_for_its_offloads():
    # Under a budget the offloads depend on the stage inputs' sizes: model.plan() takes them
    # from the call's inputs, as the call itself does.
    cfg = RoundPipeRunConfig(num_microbatch=4, device_memory_budget=1560)
    model = RoundPipe(_model(), devices="emu", model_run_config=cfg)
    x, _ = _batch()
    unknown = model.plan()
    known = model.plan(inputs=((x,), {}))
    offloads = [str(a) for a in known.program[0] if a.kind is ActionKind.OFFLOAD]
    assert offloads == [
        "O1.2",
        "O1.3",
        "O2.0",
        "O2.1",
        "O2.2",
        "O2.3",
        "O3.0",
        "O3.1",
        "O3.2",
        "O3.3",
    ]
    assert not any(a.kind is ActionKind.OFFLOAD for a in unknown.program[0])
    assert "ledger peak 0:" in str(known)


def test_the_ledger_keeps_each_device_within_its_budget():
    S, M = 6, 4
    for budget in (2_000, 3_000, 5_000, 10_000):
        sizes = PlanSizes((400,) * S, ((300,) * M,) * S, budget=budget)
        for D in (1, 2):
            plan = build_plan(S, M, D, training=True, stage_major=True, sizes=sizes)
            assert plan.peak_bytes is not None
            assert all(peak <= budget for peak in plan.peak_bytes), (budget, D, plan.peak_bytes)
    # Without a budget nothing limits it: every stage input before the last one's kept, and the
    # running stage beside the prefetched one.
    free = build_plan(
        S, M, 1, training=True, stage_major=True, sizes=PlanSizes((400,) * S, ((300,) * M,) * S)
    )
    assert free.peak_bytes[0] == (S - 1) * M * 300 + 2 * 400
