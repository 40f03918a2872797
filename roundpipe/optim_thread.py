"""The optimizer thread: one background thread per process that runs launched work in FIFO order.

Everything that touches the fp32 master parameters, their gradients, the optimizer state or the
back side of a :class:`roundpipe.GradScaler` runs there, so the main thread can already compute
the next iteration while a step runs. See ``docs/threads-and-staleness.md``.

Public API (``roundpipe.optim_thread``):

* :func:`launch` checks a callable (see :func:`roundpipe.step_check.check_step_fn`), queues it
  and returns at once.
* :func:`synchronize` waits for everything launched so far and re-raises a captured error.
* :func:`on_optimizer_thread` tells whether the caller is the optimizer thread.
* :func:`set_num_threads` / :func:`get_num_threads`: the intra-op threads its ops use;
  :func:`use_default_num_threads` is what a model on an accelerator pool calls.

The client API that roundpipe's own modules build on (``launch_step``, ``launch_item``,
``launch_work``, ``wait_all``, ``raise_failures``, the non-blocking questions) lives in
:mod:`roundpipe.threads.optimizer_thread` and is re-exported here. This module sits above
:mod:`roundpipe.step_check`, so :func:`launch` calls the step check directly: nothing registers
itself at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roundpipe.scaler.grad_scaler import note_step_launched
from roundpipe.step_check import check_step_fn
from roundpipe.threads import optimizer_thread
from roundpipe.threads.optimizer_thread import *  # noqa: F403 -- this module is the queue's public face

# The queue's public names, and launch.
__all__ = ["launch", *optimizer_thread.__all__]


def launch(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Queue ``fn(*args, **kwargs)`` on the optimizer thread and return at once.

    Any thread. Work runs in launch order. An exception raised by ``fn`` is re-raised on the
    main thread by the next :func:`synchronize` (or the next scaler/model call that depends on
    it), as the original exception. It counts as a step (see :func:`has_unwaited_launch`).

    Args:
        fn: the callable. Raises ``RuntimeError`` at once if it uses a
            ``torch.amp.GradScaler``; a ``roundpipe.GradScaler`` it uses is marked as used by
            steps (see :func:`roundpipe.step_check.check_step_fn`).
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.
    """
    scalers = check_step_fn(fn)
    note_step_launched(scalers, optimizer_thread.launch_step(fn, *args, **kwargs))
