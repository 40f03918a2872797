"""The stages a HuggingFace causal LM becomes: the embedding (which prepares what every layer
needs once per microbatch), one stage per decoder layer, and the head with the chunked loss.

The stage modules hold the HF model's own submodules (the same parameter objects), so training
through them trains the HF model the user passed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from roundpipe.hf import compat, tiling
from roundpipe.hf.families import Family
from roundpipe.hf.loss import IGNORE_INDEX, chunked_causal_lm_loss
from roundpipe.microbatch_context import WithContext
from roundpipe.runtime.compiled import compiled_layer

__all__ = ["Embed", "Decoder", "Head", "num_experts", "has_experts"]


class Embed(nn.Module):
    """``embed(input_ids, attention_mask=None, labels=None, position_ids=None,
    num_items_in_batch=None)``: the token embeddings, with the microbatch's context: the
    attention mask transformers builds for the model's attention implementation (None where
    SDPA's causal kernel needs none), position ids, the rotary (cos, sin), and for training the
    shifted labels and the batch's count of predicted tokens."""

    def __init__(
        self, parts: dict[str, Any], config: Any, kinds: Sequence[str], family: Family
    ) -> None:
        super().__init__()
        self.embed_tokens = parts["embed"]
        self.rotary_emb = parts["rotary"]
        self.rotary_local = parts.get("rotary_local")
        self.config = config
        self.kinds = sorted(set(kinds))  # the attention types the layers take masks for
        # What the model does to its token embeddings before the first layer (Gemma, Granite).
        self.transform = _embed_transform(family, config, self.embed_tokens)
        # A body that builds its mask itself (Qwen2-MoE on 4.x) gives every layer that one; a
        # plain callable, so the body's modules are not this stage's.
        self.own_mask = compat.own_mask_builder(parts.get("body"))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | None = None,
    ) -> WithContext:
        builders = compat.mask_builders()
        hidden = self.embed_tokens(input_ids)
        if self.transform is not None:
            hidden = self.transform(hidden)
        # Positions the batch gives may mark packed sequences, which the mask builders read;
        # the arange made here marks none, so the builders get None: on fake tensors (a memory
        # plan) they cannot read it and would build the (tokens x tokens) mask a real run
        # skips.
        mask_positions = position_ids
        if position_ids is None:  # as the HF decoder does without a cache
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if self.own_mask is not None:
            mask = self.own_mask(attention_mask, hidden)
            masks = dict.fromkeys(self.kinds, mask)
        else:
            masks = {
                kind: compat.build_mask(
                    builders[kind], self.config, hidden, attention_mask, mask_positions
                )
                for kind in self.kinds
            }
        context: dict[str, Any] = {
            "attention_masks": masks,
            "position_ids": position_ids,
            "position_embeddings": compat.position_embeddings(
                self.rotary_emb, self.rotary_local, hidden, position_ids, self.kinds
            ),
            "padding_mask": attention_mask,
        }
        if labels is not None:
            context["shift_labels"] = shift_labels(labels)
            context["num_items"] = num_items_in_batch
        return WithContext(hidden, context)


def _embed_transform(
    family: Family, config: Any, embed: nn.Module
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The family's ``embed_scale`` as a function of the embeddings, or None: where the
    embedding module multiplies by its own factor already, or the family has none."""
    if family.embed_scale is None or compat.embedding_scales_itself(embed):
        return None
    scale = family.embed_scale(config)
    if scale is None or callable(scale):
        return scale
    return functools.partial(_times_in_dtype, factor=float(scale))


def _times_in_dtype(hidden: torch.Tensor, factor: float) -> torch.Tensor:
    # The factor rounded to the embeddings' dtype first, as Gemma multiplies.
    return hidden * torch.tensor(factor, dtype=hidden.dtype)


def has_experts(config: Any) -> bool:
    """Whether ``config`` is a mixture of experts (:func:`num_experts` would find some)."""
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def num_experts(config: Any) -> int:
    """The experts of a mixture-of-experts config (``num_experts``, or Mixtral's and GPT-OSS's
    ``num_local_experts``)."""
    count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not count:
        raise TypeError(f"{type(config).__name__} names no number of experts")
    return int(count)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t predicts label t+1 (the last predicts nothing), as transformers' loss shifts."""
    padded = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
    return padded[..., 1:].contiguous()


class _RouterTap:
    """Collects the router logits of one decoder layer's forward on the calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self) -> None:
        self._local.logits = []

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        found = getattr(self._local, "logits", None)
        if found is not None:
            found.append(compat.router_logits(output))

    def take(self) -> list[torch.Tensor]:
        found, self._local.logits = self._local.logits, None
        return found


class Decoder(nn.Module):
    """One decoder layer, called with the microbatch's context. In a mixture-of-experts family
    whose head adds the load-balancing loss (``config.output_router_logits``), the hidden states
    travel with the running sums that loss needs (``(hidden, tokens_per_expert, router_prob,
    rows)``), so the head computes it for the microbatch over every layer, as transformers does
    over the batch; a layer without a router (a dense one) passes them on.

    In a dense family the layer's token-wise submodules (:attr:`Family.tiled`: the MLP and its
    norms) run in tiles of ``mlp_tile_tokens`` tokens when a microbatch has more
    (:mod:`roundpipe.hf.tiling`; None: never). ``mlp_tile_tokens`` is written on the main thread
    between calls (by :func:`roundpipe.hf.wrap`) and read by the worker that runs the stage.

    :meth:`compile_layer` makes the stage run its HF layer through ``torch.compile`` (see
    [Note: compiled layers] in roundpipe/runtime/compiled.py): the layer, not this module,
    whose context handling and tiling switch are thread-local Python."""

    takes_context = True

    def __init__(
        self,
        layer: nn.Module,
        family: Family,
        config: Any,
        kind: str,
        mlp_tile_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.kind = kind  # its attention type: which of the context's masks it takes
        # A family with a router keeps its MoE block whole (the tap reads one call per layer).
        self.tiled = [] if family.router is not None else tiling.install(layer, family.tiled)
        self.mlp_tile_tokens = mlp_tile_tokens
        self._tap: _RouterTap | None = None
        router = None
        if family.router is not None and getattr(config, "output_router_logits", False):
            router = family.router_of(layer)
        if router is not None:
            self._tap = _RouterTap()
            self._router_path = f"{family.router!r} (family {family.name!r})"
            self.num_experts = num_experts(config)
            self.top_k = int(config.num_experts_per_tok)
            router.register_forward_hook(self._tap)

    def extra_repr(self) -> str:
        # Which mask it takes: part of what decides its memory (see [Note: identical stages]
        # in roundpipe.memory.trace), and so does the tile length.
        tiles = self.mlp_tile_tokens if self.tiled else None
        return f"kind={self.kind!r}, mlp_tile_tokens={tiles}"

    def compile_layer(self, options: dict[str, Any]) -> None:
        """Run the layer through ``torch.compile(layer, **options)`` from now on, except under
        a dispatch mode (a memory trace on fake tensors runs it eagerly). Main thread, between
        calls. The compiled module is kept outside the module tree: the parameters keep their
        names, and the model stays the user's."""
        vars(self)["_compiled"] = compiled_layer(self.layer, options)

    def forward(self, x: Any, context: dict[str, Any]) -> Any:
        sums = None
        if isinstance(x, tuple):
            x, *sums = x
        if self._tap is not None:
            self._tap.start()
        layer = self.layer
        compiled = vars(self).get("_compiled")
        if compiled is not None and _get_current_dispatch_mode() is None:
            layer = compiled
        with tiling.tiles(self.mlp_tile_tokens if self.tiled else None):
            out = layer(
                x,
                **compat.layer_kwargs(
                    self.layer,
                    self.kind,
                    context["attention_masks"][self.kind],
                    context["position_ids"],
                    context["position_embeddings"],
                ),
            )
        hidden = out[0] if isinstance(out, tuple) else out
        if self._tap is None:
            return hidden if sums is None else (hidden, *sums)
        logits = self._router_logits(self._tap.take(), x.shape[:-1].numel())
        return (hidden, *self._add_router_sums(sums, logits, context["padding_mask"]))

    def _router_logits(self, found: list[Any], tokens: int) -> torch.Tensor:
        """The one call's router logits as ``(tokens, experts)``; ``ValueError`` naming the
        router path where the module there is not called once per layer call or returns
        something of another shape (it is not the router)."""
        if len(found) != 1:
            raise ValueError(
                f"the router module at {self._router_path} ran {len(found)} times in one call "
                f"of its decoder layer, not once: give the Family the path of the router "
                f"(router=), the module that returns the router logits"
            )
        (logits,) = found
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
        if not isinstance(logits, torch.Tensor) or logits.numel() != tokens * self.num_experts:
            raise ValueError(
                f"the module at router path {self._router_path} returned {shape}, not router "
                f"logits of {tokens} tokens x {self.num_experts} experts, which the "
                f"load-balancing loss takes: give the Family the path of the router (router=)"
            )
        return logits.reshape(tokens, self.num_experts)

    def _add_router_sums(
        self, sums: list[torch.Tensor] | None, layer_logits: torch.Tensor, mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add one layer's expert counts, router probabilities and rows (padding excluded),
        as transformers' load_balancing_loss_func sums them layer by layer."""
        device = layer_logits.device
        if sums is None:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            sums = [zeros, zeros, torch.zeros((), dtype=torch.float32, device=device)]
        counts, probs, rows = sums
        weights = torch.softmax(layer_logits.float(), dim=-1)
        selected = torch.topk(weights, self.top_k, dim=-1).indices
        if mask is None:
            flat = torch.ones(weights.shape[0], dtype=torch.float32, device=device)
        else:
            flat = mask.reshape(-1).to(device=device, dtype=torch.float32)
        counts = counts + torch.zeros_like(counts).scatter_add_(
            0, selected.reshape(-1), flat.repeat_interleave(self.top_k)
        )
        probs = probs + (weights * flat.unsqueeze(-1)).sum(dim=0)
        return counts, probs, rows + flat.sum()


class Head(nn.Module):
    """The final norm and the output projection. Training (the context has labels): the sum of
    the microbatch's token losses over the batch's count of predicted tokens, computed in chunks
    of ``chunk_tokens`` (see :func:`chunked_causal_lm_loss`), plus the weighted load-balancing
    loss in a mixture-of-experts family; with ``token_stats`` set, ``(loss, stats)``, ``stats``
    each row's sums of :func:`chunked_causal_lm_loss`'s token statistics (rows x 3: entropy,
    top-1 hits, predicted tokens). Inference: the logits.

    In training the final norm runs in tiles of ``norm_tile_tokens`` tokens when a microbatch
    has more (:mod:`roundpipe.hf.tiling`; None: never), as the decoder layers' norms do: its
    fp32 intermediates and their gradients (several times the hidden states' bytes, the
    largest term of a long sequence's head) exist for one tile at a time.

    ``token_stats`` and ``norm_tile_tokens`` are written on the main thread between calls
    (roundpipe.hf.Trainer's, for TRL's metrics; :func:`roundpipe.hf.wrap`) and read by the
    worker that runs the stage during a call."""

    takes_context = True

    def __init__(
        self,
        parts: dict[str, Any],
        config: Any,
        chunk_tokens: int,
        family: Family,
        norm_tile_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.norm = parts["norm"]
        self.lm_head = parts["head"]
        self.tiled = tiling.install(self, ["norm"])
        self.norm_tile_tokens = norm_tile_tokens
        self.chunk_tokens = chunk_tokens
        self.aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0))
        self.aux_on = bool(getattr(config, "output_router_logits", False))
        self.num_experts = num_experts(config) if family.router is not None else 0
        # What the model does to the logits before its loss (soft-capping, scaling).
        self.transform = None if family.logits is None else family.logits(config)
        self.token_stats = False

    def extra_repr(self) -> str:
        # Part of what decides its memory, as a Decoder's tile (see [Note: identical stages]).
        tiles = self.norm_tile_tokens if self.tiled else None
        return f"chunk_tokens={self.chunk_tokens}, norm_tile_tokens={tiles}"

    def forward(
        self, x: Any, context: dict[str, Any]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        sums = None
        if isinstance(x, tuple):
            x, *sums = x
        labels = context.get("shift_labels")
        with tiling.tiles(self.norm_tile_tokens if labels is not None and self.tiled else None):
            hidden = self.norm(x)
        if labels is None:
            logits = self.lm_head(hidden)
            return logits if self.transform is None else self.transform(logits)
        token_stats = self.token_stats
        loss = chunked_causal_lm_loss(
            hidden,
            self.lm_head,
            labels,
            context["num_items"],
            self.chunk_tokens,
            transform=self.transform,
            token_stats=token_stats,
        )
        stats = None
        if token_stats:
            loss, stats = loss
            stats = stats.reshape(stats.shape[0], -1, 3).sum(dim=1)  # per row
        if sums is not None and self.aux_on:
            counts, probs, rows = sums
            aux = torch.sum((counts / rows) * (probs / rows)) * self.num_experts
            # Per microbatch, weighted by its share of the batch's predicted tokens, so the
            # microbatches add up to one load-balancing term (docs/hf.md).
            share = (labels != IGNORE_INDEX).sum() / context["num_items"]
            loss = loss + self.aux_coef * aux * share
        return loss if stats is None else (loss, stats)
