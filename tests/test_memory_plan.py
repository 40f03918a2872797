"""Memory plans (model.memory_plan, roundpipe.plan.device_peaks): the planned device peak against
the peak the emulated device measures for a real forward_backward of the same batch, the
report, stages fake tensors cannot run, a plan that changes nothing, and the check of the first
forward_backward (DeviceMemoryError)."""

import dataclasses
import gc
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import (
    DeviceMemoryError,
    GradScaler,
    OptimizerCtx,
    RoundPipe,
    RoundPipeRunConfig,
    StageNotTraceable,
)
from roundpipe.memory import trace as memory_trace
from roundpipe.plan import ActionBytes, PlanSizes, StageBytes, build_plan, device_peaks
from roundpipe.testing import emu

memory = torch.get_device_module("emu")


@pytest.fixture
def capacity():
    previous = emu.set_memory_capacity(None)
    yield emu.set_memory_capacity
    emu.set_memory_capacity(previous)


class Block(nn.Module):
    """A pre-norm transformer block: attention (torch's SDPA) and an MLP with dropout."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)
        )
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


def gpt(vocab=512, d=64, layers=3, heads=4):
    torch.manual_seed(0)
    blocks = [Block(d, heads) for _ in range(layers)]
    return nn.Sequential(
        nn.Embedding(vocab, d), *blocks, nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))
    )


def mlp(width=128, depth=4):
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        for _ in range(depth)
    ]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def _lm_batch(rows, seq, vocab=512):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(
        0, vocab, (rows, seq), generator=g
    )


def lm_loss(out, label):
    return F.cross_entropy(out.float().flatten(0, 1), label.flatten())


def _measured(model, x, y, loss_fn):
    """Each device's peak above what it held before, for one real forward_backward."""
    gc.collect()
    n = len(model.plan().per_device)
    base = [memory.memory_allocated(d) for d in range(n)]
    for d in range(n):
        memory.reset_peak_memory_stats(d)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    return [memory.max_memory_allocated(d) - base[d] for d in range(n)]


CASES = {
    # name: (model, dtype, devices, config, batch, sequence)
    "mlp fp16, 4 microbatches": (mlp, torch.float16, "emu", {"num_microbatch": 4}, 64, None),
    "mlp fp16, offloaded inputs": (
        mlp, torch.float16, "emu", {"num_microbatch": 4, "offload_activations": True}, 64, None,
    ),
    "mlp fp32, no recompute": (mlp, torch.float32, "emu", {"num_microbatch": 2, "recompute": False}, 32, None),
    "gpt fp32, bf16 autocast": (gpt, torch.float32, "emu", {"num_microbatch": 2, "autocast": torch.bfloat16}, 4, 64),
    "gpt bf16, two devices": (gpt, torch.bfloat16, "emu:2", {"num_microbatch": 2}, 4, 64),
    "gpt fp32, two devices, 3 microbatches": (gpt, torch.float32, "emu:2", {"num_microbatch": 3}, 2, 32),
}  # fmt: skip


def _case(case):
    """The model, inputs, labels and loss function of one of CASES."""
    make, dtype, devices, cfg, rows, seq = CASES[case]
    model = RoundPipe(
        make().to(dtype),
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(**cfg),
    )
    M = cfg["num_microbatch"]
    if seq is not None:
        return (model, *_lm_batch(rows * M, seq), lm_loss)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows * M, 128, generator=g)
    y = torch.randint(0, 10, (rows * M,), generator=g)

    def loss_fn(out, lbl):
        return F.cross_entropy(out.float(), lbl)

    return model, x, y, loss_fn


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_device_peak_is_the_measured_one_within_ten_percent(case):
    model, x, y, loss_fn = _case(case)
    plan = model.memory_plan(input_args=(x,), label=y, loss_fn=loss_fn)
    measured = _measured(model, x, y, loss_fn)
    planned = [d.peak for d in plan.devices]
    print(f"{case}: planned {planned}, measured {measured}")
    assert not plan.untraced and not plan.measured
    assert len(planned) == len(measured)
    for p, m in zip(planned, measured):
        assert abs(p - m) <= 0.1 * m, (case, planned, measured)


def test_the_report_names_every_term_and_the_largest():
    model = RoundPipe(gpt(), devices="emu", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = _lm_batch(4, 32)
    plan = model.memory_plan(input_args=(x,), label=y, loss_fn=lm_loss)
    text = str(plan)
    print(text)
    for expected in (
        "Memory plan: 2 microbatch(es) of 2 (batch 4)",
        "microbatch 0 inputs: (2, 32) int64",
        "Host RAM",
        "master copies",
        "optimizer state (estimated as Adam: 2 x masters)",
        "Device emu:0: peak",
        "stage weights and buffers (uploads)",
        "activations and workspace of the running action",
        "Stages, microbatch 0",
        "Largest term:",
    ):
        assert expected in text, expected
    where, term, nbytes = plan.largest
    assert nbytes == max(
        [b for _, b in plan.host.rows()[1:]] + [b for d in plan.devices for _, b in d.terms]
    )
    assert f"Largest term: {term} ({where})" in text
    # When the device peaks, in words, with the stage named by its layers; the compact label
    # (as print(model.plan()) writes the program) stays on the DeviceMemory.
    (dev,) = plan.devices
    assert re.fullmatch(r"[FLB][0-9]+\.[0-9]+", dev.at), dev.at
    assert dev.during.startswith("the ") and f"during {dev.during}" in text
    assert dev.at not in text
    assert "layer 4 (Sequential)" in text and "layer 1 (Block)" in text
    assert plan.fits
    assert [r.stage for r in plan.stages] == list(range(5))
    assert all(r.backward and r.backward > 0 for r in plan.stages)
    # Host terms: the masters and Adam's moments of every trainable parameter.
    numel = sum(p.numel() for p in model.parameters())
    assert plan.host.masters == 4 * numel and plan.host.optimizer == 8 * numel


def test_without_inputs_only_weights_count_and_the_report_says_so():
    model = RoundPipe(mlp(), devices="emu")
    plan = model.memory_plan()
    assert "No example inputs" in str(plan)
    assert plan.devices[0].peak >= 2 * max(s.upload_bytes for s in model._stages.stages(((0, 1),)))


def test_a_cpu_pool_plans_the_host_only():
    model = RoundPipe(mlp(), devices="cpu")
    x = torch.randn(16, 128)
    plan = model.memory_plan(input_args=(x,), label=torch.zeros(16, dtype=torch.long))
    assert plan.devices == ()
    assert plan.host.activations > 0  # the stage inputs and one stage's activations
    assert "No accelerator" in str(plan)


def test_device_peaks_walks_the_program_by_hand():
    # Two stages on one device, two microbatches: the peak is during L1.1, with stage 1 and
    # the prefetched stage 0 (200), stage 1's gradient sums (100, from L1.0 on), three kept
    # stage inputs (30), L1.0's input gradient for B0.0 (10) and L1.1's own activations (70).
    plan = build_plan(
        2, 2, 1, True, stage_major=True, sizes=PlanSizes((200, 200), ((10, 10), (10, 10)))
    )
    first = ActionBytes(input=10, output=10, forward_peak=5, backward_peak=50, backward_end=20)
    last = ActionBytes(input=10, backward_peak=70, backward_end=30, input_grad=10)
    (peak,) = device_peaks(
        plan, [StageBytes(100, 100), StageBytes(100, 100, 40)], [[first] * 2, [last] * 2]
    )
    assert peak.peak == 410 and str(peak.at) == "L1.1"
    assert dict(peak.terms) == {
        "weights": 200,
        "grads": 100,
        "action": 70,
        "inputs": 30,
        "handoffs": 10,
    }


# -- stages that fake tensors cannot run ------------------------------------------------------


class DataDependent(nn.Module):
    """Its output's shape depends on the values: fake tensors cannot run it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        kept = x[x > 0]  # a data-dependent shape
        return self.lin(x) + kept.sum()


def _untraceable():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), DataDependent(), nn.Linear(16, 4))


def test_a_stage_fake_tensors_cannot_run_is_measured_on_the_cpu():
    model = RoundPipe(_untraceable(), devices="emu")
    x = torch.randn(8, 16)
    plan = model.memory_plan(input_args=(x,), label=torch.zeros(8, dtype=torch.long))
    assert plan.measured == (1,) and not plan.untraced
    assert "Stage 1 could not run on fake tensors; measured with a real run on the CPU" in str(plan)


def test_a_large_untraceable_stage_is_reported_with_what_failed(monkeypatch):
    monkeypatch.setattr(memory_trace, "REAL_RUN_LIMIT", 0)
    model = RoundPipe(_untraceable(), devices="emu")
    x = torch.randn(8, 16)
    plan = model.memory_plan(input_args=(x,), label=torch.zeros(8, dtype=torch.long))
    assert sorted(plan.untraced) == [1, 2]
    assert isinstance(plan.untraced[1], StageNotTraceable)
    assert "stage 1 (layer 1 (DataDependent)) could not run on fake tensors" in str(
        plan.untraced[1]
    )
    assert "its input is the output of stage 1" in str(plan.untraced[2])
    assert "Not counted: stage 1" in str(plan)


# -- a plan changes nothing -------------------------------------------------------------------


class Caches(nn.Module):
    """Keeps a tensor on itself during its forward, as rotary-embedding caches do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.cache = None

    def forward(self, x):
        if self.cache is None or self.cache.shape != x.shape:
            self.cache = torch.ones_like(x)
        return self.lin(x * self.cache)


def test_a_plan_changes_neither_the_model_the_rng_nor_the_scaler():
    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), Caches(), nn.Linear(16, 4)
    )
    model = RoundPipe(seq, devices="emu")
    state = {k: v.clone() for k, v in seq.state_dict().items()}
    scaler = GradScaler()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(out, lbl):
        return scaler.scale(F.cross_entropy(out.float(), lbl))

    rng = torch.get_rng_state()
    model.memory_plan(input_args=(x,), label=y, loss_fn=loss_fn)
    assert torch.equal(torch.get_rng_state(), rng)
    assert seq[3].cache is None
    for k, v in seq.state_dict().items():
        assert torch.equal(v, state[k]), k
    # The scaler still works: its scale was never made from a fake tensor.
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: (scaler.step(opt), opt.zero_grad()))
    scaler.update()
    model.synchronize()
    assert scaler.get_scale(up_to_date=True) == 65536.0


# -- the check of the first forward_backward --------------------------------------------------


def _mlp_model(**kwargs):
    return RoundPipe(
        mlp().half(),
        optim_dtype=torch.float32,
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        **kwargs,
    )


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 128, generator=g), torch.randint(0, 10, (256,), generator=g)


def _ce(out, lbl):
    return F.cross_entropy(out.float(), lbl)


def test_a_run_that_cannot_fit_raises_before_allocating(capacity):
    model = _mlp_model(name="tight")
    x, y = _mlp_batch()
    peak = model.memory_plan(input_args=(x,), label=y, loss_fn=_ce).devices[0].peak
    gc.collect()
    held = memory.memory_allocated(0)
    capacity(held + peak // 2)
    with emu.record_copies() as copies, pytest.raises(DeviceMemoryError) as info:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert copies == [] and memory.memory_allocated(0) == held  # nothing was allocated
    message = str(info.value)
    for expected in (
        "RoundPipe 'tight': this forward_backward would need about",
        roundpipe.memory.host.format_bytes(peak),
        "emu:0",
        roundpipe.memory.host.format_bytes(peak // 2),
        "stage weights and buffers (uploads)",
        "num_microbatch=8",
        "offload_activations=True",
        'device_memory_budget="auto"',
        "shorter sequences",
        "ROUNDPIPE_SKIP_MEMORY_CHECK=1",
    ):
        assert expected in message, expected
    # The same call again is checked again (it used to run, fail part way with a raw
    # OutOfMemoryError and leave device memory in use until gc.collect()): refused again, with
    # nothing allocated.
    with emu.record_copies() as copies, pytest.raises(DeviceMemoryError):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)
    assert copies == [] and memory.memory_allocated(0) == held
    capacity(None)
    model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)  # fits now: it runs


def test_the_check_passes_a_run_that_just_fits(capacity):
    # Measure the peak unchecked, then give the device 3% more than that: the planned peak
    # must not exceed it (no spurious DeviceMemoryError), and the run must fit.
    x, y = _mlp_batch()
    measured = _measured(_mlp_model(memory_check=False), x, y, _ce)[0]
    model = _mlp_model()
    gc.collect()
    capacity(memory.memory_allocated(0) + int(measured * 1.03))
    model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)


def test_the_check_can_be_skipped(capacity, monkeypatch):
    x, y = _mlp_batch()
    peak = _mlp_model().memory_plan(input_args=(x,), label=y, loss_fn=_ce).devices[0].peak
    gc.collect()
    capacity(memory.memory_allocated(0) + peak // 2)  # too small for this batch
    for model in (_mlp_model(memory_check=False), None):
        if model is None:
            monkeypatch.setenv("ROUNDPIPE_SKIP_MEMORY_CHECK", "1")
            model = _mlp_model()
        with pytest.raises(torch.OutOfMemoryError) as info:
            model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)
        assert not isinstance(info.value, DeviceMemoryError)


def test_the_check_leaves_the_devices_reserve_free(capacity, monkeypatch):
    # A device whose reserve (on a GPU: cuBLAS's workspaces, the allocator's rounding) does not
    # fit beside a peak that alone would: refused, and the reserve is named in the message.
    from roundpipe.devices.accelerator import AcceleratorBackend

    x, y = _mlp_batch()
    plain = _mlp_model().memory_plan(input_args=(x,), label=y, loss_fn=_ce).devices[0]
    assert plain.reserve == 0 and plain.reserve_note == ""  # the emulated device's default
    monkeypatch.setattr(
        AcceleratorBackend, "reserve", lambda self, peak: (peak // 2, "test workspaces")
    )
    model = _mlp_model(name="reserved")
    planned = model.memory_plan(input_args=(x,), label=y, loss_fn=_ce)
    assert planned.devices[0].reserve == plain.peak // 2
    assert "reserve (test workspaces)" in str(planned)
    gc.collect()
    capacity(memory.memory_allocated(0) + int(plain.peak * 1.2))  # the peak alone fits
    with pytest.raises(DeviceMemoryError, match=r"(?s)reserve \(test workspaces\)"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)


@pytest.fixture
def gpu_like(capacity):
    """The emulated device running out where a GPU would: a capacity that counts the caching
    allocator's segments and a 1 MiB cuBLAS workspace per stream that runs a matmul."""
    previous = emu.set_gpu_overheads(cublas_workspace=1 << 20)

    def give(nbytes):
        capacity(nbytes, counts_reserved=True)

    give(1 << 40)
    yield give
    emu.set_gpu_overheads(previous.context, previous.cublas_workspace)


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_reserve_covers_what_the_caching_allocator_holds(case, gpu_like):
    # A GPU holds more than the live tensors: segments per stream, 512-byte blocks, cuBLAS's
    # workspaces. The plan's peak plus its reserve must cover the peak the emulated device's
    # model of the caching allocator reserves (and the workspaces its streams took), and
    # overshoot it by no more than a small segment per allocating stream.
    from roundpipe.devices.accelerator import ALLOCATING_STREAMS, SMALL_SEGMENT

    model, x, y, loss_fn = _case(case)
    plan = model.memory_plan(input_args=(x,), label=y, loss_fn=loss_fn)
    n = len(plan.devices)
    gc.collect()
    memory.empty_cache()
    base = [memory.memory_reserved(d) + emu.overheads_held(d) for d in range(n)]
    for d in range(n):
        memory.reset_peak_memory_stats(d)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    for d, dev in enumerate(plan.devices):
        held = memory.max_memory_reserved(d) + emu.overheads_held(d) - base[d]
        planned = dev.peak + dev.reserve
        print(f"{case} device {d}: planned {planned}, held {held}, {planned / held:.3f}x")
        assert "segments" in dev.reserve_note and "cuBLAS workspaces" in dev.reserve_note
        assert held <= planned <= held + ALLOCATING_STREAMS * SMALL_SEGMENT, (case, d)


def test_a_run_whose_tensors_fit_but_whose_segments_do_not_is_refused(gpu_like, monkeypatch):
    # Near capacity the live tensors fit and the allocator's segments do not: the check, which
    # leaves the reserve free, refuses the call before anything is allocated; without the
    # reserve (the check as it was) the run fails part way with a raw OutOfMemoryError.
    from roundpipe.devices.accelerator import AcceleratorBackend

    x, y = _mlp_batch()
    model = _mlp_model(name="near")
    plan = model.memory_plan(input_args=(x,), label=y, loss_fn=_ce).devices[0]
    gc.collect()
    memory.empty_cache()
    gpu_like(memory.memory_reserved(0) + emu.overheads_held(0) + int(plan.peak * 1.5))
    with emu.record_copies() as copies, pytest.raises(DeviceMemoryError, match="segments"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_ce)
    assert copies == []
    monkeypatch.setattr(AcceleratorBackend, "reserve", lambda self, peak: (0, ""))
    unmargined = _mlp_model(name="unmargined")
    with pytest.raises(torch.OutOfMemoryError) as info:
        unmargined.forward_backward(input_args=(x,), label=y, loss_fn=_ce)
    assert not isinstance(info.value, DeviceMemoryError)


@pytest.mark.parametrize(
    "major, env, expected_mib",
    [
        (9, {}, 32 + 1),  # Hopper: torch's 4096 KiB x 8, plus cuBLASLt's 1 MiB
        (8, {}, 8.125 + 1),  # before: 4096 KiB x 2 + 16 KiB x 8
        (9, {"CUBLAS_WORKSPACE_CONFIG": ":4096:2"}, 8 + 1),
        (8, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "TORCH_CUBLASLT_WORKSPACE_SIZE": "0"}, 0.125),
    ],
)
def test_cublas_workspace_bytes_follow_torchs_defaults_and_settings(major, env, expected_mib):
    from roundpipe.devices.accelerator import cublas_workspace_bytes

    assert cublas_workspace_bytes(major, env) == int(expected_mib * 2**20)


def test_live_bytes_counts_each_storage_once_and_forgets_without_recounting():
    from roundpipe.memory.live import LiveBytes

    live = LiveBytes()
    assert live.add(1, 100) and live.add(2, 50)
    assert not live.add(1, 100)  # already counted
    assert (live.live, live.peak) == (150, 150)
    assert live.remove(1) == 100 and (live.live, live.peak) == (50, 150)
    live.reset_peak()
    assert live.peak == 50
    live.forget()  # storage 2 stays known: seen again, it is not counted again
    assert (live.live, live.peak) == (0, 0) and 2 in live and not live.add(2, 50)
    assert live.add(3, 10) and live.remove(2) == 0  # a forgotten storage's death changes nothing
    assert (live.live, live.peak) == (10, 10)


def test_a_model_on_the_meta_device_plans_but_refuses_to_run_by_name():
    with torch.device("meta"):
        seq = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).half()
    model = RoundPipe(seq, name="shapes", devices="emu", memory_check=False)
    x = torch.randn(4, 8)
    plan = model.memory_plan(input_args=(x,), label=torch.zeros(4, dtype=torch.long))
    assert plan.devices and plan.devices[0].peak > 0  # the plan works on shapes
    for run in (
        lambda: model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().sum()),
        lambda: model(x),
    ):
        with pytest.raises(
            RuntimeError,
            match=r"shapes.*'0\.weight' is on the meta device.*"
            r"can be planned \(memory_plan\(\), plan\(\)\) but not run",
        ):
            run()


def test_a_memo_plans_the_host_terms_and_describes_each_module_once(monkeypatch):
    # A length search plans one model many times (roundpipe.memory.report.TraceMemo): the host
    # terms and each module's description are the model's, not the call's.
    from roundpipe.memory.report import TraceMemo, reused_traces
    from roundpipe.runtime import call_memory

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)]
    model = RoundPipe(nn.Sequential(*blocks).half(), devices="emu")
    counts = {"host_terms": 0, "repr": 0}
    host_terms = call_memory.host_terms

    def counted(*args, **kwargs):
        counts["host_terms"] += 1
        return host_terms(*args, **kwargs)

    monkeypatch.setattr(call_memory, "host_terms", counted)
    monkeypatch.setattr(
        nn.Sequential, "extra_repr", lambda self: counts.update(repr=counts["repr"] + 1) or ""
    )

    def plan(rows):
        x = torch.randn(rows, 32).half()
        return model.memory_plan(
            input_args=(x,), label=x, loss_fn=lambda o, y: (o - y).pow(2).sum()
        )

    alone = [plan(rows) for rows in (8, 16)]
    assert counts["host_terms"] == 2
    counts.update(host_terms=0, repr=0)
    memo = TraceMemo()
    with reused_traces(memo):
        reused = [plan(rows) for rows in (8, 16)]
    assert counts["host_terms"] == 1
    assert counts["repr"] == 3  # each block's repr once, for two traces
    for a, b in zip(alone, reused):
        assert dataclasses.replace(a.host, available=None) == dataclasses.replace(
            b.host, available=None
        )
        assert [d.peak for d in a.devices] == [d.peak for d in b.devices]


def test_a_hooked_module_is_not_described():
    # A hook may keep or make tensors its repr does not show: such a stage is always traced.
    layer = nn.Linear(4, 4)
    assert memory_trace.describe_module(layer) is not None
    layer.register_forward_hook(lambda *args: None)
    assert memory_trace.describe_module(layer) is None
