"""Test infrastructure that ships with roundpipe: the emulated accelerator (:mod:`.emu`).

Importing this package registers the ``emu`` device kind with the device pool
(:func:`roundpipe.devices.register_device_kind`), so ``devices="emu"`` / ``"emu:N"`` (N
emulated accelerators) work; roundpipe's ``roundpipe.devices`` entry point names this package, so
``ROUNDPIPE_DEVICES=emu`` works without importing it first.
"""

from collections.abc import Sequence

from roundpipe.devices.pinned import TORCH_PINNED, PinnedAllocator
from roundpipe.devices.pool import DeviceKind, register_device_kind
from roundpipe.testing.emu import (
    DEVICE_COUNT,
    EmuTensor,
    install,
    is_installed,
    pinned_round_limit,
)

__all__ = ["DEVICE_COUNT", "EMU_PINNED", "EmuTensor", "install", "is_installed"]


def _emu_indices(rest: str) -> Sequence[int]:
    if not rest:
        return [0]
    if rest.isdigit() and 1 <= int(rest) <= DEVICE_COUNT:
        return range(int(rest))
    raise ValueError(f"'emu:N' takes a number of emulated devices 1 <= N <= {DEVICE_COUNT}")


# torch's pinned memory, which the emulated device's allocator rounds up to a power of two as
# CUDA's does (up to its own limit), and counts (see [Note: emulated pinned memory] in
# roundpipe.testing.emu).
EMU_PINNED = PinnedAllocator("emulated pinned memory", TORCH_PINNED.allocate, pinned_round_limit)
register_device_kind(
    DeviceKind(
        "emu",
        _emu_indices,
        install,
        "'emu' / 'emu:N' (N emulated accelerators, for tests)",
        pinned=EMU_PINNED,
        memory_in_host=True,  # an emulated tensor is a host tensor
    )
)
