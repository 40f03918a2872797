"""Test infrastructure that ships with roundpipe: the emulated accelerator (:mod:`.emu`)."""

from roundpipe.testing.emu import DEVICE_COUNT, EmuTensor, install, is_installed

__all__ = ["DEVICE_COUNT", "EmuTensor", "install", "is_installed"]
