"""The loss scale for fp16 training on roundpipe's threads.

* :mod:`.grad_scaler`: :class:`GradScaler` (``roundpipe.GradScaler``), the drop-in for
  ``torch.amp.GradScaler`` whose scale is double-buffered between the compute threads and the
  optimizer thread (see [Note: the scale double buffer]).
* :mod:`.rule`: the update rule itself, free of threads (:class:`ScaleRule`).
* :mod:`.finite_check`: gradients checked for inf/NaN on the device, so that the step need not
  read them again on the host.
* :mod:`.host_copy`: scalar values on their way to the host, read without a device sync (the
  scale for monitoring; the training monitor's losses).

Nothing is imported here: the public names are re-exported by :mod:`roundpipe`.
"""
