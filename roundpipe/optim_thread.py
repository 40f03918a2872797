"""The optimizer thread: one background thread per process that runs launched work in FIFO order.

Everything that touches the fp32 master parameters, their gradients, the optimizer state or the
back side of a :class:`roundpipe.GradScaler` runs here, so the main thread can already compute
the next iteration while a step runs. See ``docs/threads-and-staleness.md``.

Public API (``roundpipe.optim_thread``):

* :func:`launch` queues a callable and returns at once.
* :func:`synchronize` waits for everything launched so far and re-raises a captured error.
* :func:`on_optimizer_thread` tells whether the caller is the optimizer thread.

Errors never end the process and are never dropped: a launched callable that raises is captured
with its traceback, and the exception object itself is re-raised on the main thread at the next
call that depends on it (see [Note: error reporting]). The thread keeps serving afterwards.
"""

from __future__ import annotations

import functools
import sys
import threading
import traceback
from typing import Any, Callable, Optional

from roundpipe.workers import Future, WorkerThread

__all__ = ["launch", "synchronize", "on_optimizer_thread"]


# [Note: error reporting]
# A work item that raises keeps its exception and joins the list of unreported failures. The
# first call on another thread that depends on the failed work reports it: either a wait on that
# very item (``_WorkItem.wait``) or ``synchronize()``, which reports every unreported failure at
# once (the first is raised, the others are attached to it as notes). A failure is reported
# exactly once; afterwards the thread, the scaler and the model are usable again, so the user
# can always save a checkpoint.


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (shown under its traceback); a no-op before Python 3.11."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class _WorkItem(Future):
    """One launched callable and its future-like result (a :class:`roundpipe.workers.Future`
    that also reports its failure, see [Note: error reporting]).

    Written by the optimizer thread only (the result or exception) before ``_done`` is set; read
    by other threads only after ``_done`` is set.
    """

    __slots__ = ("fn", "args", "kwargs", "seq", "_owner")

    def __init__(self, owner: "_OptimizerThread", fn: Callable, args: tuple, kwargs: dict, seq: int):
        super().__init__()
        self.fn, self.args, self.kwargs, self.seq = fn, args, kwargs, seq
        self._owner = owner

    def __call__(self) -> None:
        """Run on the optimizer thread (the worker's job)."""
        args, kwargs = self.args, self.kwargs
        self.args = self.kwargs = None  # free tensors held by the closure's arguments
        self.run(functools.partial(self.fn, *args, **kwargs))

    def set_exception(self, exc: BaseException) -> None:
        add_note(exc, f"[roundpipe optimizer thread] raised while running {_describe(self.fn)}")
        self._exception = exc
        self._owner._record_failure(self)  # before _done: a waiter then finds it to claim
        super().set_exception(exc)

    def wait(self, report: bool = True) -> bool:
        """Block until the item ran. Returns True on success.

        If the item failed and its failure is not reported yet, raises it (see
        [Note: error reporting]); if it was reported already, or ``report`` is False (the caller
        reports failures later, oldest first, with ``_raise_failures``), returns False. Called on
        the optimizer thread for an item that has not run yet, raises instead of deadlocking.
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


def _describe(fn: Callable) -> str:
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
    launch made through :func:`launch`), ``_waited_seq`` (the newest launch another thread has
    waited for), ``_failures`` (unreported failed items, oldest first). The thread's lifecycle
    is the worker's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker = WorkerThread(
            name="roundpipe-optimizer",
            closed_message="the roundpipe optimizer thread has shut down (the interpreter is "
                           "exiting); no new work can be launched",
            after_exit_drain=self._report_unwaited)
        self._seq = 0
        self._tracked_seq = 0
        self._waited_seq = 0
        self._failures: list[_WorkItem] = []
        self._failure_total = 0  # failures ever recorded

    @property
    def _thread(self) -> Optional[threading.Thread]:
        return self._worker.thread

    # -- submission ---------------------------------------------------------------------------
    def submit(self, fn: Callable, args: tuple, kwargs: dict, track: bool) -> _WorkItem:
        with self._lock:
            item = _WorkItem(self, fn, args, kwargs, self._seq + 1)
            self._worker.enqueue(item)  # under _lock: FIFO order is launch order
            self._seq += 1
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
        if self._worker.running():
            # A barrier item: FIFO order means everything launched before it has run.
            self.submit(_noop, (), {}, track=False).wait()

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
    def _record_failure(self, item: _WorkItem) -> None:
        with self._lock:
            self._failures.append(item)
            self._failure_total += 1

    def _claim_failure(self, item: _WorkItem) -> bool:
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
        first = failures[0]._exception
        for later in failures[1:]:
            exc = later._exception
            add_note(first, "[roundpipe optimizer thread] a later launched call also failed:\n"
                     + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        raise first

    # -- shutdown -----------------------------------------------------------------------------
    def _report_unwaited(self) -> None:
        """At interpreter exit, after the worker drained: print the failures nobody waited for."""
        with self._lock:
            failures, self._failures = self._failures, []
        for item in failures:
            # Nothing on the main thread can depend on this work any more: say so, loudly.
            exc = item._exception
            print("roundpipe: work launched on the optimizer thread failed and was never waited for:",
                  file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def _noop() -> None:
    return None


_EXECUTOR = _OptimizerThread()


def launch(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Queue ``fn(*args, **kwargs)`` on the optimizer thread and return at once.

    Any thread may call it. Work runs in launch order. An exception raised by ``fn`` is re-raised
    on the main thread by the next :func:`synchronize` (or the next scaler/model call that depends
    on it), as the original exception.
    """
    _EXECUTOR.submit(fn, args, kwargs, track=True)


def _launch(fn: Callable, *args: Any, **kwargs: Any) -> _WorkItem:
    """Library-internal launch that returns the work item to wait on.

    Unlike :func:`launch`, it does not count as user work "launched without waiting", which is
    what makes :meth:`GradScaler.update` choose its asynchronous mode.
    """
    return _EXECUTOR.submit(fn, args, kwargs, track=False)


def _launch_step(fn: Callable, *args: Any, **kwargs: Any) -> _WorkItem:
    """Library-internal launch of a user's step: like :func:`launch` (it counts as user work, so
    an ``update()`` that follows without waiting is asynchronous) but returns the work item."""
    return _EXECUTOR.submit(fn, args, kwargs, track=True)


def synchronize() -> None:
    """Block until everything launched so far has run, then re-raise any captured error.

    Call it from any thread but the optimizer thread; there it returns at once (waiting for
    itself would deadlock). Ctrl-C while waiting raises KeyboardInterrupt.
    """
    _EXECUTOR.synchronize()


def on_optimizer_thread() -> bool:
    """Whether the calling thread is the optimizer thread. Never blocks."""
    thread = _EXECUTOR._thread
    return thread is not None and threading.current_thread() is thread


def _raise_failures() -> None:
    """Non-blocking check used by calls that depend on earlier launched work."""
    _EXECUTOR.raise_failures()


def _wait_all() -> None:
    """Like :func:`synchronize`, but leaves failures for a later ``_raise_failures``."""
    _EXECUTOR.wait_all()


def _failure_total() -> int:
    """How many launched calls have failed so far (reported or not)."""
    return _EXECUTOR._failure_total


def _has_unwaited_launch() -> bool:
    return _EXECUTOR.has_unwaited_launch()


def _last_launch() -> int:
    """A number that changes whenever work is launched through :func:`launch` (a user's step)."""
    with _EXECUTOR._lock:
        return _EXECUTOR._tracked_seq
