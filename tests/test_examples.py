"""The examples, run as a user runs them (a subprocess, from the repository root) in a short mode,
with assertions on what they print."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name, *args, timeout=100, env=None, expect_rc=0, devices=None):
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    if devices is not None:
        env["ROUNDPIPE_DEVICES"] = devices
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == expect_rc, (
        f"{name} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout, proc.stderr


def test_every_flag_of_the_examples_and_the_cli_has_help_text():
    import ast

    missing = []
    for path in [*sorted((ROOT / "examples").glob("*.py")), ROOT / "roundpipe" / "__main__.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                if not any(k.arg == "help" for k in node.keywords):
                    missing.append(f"{path.name}: {ast.literal_eval(node.args[0])}")
    assert missing == []


@pytest.mark.slow
def test_scaler_dropin_matches_torch():
    out, err = run_example("scaler_dropin.py", "--steps", 120)
    assert "same scale sequence: True" in out
    assert "same skipped steps: True" in out
    assert "bitwise identical parameters: True" in out
    skipped = re.search(
        r"skipped steps: torch (\d+), roundpipe (\d+) \(roundpipe's own count: (\d+)\)", out
    )
    assert (
        skipped and int(skipped[1]) == int(skipped[2]) == int(skipped[3]) > 0
    )  # overflows happened
    assert "DROP-IN OK" in out
    assert "it/s" in err or "s/it" in err  # the tqdm progress bar


@pytest.mark.slow
def test_digits_classifier_learns_and_plots(tmp_path):
    plot = tmp_path / "digits.png"
    out, err = run_example("digits_classifier.py", "--steps", 150, "--plot", plot)
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out)[1])
    assert accuracy > 0.6, out  # chance is 0.1; 150 steps reach about 0.9
    first_loss = re.search(r"final train loss: ([0-9.]+)", out)
    assert first_loss and float(first_loss[1]) < 1.5, out  # started at ln(10) = 2.30
    assert plot.exists() and plot.read_bytes()[:4] == b"\x89PNG"
    assert "step/s" in err or "s/step" in err  # the tqdm progress bar


@pytest.mark.slow
def test_digits_classifier_plot_without_matplotlib_stops_before_training(tmp_path):
    # A matplotlib package that cannot be imported, ahead of the real one on the path.
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('no matplotlib here')\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    out, err = run_example(
        "digits_classifier.py", "--steps", 5, "--plot", tmp_path / "x.png", env=env, expect_rc=2
    )
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err
    assert "training" not in err and "test accuracy" not in out  # nothing ran before the check


@pytest.mark.slow
def test_digits_classifier_clips_and_schedules_in_the_step_function():
    out, err = run_example(
        "digits_classifier.py", "--steps", 60, "--clip", 0.5, "--lr-schedule", "cosine"
    )
    clipped = re.search(r"clipped to 0.5 in (\d+) of (\d+) steps", out)
    assert clipped and 0 < int(clipped[1]) <= int(clipped[2]) <= 60, out
    assert float(re.search(r"median ([0-9.]+)", out)[1]) > 0  # real gradients, not the model's None
    assert "final learning rate: 0" in out  # the cosine schedule ran to its end, once per step
    assert "Warning" not in err


@pytest.mark.slow
def test_digits_classifier_bf16_on_two_workers():
    out, _ = run_example(
        "digits_classifier.py", "--steps", 100, "--dtype", "bf16", "--devices", "cpu:2"
    )
    assert "cpu#0, cpu#1" in out
    assert float(re.search(r"test accuracy: ([0-9.]+)", out)[1]) > 0.5


@pytest.mark.slow
def test_digits_classifier_on_the_emulated_accelerator_from_the_environment():
    # A newcomer's loop, unchanged, on ROUNDPIPE_DEVICES=emu: host tensors would be rejected and
    # backward runs on autograd's device thread, as on CUDA.
    out, _ = run_example("digits_classifier.py", "--steps", 60, devices="emu")
    assert "devices emu:0" in out
    assert float(re.search(r"test accuracy: ([0-9.]+)", out)[1]) > 0.3


def _iteration_losses(out):
    return dict(re.findall(r"^iteration (\d+) loss \S+ (\S+)$", out, flags=re.M))


TINY = [
    "--print-every",
    1,
    "--sample",
    0,
    "--corpus-bytes",
    200_000,
    "--dim",
    32,
    "--context",
    32,
    "--batch-size",
    8,
]


@pytest.fixture(scope="module")
def tiny_lm_saved(tmp_path_factory):
    """tiny_lm.py's first 4 iterations, with a checkpoint written in the background every
    iteration: its output and the checkpoint directory, which the runs resumed from it read
    and never write (they pass no --save)."""
    ckpt = tmp_path_factory.mktemp("tiny-lm") / "ckpts"
    out, _ = run_example("tiny_lm.py", "--steps", 4, "--save", ckpt, "--save-every", 1, *TINY)
    return out, ckpt


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_lm_saved")  # one worker runs tiny_lm_saved, once
def test_tiny_lm_resume_with_steps_not_past_the_checkpoint_says_so(tiny_lm_saved):
    _, ckpt = tiny_lm_saved  # its newest checkpoint is of iteration 4
    # --steps counts from the start of the run: 2 < 4 is refused, with the --steps that works.
    _, err = run_example("tiny_lm.py", "--steps", 2, "--resume", ckpt, *TINY, expect_rc=2)
    assert "--steps 2 is below the iteration 4" in err and "--steps 6 trains 2 more" in err
    out, _ = run_example("tiny_lm.py", "--steps", 4, "--resume", ckpt, *TINY)
    assert "already at iteration 4 = --steps: nothing to train" in out
    assert not _iteration_losses(out)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_lm_saved")
def test_tiny_lm_resume_continues_exactly_as_the_uninterrupted_run(tiny_lm_saved):
    small = TINY
    n = 4
    full, _ = run_example("tiny_lm.py", "--steps", 2 * n, *small)
    # With a checkpoint written in the background every iteration too: they change nothing.
    first, ckpt = tiny_lm_saved
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-000002", "ckpt-000003", "ckpt-000004"]
    second, err = run_example("tiny_lm.py", "--steps", 2 * n, "--resume", ckpt, *small)

    full_losses = _iteration_losses(full)
    assert sorted(map(int, full_losses)) == list(range(2 * n))
    first_losses, second_losses = _iteration_losses(first), _iteration_losses(second)
    assert sorted(map(int, second_losses)) == list(range(n, 2 * n))  # it did resume at n
    # Bit for bit (float.hex): the first half, the resumed half, and the final parameters.
    assert {**first_losses, **second_losses} == full_losses
    digest = lambda out: re.search(r"params sha256: (\w+)", out)[1]  # noqa: E731
    assert digest(second) == digest(full) != digest(first)
    assert float.fromhex(full_losses[str(2 * n - 1)]) < float.fromhex(full_losses["0"])  # it learns
    assert "step/s" in err or "s/step" in err


@pytest.mark.slow
def test_tiny_lm_on_two_emulated_devices_resumes_exactly(tmp_path):
    small = [
        "--print-every",
        1,
        "--sample",
        0,
        "--corpus-bytes",
        100_000,
        "--dim",
        16,
        "--context",
        16,
        "--batch-size",
        4,
    ]
    n = 2
    full, _ = run_example("tiny_lm.py", "--steps", 2 * n, *small, devices="emu:2")
    ckpt = tmp_path / "ckpts"
    run_example("tiny_lm.py", "--steps", n, "--save", ckpt, *small, devices="emu:2")
    second, _ = run_example(
        "tiny_lm.py", "--steps", 2 * n, "--resume", ckpt, *small, devices="emu:2"
    )
    digest = lambda out: re.search(r"params sha256: (\w+)", out)[1]  # noqa: E731
    assert digest(second) == digest(full)
    assert sorted(map(int, _iteration_losses(second))) == list(range(n, 2 * n))


HF_SHORT = [
    "--steps",
    12,
    "--layers",
    2,
    "--hidden",
    64,
    "--seq-len",
    32,
    "--batch-size",
    4,
    "--num-microbatch",
    2,
    "--corpus-bytes",
    100_000,
    "--generate",
    8,
]


def _first_and_last_loss(out):
    found = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert found, out
    return float(found[1]), float(found[2])


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="full-cpu"),
        pytest.param(["--lora", 4, "--devices", "emu:2", "--lr", 1e-2], id="lora-emu2"),
    ],
)
def test_finetune_hf_trains_saves_and_reloads(tmp_path, extra):
    pytest.importorskip("transformers")
    if "--lora" in extra:
        pytest.importorskip("peft")
    out, err = run_example("finetune_hf.py", *HF_SHORT, "--out", tmp_path / "out", *extra)
    first, last = _first_and_last_loss(out)
    assert last < first, out
    assert (tmp_path / "out" / "config.json").exists()
    assert "reloaded in plain transformers" in out
    assert "tok_s" in err  # the progress bar shows tokens/s


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [[], ["--sft", "--lora", "4"]], ids=["trainer", "sft-lora"])
def test_trainer_hf_trains_through_the_trainer_and_saves(tmp_path, extra):
    pytest.importorskip("transformers")
    if "--sft" in extra:
        pytest.importorskip("trl")
        pytest.importorskip("peft")
    out, _ = run_example(
        "trainer_hf.py",
        "--steps",
        6,
        "--layers",
        2,
        "--hidden",
        64,
        "--seq-len",
        64,
        "--out",
        tmp_path / "out",
        *extra,
        timeout=200,
    )
    losses = re.search(r"loss ([\d.]+) -> ([\d.]+)", out)
    assert losses and float(losses[2]) < float(losses[1]), out
    assert "train tokens/s" in out
    # save_steps=3 through roundpipe.checkpoint; save_total_limit=1 kept the newest
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-6"]
    if "--lora" in extra:
        assert (tmp_path / "out" / "final" / "adapter_config.json").exists()
    else:
        assert "reloaded in plain transformers" in out
