"""Long sequences at wrap's defaults (roundpipe.hf.defaults): the loss chunk chosen from the
device's memory and the vocabulary, activation offload chosen per call where the kept stage
inputs would not fit, a refusal that names the longest sequence that fits (a search over the
memory plan), all on the emulated device with a capacity."""

import gc
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe import DeviceMemoryError, RoundPipeRunConfig  # noqa: E402
from roundpipe.hf.defaults import (  # noqa: E402
    KEPT_INPUTS_SHARE,
    LOSS_CHUNK_BYTES,
    default_loss_chunk_tokens,
    kept_input_bytes,
    offload_needed,
)
from roundpipe.memory.search import longest_fitting  # noqa: E402
from roundpipe.testing import emu  # noqa: E402

memory = torch.get_device_module("emu")
MIB = 1 << 20
VOCAB = 8192


@pytest.fixture
def capacity():
    previous = emu.set_memory_capacity(None)
    yield emu.set_memory_capacity
    emu.set_memory_capacity(previous)


def _model(layers=12, hidden=256):
    # fp32 weights: the CPU's bf16 matmuls are slow, and the device bytes scale the same way.
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _batch(rows, seq_len):
    ids = torch.randint(VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_the_loss_chunk_shrinks_with_the_device_and_the_vocabulary():
    # No device: the cap alone (512 MiB of fp32 logits; a 152k vocabulary gets 512 tokens).
    assert default_loss_chunk_tokens(151936) == 512
    assert default_loss_chunk_tokens(VOCAB) * 4 * VOCAB == LOSS_CHUNK_BYTES
    # A 24 GiB device: 384 MiB of logits; a 64 MiB one: 1 MiB, 32 tokens of an 8k vocabulary.
    assert default_loss_chunk_tokens(151936, 24 << 30) == 512
    assert default_loss_chunk_tokens(VOCAB, 64 * MIB) == 32
    assert default_loss_chunk_tokens(VOCAB, 4 * MIB) == 16  # the floor
    assert default_loss_chunk_tokens(VOCAB, 96 * MIB) == 32  # a power of two, rounded down


def test_offload_is_chosen_where_the_kept_inputs_take_more_than_their_share():
    kept = kept_input_bytes(num_layers=12, tokens=1024, hidden_size=256, itemsize=4)
    assert kept == 13 * MIB  # one hidden state per decoder layer and the head
    assert offload_needed(kept, int(kept / KEPT_INPUTS_SHARE) - 1)
    assert not offload_needed(kept, int(kept / KEPT_INPUTS_SHARE))
    assert not offload_needed(kept, None)  # a CPU pool computes in host memory


def test_offload_is_not_chosen_where_the_host_has_not_the_kept_inputs_free():
    kept = kept_input_bytes(num_layers=12, tokens=1024, hidden_size=256, itemsize=4)
    device = int(kept / KEPT_INPUTS_SHARE) - 1  # a device they would take too much of
    assert offload_needed(kept, device, host_free=kept)
    assert not offload_needed(kept, device, host_free=kept - 1)  # the host would be short
    assert offload_needed(kept, device, host_free=None)  # unknown: the device decides


def test_wraps_default_keeps_the_inputs_on_the_device_when_the_host_has_no_room(
    capacity, monkeypatch
):
    """The stage inputs of 2 x 512 tokens (13 MiB) would take more than a quarter of a 40 MiB
    device: wrap offloads them, unless the host has less than that free, where offloading
    would only move the shortfall to the host (the plan command's choice, see
    roundpipe.hf.memory_cli.ConfigPlanner.plans)."""
    import sys

    model = roundpipe.hf.wrap(_model(), devices="emu", check=False)
    batch = _batch(2, 512)
    capacity(40 * MIB)
    assert model.fitting_run_config(batch, None).offload_activations is True
    kept = kept_input_bytes(num_layers=12, tokens=1024, hidden_size=256, itemsize=4)
    wrap_module = sys.modules["roundpipe.hf.wrap"]
    monkeypatch.setattr(wrap_module, "host_memory_available", lambda: kept - 1)
    assert model.fitting_run_config(batch, None) is None


@pytest.mark.parametrize("high,step,edge", [(100, 1, 37), (100, 1, 100), (100, 1, 0), (96, 8, 41)])
def test_longest_fitting_is_the_edge_of_the_verdict(high, step, edge):
    asked = []

    def fits(n):
        asked.append(n)
        return n <= edge

    assert longest_fitting(fits, high, step) == edge // step * step
    assert asked[0] == high // step * step  # what fits costs one plan
    assert len(asked) <= (high // step).bit_length() + 1


def test_a_sequence_the_old_defaults_refuse_trains_at_the_new_defaults_as_planned(capacity):
    """12 layers of hidden 256, 2 x 512 tokens, a 40 MiB device. With the old defaults (a loss
    chunk of the cap's fp32 logits: never chunked here; no offload) the plan needs about 119 MiB
    and the first forward_backward is refused; wrap's defaults choose a 16-token chunk and
    offload (13 MiB of kept inputs is more than a quarter of 40 MiB), and the run's peak on the
    emulated device is the planned one."""
    hf = _model()
    batch = _batch(2, 512)
    capacity(40 * MIB)
    old = roundpipe.hf.wrap(
        hf,
        devices="emu",
        check=False,
        loss_chunk_tokens=default_loss_chunk_tokens(VOCAB),
        model_run_config=RoundPipeRunConfig(offload_activations=False),
    )
    assert not old.memory_plan(input_kwargs=batch).fits
    del old
    gc.collect()

    model = roundpipe.hf.wrap(hf, devices="emu", check=False)
    assert model.module[-1].chunk_tokens == 16
    assert model.fitting_run_config(batch, None).offload_activations is True
    plan = model.memory_plan(input_kwargs=batch)
    assert plan.fits, str(plan)
    gc.collect()
    memory.reset_peak_memory_stats(0)
    base = memory.memory_allocated(0)
    loss = model.forward_backward(input_kwargs=batch)
    measured = memory.max_memory_allocated(0) - base
    assert torch.isfinite(loss)
    planned = plan.devices[0].peak
    print(f"planned {planned} measured {measured} ({planned / measured - 1:+.2%})")
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


def test_an_explicit_offload_setting_is_kept():
    model = roundpipe.hf.wrap(
        _model(layers=2, hidden=64),
        devices="emu",
        check=False,
        model_run_config=RoundPipeRunConfig(offload_activations=False),
    )
    huge = _batch(1, 4096)
    assert model.fitting_run_config(huge, None) is None
    call = RoundPipeRunConfig(offload_activations=False)
    assert model.fitting_run_config(huge, call) is call


def test_a_refusal_names_the_longest_sequence_that_fits(capacity):
    model = roundpipe.hf.wrap(_model(layers=2, hidden=64), devices="emu", check=False)
    capacity(24 * MIB)
    with pytest.raises(DeviceMemoryError, match="longest sequence that fits") as refused:
        model.forward_backward(input_kwargs=_batch(1, 1024))
    longest = int(re.search(r"at these settings: (\d+) tokens", str(refused.value)).group(1))
    assert 0 < longest < 1024
    # The edge of the plan's verdict, as the search over it promises.
    assert model.memory_plan(input_kwargs=_batch(1, longest)).fits
    assert not model.memory_plan(input_kwargs=_batch(1, longest + 1)).fits
