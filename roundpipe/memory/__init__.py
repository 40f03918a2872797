"""Will it fit: roundpipe's memory concern, one module per question.

* :mod:`.host`: the host RAM a wrapped model takes, term by term (:func:`host_terms`).
* :mod:`.probe`: what the machine has free (:func:`host_memory_available`).
* :mod:`.trace`: each stage's device bytes, traced on fake tensors.
* :mod:`.report`: a call's :class:`MemoryPlan`, host and devices, and its report.
* :mod:`.checks`: the refusals before anything is allocated (:class:`HostMemoryError`,
  :class:`DeviceMemoryError`).

* :mod:`.live`: bytes of the storages alive now (:class:`~roundpipe.memory.live.LiveBytes`),
  the count the tracer and the emulated device keep.

Import from the modules themselves: the package re-exports nothing, so that importing one
leaf (the emulated device imports :mod:`.live` while :mod:`roundpipe.devices` is being
imported) does not import the report, which needs :mod:`roundpipe.devices`.

The plan's device ledger is :mod:`roundpipe.plan.memory`'s; the pinned pools the devices copy
from are :mod:`roundpipe.devices.pinned`'s.
"""
