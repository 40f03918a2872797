"""Data parallelism on torch.distributed (gloo, processes on this machine, 127.0.0.1 only).

Each multi-process test runs tests/dp_worker.py's ``main()`` on its ranks with the environment
torchrun would give them: in the session's rank processes (conftest's ``rank_pool``, see
tests/rank_pool_worker.py), each run with its own process group, or, where a rank's crash, kill
or hang or a process's exit is the point, in fresh ``python tests/dp_worker.py`` processes. Each
run is bounded by a small process-group timeout and its own deadline; what is left is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roundpipe import GradScaler, OptimizerCtx, RoundPipe
from roundpipe import distributed as rpd
from roundpipe.distributed.group import active_group

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_worker  # noqa: E402
from rank_pool_worker import start_together  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dp_worker.py"

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )


def run_ranks(world, cfg, tmp_path, deadline=90.0, expect_exit=None, pool=None):
    """Run ``world`` ranks of dp_worker with ``cfg``; returns ({rank: record}, {rank: (code,
    output)}). With ``pool`` (conftest's ``rank_pool``) in the session's rank processes, else
    in fresh ones (where a rank's crash, kill or hang is the point)."""
    cfg = {**cfg, "out": str(tmp_path)}
    if pool is not None:
        assert expect_exit is None, "a run whose rank fails or hangs runs in fresh processes"
        try:
            outcome = pool.run(
                "dp_worker", [json.dumps(cfg)], world, tmp_path, deadline, free_port()
            )
        except TimeoutError as exc:
            pytest.fail(str(exc))
    else:
        outcome = _run_fresh_ranks(world, cfg, deadline, expect_exit)
    records = {}
    for rank in range(world):
        path = tmp_path / f"rank{rank}.pt"
        if path.exists():
            records[rank] = torch.load(path, weights_only=False)
    for rank, (code, err) in outcome.items():
        if expect_exit is None or rank not in expect_exit:
            assert code == 0, f"rank {rank} exited with {code}:\n{err}"
    return records, outcome


def _run_fresh_ranks(world, cfg, deadline, expect_exit):
    port = free_port()
    procs = []
    try:
        procs = start_together(
            [sys.executable, str(WORKER), json.dumps(cfg)],
            [rank_env(rank, world, port) for rank in range(world)],
        )
        end = time.monotonic() + deadline
        outcome = {}
        for rank, p in enumerate(procs):
            if expect_exit is not None and expect_exit.get(rank) == "hang":
                continue
            try:
                _, err = p.communicate(timeout=max(end - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} did not finish within {deadline} s (a hang)")
            outcome[rank] = (p.returncode, err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for stream in (p.stdin, p.stdout, p.stderr):
                stream.close()
    return outcome


def assert_bitwise_equal_across_ranks(records, key="masters"):
    first = records[0][key]
    for rank, rec in records.items():
        for name, value in rec[key].items():
            assert torch.equal(value, first[name]), f"{key} {name!r} differs on rank {rank}"


def assert_close_to(reference, record, rtol=1e-5, atol=1e-6):
    for name, value in reference["masters"].items():
        torch.testing.assert_close(record["masters"][name], value, rtol=rtol, atol=atol)


# -- multi-process runs ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,mode,optimizer", [(2, "async", "adam"), (3, "sync", "sgd")])
def test_ranks_on_shards_match_one_process_on_the_whole_batch(
    tmp_path, rank_pool, world, mode, optimizer
):
    cfg = {"steps": 6, "global_batch": 12, "mode": mode, "optimizer": optimizer}
    records, _ = run_ranks(world, cfg, tmp_path, pool=rank_pool)
    assert sorted(records) == list(range(world))
    reference = dp_worker.train(cfg)
    assert_bitwise_equal_across_ranks(records, "masters")
    assert_bitwise_equal_across_ranks(records, "params")
    for rec in records.values():
        assert rec["error"] is None
        assert rec["replicas_identical"] is True
        assert_close_to(reference, rec)
        # Same scales in use and same skipped steps as the one-process run (the scale grew).
        assert rec["scales"] == reference["scales"]
        assert rec["skipped"] == reference["skipped"]
        assert rec["scaler"] == reference["scaler"]
    assert max(reference["scales"].values()) > min(reference["scales"].values())
    # The ranks did train on different data: their shards' losses differ.
    assert records[0]["losses"] != records[1]["losses"]
    # And they trained: the masters moved away from where they started.
    start = dp_worker.build({**dp_worker.DEFAULTS, **cfg})[0].master_state_dict()
    assert any(not torch.equal(start[n], v) for n, v in records[0]["masters"].items())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_with_their_masters_and_state_in_files_match_ranks_in_ram(tmp_path, rank_pool):
    # MastersOnDisk and Adam(state_dir=...) on each rank: DataParallel's start broadcasts into
    # masters that are a file's memory map, and the spilled steps stay bitwise the in-RAM ones.
    cfg = {"steps": 4, "global_batch": 8, "mode": "async", "optimizer": "adam", "dtype": "fp16"}
    (tmp_path / "ram").mkdir()
    (tmp_path / "disk").mkdir()
    in_ram, _ = run_ranks(2, cfg, tmp_path / "ram", pool=rank_pool)
    spill = {**cfg, "spill": str(tmp_path / "nvme")}
    spilled, _ = run_ranks(2, spill, tmp_path / "disk", pool=rank_pool)
    for rank in (0, 1):
        assert spilled[rank]["error"] is None and spilled[rank]["replicas_identical"] is True
        assert all(spilled[rank]["masters_in_files"]) and not any(in_ram[rank]["masters_in_files"])
        for key in ("masters", "params"):
            for name, value in in_ram[rank][key].items():
                assert torch.equal(spilled[rank][key][name], value), (rank, key, name)
    assert in_ram[0]["skipped"] == spilled[0]["skipped"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, rank_pool, optimizer):
    cfg = {"steps": 5, "mode": "async", "optimizer": optimizer, "inf_step": 2, "inf_rank": 1}
    records, _ = run_ranks(2, cfg, tmp_path, pool=rank_pool)
    reference = dp_worker.train({**cfg, "inf_rank": None})  # one process, the same overflow
    assert reference["skipped"][2] is True
    for rec in records.values():
        assert (
            rec["skipped"] == reference["skipped"]
        )  # rank 0 skipped step 2 although its grads were finite
        assert rec["scaler"] == reference["scaler"]
        assert rec["scales"] == reference["scales"]
        assert_close_to(reference, rec)
    assert records[0]["scaler"]["roundpipe"]["skipped_steps"] == 1
    assert_bitwise_equal_across_ranks(records, "masters")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_checkpoint_of_two_ranks_resumes_on_three(tmp_path, rank_pool):
    n = 4
    cfg = {"steps": n, "global_batch": 12, "mode": "async", "save_after": n - 1}
    first_dir, second_dir = tmp_path / "two", tmp_path / "three"
    first_dir.mkdir()
    second_dir.mkdir()
    run_ranks(2, cfg, first_dir, pool=rank_pool)
    ckpt = first_dir / "ckpt.pt"
    assert ckpt.exists()
    records, _ = run_ranks(
        3,
        {**cfg, "steps": 2 * n, "save_after": None, "resume": str(ckpt)},
        second_dir,
        pool=rank_pool,
    )
    reference = dp_worker.train({**cfg, "steps": 2 * n, "save_after": None})
    assert_bitwise_equal_across_ranks(records)
    for rec in records.values():
        assert sorted(rec["losses"]) == list(range(n, 2 * n))  # it resumed at iteration n
        assert_close_to(reference, rec)
        assert rec["scaler"] == reference["scaler"]
        assert {k: v for k, v in rec["scales"].items()} == {
            k: v for k, v in reference["scales"].items() if k >= n
        }


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,world", [("raise", 2), ("kill", 3), ("hang", 2)])
def test_a_failed_rank_ends_the_others_with_a_clear_error(tmp_path, how, world):
    timeout = 4.0
    cfg = {"steps": 8, "pg_timeout": timeout, "fail": {"rank": 1, "step": 3, "how": how}}
    records, outcome = run_ranks(world, cfg, tmp_path, deadline=60.0, expect_exit={1: how})
    survivors = [r for r in range(world) if r != 1]
    assert sorted(records) == survivors
    for rank in survivors:
        error = records[rank]["error"]
        assert error is not None, f"rank {rank} finished without noticing rank 1's failure"
        assert error["type"] == "DataParallelError"
        assert f"rank {rank} of {world}" in error["message"]
        assert "Another rank most likely failed" in error["message"]
        assert error["call"] in ("forward_backward", "step", "scaler.update", "synchronize")
        # Within the group's timeout (plus scheduling slack on a loaded machine), not a hang.
        assert error["seconds"] < timeout + 10, error
        if how == "hang":
            assert "timed out" in error["message"].lower() or "timeout" in error["message"].lower()
            assert error["seconds"] >= timeout * 0.9  # it was the timeout that ended the wait
        # Afterwards the group is marked broken: the next step fails at once.
        assert "was not attempted" in error["again"]
        assert error["again_seconds"] < timeout
        assert records[rank]["masters_after_error"].keys() == records[rank]["masters"].keys()
    if how == "raise":
        code, err = outcome[1]
        assert code != 0 and "fails on purpose" in err
    if how == "kill":
        assert outcome[1][0] == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_that_built_different_models_are_told_so(tmp_path):
    cfg = {"steps": 2, "by_rank": {"1": {"hidden": 24}}}
    records, outcome = run_ranks(
        2, cfg, tmp_path, deadline=60.0, expect_exit={0: "fail", 1: "fail"}
    )
    assert records == {}
    for _rank, (code, err) in outcome.items():
        assert code != 0
        assert "ValueError" in err and "the ranks built different models" in err, err
        # Raised once, by DataParallel(): not again at exit as work nobody waited for.
        assert err.count("the ranks built different models") == 1, err
        assert "never waited for" not in err, err


def torchrun(script_args, nproc=2, timeout=240):
    """Run ``script_args`` (a script and its arguments) under torchrun on 127.0.0.1; returns
    its stdout."""
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("ROUNDPIPE_DEVICES", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *map(str, script_args),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, f"{out}\n{err}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_example_under_torchrun(tmp_path):
    out = torchrun([ROOT / "examples" / "data_parallel.py", "--steps", "40"], timeout=100)
    assert "2 ranks" in out and "masters identical on every rank: True" in out, out
    accuracy = float(out.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.5, out  # chance is 0.1


@pytest.mark.slow
def test_the_example_without_torchrun_trains_as_one_rank():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--steps", "20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    # Before: torch's "environment variable RANK expected, but not set" traceback.
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "not started by torchrun" in proc.stdout and "torchrun --standalone" in proc.stdout
    assert "1 rank, global batch 64" in proc.stdout
    assert "masters identical on every rank: True" in proc.stdout


# -- in one process: a group of one, and what needs no group ------------------------------------


def test_plan_buckets_caps_bytes_per_dtype_and_keeps_order():
    tensors = [
        ("a", torch.zeros(10)),
        ("b", torch.zeros(10)),
        ("h", torch.zeros(4, dtype=torch.float16)),
        ("c", torch.zeros(30)),
        ("d", torch.zeros(5)),
    ]
    buckets = rpd.plan_buckets(tensors, cap_bytes=80)
    assert [(b.dtype, b.names) for b in buckets] == [
        (torch.float32, ("a", "b")),  # 80 bytes: full
        (torch.float32, ("c",)),  # 120 bytes: larger than the cap, alone
        (torch.float16, ("h",)),
        (torch.float32, ("d",)),
    ]
    assert buckets[0].offsets == (0, 10) and buckets[0].numel == 20
    assert [tensors[i][0] for b in buckets for i in b.index] == [
        n for b in buckets for n in b.names
    ]
    assert "float32, 80 bytes: a, b" in str(buckets[0])
    with pytest.raises(ValueError, match="positive number of bytes"):
        rpd.plan_buckets(tensors, cap_bytes=0)


def test_without_a_process_group_the_calls_say_what_to_do():
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    model = RoundPipe(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        rpd.DataParallel(model)
    with pytest.raises(RuntimeError, match="init_process_group"):
        rpd.shard(torch.zeros(4))
    assert not model._step_pre_hooks
    assert active_group() is None


def test_init_process_group_without_torchrun_names_the_command(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        RuntimeError,
        match=r"found no torchrun environment \(RANK, WORLD_SIZE, "
        r"MASTER_ADDR, MASTER_PORT not set\).*`torchrun "
        r"--standalone --nproc-per-node 2 .*`.*store=",
    ):
        rpd.init_process_group(timeout=5)
    assert not dist.is_initialized()


def test_a_group_of_one_trains_bitwise_as_no_data_parallelism(group_of_one):
    cfg = {"steps": 4, "mode": "async", "inf_step": 1}
    plain = dp_worker.train(cfg)
    with_dp = dp_worker.train(cfg, dp={"bucket_cap_mb": 1e-4})  # several buckets, a ring reused
    assert active_group() is None  # the worker closed its DataParallel
    for name, value in plain["masters"].items():
        assert torch.equal(with_dp["masters"][name], value), name
    assert with_dp["skipped"] == plain["skipped"] and plain["skipped"][1] is True
    assert with_dp["replicas_identical"] is True


def test_data_parallel_misuse_is_rejected(group_of_one):
    model = RoundPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        rpd.DataParallel(model, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="buckets_in_flight"):
        rpd.DataParallel(model, buckets_in_flight=0)
    dp = rpd.DataParallel(model, bucket_cap_mb=5e-5)  # 52 bytes
    try:
        assert dp.rank == 0 and dp.world_size == 1
        names = [n for b in dp.buckets for n in b.names]
        assert names == [n for n, _ in model.optim_named_parameters()]
        assert [b.names for b in dp.buckets] == [("0.weight", "0.bias"), ("1.weight", "1.bias")]
        with pytest.raises(RuntimeError, match="already has a DataParallel"):
            rpd.DataParallel(model)
        with pytest.raises(ValueError, match="does not split evenly"):
            rpd.shard((torch.zeros(4), torch.tensor(1.0)))  # a 0-d tensor has no batch dim
    finally:
        dp.close()
    dp.close()  # idempotent
    assert not model._step_pre_hooks and active_group() is None
    with pytest.raises(RuntimeError, match="was closed"):
        dp.replicas_identical()


def test_a_parameter_no_rank_used_keeps_no_gradient(group_of_one):
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = RoundPipe(seq)
    dp = rpd.DataParallel(model)
    try:
        masters = dict(model.optim_named_parameters())
        model.forward_backward(
            input_args=(torch.randn(2, 4),),
            label=torch.tensor([0, 1]),
            loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y),
        )
        masters["0.bias"].grad = None  # as if no rank had used it
        before = masters["1.weight"].grad.clone()
        seen = {}
        model.step(lambda: seen.update({n: m.grad for n, m in masters.items()}), is_async=False)
        assert seen["0.bias"] is None
        assert torch.equal(seen["1.weight"], before)  # averaged over one rank: itself
    finally:
        dp.close()


def test_only_a_scaler_the_models_steps_use_agrees_over_the_group(group_of_one):
    """No process-wide coupling: a DataParallel makes the scaler its model's steps use agree
    over its ranks, not every GradScaler of the process; close() releases it."""
    model = RoundPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    used, bystander = GradScaler("cpu"), GradScaler("cpu")
    dp = rpd.DataParallel(model)
    try:
        model.forward_backward(
            input_args=(torch.randn(4, 3),),
            label=torch.randint(0, 2, (4,)),
            loss_fn=lambda out, y: used.scale(F.cross_entropy(out, y)),
        )
        model.step(lambda: (used.step(opt), opt.zero_grad()))
        used.update()
        assert used.data_parallel is dp and bystander.data_parallel is None
        explicit = GradScaler("cpu", data_parallel=dp)
        assert explicit.data_parallel is dp
    finally:
        dp.close()
    assert used.data_parallel is None
