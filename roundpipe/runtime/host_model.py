"""The wrapped model lives in host memory: a model handed to roundpipe on a device is moved back.

roundpipe keeps the model's parameters in host memory and streams each stage through the
devices when it computes; a parameter left on a device would be computed with in place (the
offload defeated: the device holds the whole model) or meet host tensors in a stage. A model
given on a device (``model.to("cuda")``, ``.cuda()``, a copy of a script written for the plain
Trainer) is moved to the host once, with a warning that says so and what it cost.

Threads: main, at wrap time, before anything else reads the model's tensors.
"""

from __future__ import annotations

import warnings

from torch import nn

from roundpipe.user_frame import user_stacklevel

__all__ = ["move_to_host"]


def move_to_host(module: nn.Module, owner: str) -> None:
    """If any of ``module``'s parameters or buffers is on a device (not the CPU, not ``meta``),
    move the module to the host (``module.to("cpu")``: the same parameter objects, their data
    copied once) and warn, naming ``owner`` (e.g. ``"roundpipe.hf.wrap"``), the devices, the
    bytes copied and how to avoid the copy. Main thread."""
    seen: dict[int, int] = {}
    devices = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type in ("cpu", "meta"):
            continue
        devices.add(str(tensor.device))
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    if not devices:
        return
    warnings.warn(
        f"{owner}: the model is on {', '.join(sorted(devices))}, and roundpipe keeps the model "
        f"in host memory and streams each stage through the devices as it computes: it moved "
        f"the model to the host (model.to('cpu'), {sum(seen.values()) / 2**20:.1f} MiB copied "
        f"once; the device memory is free once nothing else holds those tensors). Build or "
        f"load the model in host memory (no .to(device), .cuda() or device_map) to skip the copy",
        stacklevel=user_stacklevel(),
    )
    module.to("cpu")
