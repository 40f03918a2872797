"""HostCopy: values on their way to the host, read without waiting for anything but that copy
(see [Note: host copies] in roundpipe.scaler.host_copy). On the emulated device an event is done only
once the host has waited for it (see [Note: emulated event queries] in roundpipe.testing.emu),
so the branch where a copy is still on its way runs here as it does on a GPU."""

import pytest
import torch

from roundpipe.scaler.host_copy import HostCopy
from roundpipe.testing.emu import rules_set


def test_host_values_are_ready_at_once():
    copy = HostCopy(torch.tensor(2.0), 3)
    assert copy.ready() and copy.values() == [2.0, 3.0]
    assert HostCopy(1.5).value() == 1.5


def test_a_device_copy_is_not_ready_until_read_and_reading_waits_for_it():
    x = torch.arange(3.0, device="emu:0")
    copy = HostCopy(x.sum(), x.max())
    assert not copy.ready()  # never blocks: the device may not have got there
    assert copy.values() == [3.0, 2.0]
    assert copy.ready() and copy.value() == 3.0


def test_a_copy_is_ready_once_the_host_waited_for_its_device():
    copy = HostCopy(torch.ones((), device="emu:0"))
    assert not copy.ready()
    torch.accelerator.synchronize("emu:0")
    assert copy.ready() and copy.value() == 1.0


def test_a_copy_from_another_device_waits_for_that_device():
    copy = HostCopy(torch.full((), 5.0, device="emu:1"))
    torch.accelerator.synchronize("emu:0")  # not the copy's device: still on its way
    assert not copy.ready()
    assert copy.value() == 5.0


def test_tensors_of_several_devices_are_refused():
    with pytest.raises(AssertionError, match="several devices"):
        HostCopy(torch.ones((), device="emu:0"), torch.ones((), device="emu:1"))


def test_without_the_rule_queries_answer_done_at_once():
    with rules_set(event_queries=False):
        copy = HostCopy(torch.ones((), device="emu:0"))
        assert copy.ready() and copy.value() == 1.0
