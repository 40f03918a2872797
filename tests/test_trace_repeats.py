"""A memory trace runs four of a loop's equal pieces (roundpipe.memory.repeats): the MLP's
token tiles and the loss's chunks. Traced with the middle pieces stood in for and with every
piece run, each stage's bytes are the same, action by action, for full fine-tuning and LoRA,
with the Trainer's token statistics on, with and without the activation offload; a real run
never elides; and a trace computes the same ops at any length."""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.hf import loss as hf_loss  # noqa: E402
from roundpipe.memory import repeats, trace  # noqa: E402
from roundpipe.memory.report import TraceMemo, reused_traces  # noqa: E402
from roundpipe.testing import emu  # noqa: E402, F401  (installed by conftest)

# peft's own wrap of a transformers 5 model warns of transformers' renamed attribute.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def _llama(layers=2, vocab=32000, intermediate=8192):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _batch(rows, seq_len):
    ids = torch.randint(256, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class _Recorded(TraceMemo):
    """Every call traced afresh, its traces kept."""

    def __init__(self):
        super().__init__()
        self.traces = []

    def get(self, call, real_runs, trace_fn):
        self.traces.append(trace_fn())
        return self.traces[-1]


def _traced(model, batch, offload, elide=True):
    memo = _Recorded()
    with contextlib.ExitStack() as stack:
        if not elide:
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                trace, "elided", contextlib.nullcontext
            )
        stack.enter_context(reused_traces(memo))
        model.memory_plan(
            input_kwargs=batch, run_config=RoundPipeRunConfig(offload_activations=offload)
        )
    (traced,) = memo.traces
    assert not traced.untraced and not traced.measured
    return traced.bytes


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
def test_elided_traces_count_what_every_piece_run_counts(lora, offload):
    """At wrap's defaults on the emulated device: an MLP of 8,192 (tiles of 2,048 tokens) and a
    vocabulary of 32,000 (loss chunks of 2,048), one sequence of 11,000 tokens: 6 tiles, the
    last of 744, and 6 chunks, the last of 759 (the head's labels are shifted)."""
    model = _llama()
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"])
        )
    wrapped = roundpipe.hf.wrap(model, devices="emu")
    assert wrapped.module[1].mlp_tile_tokens == 2048 and wrapped.module[-1].chunk_tokens == 2048
    batch = _batch(1, 11000)
    elided = _traced(wrapped, batch, offload)
    every = _traced(wrapped, batch, offload, elide=False)
    assert elided == every
    assert any(b.backward_peak for row in every for b in row if b is not None)


def test_elided_traces_count_the_token_statistics_as_every_chunk_does():
    """The Trainer's token statistics (one row per token, kept from every chunk), at wrap's
    defaults: 6 loss chunks of 2,048 tokens."""
    wrapped = roundpipe.hf.wrap(_llama(layers=1), devices="emu")
    wrapped.module[-1].token_stats = True
    batch = _batch(1, 11000)
    assert _traced(wrapped, batch, False) == _traced(wrapped, batch, False, elide=False)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_an_elided_loss_runs_four_chunks_on_fake_tensors():
    """The chunked loss on fake tensors, 40 chunks and 5: elided, the same ops either way; a
    real run (outside the tracer's elision) computes every chunk, the same loss as one chunk."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    head = torch.nn.Linear(16, 32, bias=False)

    def ops(tokens):
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            hidden = torch.empty(tokens, 16, requires_grad=True)
            labels = torch.zeros(tokens, dtype=torch.long)
            weight = mode.from_tensor(head.weight).requires_grad_()
            counter = _Ops()
            with repeats.elided(), counter:
                total, _ = hf_loss._LinearCrossEntropy.apply(hidden, weight, None, labels, 4, False)
                total.backward()
        return counter.count

    assert ops(4 * 40) == ops(4 * 5)
    hidden = torch.randn(64, 16)
    labels = torch.randint(32, (64,))
    chunked = hf_loss.chunked_causal_lm_loss(hidden, head, labels, None, chunk_tokens=4)
    whole = hf_loss.chunked_causal_lm_loss(hidden, head, labels, None, chunk_tokens=64)
    torch.testing.assert_close(chunked, whole)


def test_a_trace_computes_the_same_ops_at_twice_the_length(monkeypatch):
    """11,000 and 22,000 tokens at wrap's defaults (6 and 11 MLP tiles and loss chunks of 2,048
    tokens): the tracer sees the same ops but for the stand-ins' allocations and views
    (``new_empty``, ``slice`` and the device queries around them), so a plan costs about the
    same at any length."""
    counts = []
    dispatch = trace._LiveBytes.__torch_dispatch__
    bookkeeping = ("aten.new_empty.", "aten.slice.", "prim.")

    def counted(self, func, types, args=(), kwargs=None):
        if not str(func).startswith(bookkeeping):
            counts[-1] += 1
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(trace._LiveBytes, "__torch_dispatch__", counted)
    wrapped = roundpipe.hf.wrap(_llama(), devices="emu")
    for tokens in (11000, 22000):
        counts.append(0)
        wrapped.memory_plan(input_kwargs=_batch(1, tokens))
    assert counts[0] == counts[1] > 0
