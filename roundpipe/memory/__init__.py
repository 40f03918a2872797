"""Will it fit: roundpipe's memory concern, one module per question.

* :mod:`.host`: the host RAM a wrapped model takes, term by term (:func:`host_terms`).
* :mod:`.probe`: what the machine has free (:func:`host_memory_available`).
* :mod:`.trace`: each stage's device bytes, traced on fake tensors.
* :mod:`.report`: a call's :class:`MemoryPlan`, host and devices, and its report.
* :mod:`.checks`: the refusals before anything is allocated (:class:`HostMemoryError`,
  :class:`DeviceMemoryError`).

* :mod:`.live`: bytes of the storages alive now (:class:`~roundpipe.memory.live.LiveBytes`),
  the count the tracer and the emulated device keep.

The names below are imported when first read (PEP 562), so that the emulated device, which
imports :mod:`.live` while :mod:`roundpipe.devices` is being imported, does not import the
report (which needs :mod:`roundpipe.devices`) too early.

The plan's device ledger is :mod:`roundpipe.plan.memory`'s; the pinned pools the devices copy
from are :mod:`roundpipe.devices.pinned`'s.
"""

from __future__ import annotations

import importlib
from typing import Any

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

# Where each name above lives.
_HOME = {
    **dict.fromkeys(
        (
            "SKIP_CHECK_ENV",
            "DeviceMemoryError",
            "HostMemoryError",
            "check_device_memory",
            "check_host_memory",
            "skip_memory_check",
        ),
        "checks",
    ),
    **dict.fromkeys(("HostTerms", "format_bytes", "host_terms", "master_dtype_of"), "host"),
    "host_memory_available": "probe",
    **dict.fromkeys(("DeviceMemory", "MemoryPlan", "StageMemory"), "report"),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'roundpipe.memory' has no attribute {name!r}")
    return getattr(importlib.import_module(f"roundpipe.memory.{home}"), name)
