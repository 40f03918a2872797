"""benchmarks/bench_gpu.py, run as a user runs it (a subprocess from the repository root): its tiny
mode on the CPU and on the emulated accelerator prints the table of the three variants with
ratios that agree with its own tokens/s, and without CUDA it says so and exits 0. No timing is
asserted: only that the script runs and reports what it measured."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundpipe.plan import HOST_CONTENTION

# Every test here runs a subprocess (see the slow marker in pyproject.toml).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
TIGHT = [
    "--layers",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--seq",
    "8",
    "--vocab",
    "32",
    "--batch",
    "4",
    "--iters",
    "1",
    "--warmup",
    "1",
]
VARIANTS = ("roundpipe", "plain PyTorch", "plain PyTorch + checkpoint")
ROW = re.compile(
    r"^\| (roundpipe|plain PyTorch|plain PyTorch \+ checkpoint) \| (\d+) \| "
    r"([\d,]+) \| ([\d.]+) \| ([\d.]+) \| (\S+) \| (\S+) \|$",
    re.M,
)


def run_bench(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"bench_gpu.py failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("devices", ["cpu", "emu"])
def test_tiny_mode_prints_the_three_variants_with_ratios(devices):
    out = run_bench("--devices", devices, "--microbatches", "1", "2", *TIGHT)
    assert f"NOT A GPU RUN: a tiny configuration on {devices}" in out
    assert (
        "| variant | microbatches | tokens/s | vs plain PyTorch | vs plain PyTorch + checkpoint "
        "| GPU peak GiB | host RSS peak GiB |"
    ) in out

    rows = {
        (name, int(m)): (float(tps.replace(",", "")), float(vs_plain), float(vs_ckpt), gpu, rss)
        for name, m, tps, vs_plain, vs_ckpt, gpu, rss in ROW.findall(out)
    }
    assert set(rows) == {(name, m) for name in VARIANTS for m in (1, 2)}, out
    for m in (1, 2):
        rp, plain, ckpt = (rows[(name, m)] for name in VARIANTS)
        assert plain[1] == 1.0 and ckpt[2] == 1.0  # each baseline against itself
        for row in (rp, plain, ckpt):
            assert row[0] > 0
            # The ratio columns are the row's tokens/s over the baseline's (tokens/s is printed
            # rounded to whole tokens, the ratio to three decimals).
            assert row[1] == pytest.approx(row[0] / plain[0], rel=0.02, abs=2e-3), out
            assert row[2] == pytest.approx(row[0] / ckpt[0], rel=0.02, abs=2e-3), out
            if devices == "cpu":
                assert row[3] == "n/a"  # no device memory of its own
            else:  # the emulated device counts its memory exactly
                assert float(row[3]) > 0
            assert float(row[4]) > 0.05  # host RSS in GiB: at least torch itself
        if devices == "emu":
            # roundpipe keeps a few stages on the device, plain PyTorch all of the model, its
            # masters and Adam's state; and the plain variants, run first, are gone by then.
            assert float(rp[3]) < float(plain[3]), out

    # The targets beside the measured values, the ratio the same as in the table.
    assert "[no GPU: not a measurement of the target]" in out
    for m in (1, 2):
        line = re.search(
            rf"roundpipe / plain PyTorch \+ checkpoint, +{m} microbatches: "
            rf"([\d.]+)  \(target >= 0.85\)  (met|NOT met)",
            out,
        )
        assert line and float(line[1]) == rows[("roundpipe", m)][2], out
    assert re.search(
        r"roundpipe tokens/s against 1 microbatches: 1: 1.000, 2: [\d.]+  "
        r"\(target: none below 0.95\)  (met|NOT met)",
        out,
    ), out
    if devices == "cpu":
        assert "GPU peak <= 2 stages + activations: n/a (no GPU memory to measure)" in out
    else:
        for m in (1, 2):
            line = re.search(
                rf"roundpipe GPU peak, +{m} microbatches: ([\d.]+) GiB  \(target "
                rf"<= 2 stages [\d.]+ \+ activations [\d.]+ = [\d.]+ GiB\)  "
                rf"(met|NOT met)",
                out,
            )
            assert line and line[1] == rows[("roundpipe", m)][3], out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_and_exits_0():
    for args in ([], ["--devices", "cuda"]):
        out = run_bench(*args)
        assert out.startswith("No GPU: ") and "CUDA is not available" in out, out
        assert "--allow-cpu" in out and "| variant |" not in out

    out = run_bench("--allow-cpu", "--microbatches", "2", *TIGHT)
    assert "NOT A GPU RUN: a tiny configuration on cpu" in out
    assert {name for name, *_ in ROW.findall(out)} == set(VARIANTS)


def _profile_script(name, out):
    """benchmarks/``name`` in its tiny mode on the emulated device, one timed iteration."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), "--devices", "emu"]
        + ["--warmup", "1", "--iters", "1", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_profile_gpu_prices_the_plan_and_writes_a_trace_and_a_timeline(tmp_path):
    """benchmarks/profile_gpu.py in its tiny mode on the emulated device: the measured and the
    priced iteration, the profile's thread and device split, and its two files."""
    import gzip
    import json

    proc = _profile_script("profile_gpu.py", tmp_path)
    measured = float(re.search(r"^measured: ([\d.]+) s/iteration", proc.stdout, re.M)[1])
    priced = re.search(
        r"^priced: +([\d.]+) s/iteration \(devices ([\d.]+) s, optimizer thread ([\d.]+) s: "
        r"(optimizer|device)-bound, contention ([\d.]+)\).*measured/priced ([\d.]+) "
        r"\(without contention ([\d.]+)\)",
        proc.stdout,
        re.M,
    )
    assert priced is not None, proc.stdout
    total, devices, step, contention = (float(priced[i]) for i in (1, 2, 3, 5))
    assert contention == HOST_CONTENTION
    longer, shorter = max(devices, step), min(devices, step)
    assert total == pytest.approx(longer + contention * shorter, abs=2e-4)
    assert float(priced[6]) == pytest.approx(measured / total, abs=0.01)
    assert float(priced[7]) == pytest.approx(measured / longer, abs=0.01)
    assert re.search(r"^alone: +forward_backward [\d.]+ s, step [\d.]+ s; ", proc.stdout, re.M)
    assert re.search(r"^  host thread \d+: [\d.]+ s in top-level ops", proc.stdout, re.M)
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["iteration_time"] == pytest.approx(total, abs=1e-4)
    assert {s["stream"] for s in timeline["spans"]} >= {"compute"}
    trace = json.load(gzip.open(tmp_path / "trace.json.gz"))
    assert any(e.get("name", "").startswith("Optimizer.step") for e in trace["traceEvents"])


def test_profile_hf_names_roundpipes_actions_in_its_profile(tmp_path):
    """benchmarks/profile_hf.py in its tiny mode on the emulated device: the measured iteration,
    the two shares, and a table of the executor's labelled actions (every stage's forward and
    prefetch, the head's last action) with a trace that carries the same labels."""
    pytest.importorskip("transformers")
    import gzip
    import json

    proc = _profile_script("profile_hf.py", tmp_path)
    assert re.search(r"^measured: [\d.]+ s/iteration", proc.stdout, re.M), proc.stdout
    assert re.search(r"^forward_backward alone: [\d.]+ s; step alone", proc.stdout, re.M)
    assert re.search(
        rf"^overlapped: [\d.]+ s/iteration at the price's contention {HOST_CONTENTION} ",
        proc.stdout,
        re.M,
    ), proc.stdout
    # tiny mode: 2 decoder layers, so stages 0 (embedding) to 3 (head)
    actions = dict(re.findall(r"^  (roundpipe [a-z_]+ stage \d+) +(\d+) ", proc.stdout, re.M))
    for stage in (1, 2):
        # 4 microbatches in each of the 2 profiled iterations
        assert actions[f"roundpipe forward stage {stage}"] == "8", proc.stdout
        assert actions[f"roundpipe backward stage {stage}"] == "8"
    assert actions["roundpipe last stage 3"] == "8"
    assert "roundpipe prefetch stage 1" in actions and "roundpipe download stage 1" in actions
    trace = json.load(gzip.open(tmp_path / "trace.json.gz"))
    assert any(e.get("name") == "roundpipe forward stage 1" for e in trace["traceEvents"])


def test_the_gpu_session_script_is_valid_bash():
    proc = subprocess.run(
        ["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
