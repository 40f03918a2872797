"""Streaming on an accelerator (see [Note: streaming] in roundpipe/plan/build.py): stage-major
plans, what they say they move, and what the emulated device sees moved."""

import copy
import itertools
import time
from collections import Counter

import pytest
import torch
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.plan import ActionKind, TransferKind, build_plan, simulate
from roundpipe.testing import emu

SHAPES = list(itertools.product([1, 2, 3, 5], [1, 2, 4, 16], [1, 2, 3]))


def _uploads(plan, device):
    return [t for t in plan.transfers(device) if t.kind is TransferKind.UPLOAD]


def _first_upload(plan, device):
    """The upload of ``device``'s first run (None: no upload, or no actions)."""
    uploads = _uploads(plan, device)
    return uploads[0] if uploads else None


def _upload_after(plan, action):
    """The upload of the run that the compute action after ``action`` on its device starts."""
    actions = plan.per_device[action.device]
    i = actions.index(action)
    if i + 1 == len(actions):
        return None
    return next((t for t in _uploads(plan, action.device) if t.action == actions[i + 1]), None)


def _hands_off(plan, action):
    """Whether the program records a device event after ``action`` for another device."""
    return any(
        a.kind is ActionKind.HANDOFF
        and (a.stage, a.mb_index, a.of) == (action.stage, action.mb_index, action.kind)
        for a in plan.program[action.device]
    )


def _moves(plan):
    ups, downs = Counter(), Counter()
    for t in plan.transfers():
        (ups if t.kind is TransferKind.UPLOAD else downs)[t.stage] += 1
    return ups, downs


@pytest.mark.parametrize("S,M,D", SHAPES)
def test_stage_major_training_plan_runs_and_moves_each_stage_at_most_twice(S, M, D):
    plan = build_plan(S, M, D, training=True, stage_major=True)
    assert len(simulate(plan)) == len(plan.actions())  # no deadlock
    ups, downs = _moves(plan)
    for s in range(S):
        assert ups[s] == (1 if s == S - 1 else 2), plan  # the last stage: forward+backward
        assert downs[s] == 1, plan
    for d, actions in enumerate(plan.per_device):  # each (stage, kind) is one run on its device
        runs = [k for k, _ in itertools.groupby((a.stage, a.kind) for a in actions)]
        assert len(runs) == len(set(runs))
        # A device's first upload is at its first action (None: a device without stages);
        # every later one is named at the end of the run before it.
        first = _first_upload(plan, d)
        assert (first.action if first else None) == (actions[0] if actions else None)
        ups = [
            t.action
            for t in plan.transfers()
            if t.kind is TransferKind.UPLOAD and t.action.device == d
        ]
        assert ups[1:] == [
            b
            for a, b in zip(actions, actions[1:])
            if _upload_after(plan, a) is not None and _upload_after(plan, a).action == b
        ]


@pytest.mark.parametrize("S,M,D", SHAPES)
def test_stage_major_inference_and_no_recompute_upload_once(S, M, D):
    infer = build_plan(S, M, D, training=False, stage_major=True)
    assert len(simulate(infer)) == S * M
    assert _moves(infer) == (Counter({s: 1 for s in range(S)}), Counter())
    kept = build_plan(S, M, D, training=True, stage_major=True, recompute=False)
    ups, downs = _moves(kept)
    assert ups == Counter({s: 1 for s in range(S)}) and downs == Counter({s: 1 for s in range(S)})


def test_a_stage_major_plan_prints_its_moves():
    text = str(build_plan(3, 2, 1, training=True, stage_major=True))
    assert "device 0: F0.0 F0.1 F1.0 F1.1 L2.0 L2.1 B1.0 B1.1 B0.0 B0.1" in text
    assert (
        "moves 0: up0@F0.0 up1@F1.0 up2@L2.0 down2@L2.1 up1@B1.0 down1@B1.1 up0@B0.0 "
        "down0@B0.1" in text
    )


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    # Parameter sizes all differ, so a download is told apart by its size.
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Dropout(0.2), nn.Linear(5, 3)
    ).to(dtype)


def _batch(n=32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _loss(out, y):
    return (out.float() - y).pow(2).mean()


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_each_stage_is_uploaded_at_most_twice_and_its_grads_downloaded_once(devices, M):
    model = RoundPipe(
        _model(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=M)
    )
    params = dict(model.module.named_parameters())
    assert all(p.is_pinned() for p in params.values())  # uploads come from pinned memory
    ptr = {p.data_ptr(): n for n, p in params.items()}
    x, y = _batch()
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    uploads = Counter(ptr[c.host_ptr] for c in log if c.direction == "h2d" and c.host_ptr in ptr)
    last = str(len(model.module) - 1)
    for name in params:  # "0.weight": layer 0 is stage 0
        assert uploads[name] == (1 if name.split(".")[0] == last else 2), (name, uploads)
    by_size = {p.numel(): n for n, p in params.items()}
    # Smaller than any param: the losses, and each download's check (found, largest magnitude).
    downloads = Counter(
        by_size[c.numel]
        for c in log
        if c.direction == "d2h" and c.dtype == torch.float32 and c.numel > 2
    )
    assert downloads == Counter({n: 1 for n in params}), downloads
    assert all(c.pinned for c in log if c.direction == "d2h" and c.numel > 1)


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_streamed_training_equals_the_cpu_pool_bit_for_bit(devices):
    # fp16 shards, dropout in the RNG chain, BatchNorm stats, an async step: the streamed run
    # (forward without a graph, recompute on the worker, gradients summed on the device) ends
    # with the CPU pool's parameters and running stats.
    def run(pool):
        torch.manual_seed(0)
        seq = nn.Sequential(
            nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3)
        ).half()
        model = RoundPipe(
            copy.deepcopy(seq),
            optim_dtype=torch.float32,
            devices=pool,
            model_run_config=RoundPipeRunConfig(num_microbatch=4),
        )
        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _i in range(3):
            x, y = _batch()
            model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        return model.module.state_dict()

    ref, got = run("cpu"), run(devices)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


class _TiedInside(nn.Module):
    """One weight under two names of one layer, and a buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) + self.shift))


def test_a_layer_computes_on_its_device_copies_under_every_name_and_gets_its_own_back():
    # The emulated device rejects host tensors: a name left on the host weight would raise.
    def run(pool):
        torch.manual_seed(0)
        seq = nn.Sequential(_TiedInside(), nn.Linear(4, 3))
        model = RoundPipe(seq, devices=pool, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        layer = model.module[0]
        own = layer.a.weight, layer.shift
        with OptimizerCtx():
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batch(8)
        for _ in range(2):
            model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        # after the calls, the layer holds its own parameter (under both names) and buffer
        assert layer.a.weight is own[0] and layer.b.weight is own[0] and layer.shift is own[1]
        return {k: v.clone() for k, v in model.module.state_dict().items()}

    ref, got = run("cpu"), run("emu")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], msg=k)


def test_a_layer_that_raises_gets_its_own_tensors_back():
    class Fails(nn.Linear):
        def forward(self, x):
            raise ValueError("layer failed")

    seq = nn.Sequential(nn.Linear(4, 4), Fails(4, 3))
    own = seq[1].weight
    model = RoundPipe(seq, devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = _batch(8)
    with pytest.raises(ValueError, match="layer failed"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert seq[1].weight is own and seq[1].weight.device.type == "cpu"


def test_inputs_that_require_grad_get_it_through_a_streamed_call():
    x, y = _batch(8)
    grads = []
    for pool in ("cpu", "emu:2"):
        model = RoundPipe(
            _model(), devices=pool, model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        leaf = x.clone().requires_grad_()
        model.forward_backward(input_args=(leaf * 2,), label=y, loss_fn=_loss)
        grads.append(leaf.grad)
    assert grads[1] is not None and torch.equal(grads[0], grads[1])


def test_no_recompute_keeps_the_forward_upload_for_the_backward():
    model = RoundPipe(
        _model(),
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=4, recompute=False),
    )
    ptr = {p.data_ptr() for p in model.module.parameters()}
    x, y = _batch()
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert sum(c.direction == "h2d" and c.host_ptr in ptr for c in log) == len(ptr)
    ref = RoundPipe(
        _model(),
        devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=4, recompute=False),
    )
    ref.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    for a, b in zip(model.optim_parameters(), ref.optim_parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_differentiable_forward_reaches_the_masters_on_an_accelerator():
    x, _ = _batch(8)
    grads = []
    for pool in ("cpu", "emu"):
        model = RoundPipe(
            _model(), devices=pool, model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        model(x).pow(2).sum().backward()
        grads.append([m.grad for m in model.optim_parameters()])
    assert all(g is not None for g in grads[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_plan_of_an_accelerator_pool_is_stage_major():
    model = RoundPipe(
        _model(), devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    plan = model.plan()
    assert plan.stage_major and not plan.fused
    assert [a.kind for a in plan.per_device[0][:3]] == [ActionKind.FORWARD] * 3
    assert "moves 1:" in str(plan)


def test_the_next_stage_is_prefetched_on_the_copy_stream():
    model = RoundPipe(
        _model(), devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    backend = model._pool.backends[0]
    params = dict(model.module.named_parameters())
    stage_of = {p.data_ptr(): int(n.split(".")[0]) for n, p in params.items()}
    x, y = _batch()
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    uploads = [
        (stage_of[c.host_ptr], c.stream_id)
        for c in log
        if c.direction == "h2d" and c.host_ptr in stage_of
    ]
    # Stage 0's first upload was copied in as the call started, every later one while the
    # stage before it computed: all on the copy stream.
    assert uploads[0][0] == 0
    assert {stream for _, stream in uploads} == {backend.copy_stream.stream_id}, uploads
    assert backend.copy_stream.stream_id != backend.stream.stream_id


def _streams_of(model):
    """(device, stream id) -> (device, "compute" or "copy") of the pool's backends (stream ids
    are per device: two devices' streams may share one)."""
    out = {}
    for d, backend in enumerate(model._pool.backends):
        index = backend.torch_device.index
        out[index, backend.stream.stream_id] = (d, "compute")
        out[index, backend.copy_stream.stream_id] = (d, "copy")
    return out


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_every_devices_first_upload_of_a_call_runs_on_its_copy_stream(devices):
    # Each device's first upload is queued as the call starts, on the copy stream, ahead of its
    # actions; every iteration (async steps between them) still uploads each stage twice and
    # the last stage once. Three stages with parameters, (Linear, Tanh), (Linear, Dropout) and
    # (Linear): on two devices, each has a stage with parameters first.
    model = RoundPipe(
        _model(),
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=[2, 2, 1]),
    )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.module.named_parameters())
    stage_of = {p.data_ptr(): int(n.split(".")[0]) // 2 for n, p in params.items()}
    last = 2
    plan = model.plan()
    x, y = _batch()
    for _ in range(3):
        with emu.record_copies() as log:
            model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        streams = _streams_of(model)
        uploads = [
            (stage_of[c.host_ptr], streams[c.device, c.stream_id])
            for c in log
            if c.direction == "h2d" and c.host_ptr in stage_of
        ]
        for d, actions in enumerate(plan.per_device):
            mine = [(stage, kind) for stage, (dev, kind) in uploads if dev == d]
            assert mine[0] == (actions[0].stage, "copy"), (d, uploads)
        per_param = Counter(
            c.host_ptr for c in log if c.direction == "h2d" and c.host_ptr in stage_of
        )
        assert per_param == {ptr: 1 if s == last else 2 for ptr, s in stage_of.items()}
    model.synchronize()


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_every_upload_runs_on_the_copy_stream(devices):
    # Stages (Linear, Tanh), (Linear, Dropout), (Linear). On two devices, device 1's backward
    # run of stage 1 follows its forward run: that upload is copied in once the forward run has
    # ended; every other upload while the run before it computed or as the call started.
    model = RoundPipe(
        _model(),
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=[2, 2, 1]),
    )
    ptr = {p.data_ptr() for p in model.module.parameters()}
    x, y = _batch()
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    streams = _streams_of(model)
    kinds = Counter(
        streams[c.device, c.stream_id][1] for c in log if c.direction == "h2d" and c.host_ptr in ptr
    )
    assert kinds == Counter({"copy": 2 * (2 + 2) + 2}), kinds  # two params a stage


def test_a_first_upload_waits_for_the_params_of_the_step_before(monkeypatch):
    # The master->model copy that a step launches writes the host params the next call uploads;
    # slowed down, an upload that did not wait for its stage's "params ready" events would read
    # the params from before it, and the run would leave the CPU pool's result.
    from roundpipe.runtime.params import Params

    copy_masters = Params.copy_masters_to_model

    def slow(self, ready):
        time.sleep(0.05)
        copy_masters(self, ready)

    monkeypatch.setattr(Params, "copy_masters_to_model", slow)

    def run(pool):
        model = RoundPipe(
            _model(),
            optim_dtype=torch.float32,
            devices=pool,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        with OptimizerCtx():
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batch(8)
        for _ in range(4):
            model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        return [p.detach().clone() for p in model.module.parameters()]

    for a, b in zip(run("cpu"), run("emu:2")):
        assert torch.equal(a, b)


def test_one_device_waits_for_the_device_only_at_the_end_of_the_call(monkeypatch):
    from roundpipe.devices import AcceleratorBackend

    waits = []
    finish = AcceleratorBackend.finish
    monkeypatch.setattr(
        AcceleratorBackend, "finish", lambda self: (waits.append(1), finish(self))[1]
    )
    model = RoundPipe(
        _model(), devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    x, y = _batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    # The device is drained once, at the program's end: not once per action (5 stages x 4
    # microbatches x forward and backward), nor per gradient download (the optimizer thread
    # waits for those). The host's other waits are for a finished run whose memory a prefetch
    # takes (S s in the program; see tests/test_price.py).
    assert len(waits) == 1


def test_two_devices_hand_off_through_device_events(monkeypatch):
    from roundpipe.devices import AcceleratorBackend

    waits, events = [], []
    finish, record = AcceleratorBackend.finish, AcceleratorBackend.record_event
    monkeypatch.setattr(
        AcceleratorBackend, "finish", lambda self: (waits.append(self.device), finish(self))[1]
    )
    monkeypatch.setattr(
        AcceleratorBackend,
        "record_event",
        lambda self: (events.append(self.device), record(self))[1],
    )
    model = RoundPipe(
        _model(), devices="emu:2", model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    x, y = _batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    plan = model.plan()
    # Each stage's output (forward) and input gradients (backward) go to the other device with
    # a device event; the host waits for each device once, after its last action.
    handoffs = [a for a in plan.actions() if _hands_off(plan, a)]
    assert len(handoffs) == 2 * (5 - 1) * 4
    assert len(events) == len(handoffs)
    assert sorted(str(d) for d in waits) == ["emu:0", "emu:1"]


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_offloaded_stage_inputs_wait_in_pinned_host_memory_and_change_nothing(devices):
    x, y = _batch()
    cfg = RoundPipeRunConfig(num_microbatch=4, offload_activations=True)
    results = {}
    for pool, config in (
        ("cpu", cfg),
        (devices, cfg),
        (devices, RoundPipeRunConfig(num_microbatch=4)),
    ):
        model = RoundPipe(_model(), devices=pool, model_run_config=config)
        leaf = x.clone().requires_grad_()
        with emu.record_copies() as log:
            model.forward_backward(input_args=(leaf,), label=y, loss_fn=_loss)
        grads = [m.grad for m in model.optim_parameters()] + [leaf.grad]
        results[(pool, config.offload_activations)] = (grads, log)
    # Each stage before the last saves its input of each microbatch (batch 32 / 4 = 8 rows):
    # stage 0 gets 8 x 4 inputs, stage 1 8 x 6, stage 2 8 x 6, stage 3 8 x 5.
    # (The input's own gradient, 8 x 4 per microbatch, reaches the host through autograd, in
    # pageable memory: only the pinned copies are the runtime's.)
    _, log = results[(devices, True)]
    saved = Counter(
        c.numel for c in log if c.direction == "d2h" and c.pinned and c.numel in (32, 48, 40)
    )
    assert saved == Counter({32: 4, 48: 8, 40: 4}), saved
    _, kept = results[(devices, None)]
    assert not any(c.direction == "d2h" and c.pinned and c.numel in (32, 48, 40) for c in kept)
    # Same gradients, the input's included, with and without the offload and on the CPU.
    reference = results[("cpu", True)][0]
    for key in ((devices, True), (devices, None)):
        for a, b in zip(reference, results[key][0]):
            assert torch.equal(a, b), key


def _saved_offloads(log):
    """Pinned downloads of stage inputs (8 rows of 4, 6 or 5 floats), by size."""
    return Counter(
        c.numel for c in log if c.direction == "d2h" and c.pinned and c.numel in (32, 48, 40)
    )


@pytest.mark.parametrize(
    "budget,offloaded,prefetched",
    [
        (10**9, Counter(), True),  # room for everything
        (560 + 1000, Counter({48: 6, 40: 4}), True),  # stage 0's and two of stage 1's kept
        (1, Counter({32: 4, 48: 8, 40: 4}), False),  # nothing fits
    ],
)
def test_a_device_memory_budget_decides_prefetch_and_offload(budget, offloaded, prefetched):
    # On one emulated device the largest stage (Linear(6, 5): 140 bytes of fp32 weights and
    # 140 of gradient sums) reserves 2 x 280 = 560 bytes; the saved inputs of a microbatch are
    # 8 x 4, 8 x 6, 8 x 6 and 8 x 5 floats for stages 0 to 3.
    x, y = _batch()
    model = RoundPipe(
        _model(),
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=4, device_memory_budget=budget),
    )
    backend = model._pool.backends[0]
    ptr = {p.data_ptr() for p in model.module.parameters()}
    with emu.record_copies() as log:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert _saved_offloads(log) == offloaded
    streams = {c.stream_id for c in log if c.direction == "h2d" and c.host_ptr in ptr}
    assert (backend.copy_stream.stream_id in streams) == prefetched
    ref = RoundPipe(_model(), devices="cpu", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    ref.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    for a, b in zip(model.optim_parameters(), ref.optim_parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_bad_device_memory_budget_is_refused():
    with pytest.raises(ValueError, match="device_memory_budget"):
        RoundPipeRunConfig(device_memory_budget=0)
