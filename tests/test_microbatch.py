"""Splitting inputs and labels into microbatches, merging outputs."""

import pytest
import torch

from roundpipe.microbatch import merge_outputs, microbatch_sizes, split_inputs, split_label


class Spec:  # duck-typed torch.distributed.pipelining TensorChunkSpec
    def __init__(self, split_dim):
        self.split_dim = split_dim


def test_split_nested_inputs_and_replicate_non_tensors():
    x = torch.arange(10).view(5, 2)
    chunks, sizes = split_inputs((x, {"mask": torch.ones(5, 3)}), {"flag": True, "w": x}, 2)
    assert sizes == [3, 2]
    (a0, k0), (a1, k1) = chunks
    assert torch.equal(a0[0], x[:3]) and torch.equal(a1[0], x[3:])
    assert a1[1]["mask"].shape == (2, 3)
    assert k0["flag"] is True and torch.equal(k1["w"], x[3:])


def test_split_dim_spec():
    x = torch.randn(4, 6)
    chunks, sizes = split_inputs((x,), {}, 3, Spec(1))
    assert [c[0][0].shape for c in chunks] == [(4, 2)] * 3
    assert sizes == [2, 2, 2]
    chunks, _ = split_inputs((x, torch.randn(6, 1)), {}, 2, (1, 0))
    assert chunks[0][0][1].shape == (3, 1)


def test_split_per_leaf_none_replicates():
    x, table = torch.randn(4, 2), torch.randn(7, 3)
    chunks, _ = split_inputs((x, table), {}, 2, (0, None))
    assert chunks[1][0][1] is table


def test_callable_split():
    def split(args, kwargs, n):
        return [((args[0][i::n],), kwargs) for i in range(n)]

    chunks, sizes = split_inputs((torch.arange(6),), {}, 2, split)
    assert torch.equal(chunks[1][0][0], torch.tensor([1, 3, 5]))
    assert sizes == [3, 3]


def test_batch_smaller_than_num_microbatch():
    with pytest.raises(ValueError, match="3 samples cannot be split into 4 microbatches"):
        split_inputs((torch.randn(3, 2),), {}, 4)


def test_inconsistent_input_batch_sizes():
    with pytest.raises(ValueError, match="disagrees"):
        split_inputs((torch.randn(4, 2), torch.randn(5, 2)), {}, 2)


def test_label_batch_disagrees():
    _, sizes = split_inputs((torch.randn(8, 2),), {}, 2)
    with pytest.raises(ValueError, match="label batch size 6 .* input batch size 8"):
        split_label(torch.zeros(6), 2, sizes)
    with pytest.raises(ValueError, match="label batch size 6"):
        split_label(torch.zeros(6), 1, [8])


def test_label_split_and_none():
    parts = split_label({"y": torch.arange(5), "name": "z"}, 2, [3, 2])
    assert torch.equal(parts[1]["y"], torch.tensor([3, 4])) and parts[1]["name"] == "z"
    assert split_label(None, 3, [1, 1, 1]) == [None, None, None]


def test_merge_concat_and_weighted_scalar():
    outs = [(torch.ones(3, 2), torch.tensor(1.0)), (torch.zeros(1, 2), torch.tensor(5.0))]
    cat, mean = merge_outputs(outs, [3, 1])
    assert cat.shape == (4, 2)
    assert mean.item() == pytest.approx(1.0 * 3 / 4 + 5.0 / 4)


def test_merge_along_spec_dim():
    merged = merge_outputs([torch.ones(2, 3), torch.ones(2, 1)], [3, 1], Spec(1))
    assert merged.shape == (2, 4)


def test_merge_non_tensor_must_agree():
    assert merge_outputs([(torch.ones(1), "a", 3), (torch.ones(1), "a", 3)], [1, 1])[1:] == ("a", 3)
    with pytest.raises(ValueError, match="differs between microbatch 0 .* microbatch 1"):
        merge_outputs([(torch.ones(1), "a"), (torch.ones(1), "b")], [1, 1])
    with pytest.raises(ValueError, match="structure"):
        merge_outputs([(torch.ones(1),), (torch.ones(1), 1)], [1, 1])


class FakeCache:  # what HuggingFace models return as past_key_values with use_cache on
    def __init__(self, n):
        self.n = n

    def __repr__(self):
        return f"FakeCache({self.n})"


def test_a_differing_leaf_is_named_by_its_key_path():
    outs = [
        {"logits": torch.ones(1, 2), "extra": {"steps": [1, "a"]}},
        {"logits": torch.ones(1, 2), "extra": {"steps": [1, "b"]}},
    ]
    with pytest.raises(
        ValueError,
        match=r"output leaf extra\.steps\[1\] \(leaf 2\) differs "
        r"between microbatch 0 \('a'\)",
    ) as info:
        merge_outputs(outs, [1, 1])
    assert "use_cache" not in str(info.value)
    with pytest.raises(ValueError, match=r"output leaf \[1\] \(leaf 1\) differs"):
        merge_outputs([(torch.ones(1), "a"), (torch.ones(1), "b")], [1, 1])


def test_a_differing_cache_says_use_cache_false():
    outs = [{"logits": torch.ones(1, 2), "past_key_values": FakeCache(m)} for m in range(2)]
    with pytest.raises(
        ValueError,
        match=r"output leaf past_key_values \(leaf 1\) differs.*"
        r"key/value cache.*use_cache=False",
    ):
        merge_outputs(outs, [1, 1])


def test_whole_model_inference_on_a_huggingface_model_names_past_key_values():
    transformers = pytest.importorskip("transformers")
    import warnings

    from roundpipe import RoundPipe, RoundPipeRunConfig

    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one stage: not an nn.Sequential
        model = RoundPipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    ids = torch.randint(0, 32, (4, 6))
    with torch.no_grad():
        # Before: "output leaf 1 differs between microbatch 0 (DynamicCache(...))".
        # transformers 5.24 renamed the output key past_key_values to cache.
        with pytest.raises(
            ValueError, match=r"output leaf (past_key_values|cache) .*use_cache=False"
        ):
            model(ids)
        out = model(ids, use_cache=False)
        assert torch.allclose(out.logits, hf(ids, use_cache=False).logits, atol=1e-5)


def test_merge_callable():
    assert merge_outputs([1, 2, 3], [1, 1, 1], sum) == 6


def test_microbatch_sizes_match_tensor_split():
    for b in range(1, 12):
        for m in range(1, b + 1):
            sizes = [t.numel() for t in torch.tensor_split(torch.arange(b), m)]
            assert microbatch_sizes(b, m) == sizes
