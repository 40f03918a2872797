"""Futures and worker threads: the one machine behind the device workers and the optimizer thread.

* :class:`Future`: the future-like result of one piece of work. The thread that runs the work
  catches ``BaseException`` and stores it (:meth:`Future.run`); the waiting thread re-raises it
  (:meth:`Future.result`). Errors are never printed-and-dropped and never end the process.
* :class:`WorkerThread`: one daemon thread, started on first use, that runs submitted jobs in
  submission order (FIFO, through a ``queue.SimpleQueue``). Its lifecycle is an explicit state;
  a submission after shutdown raises ``RuntimeError``; :meth:`WorkerThread.shutdown` drains the
  queue, is idempotent, and runs at interpreter exit for every started worker. In a child of
  ``os.fork()``, where the thread does not exist, it is "not started" again (see [Note: fork] in
  :mod:`roundpipe.threads.optimizer_thread`).

:mod:`roundpipe.devices` builds one worker per device on it (``get_worker``), and
:mod:`roundpipe.optim_thread` the optimizer thread, whose work items are futures that also
report failures (see [Note: error reporting]).
"""

from __future__ import annotations

import atexit
import enum
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Future", "WorkerThread", "add_note", "in_fork_child"]


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (shown under its traceback); a no-op before Python 3.11."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class Future:
    """Future-like result of one work item.

    Written once by the thread that runs the work (``set_result``/``set_exception``) before
    ``_done`` is set; read by other threads only after waiting on ``_done``.
    """

    __slots__ = ("_done", "_result", "_exception")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._exception: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._result = value
        self._done.set()

    def set_exception(self, exc: BaseException) -> None:
        self._exception = exc
        self._done.set()

    def done(self) -> bool:
        """Non-blocking: whether the work has run (successfully or not)."""
        return self._done.is_set()

    def run(self, fn: Callable, *args: Any, reraise: tuple[type[BaseException], ...] = ()) -> None:
        """Call ``fn(*args)`` on this thread and settle the future with its result or exception;
        an exception of a ``reraise`` type propagates instead and leaves the future unsettled."""
        try:
            result = fn(*args)
        except reraise:
            raise
        except BaseException as exc:  # noqa: B036 -- stored and re-raised by the waiter
            try:
                self.set_exception(exc)  # a subclass may do more (report it)
            finally:
                if not self._done.is_set():  # that failed too: settle anyway, never hang
                    Future.set_exception(self, exc)
        else:
            self.set_result(result)

    def exception(self) -> BaseException | None:
        """Block until done; return the stored exception (None on success)."""
        self._done.wait()
        return self._exception

    def result(self) -> Any:
        """Block until done; return the result or re-raise the stored exception."""
        self._done.wait()
        if self._exception is not None:
            raise self._exception
        return self._result


# Every WorkerThread, for the fork handler below.
_ALL_WORKERS: weakref.WeakSet[WorkerThread] = weakref.WeakSet()


_FORK = {"child": False}  # whether this process is a fork child of one that imported roundpipe


def _after_fork_in_child() -> None:
    _FORK["child"] = True
    for worker in list(_ALL_WORKERS):
        worker.after_fork_in_child()


def in_fork_child() -> bool:
    """Whether this process was made by ``os.fork()`` from one that had imported roundpipe.
    Any thread; never blocks."""
    return _FORK["child"]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _State(enum.Enum):
    NOT_STARTED = "not started"
    RUNNING = "running"
    SHUT_DOWN = "shut down"


_STOP = object()


class WorkerThread:
    """One daemon thread that runs jobs (zero-argument callables that settle their own future and
    never raise, e.g. a bound :meth:`Future.run`) in submission order.

    Daemon, so a stuck job cannot keep the process alive; :meth:`shutdown` is registered with
    ``atexit`` when the thread starts, so queued work drains before the interpreter tears down;
    ``after_exit_drain`` (if given) runs right after that drain.
    ``_state`` and ``_thread`` are guarded by ``_lock``; jobs only travel through ``_queue``.
    """

    def __init__(
        self,
        name: str,
        closed_message: str,
        thread_init: Callable[[], None] | None = None,
        after_exit_drain: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._closed_message = closed_message
        self._thread_init = thread_init
        self._after_exit_drain = after_exit_drain
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._state = _State.NOT_STARTED
        self._thread: threading.Thread | None = None
        _ALL_WORKERS.add(self)

    def after_fork_in_child(self) -> None:
        """In a fork child, where this thread does not exist: a fresh lock and queue (the
        parent's may have been held by a thread that is gone), and "not started" unless it was
        shut down, so the next job starts a thread here. Jobs queued in the parent are dropped
        with the old queue (their futures are the optimizer thread's concern, see
        [Note: fork] in :mod:`roundpipe.threads.optimizer_thread`)."""
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        if self._state is _State.RUNNING:
            self._state = _State.NOT_STARTED
        self._thread = None

    @property
    def thread(self) -> threading.Thread | None:
        """The thread, once started. Any thread; never blocks."""
        return self._thread

    def running(self) -> bool:
        """Whether the thread has started and not shut down. Any thread; never blocks."""
        with self._lock:
            return self._state is _State.RUNNING

    def enqueue(self, job: Callable[[], None]) -> None:
        """Queue ``job``, starting the thread on first use; raises ``RuntimeError`` (the
        worker's ``closed_message``) after shutdown. Any thread; never blocks on the job."""
        with self._lock:
            if self._state is _State.SHUT_DOWN:
                raise RuntimeError(self._closed_message)
            if self._state is _State.NOT_STARTED:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                self._state = _State.RUNNING
                atexit.register(self._exit_drain)
            self._queue.put(job)

    def _run(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            job()
            del job  # drop references to tensors before blocking again

    def _exit_drain(self) -> None:
        self.shutdown()
        if self._after_exit_drain is not None:
            self._after_exit_drain()

    def shutdown(self) -> bool:
        """Let queued work finish, then stop the thread; later submissions raise. Idempotent.
        Returns whether this call stopped a running thread. Any thread but the worker's own,
        which only marks it shut down."""
        with self._lock:
            was_running = self._state is _State.RUNNING
            self._state = _State.SHUT_DOWN
            thread = self._thread
        if not was_running or thread is None:
            return False
        self._queue.put(_STOP)
        if thread is not threading.current_thread():
            thread.join()
        return True
