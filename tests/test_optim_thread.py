"""The optimizer thread: FIFO, non-blocking launch, synchronize, error reporting, shutdown."""

import signal
import sys
import threading
import traceback

import pytest
import torch
from script_common import run_script

from roundpipe import optim_thread


def test_launch_returns_while_work_is_blocked_and_synchronize_waits():
    release = threading.Event()
    ran = []
    optim_thread.launch(release.wait)
    optim_thread.launch(ran.append, "after")
    # launch returned although the first item cannot finish yet.
    assert ran == []
    release.set()
    optim_thread.synchronize()
    assert ran == ["after"]


def test_work_runs_in_launch_order_on_one_thread():
    seen = []
    for i in range(200):
        optim_thread.launch(lambda i=i: seen.append((i, threading.get_ident())))
    optim_thread.synchronize()
    assert [i for i, _ in seen] == list(range(200))
    assert len({ident for _, ident in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_on_optimizer_thread():
    result = []
    optim_thread.launch(lambda: result.append(optim_thread.on_optimizer_thread()))
    optim_thread.synchronize()
    assert result == [True]
    assert optim_thread.on_optimizer_thread() is False


class _StepFailed(Exception):
    pass


def _failing_step():
    raise _StepFailed("boom in step")


def test_error_is_reraised_as_its_own_type_with_traceback_and_thread_keeps_serving():
    optim_thread.launch(_failing_step)
    with pytest.raises(_StepFailed, match="boom in step") as info:
        optim_thread.synchronize()
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_step" in frames
    # Reported once: the next synchronize is clean, and the thread still runs work.
    optim_thread.synchronize()
    out = []
    optim_thread.launch(out.append, 1)
    optim_thread.synchronize()
    assert out == [1]


def test_several_failures_are_all_reported():
    optim_thread.launch(_failing_step)
    optim_thread.launch(lambda: 1 / 0)
    with pytest.raises(_StepFailed) as info:
        optim_thread.synchronize()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ZeroDivisionError" in notes
    optim_thread.synchronize()


def test_base_exceptions_are_captured_not_fatal():
    optim_thread.launch(sys.exit, 3)
    with pytest.raises(SystemExit):
        optim_thread.synchronize()
    out = []
    optim_thread.launch(out.append, "alive")
    optim_thread.synchronize()
    assert out == ["alive"]


class _Unprintable:
    """A callable whose call and whose repr both raise."""

    def __call__(self):
        raise _StepFailed("boom in call")

    def __repr__(self):
        raise RuntimeError("no repr")


def test_a_callable_that_cannot_be_described_still_fails_loudly():
    # Describing the failure must not kill the thread (later waits would hang).
    optim_thread.launch(_Unprintable())
    with pytest.raises(_StepFailed, match="boom in call") as info:
        optim_thread.synchronize()
    assert any("_Unprintable()" in note for note in info.value.__notes__)
    out = []
    optim_thread.launch(out.append, "alive")
    optim_thread.synchronize()
    assert out == ["alive"]


def test_synchronize_on_the_optimizer_thread_returns_at_once():
    outcome = []

    def nested():
        optim_thread.launch(outcome.append, "queued behind me")
        optim_thread.synchronize()  # would deadlock if it waited for itself
        outcome.append("returned")

    optim_thread.launch(nested)
    optim_thread.synchronize()
    assert outcome == ["returned", "queued behind me"]


def test_internal_wait_on_the_optimizer_thread_raises_instead_of_deadlocking():
    errors = []

    def waits_for_later_work():
        item = optim_thread.launch_item(lambda: None)
        try:
            item.wait()
        except RuntimeError as exc:
            errors.append(str(exc))

    optim_thread.launch(waits_for_later_work)
    optim_thread.synchronize()
    assert errors and "deadlock" in errors[0]


@pytest.mark.slow
def test_pending_work_drains_at_interpreter_exit(tmp_path):
    target = tmp_path / "written.txt"
    proc = run_script(f"""
        import threading
        from roundpipe import optim_thread
        gate = threading.Event()
        optim_thread.launch(gate.wait, 0.5)   # keeps the queue busy while the main thread exits
        optim_thread.launch(open({str(target)!r}, "w").write, "drained")
        """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert target.read_text() == "drained"


@pytest.mark.slow
def test_ctrl_c_while_waiting_raises_keyboard_interrupt():
    proc = run_script("""
        import threading, sys
        from roundpipe import optim_thread
        release = threading.Event()
        optim_thread.launch(release.wait)
        try:  # the print inside: a SIGINT right after it must not escape the try
            print("waiting", flush=True)
            optim_thread.synchronize()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        release.set()
        """)
    assert proc.stdout.readline().strip() == "waiting"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "interrupted" in out, err
    assert proc.returncode == 0


@pytest.mark.slow
def test_unreported_failure_at_exit_is_printed_not_dropped():
    proc = run_script("""
        from roundpipe import optim_thread
        def lost_step():
            raise ValueError("nobody waited for me")
        optim_thread.launch(lost_step)
        """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "nobody waited for me" in err and "ValueError" in err


@pytest.mark.slow
def test_import_starts_no_thread():
    proc = run_script("""
        import threading
        import roundpipe
        print(sorted(t.name for t in threading.enumerate()))
        """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "roundpipe" not in out


def test_client_api_tells_steps_from_items_pending_from_unwaited():
    optim_thread.synchronize()
    assert not optim_thread.has_pending_work() and not optim_thread.has_unwaited_launch()
    release = threading.Event()
    mark = optim_thread.last_launch()
    item = optim_thread.launch_item(release.wait)  # library work: not a step
    assert optim_thread.last_launch() == mark and not optim_thread.has_unwaited_launch()
    assert optim_thread.has_pending_work() and not optim_thread.has_pending_launch()
    step = optim_thread.launch_step(lambda: "stepped")
    assert optim_thread.last_launch() != mark
    assert optim_thread.has_pending_launch() and optim_thread.has_unwaited_launch()
    assert not item.done() and not step.done()
    release.set()
    assert step.wait() and step.result() == "stepped" and item.done()
    assert not optim_thread.has_pending_work() and not optim_thread.has_pending_launch()
    assert not optim_thread.has_unwaited_launch()  # the main thread waited for the step


class _Broke(Exception):
    pass


def test_wait_all_leaves_failures_to_raise_failures_which_counts_as_a_wait():
    def broke():
        raise _Broke("in step")

    before = optim_thread.failure_count()
    optim_thread.launch(broke)
    optim_thread.wait_all()  # reports nothing
    assert optim_thread.failure_count() == before + 1
    optim_thread.launch(broke)
    ran = threading.Event()
    optim_thread.launch_item(ran.set)
    assert ran.wait(timeout=30)  # the step ran, and no call waited for it
    assert optim_thread.has_unwaited_launch()
    with pytest.raises(_Broke):
        optim_thread.raise_failures()
    optim_thread.raise_failures()  # reported once
    # Told of the failure, the main thread has seen that step end: it is not "unwaited" any more.
    assert not optim_thread.has_unwaited_launch()


def test_no_module_outside_the_runtime_uses_a_private_name_of_optim_thread():
    from pathlib import Path

    root = Path(optim_thread.__file__).resolve().parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "runtime" or path.name in ("optim_thread.py", "optimizer_thread.py"):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if "optim_thread._" in line or "optimizer_thread._" in line:
                offenders.append(f"{path.relative_to(root)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_a_model_on_an_accelerator_leaves_two_cores_per_device_to_the_device_threads(
    monkeypatch,
):
    from torch import nn

    from roundpipe import RoundPipe

    monkeypatch.delenv(optim_thread.THREADS_ENV_VAR, raising=False)
    on_thread = lambda: optim_thread.launch_item(torch.get_num_threads).result()  # noqa: E731
    own = torch.get_num_threads()
    torch.set_num_threads(6)
    try:
        optim_thread.set_num_threads(None)
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="emu:2")
        assert on_thread() == optim_thread.get_num_threads() == 6 - 2 * 2
        # Only that thread's count changed: this one's, and a new thread's, are the default.
        assert torch.get_num_threads() == 6
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [6]
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="emu")
        assert on_thread() == 4
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="cpu")  # a CPU pool leaves it be
        assert on_thread() == 4
        optim_thread.set_num_threads(3)  # the user's choice wins over a model's default
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="emu:2")
        assert on_thread() == 3
        optim_thread.set_num_threads(None)
        monkeypatch.setenv(optim_thread.THREADS_ENV_VAR, "5")
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="emu")
        assert on_thread() == 5
        monkeypatch.setenv(optim_thread.THREADS_ENV_VAR, "all")
        with pytest.raises(ValueError, match="ROUNDPIPE_OPTIMIZER_THREADS='all'"):
            RoundPipe(nn.Sequential(nn.Linear(4, 4)), devices="emu")
        with pytest.raises(ValueError, match=">= 1"):
            optim_thread.set_num_threads(0)
    finally:
        monkeypatch.delenv(optim_thread.THREADS_ENV_VAR, raising=False)
        torch.set_num_threads(own)
        optim_thread.set_num_threads(None)
