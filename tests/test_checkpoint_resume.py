"""Exact resume through roundpipe.checkpoint, in a new process, bit for bit: a run of N
iterations against one saved at k and resumed from the saved directory for the rest, on the CPU
pool, on two emulated accelerators and on two data-parallel ranks (torchrun's environment), for
a Sequential with a scheduler and a GradScaler and for a wrapped HF model with LoRA adapters.
The resumed runs are new processes of tests/ckpt_worker.py; the uninterrupted and the saving
runs, where the process is not the point, run in the session's rank processes (conftest's
``rank_pool``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import ckpt_worker
import pytest
from rank_pool_worker import start_together

# Every test here runs a subprocess (see the slow marker in pyproject.toml).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"


def run(cfg, tmp_path, tag, env=None, timeout=240, pool=None):
    """One run of the worker: in a new process, or with ``pool`` (conftest's ``rank_pool``) in
    the session's rank process 0 (where the process is not the point: the uninterrupted run,
    the run that saves)."""
    out = tmp_path / f"{tag}.json"
    cfg = {**cfg, "out": str(out)}
    if pool is not None:
        assert env is None
        _pool_run(pool, cfg, 1, tmp_path / tag, timeout, port=None)
        return json.loads(out.read_text())
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(cfg)],
        cwd=ROOT,
        # One thread, as the rank processes it is compared with.
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{tag}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def _pool_run(pool, cfg, world, log_dir, timeout, port):
    log_dir.mkdir()
    try:
        outcome = pool.run("ckpt_worker", [json.dumps(cfg)], world, log_dir, timeout, port)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    for rank, (code, output) in outcome.items():
        assert code == 0, f"{log_dir.name} rank {rank}:\n{output}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cfg, world):
    """``world`` new processes of the worker with torchrun's variables (their output piped),
    released together once each has imported."""
    port = _free_port()
    envs = [
        {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        for rank in range(world)
    ]
    return start_together([sys.executable, str(WORKER), json.dumps({**cfg, "dp": True})], envs)


def run_ranks(cfg, tmp_path, tag, world=2, timeout=240, pool=None):
    """``world`` ranks of the worker with the environment torchrun gives them: new processes,
    or with ``pool`` the session's rank processes."""
    out = tmp_path / f"{tag}.json"
    if pool is not None:
        dp_cfg = {**cfg, "out": str(out), "dp": True}
        _pool_run(pool, dp_cfg, world, tmp_path / tag, timeout, _free_port())
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    procs = []
    try:
        procs = start_ranks({**cfg, "out": str(out)}, world)
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"{tag} rank {rank}:\n{err}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def assert_same_run(full, first, second, k, n):
    assert sorted(map(int, second["losses"])) == list(range(k, n))  # it did resume at k
    merged = {**first["losses"], **second["losses"]}
    assert merged == full["losses"]  # every loss, as float.hex
    assert second["masters"] == full["masters"] != first["masters"]
    assert second["params"] == full["params"]
    assert second["scaler"] == full["scaler"]
    assert second["lr"] == full["lr"]


CASES = [
    pytest.param({"model": "seq", "devices": "cpu"}, id="seq-cpu"),
    pytest.param({"model": "seq", "devices": "emu:2"}, id="seq-emu2"),
    pytest.param({"model": "lora", "devices": "cpu"}, id="lora-cpu"),
    pytest.param({"model": "lora", "devices": "emu:2"}, id="lora-emu2"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("base", CASES)
def test_a_saved_run_resumes_bit_for_bit_in_a_new_process(tmp_path, rank_pool, base):
    if base["model"] == "lora":
        pytest.importorskip("peft")
    n, k = 6, 3
    unused = str(tmp_path / "unused")
    full = run({**base, "steps": n, "root": unused}, tmp_path, "full", pool=rank_pool)
    root = str(tmp_path / "ckpts")
    save = {"steps": k, "root": root, "save_at": {str(k - 1): "end"}}
    first = run({**base, **save}, tmp_path, "a", pool=rank_pool)
    # The resume is a new process: nothing but the checkpoint carries the run over.
    second = run({**base, "steps": n, "root": root, "resume": True}, tmp_path, "b")
    assert second["loaded"]["iteration"] == k
    assert_same_run(full, first, second, k, n)


@pytest.mark.timeout(600)
def test_a_save_between_forward_backward_and_step_resumes_at_the_step(tmp_path, rank_pool):
    # The gradients accumulated by forward_backward are part of that checkpoint; the resumed
    # run (a new process) next call is the step.
    n, k = 5, 2
    base = {"model": "seq", "devices": "cpu"}
    unused = str(tmp_path / "unused")
    full = run({**base, "steps": n, "root": unused}, tmp_path, "full", pool=rank_pool)
    root = str(tmp_path / "ckpts")
    save = {"steps": k + 1, "root": root, "save_at": {str(k): "after_fb"}}
    first = run({**base, **save}, tmp_path, "a", pool=rank_pool)
    second = run({**base, "steps": n, "root": root, "resume": True}, tmp_path, "b")
    assert second["loaded"] == {
        "iteration": k,
        "pending_step": True,
        "note": f"saved after_fb of iteration {k}",
    }
    assert {**first["losses"], **second["losses"]} == full["losses"]
    assert second["masters"] == full["masters"] and second["scaler"] == full["scaler"]


@pytest.mark.timeout(600)
def test_two_data_parallel_ranks_resume_bit_for_bit(tmp_path, rank_pool):
    n, k = 6, 3
    base = {"model": "seq", "devices": "cpu"}
    unused = str(tmp_path / "unused")
    full = run_ranks({**base, "steps": n, "root": unused}, tmp_path, "full", pool=rank_pool)
    root = tmp_path / "ckpts"
    save = {"steps": k, "root": str(root), "save_at": {str(k - 1): "end"}}
    first = run_ranks({**base, **save}, tmp_path, "a", pool=rank_pool)
    (saved,) = [p for p in root.iterdir()]
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["ranks"] == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]  # one writer (rank 0), every rank's RNG and extra
    # Resumed in new processes.
    second = run_ranks({**base, "steps": n, "root": str(root), "resume": True}, tmp_path, "b")
    for rank in range(2):
        assert_same_run(full[rank], first[rank], second[rank], k, n)
        assert second[rank]["replicas_identical"]
    assert full[0]["masters"] == full[1]["masters"]


@pytest.mark.timeout(600)
def test_the_hf_directory_of_a_lora_checkpoint_loads_in_peft_with_the_masters(tmp_path, rank_pool):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    root = tmp_path / "ckpts"
    run(
        {"model": "lora", "steps": 3, "root": str(root), "save_at": {"2": "end"}, "hf": True},
        tmp_path,
        "a",
        pool=rank_pool,
    )
    (saved,) = list(root.iterdir())
    hf_dir = saved / "hf"
    assert (hf_dir / "adapter_config.json").exists()
    masters = load_file(str(next(saved.glob("masters-*.safetensors"))))
    adapter = load_file(str(hf_dir / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    # The adapter holds the masters' values (fp32), not the model's one-step-older params.
    # The checkpoint names a master by its stage ("masters/1.layer.<rest>": decoder layer 0).
    by_suffix = {}
    for key, value in masters.items():
        stage, _, rest = key.removeprefix("masters/").partition(".layer.")
        by_suffix[f"{int(stage) - 1}.{rest.replace('.default', '')}"] = value
    assert len(adapter) == len(by_suffix) == 8
    for key, value in adapter.items():
        assert torch.equal(value, by_suffix[key.split("layers.", 1)[1]]), key
    torch.manual_seed(0)
    config = ckpt_worker.tiny_llama_config(tie_word_embeddings=False)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(hf_dir))
    for name, p in loaded.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            suffix = name.split("layers.", 1)[1].replace(".default", "")
            assert torch.equal(p.detach(), by_suffix[suffix]), name
