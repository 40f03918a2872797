"""The optimizer thread: one background thread per process that runs launched work in FIFO order.

Everything that touches the fp32 master parameters, their gradients, the optimizer state or the
back side of a :class:`roundpipe.GradScaler` runs here, so the main thread can already compute
the next iteration while a step runs. See ``docs/threads-and-staleness.md``.

Public API (``roundpipe.optim_thread``):

* :func:`launch` queues a callable and returns at once.
* :func:`synchronize` waits for everything launched so far and re-raises a captured error.
* :func:`on_optimizer_thread` tells whether the caller is the optimizer thread.
* :func:`set_num_threads` / :func:`get_num_threads`: the intra-op threads its ops use (see
  [Note: the optimizer thread's cores]); :func:`use_default_num_threads` is what a model on an
  accelerator pool calls.

The client API that roundpipe's own modules (the scaler, the runtime, data parallelism, the
optimizers) build on, public so that no module reaches into this one's internals:

* :func:`launch_step` / :func:`launch_item`: launch and get the :class:`WorkItem` to wait on; a
  *step* (what :func:`launch` and ``model.step`` launch) is user work, an *item* is library
  work (a gradient move, a parameter copy, a scaler update), see [Note: steps and items].
* :func:`wait_all` (blocks), :func:`raise_failures` (never blocks): the two halves of
  :func:`synchronize`.
* :func:`has_pending_work`, :func:`caller_must_wait`, :func:`has_pending_launch`,
  :func:`has_unwaited_launch`, :func:`last_launch`, :func:`failure_count`: non-blocking
  questions about what was launched.

Errors never end the process and are never dropped: a launched callable that raises is captured
with its traceback, and the exception object itself is re-raised on the main thread at the next
call that depends on it (see [Note: error reporting]). The thread keeps serving afterwards.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from _thread import get_ident
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.workers import Future, WorkerThread

__all__ = [
    "launch",
    "synchronize",
    "on_optimizer_thread",
    "WorkItem",
    "launch_step",
    "launch_item",
    "wait_all",
    "raise_failures",
    "has_pending_work",
    "caller_must_wait",
    "has_pending_launch",
    "has_unwaited_launch",
    "last_launch",
    "failure_count",
    "register_launch_check",
    "set_num_threads",
    "get_num_threads",
    "default_num_threads",
    "use_default_num_threads",
    "THREADS_ENV_VAR",
]


# [Note: steps and items]
# Everything launched runs on the one thread, in launch order, but the scaler needs to know
# whether *user* work (a step: launch(), launch_step(), model.step) was launched and not waited
# for, which decides its update mode ([Note: the scale double buffer] in grad_scaler.py), and
# whether such work may still be running (then the main thread must not touch a scaler that
# steps use). Library work (launch_item: gradient moves, master->model copies, the scaler's own
# updates) does not count as a step. Four counters describe the queue: ``_seq`` (every launch),
# ``_tracked_seq`` (the newest step), ``_ran_seq`` (the newest item that finished running,
# written by the optimizer thread only) and ``_waited_seq`` (the newest launch that a thread
# other than the optimizer thread waited for, or whose failure it was told).


# [Note: error reporting]
# A work item that raises keeps its exception and joins the list of unreported failures. The
# first call on another thread that depends on the failed work reports it: either a wait on that
# very item (``WorkItem.wait``) or ``synchronize()``, which reports every unreported failure at
# once (the first is raised, the others are attached to it as notes). A failure is reported
# exactly once; afterwards the thread, the scaler and the model are usable again, so the user
# can always save a checkpoint.


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (shown under its traceback); a no-op before Python 3.11."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class WorkItem(Future):
    """One launched callable and its future-like result (a :class:`roundpipe.workers.Future`
    that also reports its failure, see [Note: error reporting]); :func:`launch_step` and
    :func:`launch_item` return it.

    Written by the optimizer thread only (the result or exception) before ``_done`` is set; read
    by other threads only after ``_done`` is set (:meth:`wait`, ``result()``, ``exception()``).
    ``done()`` never blocks; ``result()`` and ``exception()`` block until the item ran.
    Made by :func:`launch_step` and :func:`launch_item`, never by hand.
    """

    __slots__ = ("fn", "args", "kwargs", "seq", "_owner")

    def __init__(self, owner: _OptimizerThread, fn: Callable, args: tuple, kwargs: dict, seq: int):
        super().__init__()
        self.fn: Callable | None = fn
        self.args: tuple | None = args
        self.kwargs: dict | None = kwargs
        self.seq = seq
        self._owner = owner

    def __call__(self) -> None:
        """Run on the optimizer thread (the worker's job)."""
        args, kwargs = self.args, self.kwargs
        self.args = self.kwargs = None  # free tensors held by the closure's arguments
        assert self.fn is not None and args is not None and kwargs is not None  # runs once
        try:
            self.run(functools.partial(self.fn, *args, **kwargs))
        finally:
            self.fn = None  # the newest item stays referenced (wait_all): free its closure
            self._owner.note_ran(self.seq)  # see [Note: steps and items]

    def set_exception(self, exc: BaseException) -> None:
        """Optimizer thread, when the callable raised: note where, record the failure for
        :func:`raise_failures`, then settle the item. Not for callers."""
        add_note(exc, f"[roundpipe optimizer thread] raised while running {_describe(self.fn)}")
        self._exception = exc
        self._owner._record_failure(self)  # before _done: a waiter then finds it to claim
        super().set_exception(exc)

    def failure(self) -> BaseException:
        """The exception of an item known to have failed (the thread's failure reports)."""
        exc = self._exception
        assert exc is not None, "failure() of an item that did not fail"
        return exc

    def wait(self, report: bool = True) -> bool:
        """Block until the item ran. Returns True on success.

        If the item failed and its failure is not reported yet, raises it (see
        [Note: error reporting]); if it was reported already, or ``report`` is False (the caller
        reports failures later, oldest first, with :func:`raise_failures`), returns False. Any
        thread; called on the optimizer thread for an item that has not run yet, raises
        ``RuntimeError`` instead of deadlocking.
        """
        if not self._done.is_set():
            if on_optimizer_thread():
                raise RuntimeError(
                    "a wait for work launched on the optimizer thread was made on the optimizer "
                    "thread itself, which would deadlock; wait from the main thread instead"
                )
            self._done.wait()
        self._owner._note_waited(self.seq)
        if self._exception is None:
            return True
        if report and self._owner._claim_failure(self):
            raise self._exception
        return False


def _describe(fn: Callable | None) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        try:
            name = repr(fn)
        except Exception:  # noqa: BLE001 -- a description must not fail the error it describes
            name = type(fn).__qualname__
    return f"{name}()"


class _OptimizerThread:
    """The process-wide optimizer thread (a :class:`roundpipe.workers.WorkerThread`) and the
    bookkeeping of what was launched on it.

    Shared state, guarded by ``_lock``: ``_seq`` (launch counter), ``_tracked_seq`` (the last
    step launched), ``_waited_seq`` (the newest launch another thread has waited for),
    ``_newest`` (the newest item), ``_failures`` (unreported failed items, oldest first).
    ``_ran_seq`` (the newest item that ran) is written by the optimizer thread only and read
    without the lock (an int, monotonic). See [Note: steps and items]. The thread's lifecycle is
    the worker's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker = WorkerThread(
            name="roundpipe-optimizer",
            closed_message="the roundpipe optimizer thread has shut down (the interpreter is "
            "exiting); no new work can be launched",
            thread_init=self._note_ident,
            after_exit_drain=self._report_unwaited,
        )
        self._seq = 0
        self._tracked_seq = 0
        self._waited_seq = 0
        self._ran_seq = 0
        self._ident: int | None = None  # the thread's ident, once started (never restarts)
        self._newest: WorkItem | None = None
        self._failures: list[WorkItem] = []
        self._failure_total = 0  # failures ever recorded

    @property
    def _thread(self) -> threading.Thread | None:
        return self._worker.thread

    def _note_ident(self) -> None:
        self._ident = threading.get_ident()  # on the thread itself, before its first item

    # -- submission ---------------------------------------------------------------------------
    def note_ran(self, seq: int) -> None:
        """Optimizer thread: item ``seq`` has run (see [Note: steps and items])."""
        self._ran_seq = seq

    def submit(self, fn: Callable, args: tuple, kwargs: dict, track: bool) -> WorkItem:
        with self._lock:
            item = WorkItem(self, fn, args, kwargs, self._seq + 1)
            self._worker.enqueue(item)  # under _lock: FIFO order is launch order
            self._seq += 1
            self._newest = item
            if track:
                self._tracked_seq = self._seq
        return item

    # -- waiting ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.wait_all()
        self.raise_failures()

    def wait_all(self) -> None:
        """Wait until everything launched so far has run; report nothing."""
        if on_optimizer_thread():
            return
        with self._lock:
            newest = self._newest
        if newest is not None:
            # FIFO order: once the newest item ran, everything launched before it has run.
            newest.wait(report=False)

    def has_pending_work(self) -> bool:
        return self._ran_seq < self._seq

    def has_pending_launch(self) -> bool:
        return self._ran_seq < self._tracked_seq

    def _note_waited(self, seq: int) -> None:
        if on_optimizer_thread():
            return
        with self._lock:
            if seq > self._waited_seq:
                self._waited_seq = seq

    def has_unwaited_launch(self) -> bool:
        """Whether work launched through :func:`launch` has not been waited for by any caller."""
        with self._lock:
            return self._tracked_seq > self._waited_seq

    # -- failures -----------------------------------------------------------------------------
    def _record_failure(self, item: WorkItem) -> None:
        with self._lock:
            self._failures.append(item)
            self._failure_total += 1

    def _claim_failure(self, item: WorkItem) -> bool:
        with self._lock:
            try:
                self._failures.remove(item)
            except ValueError:
                return False
            return True

    def raise_failures(self) -> None:
        """Non-blocking: raise the unreported failures, if any (the first, the rest as notes)."""
        if on_optimizer_thread():
            return
        with self._lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        # Told of its failure, the caller has waited for it (and, FIFO, for all before it).
        self._note_waited(failures[-1].seq)
        first = failures[0].failure()
        for later in failures[1:]:
            exc = later.failure()
            add_note(
                first,
                "[roundpipe optimizer thread] a later launched call also failed:\n"
                + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            )
        raise first

    # -- shutdown -----------------------------------------------------------------------------
    def _report_unwaited(self) -> None:
        """At interpreter exit, after the worker drained: print the failures nobody waited for."""
        with self._lock:
            failures, self._failures = self._failures, []
        for item in failures:
            # Nothing on the main thread can depend on this work any more: say so, loudly.
            exc = item.failure()
            print(
                "roundpipe: work launched on the optimizer thread failed and was never waited for:",
                file=sys.stderr,
            )
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


_EXECUTOR = _OptimizerThread()


def launch(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Queue ``fn(*args, **kwargs)`` on the optimizer thread and return at once.

    Any thread. Work runs in launch order. An exception raised by ``fn`` is re-raised on the main
    thread by the next :func:`synchronize` (or the next scaler/model call that depends on it), as
    the original exception. It counts as a step (see :func:`has_unwaited_launch`). Raises
    ``RuntimeError`` at once if ``fn`` uses a ``torch.amp.GradScaler`` (see
    :func:`roundpipe.step_check.check_step_fn`, registered with
    :func:`register_launch_check`).
    """
    for check in _LAUNCH_CHECKS:
        check(fn)
    _EXECUTOR.submit(fn, args, kwargs, track=True)


# Checks a launched function must pass (roundpipe.step_check registers its own); any thread.
_LAUNCH_CHECKS: list[Callable[[Callable], None]] = []


def register_launch_check(check: Callable[[Callable], None]) -> None:
    """Run ``check(fn)`` on every function :func:`launch` is given, before it is queued; it
    raises to refuse ``fn``. For roundpipe's own modules (:mod:`roundpipe.step_check`), which
    sit above this one. Any thread; call it at import."""
    _LAUNCH_CHECKS.append(check)


def launch_step(fn: Callable, *args: Any, **kwargs: Any) -> WorkItem:
    """Like :func:`launch` (it counts as a step, so a ``scaler.update()`` that follows without
    waiting is asynchronous), but returns the :class:`WorkItem` to wait on. Any thread; never
    blocks."""
    return _EXECUTOR.submit(fn, args, kwargs, track=True)


def launch_item(fn: Callable, *args: Any, **kwargs: Any) -> WorkItem:
    """Queue library work (a gradient move, a parameter copy, a scaler update) and return its
    :class:`WorkItem`. Unlike :func:`launch` it is not a step: it does not make
    :func:`has_unwaited_launch` true. Any thread; never blocks."""
    return _EXECUTOR.submit(fn, args, kwargs, track=False)


def synchronize() -> None:
    """Block until everything launched so far has run, then re-raise any captured error.

    Call it from any thread but the optimizer thread; there it returns at once (waiting for
    itself would deadlock). Ctrl-C while waiting raises KeyboardInterrupt.
    """
    _EXECUTOR.synchronize()


def on_optimizer_thread() -> bool:
    """Whether the calling thread is the optimizer thread. Any thread; never blocks."""
    return get_ident() == _EXECUTOR._ident


def wait_all() -> None:
    """Block until everything launched so far has run, like :func:`synchronize`, but raise no
    failure: failures stay for the next :func:`raise_failures` (or a wait on their item). Any
    thread; on the optimizer thread it returns at once."""
    _EXECUTOR.wait_all()


def raise_failures() -> None:
    """Raise the failures of launched work that no call has reported yet (the oldest, with the
    others attached as notes); nothing if there are none. Never blocks: work still queued is
    not waited for. Any thread; a no-op on the optimizer thread."""
    _EXECUTOR.raise_failures()


def has_pending_work() -> bool:
    """Whether some launched work (a step or an item) has not finished running yet. Any thread;
    never blocks, takes no lock (cheap enough for every ``.grad`` access)."""
    return _EXECUTOR.has_pending_work()


def caller_must_wait() -> bool:
    """Whether launched work is pending and the caller is not the optimizer thread: then
    whatever that work uses must not be touched before :func:`wait_all`. Any thread; never
    blocks, takes no lock (about 100 ns: cheap enough for every ``.grad`` access)."""
    ex = _EXECUTOR
    return ex._ran_seq < ex._seq and get_ident() != ex._ident


def has_pending_launch() -> bool:
    """Whether a step (:func:`launch`, :func:`launch_step`, ``model.step``) has not finished
    running yet: then it may be touching whatever it shares with the caller. Any thread;
    never blocks."""
    return _EXECUTOR.has_pending_launch()


def has_unwaited_launch() -> bool:
    """Whether a step was launched that no thread but the optimizer thread has waited for since
    (a wait on it or on later work, or the report of its failure). ``scaler.update()`` is
    asynchronous then. Any thread; never blocks."""
    return _EXECUTOR.has_unwaited_launch()


def last_launch() -> int:
    """A number that changes whenever a step is launched: compare two readings to tell whether
    one was launched in between. Any thread; never blocks."""
    with _EXECUTOR._lock:
        return _EXECUTOR._tracked_seq


def failure_count() -> int:
    """How many launched calls have failed so far, reported or not. Any thread; never blocks."""
    with _EXECUTOR._lock:
        return _EXECUTOR._failure_total


# [Note: the optimizer thread's cores]
# On an accelerator the step (unscale, Adam, the master->model copy) is host work over every
# parameter, and it runs while the next iteration computes. That iteration needs host threads
# too: each device's worker enqueues its stages' kernels and autograd's thread for the device
# enqueues the backward's. If the step's ops spread over every core (torch's default intra-op
# count), those threads are descheduled, the device starves, and every parallel region of the
# step waits for its slowest, descheduled thread as well. So a model on an accelerator pool
# leaves 2 cores per device to them: the optimizer thread's ops use ``torch.get_num_threads() -
# 2 * devices`` threads (at least 1), ``$ROUNDPIPE_OPTIMIZER_THREADS`` if set, or what
# :func:`set_num_threads` was given (which wins over both). The count is per thread in torch
# (OpenMP's is a per-thread setting): no other thread's count changes, and the process default
# that new threads start with is put back.

THREADS_ENV_VAR = "ROUNDPIPE_OPTIMIZER_THREADS"

_threads_lock = threading.Lock()
_threads: dict[str, int | bool | None] = {"count": None, "explicit": False}


def _set_own_num_threads(n: int) -> None:
    """Optimizer thread: its own count. torch initialises a thread's count from the process
    default at the thread's first parallel op or count query; done first here, so that it
    cannot overwrite this setting later."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def _apply_num_threads(n: int) -> None:
    """On a thread other than the optimizer thread: set that thread's count, then put the
    process default back as the caller's own count (unchanged by that)."""
    default = torch.get_num_threads()
    launch_item(_set_own_num_threads, n).wait(report=False)
    torch.set_num_threads(default)
    _threads["count"] = n


def set_num_threads(n: int | None) -> None:
    """How many intra-op threads the optimizer thread's ops use (``torch.set_num_threads`` on
    that thread only; see [Note: the optimizer thread's cores]). ``None``: back to roundpipe's
    default (the next model on an accelerator pool sets it). Any thread but the optimizer
    thread; waits for the work launched before."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"the optimizer thread's thread count must be an int >= 1, got {n!r}")
    if on_optimizer_thread():
        raise RuntimeError("set_num_threads is called from the main thread, not from a step")
    with _threads_lock:
        _threads["explicit"] = n is not None
        _apply_num_threads(torch.get_num_threads() if n is None else n)


def get_num_threads() -> int:
    """The intra-op threads of the optimizer thread's ops: what was set, else the process's
    count (the thread has not been given its own). Any thread; never blocks."""
    count = _threads["count"]
    return int(count) if count is not None else torch.get_num_threads()


def default_num_threads(num_devices: int) -> int:
    """The optimizer thread's count beside ``num_devices`` accelerators: ``$ROUNDPIPE_OPTIMIZER_
    THREADS`` if set, else the caller's ``torch.get_num_threads()`` less 2 per device, at least
    1 (see [Note: the optimizer thread's cores]). Raises ``ValueError`` on a bad variable."""
    raw = os.environ.get(THREADS_ENV_VAR, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(
                f"${THREADS_ENV_VAR}={raw!r}: expected a whole number of threads >= 1 (unset it "
                f"for the default, the process's threads less 2 per accelerator)"
            )
        return n
    return max(1, torch.get_num_threads() - 2 * num_devices)


def use_default_num_threads(num_devices: int) -> None:
    """Main thread, when a model on ``num_devices`` accelerators is made: give the optimizer
    thread its default count, unless :func:`set_num_threads` chose one. Waits for the work
    launched before only when the count changes."""
    with _threads_lock:
        if _threads["explicit"]:
            return
        n = default_num_threads(num_devices)
        if _threads["count"] != n:
            _apply_num_threads(n)
