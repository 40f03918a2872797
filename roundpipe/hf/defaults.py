"""Defaults that fit: what :func:`roundpipe.hf.wrap` chooses for a wrapped causal LM from the
device it trains on, so that a long batch trains without hand-picked options (docs/memory.md,
"Defaults that fit").

* The loss head's chunk (:func:`default_loss_chunk_tokens`): as many tokens as make
  :data:`LOSS_CHUNK_SHARE` of the device's memory in fp32 logits (at most
  :data:`LOSS_CHUNK_BYTES`), so the chunk shrinks with the device and the vocabulary.
* Activation offload (:func:`offload_needed`), per call: the stage inputs a recompute keeps
  between the forward and the backward (one per decoder layer and microbatch, each tokens x
  hidden) go to pinned host memory when they would take more than :data:`KEPT_INPUTS_SHARE`
  of what the smallest device has free, and the host has that much free; otherwise they stay
  on the device, where they cost no transfer (a host without room for them would be the
  shortfall instead).
* The decoder layers' MLP tile (:func:`default_mlp_tile_tokens`): the MLP and its norms run
  in tiles of as many tokens as make their intermediates (gate, up and their product: about
  three tokens x intermediate tensors) at most :data:`MLP_TILE_SHARE` of the device's memory
  (at most :data:`MLP_TILE_BYTES`); a microbatch of more tokens than a tile runs in tiles, a
  shorter one untiled, so the choice is per call and costs nothing where the sequence is short.

Any thread; pure arithmetic on sizes.
"""

from __future__ import annotations

__all__ = [
    "KEPT_INPUTS_SHARE",
    "LOSS_CHUNK_BYTES",
    "LOSS_CHUNK_SHARE",
    "MIN_LOSS_CHUNK_TOKENS",
    "MIN_MLP_TILE_TOKENS",
    "MLP_TILE_BYTES",
    "MLP_TILE_SHARE",
    "default_loss_chunk_tokens",
    "default_mlp_tile_tokens",
    "kept_input_bytes",
    "offload_needed",
]

# The fp32 logits of one chunk of the loss head take at most this share of the device's
# memory: with the low-precision logits and their gradient's cast the chunk's working set is
# about twice that (see [Note: the head's backward] in roundpipe/hf/loss.py), a thirty-second
# of the device, besides the head weight's gradient.
LOSS_CHUNK_SHARE = 1 / 64
# ... and never more than this many bytes (a 152k vocabulary: 512 tokens, 0.3 GB of logits),
# which is also the chunk where no device is known (a CPU pool computes in host memory).
LOSS_CHUNK_BYTES = 512 << 20
# The fewest tokens per chunk: below, the per-chunk launches cost more than the logits save.
MIN_LOSS_CHUNK_TOKENS = 16
# Stage inputs kept on the device for the backward may take at most this share of its free
# memory; the rest is for the stages' weights, gradient sums and the activations inside a stage.
KEPT_INPUTS_SHARE = 1 / 4
# One MLP tile's intermediates (three tokens x intermediate tensors in the weights' dtype) take
# at most this share of the device's memory: with their gradients in the backward about twice
# that, a thirty-second of the device.
MLP_TILE_SHARE = 1 / 64
# ... and never more than this many bytes, which is also the tile where no device is known.
MLP_TILE_BYTES = 256 << 20
# The fewest tokens per tile: below, the per-tile launches and recomputes cost more than the
# intermediates save.
MIN_MLP_TILE_TOKENS = 128


def default_loss_chunk_tokens(vocab_size: int, device_memory: int | None = None) -> int:
    """Tokens per chunk of the loss head: the largest power of two whose fp32 logits over
    ``vocab_size`` take at most :data:`LOSS_CHUNK_SHARE` of ``device_memory`` (bytes; None: no
    device, only the cap) and :data:`LOSS_CHUNK_BYTES`, at least
    :data:`MIN_LOSS_CHUNK_TOKENS`."""
    budget = LOSS_CHUNK_BYTES
    if device_memory is not None:
        budget = min(budget, int(device_memory * LOSS_CHUNK_SHARE))
    tokens = max(budget // (4 * max(vocab_size, 1)), MIN_LOSS_CHUNK_TOKENS)
    return 1 << (tokens.bit_length() - 1)


def kept_input_bytes(num_layers: int, tokens: int, hidden_size: int, itemsize: int) -> int:
    """Bytes of the stage inputs a recompute keeps on the device for the backward: one hidden
    state (``tokens`` x ``hidden_size`` of ``itemsize`` bytes, ``tokens`` the batch's) per
    decoder layer and the head."""
    return (num_layers + 1) * tokens * hidden_size * itemsize


def offload_needed(kept_bytes: int, device_free: int | None, host_free: int | None = None) -> bool:
    """Whether stage inputs of ``kept_bytes`` go to host memory on a device with
    ``device_free`` bytes free (None: unknown, a CPU pool: never): where they would take more
    than :data:`KEPT_INPUTS_SHARE` of it, unless the host has not that much free
    (``host_free``; None: unknown), where offloading them would only move the shortfall to a
    host that cannot hold it."""
    if device_free is None or kept_bytes <= device_free * KEPT_INPUTS_SHARE:
        return False
    return host_free is None or kept_bytes <= host_free


def default_mlp_tile_tokens(
    intermediate_size: int, itemsize: int, device_memory: int | None = None
) -> int:
    """Tokens per tile of the decoder layers' MLP and norms: the largest power of two whose
    three (tokens x ``intermediate_size``) tensors of ``itemsize`` bytes take at most
    :data:`MLP_TILE_SHARE` of ``device_memory`` (bytes; None: no device, only the cap) and
    :data:`MLP_TILE_BYTES`, at least :data:`MIN_MLP_TILE_TOKENS`."""
    budget = MLP_TILE_BYTES
    if device_memory is not None:
        budget = min(budget, int(device_memory * MLP_TILE_SHARE))
    tokens = max(budget // (3 * max(intermediate_size, 1) * itemsize), MIN_MLP_TILE_TOKENS)
    return 1 << (tokens.bit_length() - 1)
