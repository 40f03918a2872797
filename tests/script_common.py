"""A Python snippet run in its own process, as a user's script runs."""

import os
import signal
import subprocess
import sys
import textwrap


def _interruptible() -> None:
    # A shell's background job (a test run under nohup or with &) inherits SIGINT ignored, and a
    # Python started with it ignored leaves it so: Ctrl-C would never raise KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_script(code: str, **kwargs) -> subprocess.Popen:
    """Start ``code`` (dedented) in a fresh interpreter that imports this tree, with its output
    unbuffered and piped; Ctrl-C (SIGINT) raises KeyboardInterrupt in it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
        **kwargs,
    )
