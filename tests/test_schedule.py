"""The plan, checked without threads: which action runs where, and in which order."""

import itertools

import pytest

from roundpipe.plan import ActionKind, build_plan, partition, simulate

SHAPES = list(itertools.product([1, 2, 3, 5], [1, 2, 4], [1, 2, 3], [True, False]))


@pytest.mark.parametrize("S,M,D,training", SHAPES)
def test_every_action_once_on_round_robin_device(S, M, D, training):
    plan = build_plan(S, M, D, training)
    keys = [a.key for a in plan.actions()]
    assert len(keys) == len(set(keys))
    expected = set()
    for s in range(S):
        for m in range(M):
            if training and s == S - 1:
                expected.add((ActionKind.LAST, s, m))
            else:
                expected.add((ActionKind.FORWARD, s, m))
            if training and s < S - 1:
                expected.add((ActionKind.BACKWARD, s, m))
    assert set(keys) == expected
    for d, actions in enumerate(plan.per_device):
        for a in actions:
            assert a.device == d == a.stage % D


@pytest.mark.parametrize("S,M,D,training", SHAPES)
def test_dependencies_come_earlier(S, M, D, training):
    plan = build_plan(S, M, D, training)
    position = {a.key: (d, i) for d, acts in enumerate(plan.per_device) for i, a in enumerate(acts)}
    for a in plan.actions():
        for dep in plan.dependencies(a):
            assert dep.time < a.time
            d, i = position[dep.key]
            if d == a.device:
                assert i < position[a.key][1]


@pytest.mark.parametrize("S,M,D,training", SHAPES)
def test_simulated_execution_completes_in_dependency_order(S, M, D, training):
    plan = build_plan(S, M, D, training)
    order = simulate(plan)
    assert len(order) == len(plan.actions())
    seen = set()
    for a in order:
        assert all(dep.key in seen for dep in plan.dependencies(a))
        seen.add(a.key)


def test_one_stage_microbatches_in_order_for_deterministic_accumulation():
    plan = build_plan(4, 5, 3, True)
    for _d, actions in enumerate(plan.per_device):
        for s in range(4):
            for kind in ActionKind:
                mbs = [a.mb_index for a in actions if a.stage == s and a.kind is kind]
                assert mbs == sorted(mbs)


def test_clock_values():
    S, M = 3, 2
    plan = build_plan(S, M, 1, True)
    assert plan.action(ActionKind.FORWARD, 1, 1).time == 2
    assert plan.action(ActionKind.LAST, 2, 0).time == 2
    # BACKWARD(s, m) at (S-1) + (M-1) + (S-1-s) + m + 1
    assert plan.action(ActionKind.BACKWARD, 1, 0).time == 2 + 1 + 1 + 0 + 1
    assert plan.action(ActionKind.BACKWARD, 0, 1).time == 2 + 1 + 2 + 1 + 1


def test_deadlocking_order_is_detected():
    plan = build_plan(2, 2, 1, True)
    bad = type(plan)(
        plan.num_stages,
        plan.num_microbatch,
        plan.num_devices,
        plan.training,
        (tuple(reversed(plan.per_device[0])),),
    )
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)


def test_str_has_one_line_per_device():
    text = str(build_plan(3, 2, 2, True))
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("  device 0: F0.0")
    assert "L2.0" in lines[1] and "B1.0" in lines[2]


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="num_microbatch"):
        build_plan(2, 0, 1, True)


def test_partition():
    assert partition(3, None) == [(0, 1), (1, 2), (2, 3)]
    assert partition(5, [2, 3]) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="sum to the layer count"):
        partition(5, [2, 2])
    with pytest.raises(ValueError, match="positive ints"):
        partition(5, [5, 0])


def test_one_device_runs_microbatch_by_microbatch():
    # Nothing to overlap with: microbatch m's forward and backward finish before m + 1 starts,
    # so only one microbatch's stage inputs are alive at a time.
    plan = build_plan(3, 2, 1, True)
    assert (
        str(plan).splitlines()[1] == "  device 0: F0.0 F1.0 L2.0 B1.0 B0.0 F0.1 F1.1 L2.1 B1.1 B0.1"
    )
    assert [str(a) for a in build_plan(2, 2, 1, False).per_device[0]] == [
        "F0.0",
        "F1.0",
        "F0.1",
        "F1.1",
    ]


def test_several_devices_follow_the_clock():
    plan = build_plan(2, 2, 2, True)
    assert [str(a) for a in plan.per_device[0]] == ["F0.0", "F0.1", "B0.0", "B0.1"]
    assert [str(a) for a in plan.per_device[1]] == ["L1.0", "L1.1"]


@pytest.mark.parametrize("S,M", [(1, 1), (3, 4), (5, 2)])
def test_fused_plan_runs_each_microbatch_as_one_action_in_order(S, M):
    plan = build_plan(S, M, 1, True, fuse_stages=True)
    (actions,) = plan.per_device
    assert [(a.kind, a.mb_index) for a in actions] == [(ActionKind.MICROBATCH, m) for m in range(M)]
    assert all(plan.dependencies(a) == () for a in actions)
    assert simulate(plan) == list(actions)
    assert str(plan).splitlines()[1] == "  device 0: " + " ".join(f"M.{m}" for m in range(M))


@pytest.mark.parametrize("D,training", [(2, True), (1, False)])
def test_fusing_needs_one_device_and_training(D, training):
    with pytest.raises(ValueError, match="fuse_stages needs one device and training"):
        build_plan(3, 2, D, training, fuse_stages=True)


def _seq(*widths):
    import torch.nn as nn

    layers = []
    for w in widths:
        layers += [nn.Linear(w, w, bias=False), nn.ReLU()]  # w*w*4 bytes, then a free layer
    return nn.Sequential(*layers)


def test_stages_by_size_balances_parameter_bytes():
    from roundpipe.plan import stages_by_size

    seq = _seq(8, 8, 8, 8, 16)  # 256 B x 4, then 1024 B
    plan = stages_by_size(seq, num_stages=2)
    assert sum(plan) == len(seq) and len(plan) == 2
    assert plan == [8, 2]  # the four small linears, then the big one alone
    assert stages_by_size(seq, num_stages=100) == [2] * 5  # each linear with its ReLU
    assert stages_by_size(seq, max_stage_bytes=512) == [4, 4, 2]
    # A layer bigger than the limit is a stage of its own.
    assert stages_by_size(seq, max_stage_bytes=300) == [2, 2, 2, 2, 2]


def test_stages_by_size_counts_a_shared_parameter_once_and_rejects_misuse():
    import torch.nn as nn

    from roundpipe.plan import stages_by_size

    first, last = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    last.weight = first.weight  # tied: its 256 bytes count in the first layer only
    seq = nn.Sequential(first, nn.Linear(8, 8, bias=False), last)
    assert stages_by_size(seq, max_stage_bytes=256) == [1, 2]
    with pytest.raises(ValueError, match="needs num_stages, max_stage_bytes, or both"):
        stages_by_size(seq)
    with pytest.raises(ValueError, match="nn.Sequential"):
        stages_by_size(nn.Linear(2, 2), num_stages=2)
    with pytest.raises(ValueError, match="num_stages"):
        stages_by_size(seq, num_stages=0)


def test_stages_by_size_can_balance_measured_costs_instead_of_bytes():
    import torch.nn as nn

    from roundpipe.plan import stages_by_size

    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])  # equal bytes
    assert stages_by_size(seq, num_stages=3) == [2, 2, 2]
    # The first layer is as slow as the other five together: it gets a stage of its own.
    assert stages_by_size(seq, num_stages=2, costs=[5, 1, 1, 1, 1, 1]) == [1, 5]
    for bad in ([1, 2], [1, 1, 1, 1, 1, float("nan")], [1, 1, 1, 1, 1, float("inf")]):
        with pytest.raises(ValueError, match="one finite number >= 0 per layer"):
            stages_by_size(seq, num_stages=2, costs=bad)
    with pytest.raises(ValueError, match="give num_stages too"):
        stages_by_size(seq, max_stage_bytes=100, costs=[1] * 6)


def test_stages_by_size_balances_costs_under_a_byte_cap():
    from roundpipe.plan import stages_by_size

    seq = _seq(8, 8, 8, 8, 16)  # 256 B x 4, then 1024 B; each linear with its ReLU
    costs = [1, 0, 1, 0, 1, 0, 3, 0, 3, 0]  # the ReLUs free
    assert stages_by_size(seq, num_stages=2, costs=costs) == [8, 2]
    # Three stages of cost 3: the first holds three small linears (768 B) ...
    assert stages_by_size(seq, num_stages=3, costs=costs) == [6, 2, 2]
    # ... which a cap on bytes forbids: the best grouping under it.
    assert stages_by_size(seq, num_stages=3, max_stage_bytes=512, costs=costs) == [4, 4, 2]
    # Bytes balanced under a cap; a cap that needs more stages than asked says how many.
    assert stages_by_size(seq, num_stages=3, max_stage_bytes=1024) == [4, 4, 2]
    with pytest.raises(ValueError, match="needs at least 3 stages"):
        stages_by_size(seq, num_stages=2, max_stage_bytes=512)
    with pytest.raises(ValueError, match="max_stage_bytes must be a positive int"):
        stages_by_size(seq, num_stages=2, max_stage_bytes=0)
