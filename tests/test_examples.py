"""The examples, run as a user runs them (a subprocess, from the repository root) in a short mode,
with assertions on what they print."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, timeout=100):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *map(str, args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, proc.stderr


def test_scaler_dropin_matches_torch():
    out, err = run_example("scaler_dropin.py", "--steps", 120)
    assert "same scale sequence: True" in out
    assert "same skipped steps: True" in out
    assert "bitwise identical parameters: True" in out
    skipped = re.search(r"skipped steps: torch (\d+), roundpipe (\d+) \(roundpipe's own count: (\d+)\)", out)
    assert skipped and int(skipped[1]) == int(skipped[2]) == int(skipped[3]) > 0  # overflows happened
    assert "DROP-IN OK" in out
    assert "it/s" in err or "s/it" in err  # the tqdm progress bar
