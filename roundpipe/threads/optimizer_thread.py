"""The optimizer thread's queue: one background thread per process that runs launched work in
FIFO order. The user's face of it is :mod:`roundpipe.optim_thread` (``launch``, which checks a
step function first, ``synchronize``, ``on_optimizer_thread``, the thread-count calls), which
re-exports this module's public names; roundpipe's own modules import this one.

Everything that touches the fp32 master parameters, their gradients, the optimizer state or the
back side of a :class:`roundpipe.GradScaler` runs here, so the main thread can already compute
the next iteration while a step runs. See ``docs/threads-and-staleness.md``.

The client API that roundpipe's own modules (the scaler, the runtime, data parallelism, the
optimizers) build on, public so that no module reaches into this one's internals:

* :func:`launch_step` / :func:`launch_item`: launch and get the :class:`WorkItem` to wait on; a
  *step* (what ``optim_thread.launch`` and ``model.step`` launch) is user work, an *item* is library
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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from roundpipe.threads.workers import Future, WorkerThread, add_note

__all__ = [
    "synchronize",
    "on_optimizer_thread",
    "WorkItem",
    "launch_step",
    "launch_item",
    "launch_work",
    "Hold",
    "hold",
    "record_failure",
    "ForkedWithPendingWork",
    "wait_all",
    "raise_failures",
    "has_pending_work",
    "caller_must_wait",
    "has_pending_launch",
    "has_unwaited_launch",
    "last_launch",
    "was_waited",
    "failure_count",
    "set_num_threads",
    "get_num_threads",
    "default_num_threads",
    "use_default_num_threads",
    "THREADS_ENV_VAR",
]


# [Note: steps and items]
# Everything launched runs on the one thread, in launch order, but the scaler needs to know
# whether *user* work (a step: launch(), launch_step(), model.step) was launched and not waited
# for, which decides its update mode ([Note: the scale double buffer] in scaler/grad_scaler.py), and
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
# Failures belong to their owners: an item launched with ``owners`` (the model whose step,
# gradient move or parameter copy it is, the scalers its step function uses) is reported by
# ``raise_failures(owner)`` of one of those owners only, so with two models in a process a
# failure of model A's step is raised at A's next call, never at B's. An item without owners
# (a user's ``launch``) belongs to everyone: any owner's next report raises it. ``synchronize()``
# and ``raise_failures()`` without an owner report every failure.


# [Note: holds]
# A checkpoint is written while the next iterations compute, without copying the state it
# writes (see roundpipe/checkpoint/writer.py). Its work item, which runs where the consistent
# state is (in launch order on this thread), takes a ``Hold`` on the parts of the state the
# writer still reads ("params", "masters", "optimizer", "grads"). Before running an item, the
# thread waits while a hold covers a part the item declares it touches (``launch_work(...,
# touches=...)``); an item that declares nothing (a step: user code may touch anything) waits
# for every hold. So a gradient move (touches "grads") passes a hold of the masters, while the
# next step waits for the write, not the main thread. The writer releases parts as it finishes
# them, and all of them whatever happens to it (``Hold.release`` in a ``finally``), so a wait
# for a hold never outlives the write.


class WorkItem(Future):
    """One launched callable and its future-like result (a :class:`roundpipe.threads.workers.Future`
    that also reports its failure, see [Note: error reporting]); :func:`launch_step` and
    :func:`launch_item` return it.

    Written by the optimizer thread only (the result or exception) before ``_done`` is set; read
    by other threads only after ``_done`` is set (:meth:`wait`, ``result()``, ``exception()``).
    ``done()`` never blocks; ``result()`` and ``exception()`` block until the item ran.
    Made by :func:`launch_step` and :func:`launch_item`, never by hand.
    """

    __slots__ = ("fn", "args", "kwargs", "seq", "owners", "touches", "_owner")

    def __init__(
        self,
        owner: _OptimizerThread,
        fn: Callable | None,
        args: tuple,
        kwargs: dict,
        seq: int,
        owners: tuple = (),
        touches: frozenset[str] | None = None,
    ):
        super().__init__()
        self.fn: Callable | None = fn
        self.args: tuple | None = args
        self.kwargs: dict | None = kwargs
        self.seq = seq
        self.owners = owners  # see [Note: error reporting]
        self.touches = touches  # see [Note: holds]; None: anything
        self._owner = owner

    def __call__(self) -> None:
        """Run on the optimizer thread (the worker's job)."""
        args, kwargs = self.args, self.kwargs
        self.args = self.kwargs = None  # free tensors held by the closure's arguments
        assert self.fn is not None and args is not None and kwargs is not None  # runs once
        try:
            self._owner.pass_holds(self.touches)
            self.run(functools.partial(self.fn, *args, **kwargs))
        finally:
            self.fn = None  # the newest item stays referenced (wait_all): free its closure
            if self._exception is None:
                # Nothing to report: the models it names can be collected once dropped.
                self.owners = ()
            self._owner.note_ran(self.seq)  # see [Note: steps and items]

    def belongs_to(self, owner: Any) -> bool:
        """Whether ``owner``'s report raises this item's failure (see [Note: error
        reporting]). Any thread; never blocks."""
        return not self.owners or any(o is owner for o in self.owners)

    def set_exception(self, exc: BaseException) -> None:
        """Optimizer thread, when the callable raised: note where, record the failure for
        :func:`raise_failures`, then settle the item. Not for callers."""
        if self.fn is not None:
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
    """The process-wide optimizer thread (a :class:`roundpipe.threads.workers.WorkerThread`) and the
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
        # Launched items that have not finished running, by seq (for a fork child, see
        # [Note: fork]); guarded by _lock.
        self._unfinished: dict[int, WorkItem] = {}
        # Active holds (see [Note: holds]); guarded by _holds_changed's lock.
        self._holds: list[Hold] = []
        self._holds_changed = threading.Condition(threading.Lock())

    @property
    def _thread(self) -> threading.Thread | None:
        return self._worker.thread

    def _note_ident(self) -> None:
        self._ident = threading.get_ident()  # on the thread itself, before its first item

    # -- submission ---------------------------------------------------------------------------
    def note_ran(self, seq: int) -> None:
        """Optimizer thread: item ``seq`` has run (see [Note: steps and items])."""
        with self._lock:
            self._unfinished.pop(seq, None)
        self._ran_seq = seq

    def submit(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        track: bool,
        owners: tuple = (),
        touches: frozenset[str] | None = None,
    ) -> WorkItem:
        with self._lock:
            item = WorkItem(self, fn, args, kwargs, self._seq + 1, owners, touches)
            self._worker.enqueue(item)  # under _lock: FIFO order is launch order
            self._seq += 1
            self._unfinished[item.seq] = item
            self._newest = item
            if track:
                self._tracked_seq = self._seq
        return item

    # -- holds (see [Note: holds]) ------------------------------------------------------------
    def add_hold(self, hold: Hold) -> None:
        with self._holds_changed:
            self._holds.append(hold)

    def release_hold(self, hold: Hold, parts: frozenset[str] | None) -> None:
        with self._holds_changed:
            hold.parts = frozenset() if parts is None else hold.parts - parts
            if not hold.parts and hold in self._holds:
                self._holds.remove(hold)
            self._holds_changed.notify_all()

    def pass_holds(self, touches: frozenset[str] | None) -> None:
        """Optimizer thread, before an item runs: wait while a hold covers what it touches."""
        with self._holds_changed:
            while any(h.blocks(touches) for h in self._holds):
                self._holds_changed.wait()

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
        """Whether a step (see [Note: steps and items]) has not been waited for by any caller."""
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

    def record_failure(self, exc: BaseException, owners: tuple) -> WorkItem:
        """Another thread's failure (the checkpoint writer's) into the list of unreported
        failures, as a settled item that waits and reports like a launched one."""
        item = WorkItem(self, None, (), {}, 0, owners, None)
        item.set_exception(exc)
        return item

    def raise_failures(self, owner: Any = None) -> None:
        """Non-blocking: raise the unreported failures that ``owner`` reports (all of them
        without one), if any (the first, the rest as notes)."""
        if on_optimizer_thread():
            return
        with self._lock:
            if owner is None:
                failures, self._failures = self._failures, []
            else:
                failures = [f for f in self._failures if f.belongs_to(owner)]
                self._failures = [f for f in self._failures if not f.belongs_to(owner)]
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

    # -- fork (see [Note: fork]) ----------------------------------------------------------------
    def after_fork_in_child(self) -> None:
        """In a fork child (the only thread there): fresh locks, no optimizer thread yet (the
        next launch starts one), and every item the parent had not finished running fails
        with :class:`ForkedWithPendingWork`, for the child's next call that depends on it."""
        self._lock = threading.Lock()
        self._holds_changed = threading.Condition(threading.Lock())
        self._holds = []
        self._ident = None
        unfinished = sorted(self._unfinished.items())
        self._unfinished = {}
        for _, item in unfinished:
            if not item.done():
                item.fn = item.args = item.kwargs = None
                item.set_exception(
                    ForkedWithPendingWork(
                        f"this process is a fork (os.fork()) of one whose roundpipe optimizer "
                        f"thread had not finished work launched there (item {item.seq}); that "
                        f"work did not run here, so the state it would have changed is not what "
                        f"the parent has. Before forking a process that uses roundpipe, call "
                        f"model.synchronize() (or roundpipe.optim_thread.synchronize()), or "
                        f"start it with multiprocessing's 'spawn' method"
                    )
                )
        if unfinished:
            self._ran_seq = self._seq


class Hold:
    """Parts of the training state that work running beside the optimizer thread (a checkpoint
    write) still reads; items that touch them wait (see [Note: holds]). Made by :func:`hold` on
    the optimizer thread; released by the thread that reads, in parts or all at once.
    ``parts`` is guarded by the optimizer thread's hold lock."""

    def __init__(self, parts: frozenset[str]) -> None:
        self.parts = parts

    def blocks(self, touches: frozenset[str] | None) -> bool:
        """Whether an item that touches ``touches`` (None: anything) must wait. Under the hold
        lock."""
        return bool(self.parts) and (touches is None or bool(self.parts & touches))

    def release(self, parts: Iterable[str] | None = None) -> None:
        """Let items that touch ``parts`` (None: every part) run again. Any thread; never
        blocks beyond the hold lock; idempotent."""
        _EXECUTOR.release_hold(self, None if parts is None else frozenset(parts))


class ForkedWithPendingWork(RuntimeError):
    """Work launched on the optimizer thread had not run when the process forked; raised in the
    child at its next call that depends on that work (see [Note: fork])."""


# [Note: fork]
# os.fork() copies the forking thread only: the child has no optimizer thread and no device
# workers, while their objects say they run, so a call there would wait forever. In the child,
# every WorkerThread returns to "not started" with a fresh queue (the next job starts a thread,
# roundpipe/threads/workers.py), this module's locks are new, and the items the parent had not finished
# fail with ForkedWithPendingWork (the state they would have changed is not the parent's): the
# child's next dependent call raises it, and after that, or when nothing was pending (the
# parent synchronized before forking), the child trains on its own threads.


_EXECUTOR = _OptimizerThread()


def launch_step(fn: Callable, *args: Any, **kwargs: Any) -> WorkItem:
    """Queue a step (user work: it counts as a step, so a ``scaler.update()`` that follows without
    waiting is asynchronous) and return the :class:`WorkItem` to wait on; unlike
    ``optim_thread.launch`` it does not check the function. Any thread; never
    blocks."""
    return _EXECUTOR.submit(fn, args, kwargs, track=True)


def launch_item(fn: Callable, *args: Any, **kwargs: Any) -> WorkItem:
    """Queue library work (a gradient move, a parameter copy, a scaler update) and return its
    :class:`WorkItem`. Unlike :func:`launch` it is not a step: it does not make
    :func:`has_unwaited_launch` true. Any thread; never blocks."""
    return _EXECUTOR.submit(fn, args, kwargs, track=False)


def launch_work(
    fn: Callable,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    step: bool = False,
    owners: Iterable[Any] = (),
    touches: Iterable[str] | None = None,
) -> WorkItem:
    """The general launch: queue ``fn(*args, **kwargs)`` and return its :class:`WorkItem`.
    ``step``: user work (as :func:`launch_step`) or library work (as :func:`launch_item`).
    ``owners``: the objects (a model, a scaler) whose report raises its failure (see
    [Note: error reporting]; none: every report). ``touches``: the parts of the training state
    it changes (``"params"``, ``"masters"``, ``"grads"``, ``"optimizer"``, ``"scaler"``), so
    that it waits only for the holds on those (see [Note: holds]); None (user code): it waits
    for every hold. Any thread; never blocks."""
    return _EXECUTOR.submit(
        fn,
        tuple(args),
        dict(kwargs or {}),
        track=step,
        owners=tuple(owners),
        touches=None if touches is None else frozenset(touches),
    )


def hold(parts: Iterable[str]) -> Hold:
    """On the optimizer thread, inside a launched item: from the next item on, items that
    touch any of ``parts`` wait until the returned :class:`Hold` releases them (see
    [Note: holds]). The caller must release it (``Hold.release``) whatever happens. Raises
    ``RuntimeError`` on any other thread (there the order of items is not known)."""
    if not on_optimizer_thread():
        raise RuntimeError(
            "optim_thread.hold() is taken inside work launched on the optimizer thread, where "
            "the launch order says which items come after it; launch a function that takes it"
        )
    h = Hold(frozenset(parts))
    if h.parts:
        _EXECUTOR.add_hold(h)
    return h


def record_failure(exc: BaseException, owners: Iterable[Any] = ()) -> WorkItem:
    """Record ``exc``, raised by library work on another thread beside the optimizer thread
    (the checkpoint writer), as a failure that ``owners``' next report raises (see
    [Note: error reporting]); returns the settled :class:`WorkItem`, whose ``wait()`` reports
    it instead. Any thread; never blocks."""
    return _EXECUTOR.record_failure(exc, tuple(owners))


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


def raise_failures(owner: Any = None) -> None:
    """Raise the failures of launched work that no call has reported yet (the oldest, with the
    others attached as notes); nothing if there are none. With ``owner``, only the failures
    that belong to it (see [Note: error reporting]): those of work launched with it among its
    owners, and of work launched without owners. Never blocks: work still queued is not waited
    for. Any thread; a no-op on the optimizer thread."""
    _EXECUTOR.raise_failures(owner)


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


def was_waited(item: WorkItem) -> bool:
    """Whether a thread other than the optimizer thread has waited for ``item`` (or for later
    work, or had its failure reported) since it was launched. Any thread; never blocks."""
    with _EXECUTOR._lock:
        return item.seq <= _EXECUTOR._waited_seq


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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_EXECUTOR.after_fork_in_child)
