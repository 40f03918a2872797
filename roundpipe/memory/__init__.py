"""Will it fit: roundpipe's memory concern, one module per question.

* :mod:`.host`: the host RAM a wrapped model takes, term by term (:func:`host_terms`).
* :mod:`.probe`: what the machine has free (:func:`host_memory_available`).
* :mod:`.trace`: each stage's device bytes, traced on fake tensors.
* :mod:`.report`: a call's :class:`MemoryPlan`, host and devices, and its report.
* :mod:`.checks`: the refusals before anything is allocated (:class:`HostMemoryError`,
  :class:`DeviceMemoryError`).

The plan's device ledger is :mod:`roundpipe.plan.memory`'s; the pinned pools the devices copy
from are :mod:`roundpipe.devices.pinned`'s.
"""

from roundpipe.memory.checks import (
    SKIP_CHECK_ENV,
    DeviceMemoryError,
    HostMemoryError,
    check_device_memory,
    check_host_memory,
    skip_memory_check,
)
from roundpipe.memory.host import HostTerms, format_bytes, host_terms, master_dtype_of
from roundpipe.memory.probe import host_memory_available
from roundpipe.memory.report import DeviceMemory, MemoryPlan, StageMemory

__all__ = [
    "SKIP_CHECK_ENV",
    "DeviceMemory",
    "DeviceMemoryError",
    "HostMemoryError",
    "HostTerms",
    "MemoryPlan",
    "StageMemory",
    "check_device_memory",
    "check_host_memory",
    "format_bytes",
    "host_memory_available",
    "host_terms",
    "master_dtype_of",
    "skip_memory_check",
]
