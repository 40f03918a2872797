"""`python -m roundpipe`: versions, device pool and the self-check, run as a user runs it."""

import json
import os
import subprocess
import sys

import pytest
import torch

import roundpipe


def run_cli(*args, env_extra=None, timeout=100):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "roundpipe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.slow
def test_quick_self_check_passes_and_reports_the_environment():
    proc = run_cli("--quick")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"roundpipe {roundpipe.__version__}" in out
    assert f"torch {torch.__version__}" in out
    assert "device pool (default): " in out
    assert out.rstrip().splitlines()[-1].startswith("PASSED")
    assert "[FAIL]" not in out
    for what in (
        "the loss went down",
        "ran on the optimizer thread",
        "hold the newest masters",
        "re-raised on the main thread",
        "usable after that error",
    ):
        assert what in out


@pytest.mark.slow
def test_quick_self_check_on_two_workers_in_bf16_from_the_environment():
    proc = run_cli("--quick", "--dtype", "bf16", env_extra={"ROUNDPIPE_DEVICES": "cpu:2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device pool ($ROUNDPIPE_DEVICES): cpu#0, cpu#1" in proc.stdout
    assert "bf16 shards" in proc.stdout and "PASSED" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("spec,pool", [("emu", "emu:0"), ("emu:2", "emu:0, emu:1")])
def test_quick_self_check_on_the_emulated_accelerator(spec, pool):
    proc = run_cli("--quick", env_extra={"ROUNDPIPE_DEVICES": spec})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"device pool ($ROUNDPIPE_DEVICES): {pool}" in proc.stdout
    assert "PASSED" in proc.stdout and "[FAIL]" not in proc.stdout


@pytest.mark.slow
def test_a_bad_device_pool_fails_with_the_reason():
    proc = run_cli("--quick", env_extra={"ROUNDPIPE_DEVICES": "gpu9"})
    assert proc.returncode == 1
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("FAILED") and "gpu9" in last and "cpu:N" in last


def test_self_check_fails_when_the_optimizer_does_nothing(monkeypatch, capsys):
    import roundpipe.__main__ as cli

    class IdleAdam(roundpipe.optim.Adam):
        def step(self, closure=None):
            return None

    monkeypatch.setattr(roundpipe.optim, "Adam", IdleAdam)
    assert cli.main(["--quick"]) == 1
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("FAILED") and "the loss went down" in last and "changed 0/6" in last
    assert "PASSED" not in out


@pytest.mark.slow
def test_help_is_plain_text():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "``" not in proc.stdout  # reST markup of the module docstring showed through before
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "self-check training loop" in text and "PASSED (exit code 0)" in text


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4])
def test_plan_of_a_transformers_config_reports_host_and_device(tmp_path, lora):
    pytest.importorskip("transformers")
    if lora:
        pytest.importorskip("peft")
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = run_cli("plan", str(path), "--seq-len", "128", "--lora", str(lora), "--devices", "emu")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "Host RAM" in out and "Device emu:0: peak" in out and "Largest term" in out
    # The host terms count all six layers (the device plan uses a two-layer cut).
    layer = 4 * 64 * 64 // 2 + 2 * 64 * 16 * 2 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + mlp + norms
    total = 2 * 512 * 64 + 64 + 6 * layer
    # LoRA: A (4 x in) and B (out x 4) on q, o (64 -> 64) and k, v (64 -> 32) of six layers.
    trained = 6 * (2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4)) if lora else total
    assert f"({trained / 1e3:.2f}K trainable params" in out, out
