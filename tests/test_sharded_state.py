"""Model state sharded over data-parallel ranks (roundpipe.distributed.ShardedState): the owners,
what a rank allocates, the sharded run against the replicated one (gloo, processes on this
machine, through tests/dp_worker.py: in the session's rank processes, in fresh ones where a
rank's exit is the point), the global gradient norm, the memory plan's ``ranks``, and
what is refused."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe
from roundpipe import checkpoint as rpc
from roundpipe import distributed as rpd
from roundpipe.distributed.group import active_group
from roundpipe.distributed.sharded import StageReducer
from roundpipe.memory.host import host_terms
from roundpipe.runtime.placement import shard_by_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_worker  # noqa: E402
from test_distributed import run_ranks  # noqa: E402


def _reducer_of(dp):
    """A stage reducer over ``dp``'s group and gradient targets, as the DataParallel of a
    sharded model of several ranks makes its own (a group of one has none)."""
    return StageReducer(dp._group, dp._masters, dp._owners, dp._cap, dp._in_flight, dp._install)


pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)


# -- owners -----------------------------------------------------------------------------------


def test_owners_are_whole_parameters_balanced_by_bytes():
    sizes = [400, 40, 400, 40, 400, 40, 16]
    owners = shard_by_bytes(sizes, 2)
    assert set(owners) == {0, 1}
    shares = [sum(s for s, o in zip(sizes, owners) if o == r) for r in (0, 1)]
    # Two of the 400s on one rank, whatever the split: the best there is (contiguous runs in
    # order gave 840 and 496).
    assert sorted(shares) == [536, 800]
    assert shard_by_bytes(sizes, 2) == owners  # the same on every rank
    assert shard_by_bytes(sizes, 1) == [0] * len(sizes)
    # Every rank gets an item, even when one item is most of the bytes, or items are empty.
    assert sorted(shard_by_bytes([10_000, 1, 1, 1], 4)) == [0, 1, 2, 3]
    assert shard_by_bytes([1, 1, 1, 10_000], 3)[3] == 0
    assert sorted(shard_by_bytes([0, 0, 0], 3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot shard 2 trainable parameters over 3 ranks"):
        shard_by_bytes([1, 1], 3)


def test_four_equal_layers_and_a_small_head_split_evenly_over_two_ranks():
    # The case of issue 43: whole parameters in order gave one rank three of the four layers
    # (72% of the masters); the worst rank is what must fit.
    seq = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)], nn.Linear(256, 8))
    sizes = [p.numel() * 4 for p in seq.parameters()]
    head = sizes[4] + sizes[5]
    owners = shard_by_bytes(sizes, 2)
    shares = [sum(s for s, o in zip(sizes, owners) if o == r) for r in (0, 1)]
    assert [owners[:4].count(r) for r in (0, 1)] == [2, 2]  # two layers each
    assert max(shares) - min(shares) <= head and max(shares) / sum(sizes) < 0.51
    # The plan holds a rank to the largest share, and says how large it is.
    terms = host_terms(seq.half(), torch.float32, None, ranks=2)
    assert terms.masters == max(shares) and terms.optimizer == 2 * terms.masters


def test_the_host_terms_of_a_rank_count_its_share_and_the_gradients_it_holds():
    seq = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).half()
    whole = host_terms(seq, torch.float32, None)
    two = host_terms(seq, torch.float32, None, ranks=2)
    sizes = [p.numel() * 4 for p in seq.parameters()]
    owners = shard_by_bytes(sizes, 2)
    largest = max(sum(s for s, o in zip(sizes, owners) if o == r) for r in (0, 1))
    assert (two.masters, two.optimizer) == (largest, 2 * largest)
    # One fused CPU call hands every gradient over at its end: a rank holds all of them.
    assert two.grads == whole.grads == whole.masters
    assert two.weights == whole.weights
    assert "this rank's share of 2" in dict(two.rows()).__repr__()
    # Handed over stage by stage: its share plus two layers' sums in flight.
    wide = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).half()
    by_stage = host_terms(wide, torch.float32, None, ranks=4, layers=list(wide))
    layer = (64 * 64 + 64) * 4
    assert by_stage.grads == by_stage.masters + 2 * layer < host_terms(wide, None, None).grads
    assert "two layers' sums" in repr(by_stage.rows())
    # and a margin of one layer's sums for what the allocators keep of them, named in the plan
    # ([Note: the sharded sums' slack]); none where one call hands every sum at its end
    assert by_stage.sums_slack == layer and two.sums_slack == 0 and whole.sums_slack == 0
    assert (
        "margin for the allocators' slack around the sums on their way (one layer's sums)",
        layer,
    ) in by_stage.rows()
    unslacked = dataclasses.replace(by_stage, layer_grads=0)
    assert by_stage.new_bytes == unslacked.new_bytes + layer


def test_the_terms_count_stages_in_flight_only_where_the_pool_hands_them_over():
    from roundpipe.devices import DevicePool
    from roundpipe.runtime.call_memory import sharding_terms
    from roundpipe.runtime.placement import MasterPlacement
    from roundpipe.runtime.stages import model_layers

    class TwoRanks(MasterPlacement):
        world_size = 2  # type: ignore[assignment]

    layers = model_layers(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    two_devices = sharding_terms(DevicePool("cpu:2"), TwoRanks(), layers)
    assert two_devices["ranks"] == 2 and len(two_devices["layers"]) == 2
    assert sharding_terms(DevicePool("emu"), TwoRanks(), layers)["layers"] is not None
    # One CPU device: its fused call hands every sum over at its end.
    assert sharding_terms(DevicePool("cpu"), TwoRanks(), layers) == {"ranks": 2, "layers": None}
    assert sharding_terms(DevicePool("cpu:2"), None, layers) == {"ranks": 1, "layers": None}


def test_the_plan_command_counts_one_ranks_share(tmp_path):
    pytest.importorskip("transformers")
    from test_cli import _tiny_config

    from roundpipe.hf.memory_cli import main, plan_config

    path = str(_tiny_config(tmp_path))
    from roundpipe.hf.memory_cli import ConfigPlanner
    from roundpipe.memory.host import stage_grad_bytes
    from roundpipe.runtime.stages import model_layers

    one = plan_config(path, seq_len=32, devices="emu").host
    planner = ConfigPlanner(path, devices="emu", ranks=4)
    four = planner.plan(32).host
    assert four.ranks == 4 and four.weights == one.weights
    # Its share and two stages' sums in flight (here the embedding's dominates), at most all.
    layers = [layer.module for layer in model_layers(planner.model.module)]
    in_flight = 2 * stage_grad_bytes(layers, torch.float32)
    assert four.grads == min(one.grads, four.masters + in_flight) and four.grads_by_stage
    assert one.masters / 4 <= four.masters < one.masters / 2
    assert four.optimizer == 2 * four.masters
    with pytest.raises(SystemExit):
        main([path, "--seq-len", "32", "--ranks", "0"])


# -- one rank: the placement's paths against no data parallelism -------------------------------


def test_a_sharded_group_of_one_trains_bitwise_as_no_data_parallelism(group_of_one):
    cfg = {"steps": 4, "mode": "async", "dtype": "fp16", "inf_step": 1, "clip": 1.0}
    plain = dp_worker.train(cfg)
    sharded = dp_worker.train({**cfg, "shard": True}, dp={"bucket_cap_mb": 1e-4})
    assert active_group() is None
    for name, value in plain["masters"].items():
        assert torch.equal(sharded["masters"][name], value), name
    assert sharded["skipped"] == plain["skipped"] and plain["skipped"][1] is True
    assert sharded["norms"] == plain["norms"]


def test_a_sharded_model_refuses_what_it_cannot_do(group_of_one, tmp_path):
    placement = rpd.ShardedState()
    model = RoundPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), state_placement=placement)
    assert model.state_placement is placement and placement.owners == [0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="one ShardedState\\(\\) per RoundPipe"):
        RoundPipe(nn.Linear(2, 2), state_placement=placement)
    with pytest.raises(TypeError, match="state_placement must be None"):
        RoundPipe(nn.Linear(2, 2), state_placement="shard")  # type: ignore[arg-type]
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = dict(input_args=(torch.randn(4, 3),), label=torch.randint(0, 2, (4,)))
    model.forward_backward(**batch, loss_fn=F.cross_entropy)
    with pytest.raises(RuntimeError, match="steps only with a DataParallel attached"):
        model.step(lambda: opt.step())
    dp = rpd.DataParallel(model)
    try:
        with pytest.raises(RuntimeError, match="inside step_fn"):
            dp.clip_grad_norm_(1.0)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        # One rank holds every master: its checkpoint is a replicated one, and loads back.
        saved = {n: m.detach().clone() for n, m in model.optim_named_parameters()}
        path = rpc.save(tmp_path / "ckpts", model, opt).wait()
        model.forward_backward(**batch, loss_fn=F.cross_entropy)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        rpc.load(path, model, opt, progress=False)
        for n, m in model.optim_named_parameters():
            assert torch.equal(m, saved[n]), n
    finally:
        dp.close()
    model.forward_backward(**batch, loss_fn=F.cross_entropy)
    with pytest.raises(RuntimeError, match="steps only with a DataParallel attached"):
        model.step(lambda: opt.step())
    for call in (rpc.save, rpc.load):
        with pytest.raises(RuntimeError, match="with ShardedState needs its DataParallel"):
            call(tmp_path / "ckpts", model, opt)


def test_a_stage_is_handed_over_only_once_the_stages_above_it_are_reduced(group_of_one):
    """The reducer's back-pressure (on a group of one, where a reduce is the gradient itself):
    a hand-over of stage 0 waits while stage 1 is not reduced, goes on once it is, and stops
    waiting when the call is abandoned (a failed call's stages above may never come)."""
    import threading

    from roundpipe.runtime.grad_router import CallGrads

    model = RoundPipe(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), state_placement=rpd.ShardedState()
    )
    dp = rpd.DataParallel(model)
    reducer = _reducer_of(dp)  # a group of one has none: made here
    try:
        records = model.state_access().params.records
        params = [[records[0], records[1]], [records[2], records[3]]]
        masters = [rec.master for rec in records]

        def hand(call, s, handed):
            pairs = [(m, torch.full_like(m, float(s + 1))) for m in masters[2 * s : 2 * s + 2]]
            handed.append(reducer.submit(call, {s: pairs}, None))

        installs = []
        for abandon in (False, True):
            call = CallGrads(params, None, model, reducer=reducer)
            handed: list = []
            below = threading.Thread(target=hand, args=(call, 0, handed))
            below.start()
            below.join(timeout=0.5)
            assert below.is_alive() and not handed  # stage 1 is not reduced yet
            if abandon:
                call.abandon()
            else:
                hand(call, 1, handed)
            below.join(timeout=30)
            assert not below.is_alive() and len(handed) == 2 - abandon
            if abandon:
                hand(call, 1, handed)  # what CallGrads.finish would hand: the rest
            installs += handed
        for install in installs:  # each stage's sum of the two calls
            install()
        for i, m in enumerate(masters):
            assert torch.equal(m.grad, torch.full_like(m, 2.0 * (1 + (i >= 2)))), (i, m.grad)
    finally:
        reducer.close()
        dp.close()


def test_a_reducer_that_fails_outside_a_reduce_fails_every_hand_over(group_of_one):
    """A failure of the reducer's own thread (here a call it cannot read) settles that
    submission and every later one with it, instead of leaving their moves waiting."""
    model = RoundPipe(nn.Sequential(nn.Linear(3, 3)), state_placement=rpd.ShardedState())
    dp = rpd.DataParallel(model)
    reducer = _reducer_of(dp)
    try:

        class Unsized:  # iterable, but len() raises TypeError: _arrive fails on it
            def __iter__(self):
                return iter([[1]])

        def call():
            return types.SimpleNamespace(abandoned=False, params=Unsized())

        broken = reducer.submit(call(), {0: []}, None)
        with pytest.raises(TypeError):
            broken()
        with pytest.raises(TypeError):  # settled at once: the thread is gone
            reducer.submit(call(), {0: []}, None)()
    finally:
        reducer.close()
        dp.close()


# -- several ranks ------------------------------------------------------------------------------


def merged(records, key="masters"):
    """The ranks' masters as one state dict; each name held by exactly one rank."""
    out = {}
    for rec in records.values():
        for name, value in rec[key].items():
            assert name not in out, f"{name} is held by two ranks"
            out[name] = value
    return out


def assert_sharded_equals_replicated(world, cfg, tmp_path, pool):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "replicated").mkdir()
    sharded, _ = run_ranks(
        world, {**cfg, "shard": True}, tmp_path / "sharded", deadline=150, pool=pool
    )
    replicated, _ = run_ranks(world, cfg, tmp_path / "replicated", deadline=150, pool=pool)
    assert sorted(sharded) == list(range(world))
    whole = replicated[0]["masters"]
    masters = merged(sharded)
    assert sorted(masters) == sorted(whole)
    for name, value in whole.items():
        assert torch.equal(masters[name], value), name
    for rank, rec in sharded.items():
        assert rec["error"] is None and rec["replicas_identical"] is True
        assert len(rec["masters"]) < len(whole)  # a share, not the whole
        for name, value in replicated[0]["params"].items():
            assert torch.equal(rec["params"][name], value), (rank, name)
        for key in ("skipped", "scales", "scaler"):
            assert rec[key] == replicated[rank][key], (rank, key)
        assert repr(rec["norms"]) == repr(replicated[rank]["norms"])  # nan where it overflowed
        if not cfg.get("extra_backward"):
            # The call summed each gradient onto its owner as it ran: right after
            # forward_backward, a rank holds the gradients of its own masters only.
            after = rec["grads_after_forward_backward"]
            assert after and all(has == held for held, has in after.values()), after
    return sharded, replicated


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_two_sharded_ranks_equal_the_replicated_run_bitwise(tmp_path, rank_pool, mode):
    """fp16 weights, fp32 masters, Adam, GradScaler with a step skipped on one rank's overflow."""
    cfg = {
        "steps": 20,
        "mode": mode,
        "dtype": "fp16",
        "inf_step": 3,
        "inf_rank": 1,
        "global_batch": 8,
    }
    sharded, replicated = assert_sharded_equals_replicated(2, cfg, tmp_path, rank_pool)
    assert sharded[0]["skipped"][3] is True  # rank 1's overflow skipped it on rank 0 too
    assert sharded[0]["scaler"]["roundpipe"]["skipped_steps"] >= 1
    # What a rank allocates: its masters and the one-element stand-ins of the others'; an
    # optimizer state of its share only.
    for rec in sharded.values():
        held = sum(v.numel() * 4 for v in rec["masters"].values())
        stand_ins = rec["num_trainable"] - len(rec["masters"])
        assert rec["master_storage_bytes"] == held + 4 * stand_ins
        assert rec["optimizer_state_bytes"] == 2 * held + 4 * len(rec["masters"])  # + steps
    # The reduction buffers each rank allocated (the reducer's, sharded; the step's
    # all-reduce's, replicated) are what the plan counts for them.
    for rec in list(sharded.values()) + list(replicated.values()):
        assert rec["planned_dp_buffer_bytes"] == rec["dp_buffer_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_masters_in_files_equal_the_replicated_run_bitwise(tmp_path, rank_pool):
    """ShardedState(masters_dir=...) with Adam(state_dir=...): each rank's share of the
    masters and of Adam's state in files (the replicated ranks keep theirs in files too, shown
    bitwise the in-RAM ranks by tests/test_distributed.py)."""
    cfg = {
        "steps": 8,
        "mode": "async",
        "dtype": "fp16",
        "inf_step": 3,
        "inf_rank": 1,
        "global_batch": 8,
        "spill": str(tmp_path / "nvme"),
    }
    sharded, replicated = assert_sharded_equals_replicated(2, cfg, tmp_path, rank_pool)
    assert sharded[0]["skipped"][3] is True
    for rec in list(sharded.values()) + list(replicated.values()):
        assert rec["masters_in_files"] and all(rec["masters_in_files"])
        # Adam's moments are in its file: only the step counts stay in RAM.
        assert rec["optimizer_state_bytes"] == 4 * len(rec["masters"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_global_grad_norm_clips_the_sharded_run_as_the_replicated_one(tmp_path, rank_pool):
    cfg = {"steps": 20, "mode": "sync", "dtype": "fp16", "optimizer": "sgd", "clip": 0.5}
    sharded, replicated = assert_sharded_equals_replicated(2, cfg, tmp_path, rank_pool)
    norms = sharded[0]["norms"]
    assert len(norms) >= 19 and sum(n > 0.5 for n in norms.values()) >= 5  # it did clip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_four_sharded_ranks_equal_the_replicated_run_bitwise(tmp_path, rank_pool):
    cfg = {"steps": 20, "mode": "async", "dtype": "fp16", "inf_step": 3, "inf_rank": 2}
    cfg["global_batch"] = 16
    assert_sharded_equals_replicated(4, cfg, tmp_path, rank_pool)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices,late", [("cpu:2", False), ("cpu:2", True), ("emu", False)])
def test_stage_sums_reach_their_owners_on_every_pool(tmp_path, rank_pool, devices, late):
    """Two CPU workers (a move per stage, from two threads) and the emulated accelerator (the
    plan's downloads, the reducer waiting for their events): bitwise the replicated run; also
    when rank 1 starts handing a call's stage over before the one above it (from another
    thread): that hand-over waits until the stage above is reduced, so the stages reach the
    reducer in order on every rank."""
    cfg = {
        "steps": 6,
        "mode": "async",
        "dtype": "fp16",
        "devices": devices,
        "inf_step": 2,
        "inf_rank": 1,
        "global_batch": 8,
    }
    if late:
        cfg["by_rank"] = {"1": {"hand_late": True}}
    assert_sharded_equals_replicated(2, cfg, tmp_path, rank_pool)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accumulated_calls_and_a_plain_backward_sum_as_the_replicated_run(tmp_path, rank_pool):
    """Two forward_backward calls per step (each summed over the ranks as it runs) plus a
    differentiable forward() and backward() (summed at the step, with the owners' sums so far):
    the same total as the replicated run, up to the order of the additions."""
    cfg = {"steps": 6, "mode": "async", "dtype": "fp32", "accumulate": 2, "extra_backward": True}
    (tmp_path / "sharded").mkdir()
    (tmp_path / "replicated").mkdir()
    sharded, _ = run_ranks(
        2, {**cfg, "shard": True}, tmp_path / "sharded", deadline=150, pool=rank_pool
    )
    replicated, _ = run_ranks(2, cfg, tmp_path / "replicated", deadline=150, pool=rank_pool)
    whole = replicated[0]["masters"]
    masters = merged(sharded)
    assert sorted(masters) == sorted(whole)
    for name, value in whole.items():
        torch.testing.assert_close(masters[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for rec in sharded.values():
        assert rec["error"] is None and rec["replicas_identical"] is True
        # The plain backward left local gradients on the stand-ins until the step.
        after = rec["grads_after_forward_backward"]
        assert any(has and not held for held, has in after.values())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_fails_inside_its_call_still_pairs_its_reduces(tmp_path):
    """Rank 1's loss_fn raises in iteration 3: its call hands the reducer every stage (as no
    gradients), then the process exits. Rank 0 learns of the exit within the group's timeout:
    in iteration 3's own reduces when rank 1 exits before its reducer finished them, else at
    its next collective (step 3's, or iteration 4's call)."""
    timeout = 4.0
    cfg = {
        "steps": 8,
        "shard": True,
        "devices": "cpu:2",
        "pg_timeout": timeout,
        "fail_in_backward": {"rank": 1, "step": 3},
    }
    records, outcome = run_ranks(2, cfg, tmp_path, deadline=60.0, expect_exit={1: "raise"})
    assert sorted(records) == [0]
    error = records[0]["error"]
    assert error is not None and error["type"] == "DataParallelError", error
    assert error["iteration"] in (3, 4), error
    assert error["seconds"] < timeout + 10, error
    assert "was not attempted" in error["again"] and error["again_seconds"] < timeout
    if error["iteration"] == 3 and error["call"] == "forward_backward":
        # Iteration 3's reduces failed: no step and no weight broadcast ran after step 2's,
        # whose parameters stay whole.
        assert "the gradient reduce of a stage" in error["message"], error
        assert isinstance(records[0]["params"], dict)
    else:
        # The weight broadcast failed part way: the model's parameters are refused, by name.
        assert "copying the masters into the model parameters failed" in records[0]["params"]
    code, err = outcome[1]
    assert code != 0 and "fails in loss_fn on purpose" in err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_survives_a_failed_call_stays_in_step(tmp_path, rank_pool):
    """Rank 1's call fails in iteration 3 and it goes on to the step, as rank 0 does after its
    whole call: rank 1 handed the reducer every stage of the failed call, so the ranks' reduces
    still pair up, and both finish, in step, without a data-parallel error (a rank whose failed
    call handed nothing would leave rank 0 waiting in that call's reduce until the timeout)."""
    cfg = {
        "steps": 6,
        "shard": True,
        "devices": "cpu:2",
        "pg_timeout": 4.0,
        "fail_in_backward": {"rank": 1, "step": 3, "survive": True},
    }
    records, _ = run_ranks(2, cfg, tmp_path, deadline=90.0, pool=rank_pool)
    assert sorted(records) == [0, 1]
    assert "fails in loss_fn on purpose at 3" in records[1]["survived"]
    for rec in records.values():
        assert rec["error"] is None and rec["replicas_identical"] is True
