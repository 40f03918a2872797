"""The emulated accelerator's stream order (see [Note: emulated streams] in roundpipe.testing.emu):
accesses that a GPU could run in either order raise, host memory behind a non-blocking copy
holds what a GPU could show, and the runtime loses none of the orderings it needs."""

import copy
import math
import sys

import pytest
import torch
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.devices import AcceleratorBackend
from roundpipe.runtime import grad_router
from roundpipe.testing import emu
from roundpipe.testing.emu import StreamOrderError, rules_set

EMU = torch.device("emu:0")


def _side_stream(device=EMU):
    stream = torch.Stream(device=device)
    # Start from what the current stream has done (the tensors the test made there).
    stream.wait_stream(torch.accelerator.current_stream(device))
    return stream


def _current_waits_for(stream):
    """The current stream waits for ``stream``'s work so far, through an event."""
    event = torch.Event(device=EMU)
    event.record(stream)
    torch.accelerator.current_stream(EMU).wait_event(event)


def test_a_read_of_another_streams_write_needs_an_event():
    x = torch.ones(8, device=EMU)
    side = _side_stream()
    with side:
        y = x * 2
    with pytest.raises(
        StreamOrderError,
        match=r"aten.add.Tensor on stream 0 uses memory "
        r"written by aten.mul.Tensor on stream \d+",
    ):
        y + 1
    _current_waits_for(side)
    assert (y + 1).sum().item() == 24


def test_an_event_recorded_before_the_write_does_not_order_it():
    x = torch.ones(8, device=EMU)
    side = _side_stream()
    early = torch.Event(device=EMU)
    early.record(side)
    with side:
        y = x * 2
    torch.accelerator.current_stream(EMU).wait_event(early)
    with pytest.raises(StreamOrderError):
        y + 1


def test_a_host_wait_orders_later_work_on_every_stream():
    x = torch.ones(8, device=EMU)
    side = _side_stream()
    with side:
        y = x * 2
    side.synchronize()
    assert (y + 1).sum().item() == 24


def test_a_write_over_memory_another_stream_reads_needs_an_event():
    x = torch.ones(8, device=EMU)
    side = _side_stream()
    with side:
        x.sum()
    with pytest.raises(StreamOrderError, match="writes memory read by aten.sum"):
        x.add_(1)
    torch.accelerator.current_stream(EMU).wait_stream(side)
    x.add_(1)


def test_events_carry_what_their_stream_waited_for():
    # a -> b -> current: waiting for b's event orders a's write too.
    x = torch.ones(4, device=EMU)
    a, b = _side_stream(), _side_stream()
    with a:
        y = x * 3
    b.wait_stream(a)
    _current_waits_for(b)
    assert (y + 0).sum().item() == 12


def test_an_event_is_done_only_once_the_host_waited_for_it():
    x = torch.ones(8, device=EMU)
    side = _side_stream()
    with side:
        y = x * 2
    event = torch.Event(device=EMU)
    event.record(side)
    assert not event.query() and not side.query()  # a GPU may still be computing y
    torch.accelerator.current_stream(EMU).wait_event(event)
    assert not event.query()  # a device-side wait tells the host nothing
    event.synchronize()
    assert event.query() and side.query()
    assert torch.Event(device=EMU).query()  # never recorded: done, as on CUDA
    with rules_set(event_queries=False):
        with side:
            y = y + 1
        assert side.query()  # the lenient rule: waits, then answers done
    assert (y + 0).sum().item() == 24


def test_new_streams_come_round_robin_from_a_pool_of_32_as_on_cuda():
    # (see [Note: emulated stream pool]) After 32 more streams, a new one is the first again,
    # with the work its first holder left pending on it.
    first = torch.Stream(device=EMU)
    more = [torch.Stream(device=EMU) for _ in range(32)]
    assert len({s.stream_id for s in more}) == 32 and 0 not in {s.stream_id for s in more}
    assert more[-1].stream_id == first.stream_id
    x = torch.ones(4, device=EMU)
    first.wait_stream(torch.accelerator.current_stream(EMU))
    with first:
        y = x * 2
    assert not more[-1].query()  # "a new stream" is busy with first's work
    first.synchronize()
    assert more[-1].query() and (y + 0).sum().item() == 8
    with rules_set(stream_pool=False):
        assert torch.Stream(device=EMU).stream_id > 32  # never handed out before


def test_a_non_blocking_download_lands_when_the_host_waits():
    src = torch.arange(4.0, device=EMU)
    host = torch.empty(4).pin_memory()
    host.copy_(src, non_blocking=True)
    assert torch.isnan(host).all()  # a GPU may not have written it yet
    event = torch.Event(device=EMU)
    event.record()
    event.synchronize()
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    # .to("cpu", non_blocking=True) is pinned and asynchronous too, as on CUDA.
    out = (src + 1).to("cpu", non_blocking=True)
    assert out.is_pinned() and torch.isnan(out).all()
    torch.accelerator.synchronize(EMU)
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_the_snapshots_of_copies_in_flight_are_counted_until_the_host_waits():
    # What a GPU holds in device memory until the copy runs, the emulator holds on the host.
    torch.accelerator.synchronize(EMU)
    before = emu.copies_in_flight_bytes()
    src = torch.arange(1000.0, device=EMU)
    host = torch.empty(1000).pin_memory()
    host.copy_(src, non_blocking=True)
    assert emu.copies_in_flight_bytes() - before == 4000
    torch.accelerator.synchronize(EMU)
    assert emu.copies_in_flight_bytes() == 0


def test_blocking_copies_to_the_host_wait_for_their_stream():
    src = torch.arange(4.0, device=EMU)
    assert src.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    host = torch.empty(4)  # pageable: the copy is synchronous even when asked not to be
    host.copy_(src, non_blocking=True)
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_writing_the_source_of_a_non_blocking_upload_before_waiting_raises_at_the_wait():
    source = torch.ones(4).pin_memory()
    on_device = source.to(EMU, non_blocking=True)
    source.add_(1)  # the copy may not have read it yet
    with pytest.raises(RuntimeError, match="non-blocking upload reads was written before"):
        torch.accelerator.synchronize(EMU)
    source = torch.ones(4).pin_memory()
    on_device = source.to(EMU, non_blocking=True)
    torch.accelerator.synchronize(EMU)
    source.add_(1)  # the host knows the copy is done
    torch.accelerator.synchronize(EMU)
    assert on_device.sum().item() == 4


def test_an_upload_of_downloaded_bytes_lands_them_when_ordered_after_the_download():
    # What offloading an activation does: device -> pinned host on one stream, back on another.
    src = torch.arange(6.0, device=EMU)
    down, up = _side_stream(), _side_stream()
    host = torch.empty(6).pin_memory()
    with down:
        host.copy_(src, non_blocking=True)
    with up, pytest.raises(StreamOrderError, match="uploads host memory still being written"):
        host.to(EMU, non_blocking=True)
    event = torch.Event(device=EMU)
    event.record(down)
    up.wait_event(event)
    with up:
        back = host.to(EMU, non_blocking=True)
    torch.accelerator.current_stream(EMU).wait_stream(up)
    assert back.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_copy_between_devices_orders_both_current_streams():
    one = torch.device("emu:1")
    x = torch.arange(3.0, device=EMU) * 2
    y = x.to(one)  # after the barrier, emu:1's current stream may read it
    assert (y + 1).cpu().tolist() == [1.0, 3.0, 5.0]
    side = _side_stream(one)
    with side:
        z = y * 1
    with pytest.raises(StreamOrderError):
        z.to(EMU)  # z was written on a stream the copy's barrier does not include


# -- the caching allocator's reuse (see [Note: emulated allocator reuse]) -------------------


def _freed_while_a_side_stream_reads(fix=None):
    """A tensor made on the current stream, read on a side stream, then dropped; ``fix``
    (called with the tensor and the side stream) is what the code does about it first."""
    x = torch.ones(256, device=EMU)  # 1 KiB: the small pool
    side = _side_stream()
    with side:
        y = x * 2
    if fix is not None:
        fix(x, side)
    del x
    return y, side


def test_memory_another_stream_still_reads_is_not_reused_by_the_stream_that_made_it():
    _freed_while_a_side_stream_reads()
    big = torch.empty(1 << 19, device=EMU)  # 2 MiB: the large pool, other blocks
    with pytest.raises(
        StreamOrderError,
        match=r"caching allocator reuse on emu:0: aten.empty.memory_format allocates 64 bytes "
        r"on stream 0, .* a tensor of 1024 bytes made on stream 0 \(by "
        r"aten.empty.memory_format at .*test_emu_streams.py:\d+ in "
        r"_freed_while_a_side_stream_reads, thread 'MainThread'\) was freed while stream \d+ "
        r"of emu:0 may still be using it \(aten.mul.Tensor there\)",
    ):
        torch.empty(16, device=EMU)
    del big


def _record_the_side_stream(x, side):
    x.record_stream(side)


def _wait_for_the_side_stream(x, side):
    _current_waits_for(side)


def _host_waits_for_the_side_stream(x, side):
    side.synchronize()


@pytest.mark.parametrize(
    "fix",
    [_record_the_side_stream, _wait_for_the_side_stream, _host_waits_for_the_side_stream],
    ids=["record_stream", "event", "host-wait"],
)
def test_record_stream_or_an_ordering_makes_the_reuse_safe(fix):
    y, side = _freed_while_a_side_stream_reads(fix)
    assert torch.zeros(16, device=EMU).sum().item() == 0
    _current_waits_for(side)
    assert y.cpu().tolist() == [2.0] * 256


def test_the_order_may_also_come_after_the_free_and_the_rule_switches_off():
    _freed_while_a_side_stream_reads()
    torch.accelerator.synchronize(EMU)  # before the allocation that reuses: still safe
    torch.empty(16, device=EMU)
    with rules_set(allocator_reuse=False):
        _freed_while_a_side_stream_reads()
        torch.empty(16, device=EMU)


def _dropping_record_stream_in(monkeypatch, function):
    """The runtime's ``record_stream`` calls made from ``function`` do nothing."""
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if sys._getframe(1).f_code.co_name != function:
            original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)


@pytest.mark.parametrize(
    "devices, offload, function",
    [("emu", True, "download"), ("emu:2", False, "move")],
    ids=["offload-download", "device-hand-off"],
)
def test_each_runtime_record_stream_is_needed(monkeypatch, devices, offload, function):
    # The offloaded stage inputs are read by the download stream; the hand-off between devices
    # reads the producer's output on that device's current stream and the consumer's copy on
    # its compute stream. Without their record_stream, the stream that made them reuses the
    # memory while the other may still read it.
    _dropping_record_stream_in(monkeypatch, function)
    with pytest.raises(StreamOrderError, match="caching allocator reuse"):
        _train(devices, offload, steps=3, inputs_on=EMU)


# -- the runtime keeps the orderings it needs ----------------------------------------------


def _train(devices, offload=False, steps=2, inputs_on=None):
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    model = RoundPipe(
        copy.deepcopy(seq),
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, offload_activations=offload),
    )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        if inputs_on is not None:  # made by the caller on its own stream
            x = x.to(inputs_on)
        loss = model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda out, lbl: nn.functional.cross_entropy(out, lbl)
        )
        losses.append(float(loss))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return losses, {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
def test_streamed_training_passes_the_order_checks_and_matches_the_cpu(devices, offload):
    ref_losses, ref = _train("cpu")
    losses, got = _train(devices, offload, inputs_on=EMU)
    assert all(math.isfinite(v) for v in losses)
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def _without_prefetch_wait(self, resident):
    resident.ready = None


def _without_reload_wait(self, tree, arrived):
    return self.to_device(tree)


_original_to_device = AcceleratorBackend.to_device


def _without_producer_wait(self, tree, after=None):
    return _original_to_device(self, tree)


def _moves_without_host_wait(pairs, arrived=None, nonfinite_flag=None):
    # Host threads count as one (see [Note: emulated streams]): the optimizer thread's wait
    # for a gradient download would also order the offloaded inputs downloaded before it, on
    # the same stream, for the worker, if it came first. Without it only the reload's own
    # wait orders them.
    for master, grad in pairs:
        master.grad = grad.to(master.dtype)


@pytest.mark.parametrize(
    "devices, offload, method, broken",
    [
        ("emu", False, "begin_call", lambda self: None),  # inputs made on the caller's stream
        ("emu", False, "adopt", _without_prefetch_wait),
        ("emu", True, "reload", _without_reload_wait),
        ("emu:2", False, "to_device", _without_producer_wait),
    ],
    ids=["caller-stream", "prefetch", "offload-reload", "device-hand-off"],
)
def test_each_runtime_ordering_is_needed(monkeypatch, devices, offload, method, broken):
    # The check would catch the runtime losing any of its waits: drop one, and the run races.
    monkeypatch.setattr(AcceleratorBackend, method, broken)
    if method == "reload":
        monkeypatch.setattr(grad_router, "move_grads", _moves_without_host_wait)
    with pytest.raises(StreamOrderError, match="stream race"):
        _train(devices, offload, inputs_on=EMU)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.arange(5, device=d),
        lambda d: torch.arange(1, 6, device=d, dtype=torch.float32),
        lambda d: torch.arange(0, 10, 2, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.eye(2, 4, device=d),
    ],
)
def test_factories_that_fill_an_out_tensor_have_their_shape_on_the_device(make):
    # arange and eye fill an empty tensor through their out= overload; on the emulated device
    # they once handed back a 0-element tensor whose storage held the values.
    on_device, on_host = make("emu:0"), make("cpu")
    assert on_device.shape == on_host.shape and on_device.device.type == "emu"
    assert torch.equal(on_device.cpu(), on_host)


@pytest.mark.parametrize("data", [0.5, [1.0, 2.0], [[1, 2], [3, 4]]])
def test_torch_tensor_of_host_data_lands_on_the_device(data):
    # torch.tensor(data, device=...) copies the host data with the Python dispatch key excluded,
    # through the backend's _copy_from, which the emulated device once lacked (transformers 4.x
    # makes the fill value of its eager attention masks so).
    on_device = torch.tensor(data, device="emu:1")
    assert on_device.device == torch.device("emu:1")
    assert torch.equal(on_device.cpu(), torch.tensor(data))
