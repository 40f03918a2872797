"""RoundPipeRunConfig(overlap_recompute=True) on the emulated accelerator (see
[Note: overlapped recompute] in roundpipe/runtime/stage_ops.py): the next microbatch's recompute
runs on the device's helper thread while the worker takes this one's gradients; training is
bitwise the run without it; the memory plan counts the recompute made ahead; errors on either
thread reach the caller as their own type, and nothing of a failed call runs after it."""

import collections
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.plan import ActionKind

memory = torch.get_device_module("emu")
M = 4


def _model():
    torch.manual_seed(0)
    # Stage 2 draws random numbers (dropout): it stays out of the overlap.
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Linear(32, 4)
    )


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8 * M, 8, generator=g), torch.randint(0, 4, (8 * M,), generator=g)


def _loss(out, y):
    return F.cross_entropy(out.float(), y)


def _wrap(seq, devices, overlap, **cfg):
    return RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=M, overlap_recompute=overlap, **cfg),
    )


@pytest.mark.parametrize("devices", ["emu", "emu:2"])
def test_training_with_the_recompute_ahead_is_bitwise_the_run_without(devices):
    def run(overlap):
        model = _wrap(_model().half(), devices, overlap)
        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = _batch()
        for _ in range(3):
            model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        return {k: v.clone() for k, v in model.module.state_dict().items()}

    ref, got = run(False), run(True)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_the_helper_thread_recomputes_all_but_each_stages_first_microbatch():
    seq = _model()
    model = _wrap(seq, "emu", True)
    calls = collections.defaultdict(collections.Counter)  # stage -> thread name -> calls

    def record(stage):
        def hook(module, args):
            if torch.is_grad_enabled():  # a recompute (the forward pass runs without grad)
                calls[stage][threading.current_thread().name] += 1

        return hook

    x, y = _batch()
    # The first call learns which stages draw random numbers (those it probes run in the RNG
    # chain, so on the worker); the second shows the steady state.
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    for i, layer in enumerate(seq):
        layer.register_forward_pre_hook(record(i))
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    plan = model.plan(inputs=((x,), {}))
    ahead = plan.overlapped_recomputes()
    backward_stages = {a.stage for a in plan.actions() if a.kind is ActionKind.BACKWARD}
    assert ahead == {(s, m) for s in backward_stages for m in range(M - 1)}
    helper, worker = "roundpipe-recompute-emu:0", "roundpipe-worker-emu:0"
    for s in backward_stages - {2}:
        assert calls[s] == {worker: 1, helper: M - 1}, (s, calls[s])
    assert calls[2] == {worker: M}  # the dropout stage recomputes on the worker only
    without = _wrap(_model(), "emu", False).plan(inputs=((x,), {}))
    assert without.overlapped_recomputes() == frozenset()


def test_a_reload_between_two_backwards_keeps_the_recompute_on_the_worker():
    model = _wrap(_model(), "emu", True, offload_activations=True)
    x, _ = _batch()
    plan = model.plan(inputs=((x,), {}))
    for program in plan.program:
        for before, after in zip(program, program[1:]):
            if after.kind is ActionKind.RELOAD and before.kind is ActionKind.BACKWARD:
                assert (before.stage, before.mb_index) not in plan.overlapped_recomputes()


def _measured_peak(model, x, y):
    base = memory.memory_allocated(0)
    memory.reset_peak_memory_stats(0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    return memory.max_memory_allocated(0) - base


def test_the_memory_plan_counts_the_recompute_made_ahead():
    x, y = _batch()
    peaks = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        seq = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)), nn.Linear(64, 4))
        model = _wrap(seq, "emu", overlap)
        x64 = torch.randn(8 * M, 64)
        planned = model.memory_plan(input_args=(x64,), label=y, loss_fn=_loss).devices[0].peak
        measured = _measured_peak(model, x64, y)
        peaks[overlap] = planned, measured
        assert measured <= planned * 1.01, (overlap, planned, measured)
    assert peaks[True][0] > peaks[False][0]  # one more microbatch's recompute is counted


class _FailsOnCall(nn.Linear):
    """Raises on its ``fail_at``-th call with grad enabled (a recompute)."""

    def __init__(self):
        super().__init__(8, 8)
        self.fail_at, self.count, self.failed_on = -1, 0, None

    def forward(self, x):
        if torch.is_grad_enabled():
            self.count += 1
            if self.count == self.fail_at:
                self.failed_on = threading.current_thread().name
                raise ValueError(f"recompute number {self.count} failed")
        return super().forward(x)


def test_a_recompute_that_fails_on_the_helper_raises_as_its_own_type_in_its_backward():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), _FailsOnCall(), nn.Linear(8, 4))
    model = _wrap(seq, "emu", True)
    x, y = _batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)  # learns: no RNG
    seq[1].count, seq[1].fail_at = 0, 3  # microbatch 2's recompute, made ahead
    with pytest.raises(ValueError, match="recompute number 3 failed") as info:
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert seq[1].failed_on == "roundpipe-recompute-emu:0"
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "stage 1" in notes and "microbatch 2" in notes, notes
    seq[1].fail_at = -1
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert torch.isfinite(loss)


class _BackwardFails(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _BackwardFails.calls += 1
        if _BackwardFails.calls == 2:  # microbatch 1's, while microbatch 2's recompute is ahead
            raise RuntimeError("backward failed")
        return g


class _Through(nn.Module):
    def forward(self, x):
        return _BackwardFails.apply(x)


def test_a_backward_that_fails_while_a_recompute_is_ahead_leaves_nothing_running():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), _Through(), nn.Linear(8, 4))
    model = _wrap(seq, "emu", True)
    x, y = _batch()
    _BackwardFails.calls = -100
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)  # learns: no RNG
    _BackwardFails.calls = 0
    with pytest.raises(RuntimeError, match="backward failed"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    allocated = memory.memory_allocated(0)
    # the next call runs whole; what the failed call left is gone, not still being computed
    _BackwardFails.calls = 10
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    assert memory.memory_allocated(0) <= allocated


# Tiles of 16 tokens: two per microbatch of 2 x 16.
@pytest.mark.parametrize("tile", [None, 16], ids=["untiled", "tiled MLPs"])
def test_a_hf_model_trains_bitwise_the_same_with_the_recompute_ahead(tile):
    """Tiled MLPs run again inside their backward on the stage's tensors, swapped in: their
    stages keep the recompute on the worker, and the model keeps its own parameters."""
    transformers = pytest.importorskip("transformers")
    import roundpipe

    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def run(overlap):
        torch.manual_seed(0)
        hf_model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
        own = list(hf_model.parameters())
        model = roundpipe.hf.wrap(
            hf_model,
            optim_dtype=torch.float32,
            devices="emu",
            mlp_tile_tokens=tile,
            model_run_config=RoundPipeRunConfig(num_microbatch=4, overlap_recompute=overlap),
        )
        with OptimizerCtx():
            opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            losses.append(model.forward_backward(input_kwargs=batch).item())
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        assert all(a is b for a, b in zip(hf_model.parameters(), own))
        assert all(p.device.type == "cpu" for p in hf_model.parameters())
        with OptimizerCtx():
            return losses, [p.detach().clone() for p in model.parameters()]

    (ref_losses, ref), (got_losses, got) = run(False), run(True)
    assert got_losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
