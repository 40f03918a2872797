"""Splitting a batch into microbatches and merging the microbatch outputs back.

Specs follow ``torch.distributed.pipelining.microbatch``: a ``TensorChunkSpec(dim)`` (any object
with a ``split_dim`` attribute, or a plain int) says along which dimension a tensor is split or
concatenated; ``None`` at a leaf replicates it. torch's module is not imported (it pulls in
``torch.distributed``, seconds of import time); its classes are accepted as they are.

* :func:`split_inputs` splits ``(args, kwargs)``: by default every tensor of dim >= 1 along dim 0,
  everything else replicated.
* :func:`split_label` splits the label the same way and checks that its batch size agrees.
* :func:`merge_outputs` concatenates tensors along their chunk dim, merges 0-d floating tensors as
  the mean weighted by microbatch size, and requires every other leaf to be equal across
  microbatches.

Any spec can instead be a callable that does the whole job (see each function).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["split_inputs", "split_label", "merge_outputs", "microbatch_sizes", "MicrobatchInfo"]

Chunk = tuple[tuple, dict]


def _is_replicate(x: Any) -> bool:
    # torch's pipelining uses both the class _Replicate and its instances for "replicate".
    return getattr(x, "__name__", None) == "_Replicate" or type(x).__name__ == "_Replicate"


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, int) or hasattr(x, "split_dim") or _is_replicate(x)


def _spec_dim(spec: Any) -> int | None:
    """None (replicate) or the split dimension of one leaf spec."""
    if spec is None or isinstance(spec, bool) or _is_replicate(spec):
        return None
    if isinstance(spec, int):
        return spec
    if hasattr(spec, "split_dim"):
        return int(spec.split_dim)
    raise ValueError(f"unsupported chunk spec {spec!r}: use TensorChunkSpec(dim), an int or None")


def _leaf_dims(tree: Any, spec: Any, what: str) -> list[int | None]:
    """Per flattened leaf of ``tree``: the split dim, or None to replicate."""
    leaves = pytree.tree_leaves(tree)
    if _is_spec_leaf(spec):
        # One spec for every tensor; None means the default, dim 0.
        d = 0 if spec is None else _spec_dim(spec)
        return [d if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in leaves]
    spec_leaves = pytree.tree_leaves(spec, is_leaf=_is_spec_leaf)
    if len(spec_leaves) != len(leaves):
        raise ValueError(
            f"the {what} spec has {len(spec_leaves)} leaves but the {what} has {len(leaves)}; "
            f"give one TensorChunkSpec/int/None per leaf, in the {what}'s structure"
        )
    dims = []
    for x, sp in zip(leaves, spec_leaves):
        d = _spec_dim(sp)
        if d is not None and not isinstance(x, torch.Tensor):
            raise ValueError(f"{what} spec asks to split a non-tensor leaf {x!r} along dim {d}")
        dims.append(d)
    return dims


def microbatch_sizes(batch_size: int, num_microbatch: int) -> list[int]:
    """Sizes ``torch.tensor_split`` produces: the first ``batch_size % num_microbatch`` get one
    more."""
    q, r = divmod(batch_size, num_microbatch)
    return [q + (1 if i < r else 0) for i in range(num_microbatch)]


def _split_leaves(
    leaves: list[Any],
    dims: list[int | None],
    num_microbatch: int,
    what: str,
    batch_size: int | None,
) -> tuple[list[list[Any]], int | None]:
    for x, d in zip(leaves, dims):
        if d is None:
            continue
        size = x.size(d)
        if batch_size is None:
            batch_size = size
        elif size != batch_size:
            raise ValueError(
                f"{what} batch size {size} (a tensor of shape {tuple(x.shape)}, split along dim "
                f"{d}) disagrees with the input batch size {batch_size}; every split tensor must "
                f"have the same batch size"
            )
    if batch_size is not None and batch_size < num_microbatch:
        raise ValueError(
            f"a batch of {batch_size} samples cannot be split into {num_microbatch} microbatches; "
            f"lower num_microbatch (RoundPipeRunConfig) or enlarge the batch"
        )
    per_mb: list[list[Any]] = [[] for _ in range(num_microbatch)]
    for x, d in zip(leaves, dims):
        parts = [x] * num_microbatch if d is None else torch.tensor_split(x, num_microbatch, d)
        for m in range(num_microbatch):
            per_mb[m].append(parts[m])
    return per_mb, batch_size


def split_inputs(
    args: tuple, kwargs: dict, num_microbatch: int, spec: Any = None
) -> tuple[list[Chunk], list[int]]:
    """Split ``(args, kwargs)`` into ``num_microbatch`` chunks. Returns ``(chunks, sizes)``.

    ``spec``: None (tensors of dim >= 1 along dim 0), one ``TensorChunkSpec``/int for every tensor,
    a pytree of leaf specs matching ``args`` (kwargs then use the default), or a callable
    ``spec(args, kwargs, num_microbatch) -> [(args, kwargs), ...]``. ``sizes`` are the
    microbatch sizes (used to weight merged scalars). Any thread; does not block.
    """
    if callable(spec) and not hasattr(spec, "split_dim"):
        chunks = list(spec(args, kwargs, num_microbatch))
        if len(chunks) != num_microbatch:
            raise ValueError(
                f"split_input returned {len(chunks)} chunks, expected {num_microbatch}"
            )
        chunks = [(tuple(a), dict(k)) for a, k in chunks]
        return chunks, [_guess_size(c) for c in chunks]
    if num_microbatch == 1:
        leaves = pytree.tree_leaves((args, kwargs))
        sizes = [
            next((x.size(0) for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), 1)
        ]
        return [(tuple(args), dict(kwargs))], sizes
    arg_leaves, arg_tree = pytree.tree_flatten(tuple(args))
    kw_leaves, kw_tree = pytree.tree_flatten(dict(kwargs))
    if _is_spec_leaf(spec):
        arg_dims = _leaf_dims(tuple(args), spec, "input")
        kw_dims = _leaf_dims(dict(kwargs), spec, "input")
    else:
        arg_dims = _leaf_dims(tuple(args), tuple(spec), "input")
        kw_dims = _leaf_dims(dict(kwargs), None, "input")
    if all(d is None for d in arg_dims + kw_dims):
        raise ValueError(
            f"cannot split the input into {num_microbatch} microbatches: it has no tensor to split "
            f"(pass a batch tensor, or use num_microbatch=1)"
        )
    per_mb, batch = _split_leaves(
        arg_leaves + kw_leaves, arg_dims + kw_dims, num_microbatch, "input", None
    )
    n = len(arg_leaves)
    chunks = [
        (pytree.tree_unflatten(p[:n], arg_tree), pytree.tree_unflatten(p[n:], kw_tree))
        for p in per_mb
    ]
    assert batch is not None  # some leaf was split
    return chunks, microbatch_sizes(batch, num_microbatch)


def _guess_size(chunk: Any) -> int:
    for x in pytree.tree_leaves(chunk):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.size(0)
    return 1


def split_label(
    label: Any, num_microbatch: int, sizes: Sequence[int], spec: Any = None
) -> list[Any]:
    """Split ``label`` like the input whose microbatch sizes are ``sizes``.

    ``spec`` as in :func:`split_inputs` (a pytree matching ``label``), or a callable
    ``spec(label, num_microbatch) -> [label_0, ...]``. ``label=None`` gives ``None`` per
    microbatch. Raises ``ValueError`` if the label's batch size is not ``sum(sizes)``.
    """
    if callable(spec) and not hasattr(spec, "split_dim"):
        parts = list(spec(label, num_microbatch))
        if len(parts) != num_microbatch:
            raise ValueError(f"split_label returned {len(parts)} chunks, expected {num_microbatch}")
        return parts
    if label is None:
        return [None] * num_microbatch
    leaves, tree = pytree.tree_flatten(label)
    dims = _leaf_dims(label, spec, "label")
    batch = sum(sizes)
    for x, d in zip(leaves, dims):
        if d is not None and x.size(d) != batch:
            raise ValueError(
                f"label batch size {x.size(d)} (shape {tuple(x.shape)}, dim {d}) disagrees with "
                f"the input batch size {batch}; labels must have one entry per input sample"
            )
    if num_microbatch == 1:
        return [label]
    per_mb, _ = _split_leaves(leaves, dims, num_microbatch, "label", batch)
    return [pytree.tree_unflatten(p, tree) for p in per_mb]


def merge_outputs(outputs: list[Any], sizes: Sequence[int], spec: Any = None) -> Any:
    """Merge the microbatch outputs (in microbatch order) into one.

    ``spec``: None (tensors of dim >= 1 concatenated along dim 0), one ``TensorChunkSpec``/int, a
    pytree of leaf specs matching one output, or a callable ``spec(outputs) -> merged``.
    0-d floating tensors are merged as the mean weighted by microbatch size; every other leaf
    (non-tensors, 0-d integer tensors, leaves whose spec is None) must be equal across
    microbatches, else ``ValueError``.
    """
    if callable(spec) and not hasattr(spec, "split_dim"):
        return spec(outputs)
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    tree0 = flat[0][1]
    for m, (_, tree) in enumerate(flat[1:], 1):
        if tree != tree0:
            raise ValueError(
                f"microbatch {m} output structure {tree} differs from microbatch 0's "
                f"{tree0}; outputs must have the same structure to be merged"
            )
    dims = _leaf_dims(outputs[0], spec, "output")
    total = float(sum(sizes))
    merged = []
    names = None  # each leaf's key path, worked out only for an error message
    for i, d in enumerate(dims):
        vals = [leaves[i] for leaves, _ in flat]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor) and d is not None and v0.dim() > 0:
            merged.append(torch.cat(vals, dim=d))
        elif (
            isinstance(v0, torch.Tensor)
            and v0.dim() == 0
            and (v0.is_floating_point() or v0.is_complex())
        ):
            acc = vals[0] * (sizes[0] / total)
            for v, n in zip(vals[1:], sizes[1:]):
                acc = acc + v * (n / total)
            merged.append(acc)
        else:
            for m, v in enumerate(vals[1:], 1):
                same = (
                    torch.equal(v0, v)
                    if isinstance(v0, torch.Tensor) and isinstance(v, torch.Tensor)
                    else _equal(v0, v)
                )
                if not same:
                    names = names or _leaf_names(outputs[0], len(dims))
                    raise ValueError(
                        f"output leaf {names[i]} differs between microbatch 0 ({_short(v0)}) and "
                        f"microbatch {m} ({_short(v)}); non-tensor outputs must be equal across "
                        f"microbatches (or pass merge_output= to merge them yourself)"
                        + (_CACHE_HINT if _is_cache(v0) else "")
                    )
            merged.append(v0)
    return pytree.tree_unflatten(merged, tree0)


_CACHE_HINT = (
    ". It is a key/value cache (a model called with use_cache on, as HuggingFace "
    "models are by default), which cannot be merged across microbatches: call the "
    "model with use_cache=False (model(x, use_cache=False), or set "
    "model.config.use_cache = False before wrapping it)"
)


def _is_cache(value: Any) -> bool:
    """A key/value cache object: a transformers ``Cache`` (without importing transformers), or
    any class whose name ends with "Cache"."""
    return any(c.__name__.endswith("Cache") for c in type(value).__mro__)


def _leaf_names(output: Any, count: int) -> list[str]:
    """Each leaf's key path in ``output`` as code would write it (``past_key_values``,
    ``[1]``, ``hidden_states[2]``); ``leaf i`` where a node type cannot tell its keys."""
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path(output)[0]]
    except Exception:  # noqa: BLE001 -- a node registered without key functions
        return [f"{i}" for i in range(count)]
    names = []
    for i, path in enumerate(paths):
        text = ""
        for key in path:
            if isinstance(key, pytree.SequenceKey):
                text += f"[{key.idx}]"
            elif (
                isinstance(key, pytree.MappingKey)
                and isinstance(key.key, str)
                and key.key.isidentifier()
            ):
                text += ("." if text else "") + key.key
            elif isinstance(key, pytree.GetAttrKey):
                text += ("." if text else "") + key.name
            else:
                text += str(key)
        names.append(f"{text} (leaf {i})" if text else f"{i} (the whole output)")
    return names


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- an ambiguous comparison means "not provably equal"
        return a is b


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) < 60 else r[:57] + "..."


@dataclasses.dataclass(frozen=True)
class MicrobatchInfo:
    """What a ``loss_fn`` that takes a third argument learns about its microbatch: its
    ``index``, its ``size`` (samples), the whole ``batch_size`` and ``num_microbatch``.
    ``share`` is ``size / batch_size``: scaling a microbatch's mean loss by it makes the
    microbatch losses add up to the batch mean, whatever the split (10 samples into 4
    microbatches are 3, 3, 2 and 2)."""

    index: int
    size: int
    batch_size: int
    num_microbatch: int

    @property
    def share(self) -> float:
        return self.size / self.batch_size
