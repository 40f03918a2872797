"""Device memory on the emulated accelerator (see [Note: emulated device memory] in
roundpipe.testing.emu): what the streamed schedule keeps on a device, out-of-memory errors, and
device_memory_budget="auto"."""

import dataclasses
import gc

import pytest
import torch
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.testing import emu

WIDTH = 256
ROWS = 8  # per microbatch
STAGE = (WIDTH * WIDTH + WIDTH) * 4  # one Linear stage's fp32 weights, in bytes
ACTIVATION = ROWS * WIDTH * 4  # one stage input of one microbatch
SLACK = STAGE // 2  # the activations inside one action, and the loss (small against STAGE)
memory = torch.get_device_module("emu")


@pytest.fixture
def capacity():
    """Set the emulated devices' capacity for one test."""
    previous = emu.set_memory_capacity(None)
    yield emu.set_memory_capacity
    emu.set_memory_capacity(previous)


def _peak(
    num_stages,
    num_microbatch,
    iterations=2,
    devices="emu",
    dtype=torch.float32,
    memory_check=True,
    **cfg,
):
    """Device 0's peak bytes during the last iteration of a training loop, above what was in
    use before it, and the run's master parameters. ``memory_check=False``: no planned check
    before the first call (DeviceMemoryError), so a run that does not fit really runs out."""
    gc.collect()  # earlier models' device tensors
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(num_stages)]).to(dtype)
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, **cfg),
        memory_check=memory_check,
    )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(ROWS * num_microbatch, WIDTH, generator=torch.Generator().manual_seed(1))
    for _ in range(iterations):
        model.synchronize()
        base = memory.memory_allocated(0)
        memory.reset_peak_memory_stats(0)
        model.forward_backward(
            input_args=(x.to(dtype),), loss_fn=lambda out, _: out.float().square().mean()
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return (
        memory.max_memory_allocated(0) - base,
        [p.detach().clone() for p in model.optim_parameters()],
    )


def test_device_memory_is_counted_per_storage_until_torch_frees_it(capacity):
    base = memory.memory_allocated(1)
    x = torch.ones(1000, device="emu:1")
    assert memory.memory_allocated(1) == base + 4000
    view = (x * 2)[10:]  # a fresh result, kept alive by its view
    del x
    assert memory.memory_allocated(1) == base + 4000
    memory.reset_peak_memory_stats(1)
    del view
    assert memory.memory_allocated(1) == base
    assert memory.max_memory_allocated(1) == base + 4000
    capacity(base + 6000)
    with emu.rules_set(reserved_memory=False):  # free: what the live storages leave
        assert memory.mem_get_info(1) == (6000, base + 6000)
    free, _ = memory.mem_get_info(1)  # what the segments leave (see the tests below)
    assert free + memory.memory_reserved(1) - memory.memory_allocated(1) == 6000
    kept = torch.ones(1000, device="emu:1")
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"emu:1 out of memory: tried to allocate "
        r"4000 bytes",
    ):
        torch.ones(1000, device="emu:1")
    assert memory.memory_allocated(1) == base + 4000
    del kept


@pytest.mark.parametrize("num_stages", [4, 8])
@pytest.mark.parametrize("num_microbatch", [4, 16])
def test_a_device_holds_two_stages_and_the_saved_stage_inputs(num_stages, num_microbatch):
    # Two stages' device bytes (upload plus gradient sum each): the running stage and the
    # prefetched one, whatever the number of stages; plus every microbatch's stage inputs, and
    # the hand-off between two stages (every microbatch's output, or input gradient).
    peak, _ = _peak(num_stages, num_microbatch)
    saved = num_stages * num_microbatch * ACTIVATION
    assert peak - saved <= 2 * (2 * STAGE) + num_microbatch * ACTIVATION + SLACK
    assert peak - saved > 2 * STAGE  # a stage and its gradient sum were there


def test_offloaded_stage_inputs_leave_the_device():
    peak, _ = _peak(8, 16, offload_activations=True)
    assert peak <= 2 * (2 * STAGE) + 16 * ACTIVATION + SLACK


def test_without_recompute_every_forward_upload_stays():
    # The bound above is not loose: without recompute a device keeps each stage's upload for
    # its backward.
    peak, _ = _peak(8, 4, recompute=False)
    assert peak > 8 * STAGE


def test_out_of_memory_names_the_stage_and_the_model_stays_usable(capacity):
    # Without the planned check (which would refuse this run before it allocates, see
    # tests/test_memory_plan.py), the run really runs out.
    capacity(3 * STAGE + STAGE // 2)
    with pytest.raises(torch.OutOfMemoryError) as info:
        _peak(8, 4, memory_check=False)
    assert any("[roundpipe stage" in note for note in getattr(info.value, "__notes__", []))
    capacity(None)
    _peak(8, 4)


def test_an_auto_budget_fits_where_no_budget_runs_out(capacity):
    # 3.5 stages: too small for two stages and their gradient sums (the unbudgeted schedule),
    # enough for one with its sum when nothing is prefetched and the stage inputs wait on the
    # host. "auto" reads the room from mem_get_info and gets there; the results do not change.
    _, expected = _peak(8, 4)
    capacity(3 * STAGE + STAGE // 2)
    peak, got = _peak(8, 4, device_memory_budget="auto")
    assert peak <= 3 * STAGE + STAGE // 2
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_budget_setting_is_checked():
    RoundPipeRunConfig(device_memory_budget="auto")
    with pytest.raises(ValueError, match='None, "auto" or a positive int'):
        RoundPipeRunConfig(device_memory_budget="lots")


# -- gradient sums in the stage's dtype ---------------------------------------------------

HALF_STAGE = STAGE // 2  # one Linear stage's fp16 weights


def test_fp16_gradient_sums_make_a_stage_weights_plus_gradients_of_its_own_dtype():
    # The bound in its own terms: two stages of fp16 weights and fp16 gradients, plus
    # the saved inputs and one hand-off. fp32 sums (the default) exceed it by about a stage's
    # fp16 weights; fp16 sums fit.
    saved = 4 * 4 * ACTIVATION // 2
    bound = 2 * (2 * HALF_STAGE) + saved + 4 * ACTIVATION // 2 + HALF_STAGE // 2
    fp32_sums, _ = _peak(4, 4, dtype=torch.float16)
    fp16_sums, _ = _peak(4, 4, dtype=torch.float16, device_grad_dtype=torch.float16)
    assert fp16_sums <= bound < fp32_sums


def test_fp16_gradient_sums_round_once_per_microbatch():
    # One microbatch: nothing to sum, the same masters as the CPU pool bit for bit. Four: the
    # fp16 sum rounds three times, close to the CPU pool's fp32 sum.
    for num_microbatch, exact in ((1, True), (4, False)):
        _, ref = _peak(4, num_microbatch, devices="cpu", dtype=torch.float16)
        _, got = _peak(4, num_microbatch, dtype=torch.float16, device_grad_dtype=torch.float16)
        for a, b in zip(ref, got):
            assert b.dtype == torch.float32
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)


def test_device_grad_dtype_is_checked():
    with pytest.raises(ValueError, match="device_grad_dtype must be None"):
        RoundPipeRunConfig(device_grad_dtype=torch.int8)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"is_causal": True}, id="causal"),
        pytest.param({"mask": True}, id="mask"),
        pytest.param({"bool_mask": True}, id="bool-mask"),
        pytest.param({"is_causal": True, "gqa": True}, id="causal-gqa"),
        pytest.param({"dropout_p": 0.5}, id="dropout-math"),
    ],
)
def test_attention_on_emu_computes_what_the_cpu_does_without_holding_the_scores(kwargs):
    heads, tokens, dim = 4, 256, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, dim) for _ in range(3))
    if kwargs.get("gqa"):
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    mask = None
    if kwargs.get("mask"):  # left padding: the first 10 keys are masked out
        mask = torch.zeros(1, 1, tokens, tokens)
        mask[..., :10] = float("-inf")
    if kwargs.get("bool_mask"):  # causal with left padding, as transformers builds it
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None].clone()
        mask[..., :10] = False
        mask[..., :10, 0] = True  # no row fully masked
    call = {
        "is_causal": kwargs.get("is_causal", False),
        "dropout_p": kwargs.get("dropout_p", 0.0),
        "enable_gqa": bool(kwargs.get("gqa")),
    }

    def run(device):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            *leaves, attn_mask=None if mask is None else mask.to(device), **call
        )
        out.sum().backward()
        return out, [t.grad for t in leaves]

    gc.collect()
    memory.reset_peak_memory_stats(0)
    before = memory.memory_allocated(0)
    out, grads = run("emu")
    peak = memory.max_memory_allocated(0) - before
    ref, ref_grads = run("cpu")
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0)
    scores = heads * tokens * tokens * 4
    if call["dropout_p"] == 0:  # the fused kernel: no (tokens x tokens) scores on the device
        assert peak < scores, (peak, scores)
    else:  # the math path, as on the CPU: the scores exist
        assert peak >= scores, (peak, scores)


# -- what a GPU reserves (see [Note: emulated device memory]) -------------------------------

MIB = 1 << 20
SPARE = 3  # a device no other test of this file allocates on


@pytest.fixture
def overheads():
    previous = emu.set_gpu_overheads()
    yield emu.set_gpu_overheads
    emu.set_gpu_overheads(**dataclasses.asdict(previous))


def _spare_device_empty():
    gc.collect()
    memory.empty_cache()
    assert memory.memory_allocated(SPARE) == 0 and memory.memory_reserved(SPARE) == 0


def test_a_device_reserves_segments_as_cudas_caching_allocator_does():
    _spare_device_empty()
    memory.reset_peak_memory_stats(SPARE)
    x = torch.ones(1000, device=f"emu:{SPARE}")  # a block of a 2 MiB segment
    assert memory.memory_allocated(SPARE) == 4000
    assert memory.memory_reserved(SPARE) == 2 * MIB
    y = torch.ones(3 * MIB // 4, device=f"emu:{SPARE}")  # 3 MiB: a 20 MiB segment
    assert memory.memory_reserved(SPARE) == 22 * MIB
    del y
    assert memory.memory_reserved(SPARE) == 22 * MIB  # cached, not given back
    memory.empty_cache()
    assert memory.memory_reserved(SPARE) == 2 * MIB
    assert memory.max_memory_reserved(SPARE) == 22 * MIB
    with emu.rules_set(reserved_memory=False):
        assert memory.memory_reserved(SPARE) == memory.memory_allocated(SPARE) == 4000
    del x


def test_free_memory_leaves_out_the_reserve_the_context_and_the_workspaces(capacity, overheads):
    _spare_device_empty()
    capacity(1 << 30)
    overheads(context=300 * MIB, cublas_workspace=emu.HOPPER_CUBLAS_WORKSPACE)
    device = torch.device(f"emu:{SPARE}")
    x = torch.ones(64, 64, device=device)
    before = emu.overheads_held(device)
    side = torch.Stream(device=device)
    side.wait_stream(torch.accelerator.current_stream(device))
    with side:  # a stream's first matmul: a workspace of its own
        y = x @ x
    assert emu.overheads_held(device) == before + 32 * MIB
    free, total = memory.mem_get_info(device)
    assert total == 1 << 30
    assert free == total - memory.memory_reserved(device) - emu.overheads_held(device)
    assert free <= total - 300 * MIB - 32 * MIB - 2 * MIB
    side.synchronize()
    del x, y


def test_a_capacity_that_counts_reserved_memory_runs_out_where_a_gpu_would(capacity):
    _spare_device_empty()
    capacity(3 * MIB, counts_reserved=True)
    device = torch.device(f"emu:{SPARE}")
    kept = torch.empty(MIB // 4, device=device)  # 1 MiB: a 2 MiB segment of the current stream
    other = torch.Stream(device=device)
    other.wait_stream(torch.accelerator.current_stream(device))
    with other, pytest.raises(torch.OutOfMemoryError, match="needs a new segment of 2097152"):
        torch.empty(MIB // 4, device=device)  # 2 MiB live would fit; a second segment does not
    del kept
    with other:  # the first stream's free segment goes back, and then it fits
        fits = torch.empty(MIB // 4, device=device)
    assert memory.memory_reserved(device) == 2 * MIB
    del fits


def test_a_block_record_stream_gave_to_another_stream_waits_for_that_stream(capacity):
    _spare_device_empty()
    device = torch.device(f"emu:{SPARE}")
    current = torch.accelerator.current_stream(device)
    other = torch.Stream(device=device)
    x = torch.ones(3 * MIB, device=device)  # 12 MiB: a segment of its own
    other.wait_stream(current)
    with other:
        total = x.sum()
    x.record_stream(other)
    reserved = memory.memory_reserved(device)
    del x
    y = torch.empty(3 * MIB, device=device)  # the block still waits for `other`
    assert memory.memory_reserved(device) == reserved + 12 * MIB
    del y
    other.synchronize()
    z = torch.empty(3 * MIB, device=device)  # reused: no third segment
    assert memory.memory_reserved(device) == reserved + 12 * MIB
    del z, total
