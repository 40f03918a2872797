"""Rank processes the test session starts once and runs many data-parallel runs in (conftest's
``rank_pool`` fixture), instead of a fresh interpreter per rank and run.

    python tests/rank_pool_worker.py      # one rank process; the pool starts it

A run is a worker script's ``main()`` (tests/dp_worker.py, tests/ckpt_worker.py,
tests/trainer_dp_worker.py) with its arguments and torchrun's variables for this rank
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so each run makes and destroys its own process group, as under torchrun. A
rank process imports torch, roundpipe and the emulated device once (transformers, at the first
Trainer run); each run costs its training only.

Fresh processes stay where a process's end is the point: a rank that crashes, is killed or
hangs, what happens at exit. A run that raises here ends its rank process (its state is
unknown), which the pool replaces for the next run.

Protocol: the pool writes one JSON line per run to the process's stdin (``script``, ``args``,
``env``, ``log``: where the run's stdout and stderr go) and reads one JSON line back from its
stdout (``ok``, ``error``: the traceback); the process says ``ready`` once after its imports.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

# What every rank process has from its start, as the tests' torchrun ranks have.
BASE_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(ROOT),
}


# -- fresh rank processes, started together ------------------------------------------------------

GO_ENV = "ROUNDPIPE_TEST_RANKS_GO"


def wait_for_go():
    """In a rank process that :func:`start_together` started: say ready once imported, then wait
    for every rank to be, so that no rank's rendezvous timeout (a test's small process-group
    timeout) runs while another rank is still importing torch. Elsewhere: nothing."""
    if os.environ.get(GO_ENV):
        print("ready", flush=True)
        sys.stdin.readline()


def start_together(argv, envs):
    """One new process per environment in ``envs`` running ``argv`` (from the repository root,
    text output piped), released once each has imported (see :func:`wait_for_go`)."""
    procs = []
    for env in envs:
        procs.append(
            subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**env, GO_ENV: "1"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        p.stdout.readline()  # "ready", or nothing from a process that ended before
    for p in procs:
        with contextlib.suppress(OSError):
            p.stdin.write("go\n")
            p.stdin.flush()
    return procs


# -- the rank process --------------------------------------------------------------------------


@contextlib.contextmanager
def _output_to(path):
    """fd 1 and 2 (print, tracebacks, C++ warnings) into ``path`` for one run."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _run(job):
    """One run: the script's ``main()`` with its argv and environment; the traceback if it
    raised."""
    module = importlib.import_module(job["script"])
    argv, env = sys.argv, dict(os.environ)
    sys.argv = [module.__file__, *job["args"]]
    os.environ.update(job["env"])
    try:
        with _output_to(job["log"]):
            try:
                module.main()
            except BaseException:
                traceback.print_exc()
                return traceback.format_exc()
            return None
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(env)
        gc.collect()


def serve():
    # Replies go to the stdout the pool reads; everything else printed goes to stderr's file.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path.insert(0, str(HERE))
    import torch  # noqa: F401

    import roundpipe  # noqa: F401
    from roundpipe.testing import emu

    emu.install()  # before this process's first backward: a run may use emu devices
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.flush()
    for line in sys.stdin:
        error = _run(json.loads(line))
        replies.write(json.dumps({"ok": error is None, "error": error}) + "\n")
        replies.flush()
        if error is not None:
            return 1  # the failed run's threads and group may be left: this process ends
    return 0


# -- the pool ----------------------------------------------------------------------------------


class _Rank:
    """One rank process and the thread that reads its replies into a queue."""

    def __init__(self, log_dir):
        self.log = log_dir / f"rank-process-{time.monotonic_ns()}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                cwd=ROOT,
                env={**os.environ, **BASE_ENV},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = False

    def _read(self):
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)  # the process ended

    def reply(self, until):
        try:
            return self.replies.get(timeout=max(until - time.monotonic(), 0.1))
        except queue.Empty:
            raise TimeoutError from None

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self):
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


class RankPool:
    """Rank processes 0..N-1 kept for the session (N grows to the largest world asked for).
    ``run`` runs one data-parallel run over the first ``world`` of them."""

    def __init__(self, log_dir):
        self.log_dir = Path(log_dir)
        self.ranks: list[_Rank] = []

    def _ranks(self, world, until):
        for r in range(world):
            if r < len(self.ranks) and not self.ranks[r].alive():
                self.ranks[r].kill()
                self.ranks[r] = _Rank(self.log_dir)
            elif r >= len(self.ranks):
                self.ranks.append(_Rank(self.log_dir))
        for r, rank in enumerate(self.ranks[:world]):
            if not rank.ready:
                try:
                    ready = rank.reply(until)
                except TimeoutError:
                    ready = None
                if ready is None:
                    rank.kill()
                    raise RuntimeError(
                        f"rank process {r} did not start:\n{rank.log.read_text()[-4000:]}"
                    )
                rank.ready = True
        return self.ranks[:world]

    def run(self, script, args, world, log_dir, deadline, port=None):
        """Run ``script``'s ``main()`` with ``args`` on ranks 0..world-1, with torchrun's
        variables for a group at 127.0.0.1:``port`` (None: one process, without them); returns
        ``{rank: (code, output)}``: code 0, or 1 and the output ending in the traceback. A rank
        not done within ``deadline`` seconds raises TimeoutError (the processes are killed)."""
        assert port is not None or world == 1
        ranks = self._ranks(world, time.monotonic() + 120)
        logs = [Path(log_dir) / f"rank{r}.log" for r in range(world)]
        for r, rank in enumerate(ranks):
            env = {}
            if port is not None:
                env = {
                    "RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            job = {"script": script, "args": list(args), "env": env, "log": str(logs[r])}
            rank.proc.stdin.write(json.dumps(job) + "\n")
            rank.proc.stdin.flush()
        until = time.monotonic() + deadline
        outcome, late = {}, []
        for r, rank in enumerate(ranks):
            try:
                reply = rank.reply(until)
            except TimeoutError:
                late.append(r)
                continue
            output = logs[r].read_text() if logs[r].exists() else ""
            if reply is None:  # the process died mid-run
                outcome[r] = (rank.proc.wait(timeout=30), output)
            else:
                outcome[r] = (0 if reply["ok"] else 1, output)
        if late:
            for rank in ranks:
                rank.kill()
            raise TimeoutError(f"ranks {late} did not finish within {deadline} s (a hang)")
        for r, (code, _) in outcome.items():
            if code != 0:
                ranks[r].close()  # it ends itself after a failed run
        return outcome

    def close(self):
        for rank in self.ranks:
            rank.close()
        self.ranks = []


if __name__ == "__main__":
    sys.exit(serve())
