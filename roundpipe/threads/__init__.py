"""roundpipe's threads: the machine behind them and the optimizer thread.

* :mod:`.workers`: :class:`Future` and :class:`WorkerThread`, the one machine behind the device
  workers and the optimizer thread (a FIFO daemon thread whose failures reach the waiter).
* :mod:`.optimizer_thread`: the optimizer thread, one per process: its work items, the holds a
  checkpoint takes, failure reports, the thread-count calls. Its user's face is
  :mod:`roundpipe.optim_thread`.
* :mod:`.step_context`: which model's step runs on this thread now, so that an optimizer built
  on the model's own parameters is refused.

Nothing is imported here.
"""
