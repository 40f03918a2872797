"""Checkpoints of sharded state (roundpipe.distributed.ShardedState) through roundpipe.checkpoint:
each rank writes its share, rank 0 the manifest; a checkpoint of N ranks loads on M (1 in RAM,
2, 4 sharded), bitwise; a rank killed in the weight broadcast stops the others in bounded time
and the last checkpoint loads. The runs are tests/ckpt_worker.py's under torchrun's variables
(gloo, CPU), as tests/test_checkpoint_resume.py runs them: in the session's rank processes
(conftest's ``rank_pool``), in new ones where a rank is killed or fails, or a process's exit is
the point."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
from roundpipe import OptimizerCtx, RoundPipe
from roundpipe import distributed as rpd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckpt_worker  # noqa: E402
from test_checkpoint_resume import run, run_ranks, start_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
# Every test but the first runs processes: marked slow (see the marker in pyproject.toml).

N, K = 6, 3  # the uninterrupted run's iterations; the save's
SEQ = {"model": "seq", "devices": "cpu", "shard": True}


@pytest.mark.parametrize("group_of_one", [2], indirect=True)  # a timeout of 2 s
def test_rank_0_collects_what_ranks_post_and_names_what_did_not_come(group_of_one):
    model = RoundPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    dp = rpd.DataParallel(model)
    try:
        rpd.post_to_rank0("a", b"one")
        rpd.post_to_rank0("b", b"two")
        assert rpd.collect_on_rank0(["a", "b"], "test") == [b"one", b"two"]
        started = time.monotonic()
        with pytest.raises(rpd.DataParallelError, match="nothing came for c within .* 2 s"):
            rpd.collect_on_rank0(["c"], "test")  # the group's timeout bounds the wait
        assert time.monotonic() - started >= 1.8
    finally:
        dp.close()


def merged(records, key):
    """The ranks' state by parameter name as one dict; each name from exactly one rank."""
    out = {}
    for rec in records:
        for name, value in rec[key].items():
            assert name not in out, f"{name} is held by two ranks"
            out[name] = value
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory, rank_pool):
    """A checkpoint of 2 sharded ranks at iteration K, and the ranks' records (the state by
    name at the save is their state at the end)."""
    tmp = tmp_path_factory.mktemp("saved")
    root = tmp / "ckpts"
    save = {"steps": K, "root": str(root), "save_at": {str(K - 1): "end"}}
    records = run_ranks({**SEQ, **save}, tmp, "a", pool=rank_pool)
    (path,) = list(root.iterdir())
    return path, records


@pytest.mark.slow
def test_each_rank_writes_its_share_and_the_manifest_indexes_it(saved):
    path, records = saved
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["sharded"] is True
    assert manifest["format_version"] == 2  # an older roundpipe refuses it, by its version
    names = sorted(p.name for p in path.iterdir())
    assert "masters-rank00000-00001-of-00001.safetensors" in names
    assert "optimizer-rank00001-00001-of-00001.safetensors" in names
    assert "model-00001-of-00001.safetensors" in names  # replicated: rank 0 alone
    for rank, rec in enumerate(records):
        for key in rec["at_end"]:
            kind, name = key.split("/", 1)
            if kind == "master":
                assert manifest["tensors"][f"masters/{name}"].startswith(f"masters-rank{rank:05d}")
            else:
                param = name.rsplit("/", 1)[0]
                file = manifest["tensors"][f"optimizer/state/{name}"]
                assert file.startswith(f"optimizer-rank{rank:05d}"), (param, file)
    assert len(merged(records, "at_end")) == 6 * 4  # 6 masters, each with 3 Adam tensors


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sharded_ranks_resume_bit_for_bit(saved, tmp_path, rank_pool):
    path, first = saved
    unused = str(tmp_path / "unused")
    full = run_ranks({**SEQ, "steps": N, "root": unused}, tmp_path, "full", pool=rank_pool)
    resume = {"steps": N, "root": str(path), "resume": True}
    second = run_ranks({**SEQ, **resume}, tmp_path, "b", pool=rank_pool)
    for rank in range(2):
        assert second[rank]["loaded"]["iteration"] == K
        assert second[rank]["at_load"] == first[rank]["at_end"]
        assert sorted(map(int, second[rank]["losses"])) == list(range(K, N))
        assert {**first[rank]["losses"], **second[rank]["losses"]} == full[rank]["losses"]
        for key in ("masters", "params", "scaler", "lr", "at_end"):
            assert second[rank][key] == full[rank][key], (rank, key)
        assert second[rank]["masters"] != first[rank]["masters"]
        assert second[rank]["replicas_identical"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_ranks_with_their_state_in_files_resume_bit_for_bit(saved, tmp_path, rank_pool):
    # The checkpoint of ranks in RAM, resumed by ranks whose share of the masters and of Adam's
    # state is in files (ShardedState(masters_dir=...), Adam(state_dir=...)), continues as the
    # uninterrupted run in RAM. The resumed ranks are new processes: their files go at exit.
    path, _ = saved
    unused = str(tmp_path / "unused")
    full = run_ranks({**SEQ, "steps": N, "root": unused}, tmp_path, "full", pool=rank_pool)
    spill = {"masters_dir": str(tmp_path / "nvme"), "state_dir": str(tmp_path / "nvme")}
    second = run_ranks(
        {**SEQ, **spill, "steps": N, "root": str(path), "resume": True}, tmp_path, "b"
    )
    for rank in range(2):
        assert second[rank]["loaded"]["iteration"] == K
        for key in ("masters", "params", "scaler", "lr", "at_end"):
            assert second[rank][key] == full[rank][key], (rank, key)
    assert list((tmp_path / "nvme").iterdir()) == []  # the ranks' files went at their exit


def assert_continues(records):
    for rec in records:
        assert sorted(map(int, rec["losses"])) == list(range(K, N))
        assert all(math.isfinite(float.fromhex(v)) for v in rec["losses"].values())
        assert rec["at_end"] != {k: rec["at_load"][k] for k in rec["at_end"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sharded_ranks_load_on_one_process_in_ram(saved, tmp_path, rank_pool):
    path, first = saved
    resume = {"model": "seq", "steps": N, "root": str(path), "resume": True}
    one = run(resume, tmp_path, "one", pool=rank_pool)
    assert one["at_load"] == merged(first, "at_end")  # every master and Adam tensor, bitwise
    assert one["loaded"]["iteration"] == K
    assert_continues([one])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sharded_ranks_load_on_four(saved, tmp_path, rank_pool):
    path, first = saved
    resume = {**SEQ, "steps": N, "root": str(path), "resume": True}
    four = run_ranks(resume, tmp_path, "four", world=4, pool=rank_pool)
    assert merged(four, "at_load") == merged(first, "at_end")
    assert all(len(rec["at_load"]) < 24 for rec in four)  # each its share
    assert all(rec["replicas_identical"] for rec in four)
    assert_continues(four)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_process_in_ram_loads_on_two_sharded_ranks(tmp_path, rank_pool):
    root = tmp_path / "ckpts"
    save = {"model": "seq", "steps": K, "root": str(root), "save_at": {str(K - 1): "end"}}
    one = run(save, tmp_path, "one", pool=rank_pool)
    resume = {**SEQ, "steps": N, "root": str(root), "resume": True}
    two = run_ranks(resume, tmp_path, "two", pool=rank_pool)
    assert merged(two, "at_load") == one["at_end"]
    assert_continues(two)


def kill_rank1(cfg, says, timeout):
    """Two ranks of ``cfg``, whose rank 1 kills itself (SIGKILL) saying ``says``; rank 0 must
    then fail within ``timeout`` seconds. Returns rank 0's stderr and how long after the kill
    it ended."""
    procs = start_ranks(cfg, 2)
    try:
        out1, _ = procs[1].communicate(timeout=120)
        killed_at = time.monotonic()
        assert procs[1].returncode == -9 and says in out1, out1
        _, err0 = procs[0].communicate(timeout=timeout)
        stopped_after = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode not in (0, None)
    return err0, stopped_after


def _load_problem(path, model, opt):
    with pytest.raises(ckpt.CheckpointFormatError) as info:
        ckpt.load(path, model, opt, scaler=roundpipe.GradScaler(), scheduler=_sched(opt))
    return str(info.value)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


@pytest.mark.slow
def test_a_missing_rank_file_or_other_names_are_refused_by_name(saved, tmp_path):
    path, _ = saved
    model = ckpt_worker.build_seq({**ckpt_worker.DEFAULTS, "shard": False})
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    before = {n: m.detach().clone() for n, m in model.optim_named_parameters()}
    # A model whose parameter names differ (an extra layer shifts them).
    other = RoundPipe(
        nn.Sequential(
            nn.Identity(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)
        ).half(),
        optim_dtype=torch.float32,
    )
    with OptimizerCtx():
        other_opt = roundpipe.optim.Adam(other.parameters(), lr=1e-2)
    problem = _load_problem(path, other, other_opt)
    assert "lacks the model's tensors '1.weight'" in problem, problem
    assert "has tensors this model has not: '0.weight'" in problem, problem
    # A rank's files missing.
    copy = tmp_path / path.name
    copy.mkdir()
    for f in path.iterdir():
        if "rank00001" not in f.name or not f.name.startswith("masters"):
            (copy / f.name).write_bytes(f.read_bytes())
    problem = _load_problem(copy, model, opt)
    assert "masters-rank00001-00001-of-00001.safetensors is missing (rank 1 of the 2" in problem
    assert "load an earlier checkpoint" in problem
    for n, m in model.optim_named_parameters():
        assert torch.equal(m, before[n]), n  # nothing changed


def _flip_a_byte(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_ranks_loading_together_each_check_a_share_of_the_checksums(saved, tmp_path):
    from roundpipe.checkpoint.manifest import checksum_share, read_manifest, verify_files

    path, _ = saved
    found = read_manifest(path)
    total = sum(info["bytes"] for info in found.manifest["files"].values())
    shares = [checksum_share(found, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(found.manifest["files"]) and shares[0]
    assert not set(shares[0]) & set(shares[1])
    read = [0, 0]
    for r in range(2):
        verify_files(found, lambda n, r=r: read.__setitem__(r, read[r] + n), share=(r, 2))
    assert read[0] + read[1] == total and 0 < read[1] < total  # every byte once, between them
    # A damaged file of rank 1's share: rank 0 alone does not see it; agreed, both refuse it.
    copy = tmp_path / path.name
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    _flip_a_byte(copy / shares[1][0])
    damaged = read_manifest(copy)
    verify_files(damaged, share=(0, 2))
    problems: list[list[str]] = []
    with pytest.raises(ckpt.CheckpointFormatError, match="does not match its checksum"):
        verify_files(damaged, share=(1, 2), agree=lambda p: problems.append(p) or p)
    assert len(problems) == 1 and shares[1][0] in problems[0][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_damaged_file_of_one_ranks_share_is_refused_on_every_rank(saved, tmp_path):
    from roundpipe.checkpoint.manifest import checksum_share, read_manifest

    path, _ = saved
    copy = tmp_path / "ckpts" / path.name
    copy.mkdir(parents=True)
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    victim = checksum_share(read_manifest(copy), 1, 2)[0]  # rank 1 reads it, rank 0 does not
    _flip_a_byte(copy / victim)
    cfg = {**SEQ, "steps": N, "root": str(copy.parent), "resume": True, "out": str(tmp_path / "o")}
    procs = start_ranks(cfg, 2)
    try:
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=240)
            assert p.returncode != 0, f"rank {rank} loaded a damaged checkpoint"
            assert "CheckpointFormatError" in err and f"{victim} does not match its checksum" in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_in_the_weight_broadcast_stops_the_other_in_bounded_time(tmp_path, rank_pool):
    """Rank 1 is killed (SIGKILL) in the weight broadcast of the master->model copy of
    iteration 3's step, after checkpoints at 1, 2 and 3 (each waited for). Rank 0 raises
    DataParallelError within the process group's timeout (10 s); the last checkpoint loads."""
    root = tmp_path / "ckpts"
    timeout_s = 10
    cfg = {
        **SEQ,
        "dp": True,
        "steps": N,
        "root": str(root),
        "save_every": 1,
        "wait": True,
        "timeout": timeout_s,
        # 3 layers with parameters: the copy launched by the 4th step (iteration 3), its 2nd
        "kill_in_broadcast": {"rank": 1, "at": 3 * 3 + 2},
        "out": str(tmp_path / "killed.json"),
    }
    err0, stopped_after = kill_rank1(cfg, "killed in weight broadcast", timeout_s + 50)
    assert "DataParallelError" in err0, err0
    assert "the broadcast of the updated weights" in err0 or "failed" in err0, err0
    print(f"rank 0 stopped {stopped_after:.1f} s after rank 1 was killed")
    last = ckpt.latest(root)
    assert last is not None and json.loads((last / "manifest.json").read_text())["sharded"]
    resume = {**SEQ, "steps": N, "root": str(root), "resume": True}
    resumed = run_ranks(resume, tmp_path, "resumed", pool=rank_pool)
    # The checkpoint after iteration 2 (saved as iteration 3) was the last complete one.
    assert sorted(p.name for p in root.iterdir()) == [f"ckpt-00000{i}" for i in (1, 2, 3)]
    for rec in resumed:
        assert rec["loaded"]["iteration"] == 3
        assert sorted(map(int, rec["losses"])) == list(range(3, N))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_writing_its_share_leaves_no_manifest_and_rank_0_says_whose(tmp_path):
    """Rank 1 is killed (SIGKILL) on its writer thread as it starts its share of the third
    checkpoint. Rank 0's wait for that save fails after the process group's timeout (10 s),
    naming rank 1's files; the checkpoint has no manifest, and the second loads."""
    root = tmp_path / "ckpts"
    cfg = {
        **SEQ,
        "steps": N,
        "root": str(root),
        "save_every": 1,
        "wait": True,
        "timeout": 10,
        "kill_in_write": {"rank": 1, "save": 3},
        "out": str(tmp_path / "killed.json"),
    }
    err0, stopped_after = kill_rank1(cfg, "killed writing its share of save 3", 60)
    assert "DataParallelError" in err0 and "nothing came for" in err0 and "rank1" in err0, err0
    print(f"rank 0's save failed {stopped_after:.1f} s after rank 1 was killed")
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000001", "ckpt-000002"]
    model = ckpt_worker.build_seq({**ckpt_worker.DEFAULTS, "shard": False})
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    extra = ckpt.load(
        root, model, opt, scaler=roundpipe.GradScaler(), scheduler=_sched(opt), progress=False
    )
    assert extra["iteration"] == 2
