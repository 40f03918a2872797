"""The faults a long run meets, against roundpipe.checkpoint: the process SIGKILLed at random
moments while it saves (the newest complete checkpoint always loads and resumes exactly), shards
truncated or bit-flipped and files missing (refused by name, nothing changed), a checkpoint that
does not fit the model (refused by tensor), and a save taken while a step is in flight."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"
# One thread, as the session's rank processes (conftest's rank_pool) that run the runs whose
# process is not the point, so that every run computes the same bits.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_worker(cfg, out, pool=None):
    """A run of the worker: in a new process, or with ``pool`` in a rank process of the
    session."""
    if pool is not None:
        log_dir = Path(out).with_suffix(".log")
        log_dir.mkdir(exist_ok=True)
        cfg = {**cfg, "out": str(out)}
        ((code, output),) = pool.run("ckpt_worker", [json.dumps(cfg)], 1, log_dir, 300).values()
        assert code == 0, output
        return json.loads(Path(out).read_text())
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps({**cfg, "out": str(out)})],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(Path(out).read_text())


def kill_when(cfg, prefix, count=1, delay=0.0):
    """Run the worker and SIGKILL it ``delay`` seconds after the ``count``-th line it prints
    starting with ``prefix`` (or when it ends); its return code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(cfg)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = 0
        for line in proc.stdout:
            seen += line.startswith(prefix)
            if seen == count:
                time.sleep(delay)  # a random moment of the write (the test's, not the library's)
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_process_killed_at_random_moments_while_saving_resumes_from_its_newest_checkpoint(
    tmp_path, rank_pool
):
    # Every iteration saves (keep_last=2, so old checkpoints are removed as new ones land); the
    # process is SIGKILLed a random few milliseconds after a random save was called, mostly
    # while that checkpoint is written or an older one removed. Whatever is left, the newest
    # complete checkpoint loads, and the run resumed from it continues bit for bit.
    steps = 8
    base = {"model": "seq", "width": 1536, "steps": steps}
    unused = str(tmp_path / "unused")
    reference = run_worker({**base, "root": unused}, tmp_path / "full.json", rank_pool)
    rng = random.Random(1234)
    interrupted_writes = 0
    for trial in range(5):
        root = tmp_path / f"trial{trial}"
        cfg = {**base, "root": str(root), "save_every": 1, "keep_last": 2, "announce_saves": True}
        kill_after = rng.randint(2, steps - 1)  # the save after iteration kill_after - 1
        delay = rng.uniform(0.0, 0.25)
        returncode, _ = kill_when(cfg, "saving", kill_after, delay)
        assert returncode == -signal.SIGKILL, f"trial {trial}: the run ended before the kill"
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        interrupted_writes += any(".tmp-" in name for name in leftovers)
        newest = ckpt.latest(root)
        assert newest is not None, f"trial {trial}: no checkpoint survived: {list(root.iterdir())}"
        resume = {**base, "root": str(root), "resume": True}
        resumed = run_worker(resume, tmp_path / f"r{trial}.json", rank_pool)
        start = resumed["loaded"]["iteration"]
        assert start >= kill_after - 2, (trial, start, kill_after)  # at most one save lost
        assert resumed["losses"] == {
            k: v for k, v in reference["losses"].items() if int(k) >= start
        }
        assert resumed["masters"] == reference["masters"]
        assert resumed["params"] == reference["params"]
    assert interrupted_writes >= 1  # the kills did land inside writes


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("masters", [False, True], ids=["state", "state_and_masters"])
def test_a_process_killed_while_writing_adams_state_to_disk_resumes_from_its_checkpoint(
    tmp_path, rank_pool, masters
):
    # Adam's state in files (state_dir), streamed through a small buffer so a step is many
    # writes, and with ``masters`` the masters in files there too (MastersOnDisk, written by
    # the same writer thread); the process is SIGKILLed as the writer thread starts one of
    # them. The killed process leaves its directories; the resumed run (same directory)
    # removes them with a warning, loads the newest checkpoint and continues bit for bit as the
    # in-RAM run.
    steps = 6
    base = {"model": "seq", "width": 1536, "steps": steps}
    unused = str(tmp_path / "unused")
    reference = run_worker({**base, "root": unused}, tmp_path / "full.json", rank_pool)
    state_dir = tmp_path / "nvme"
    spill = {"state_dir": str(state_dir), "state_buffer_bytes": 1 << 20}
    if masters:
        spill["masters_dir"] = str(state_dir)
    root = tmp_path / "ckpts"
    cfg = {**base, **spill, "root": str(root), "save_every": 1, "announce_write_at": 3}
    returncode, err = kill_when(cfg, "writing")
    assert returncode == -signal.SIGKILL, f"the run ended before the kill: {err}"
    left = sorted(state_dir.iterdir())  # the killed process's directories
    kinds = ["adam", "masters"] if masters else ["adam"]
    assert [p.name.split("-")[1] for p in left] == kinds
    assert all(next(p.iterdir()).stat().st_size for p in left)
    resumed = run_worker({**base, **spill, "root": str(root), "resume": True}, tmp_path / "r.json")
    # Removed by the first spill built in the resumed run (the model's masters, else Adam's).
    assert any(
        all(p.name in w for p in left) and "killed processes" in w for w in resumed["warnings"]
    )
    start = resumed["loaded"]["iteration"]
    assert 1 <= start <= 4  # saves are asynchronous: the newest complete one may lag
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) >= start}
    assert resumed["masters"] == reference["masters"]
    assert resumed["params"] == reference["params"]
    assert list(state_dir.iterdir()) == []  # the resumed run's own directory went at its exit


# -- in one process ------------------------------------------------------------------------------


def build(width=16, seed=0):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4)).half()
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, GradScaler("cpu", init_scale=2.0**8)


def forward_backward(model, scaler, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    model.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=lambda out, lbl: scaler.scale(F.cross_entropy(out.float(), lbl)) / 2,
    )


def iteration(model, opt, scaler, i, step_fn=None):
    forward_backward(model, scaler, i)
    model.step(step_fn or (lambda: (scaler.step(opt), opt.zero_grad())))
    scaler.update()


def state_of(model, opt, scaler):
    optim_thread.wait_all()
    return {
        "params": {k: v.clone() for k, v in model.state_access().module.state_dict().items()},
        "masters": model.master_state_dict(),
        "optimizer": json.dumps(
            {
                str(k): {n: torch.as_tensor(v).tolist() for n, v in s.items()}
                for k, s in opt.state_dict()["state"].items()
            }
        ),
        "scaler": scaler.state_dict(),
    }


def assert_unchanged(before, after):
    for part in ("params", "masters"):
        assert before[part].keys() == after[part].keys()
        for k in before[part]:
            assert torch.equal(before[part][k], after[part][k]), (part, k)
    assert before["optimizer"] == after["optimizer"]
    assert before["scaler"] == after["scaler"]


@pytest.fixture
def saved(tmp_path):
    model, opt, scaler = build()
    for i in range(3):
        iteration(model, opt, scaler, i)
    return ckpt.save(tmp_path, model, opt, scaler=scaler).wait()


@pytest.fixture
def target():
    """A model, optimizer and scaler trained differently, whose state a refused load must not
    change."""
    model, opt, scaler = build(seed=1)
    for i in range(10, 12):
        iteration(model, opt, scaler, i)
    return model, opt, scaler


def _refused(path, target, match):
    model, opt, scaler = target
    before = state_of(model, opt, scaler)
    with pytest.raises(ckpt.CheckpointFormatError, match=match) as info:
        ckpt.load(path, model, opt, scaler=scaler, progress=False)
    assert "nothing was" in str(info.value)
    assert_unchanged(before, state_of(model, opt, scaler))
    iteration(model, opt, scaler, 12)  # and it trains on
    return str(info.value)


def test_a_truncated_shard_is_refused_by_name(saved, target):
    shard = saved / "optimizer-00001-of-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    message = _refused(saved, target, "truncated")
    assert "optimizer-00001-of-00001.safetensors" in message


def test_a_bit_flipped_shard_is_refused_by_name(saved, target):
    shard = saved / "masters-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 7] ^= 0x10  # one bit of one master's value
    shard.write_bytes(bytes(data))
    message = _refused(saved, target, "checksum")
    assert "masters-00001-of-00001.safetensors" in message


def test_a_missing_file_is_refused_by_name(saved, target):
    (saved / "rank-00000.safetensors").unlink()
    assert "rank-00000.safetensors is missing" in _refused(saved, target, "missing")


def test_a_corrupt_manifest_is_refused(saved, target):
    manifest = saved / "manifest.json"
    manifest.write_text(manifest.read_text()[:-40])
    _refused(saved, target, "not valid JSON")


def test_a_flipped_value_in_the_manifest_is_refused(saved, target):
    manifest = saved / "manifest.json"
    text = manifest.read_text()
    assert '"sequence": 1,' in text
    manifest.write_text(text.replace('"sequence": 1,', '"sequence": 3,'))
    _refused(saved, target, "manifest.json does not match its checksum")


def test_a_checkpoint_of_a_newer_roundpipe_is_refused_naming_both_versions(saved, target):
    from roundpipe.checkpoint import manifest as ckpt_manifest

    m = ckpt_manifest.read_manifest(saved).manifest
    m["roundpipe_version"] = "99.0.0"
    del m["crc32"]
    (saved / "manifest.json").write_text(json.dumps(m, indent=1))
    message = _refused(saved, target, "newer than this")
    assert "99.0.0" in message and roundpipe.__version__ in message


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensors(saved):
    model, opt, scaler = build(width=24)  # every weight of another shape
    message = _refused(saved, (model, opt, scaler), "shape|float16")
    assert "'0.weight' is float16 (16, 8)" in message and "float16 (24, 8) in this model" in message
    wide = RoundPipe(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).float())
    with OptimizerCtx():
        opt32 = roundpipe.optim.Adam(wide.parameters(), lr=1e-2)
    message = _refused(saved, (wide, opt32, GradScaler("cpu")), "float16")
    assert "float32 (16, 8) in this model" in message  # the dtype differs


def test_parts_missing_from_the_call_or_the_checkpoint_are_refused_unless_not_strict(saved, target):
    model, opt, scaler = target
    before = state_of(model, opt, scaler)
    with pytest.raises(ckpt.CheckpointFormatError, match="no scaler="):
        ckpt.load(saved, model, opt, progress=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.raises(ckpt.CheckpointFormatError, match="holds no scheduler state"):
        ckpt.load(saved, model, opt, scaler=scaler, scheduler=sched, progress=False)
    assert_unchanged(before, state_of(model, opt, scaler))
    ckpt.load(saved, model, opt, progress=False, strict=False)  # the scaler is left as it is
    assert state_of(model, opt, scaler)["scaler"] == before["scaler"]


def test_a_save_while_a_step_is_in_flight_holds_the_state_after_that_step(tmp_path):
    # The step is still running (blocked) when save() is called: the checkpoint is taken in
    # launch order behind it, so it holds what that step produced; and the iterations after
    # the save, whose steps wait for the write, do not leak into it.
    twin, opt_twin, scaler_twin = build()  # the same run, waited for (first: one optimizer
    for i in range(2):  # thread serves both, and the slow step below blocks it)
        iteration(twin, opt_twin, scaler_twin, i)
    expected = state_of(twin, opt_twin, scaler_twin)
    model, opt, scaler = build()
    iteration(model, opt, scaler, 0)
    release, running = threading.Event(), threading.Event()

    def slow_step():
        running.set()
        release.wait()
        scaler.step(opt)
        opt.zero_grad()

    try:
        iteration(model, opt, scaler, 1, slow_step)
        running.wait()
        handle = ckpt.save(tmp_path, model, opt, scaler=scaler)
    finally:  # a failure above must not leave the optimizer thread held (a hung teardown)
        release.set()
    for i in range(2, 4):
        iteration(model, opt, scaler, i)
    handle.wait()
    loaded, opt2, scaler2 = build(seed=3)
    ckpt.load(handle.path, loaded, opt2, scaler=scaler2, progress=False)
    assert_unchanged(expected, state_of(loaded, opt2, scaler2))


def test_a_save_before_the_copy_of_the_last_step_holds_the_weights_the_next_forward_reads(
    tmp_path,
):
    # The optimizer thread is held up while iteration 1 launches the copy that swaps step 0's
    # next weights in (see [Note: the copy in the step]), then step 1, and then the save is
    # called: at save() the parameters still hold the old weights, in the storage step 1 then
    # writes. The checkpoint holds the parameters as the forward after it reads them (step
    # 0's), and step 1's masters.
    twin, opt_twin, scaler_twin = build()
    iteration(twin, opt_twin, scaler_twin, 0)
    masters0 = state_of(twin, opt_twin, scaler_twin)["masters"]
    iteration(twin, opt_twin, scaler_twin, 1)
    masters1 = state_of(twin, opt_twin, scaler_twin)["masters"]

    model, opt, scaler = build()
    iteration(model, opt, scaler, 0)
    release, held = threading.Event(), threading.Event()

    def hold_up():
        held.set()
        release.wait()

    optim_thread.wait_all()
    forward_backward(model, scaler, 1)
    optim_thread.launch(hold_up)
    held.wait()
    try:
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        handle = ckpt.save(tmp_path, model, opt, scaler=scaler)
    finally:
        release.set()  # a failure above must not leave the optimizer thread held
    handle.wait()
    loaded, opt2, scaler2 = build(seed=3)
    ckpt.load(handle.path, loaded, opt2, scaler=scaler2, progress=False)
    got = state_of(loaded, opt2, scaler2)
    for k, master in masters1.items():
        assert torch.equal(got["masters"][k], master), k
        assert torch.equal(got["params"][k], masters0[k].half()), k  # not step 1's
        assert not torch.equal(got["params"][k], master.half()), k
