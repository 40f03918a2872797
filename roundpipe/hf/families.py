"""Model families: where a HuggingFace causal LM keeps the parts that become stages.

A :class:`Family` names, by attribute path from the ``*ForCausalLM`` object, the decoder body, its
token embedding, decoder layers, final norm and rotary embedding, and the output head. The
Llama layout that most transformers decoders share is the default of every field, so a family
with that layout is registered by its ``model_type`` alone::

    roundpipe.hf.register_family(roundpipe.hf.Family("my_llama_like", ("my_llama_like",)))

A decoder layer must take ``layer(hidden, attention_mask=, position_ids=, position_embeddings=)``
and return the new hidden states (a tensor, or a tuple whose first item is); see docs/hf.md.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from roundpipe.hf import compat

__all__ = [
    "Family",
    "register_family",
    "families",
    "family_of",
    "layer_attention_types",
    "softcap_logits",
    "gemma_embed_scale",
    "granite_embeddings",
    "granite_logits",
    "cohere_logits",
    "OUTSIDE_LAYER_FEATURES",
    "TOKEN_WISE",
]


Transform = Callable[[torch.Tensor], torch.Tensor]

# The token-wise submodules of a decoder layer in the registered dense layouts: the norm before
# the attention, Llama's norm before the MLP (OLMo 2's after the attention) and the MLP, Gemma's
# norms before and after it.
TOKEN_WISE = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "mlp",
    "post_feedforward_layernorm",
)


@dataclasses.dataclass(frozen=True)
class Family:
    """Where one architecture keeps its parts (attribute paths from the ``*ForCausalLM``).

    Args:
        name: shown in messages.
        model_types: the ``config.model_type`` values it covers.
        body: the decoder body (``LlamaModel``) that holds the next four.
        embed: the token embedding, in ``body``.
        layers: the ``nn.ModuleList`` of decoder layers, in ``body``.
        norm: the final norm, in ``body``.
        rotary: the rotary position embedding module, in ``body`` (called
            ``rotary(hidden, position_ids=...) -> (cos, sin)``).
        head: the output projection, in the ``*ForCausalLM``.
        router: the attribute path, from a decoder layer, of its mixture-of-experts router
            (``mlp.gate``: a linear gate that returns the router logits, or a router module
            that returns them first), or None for a dense model. With it, the head adds the
            load-balancing loss (see docs/hf.md). A layer without a module there is a dense
            one (Qwen2-MoE's ``mlp_only_layers``); at least one layer must have it.
        rotary_local: the rotary embedding of the sliding-window layers, in ``body``, where a
            model keeps a second one (Gemma 3 on transformers 4.x); looked up only if present.
        embed_scale: ``embed_scale(config)``, what the model does to its token embeddings
            before the first layer: a factor, multiplied as a tensor of the embeddings' dtype
            (Gemma's square root of the hidden size), or a function of the embeddings
            (Granite's ``embedding_multiplier``, a Python float); None: nothing. Not applied
            where the embedding module already multiplies its output by its own factor (a
            scaled embedding, see ``compat.embedding_scales_itself``).
        logits: ``logits(config)``, a function the model applies to the head's logits before
            its loss (soft-capping, scaling), or None where the config turns it off.
        handles: the config features outside the decoder layers that this family's
            ``embed_scale`` and ``logits`` implement (see :data:`OUTSIDE_LAYER_FEATURES`); a
            model with another one turned on is refused at wrap, naming it.
        tiled: the names of a decoder layer's token-wise submodules (each output token
            depends on its own input token only: the dense MLP, RMS and layer norms) that run
            in token tiles on long microbatches (:mod:`roundpipe.hf.tiling`); those a layer
            does not have are skipped. Default: the MLP and the norms around it in the
            layouts of the registered dense families. A mixture-of-experts family tiles
            nothing (``()``): its router is read once per layer call.
    """

    name: str
    model_types: tuple[str, ...]
    body: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"
    rotary: str = "rotary_emb"
    head: str = "lm_head"
    router: str | None = None
    rotary_local: str | None = None
    embed_scale: Callable[[Any], float | Transform | None] | None = None
    logits: Callable[[Any], Transform | None] | None = None
    handles: tuple[str, ...] = ()
    tiled: tuple[str, ...] = TOKEN_WISE

    def parts(self, model: nn.Module) -> dict[str, Any]:
        """The parts of ``model`` (a ``*ForCausalLM``), by field name; raises ``TypeError``
        naming the first path that is missing."""
        found: dict[str, Any] = {}
        try:
            body = found["body"] = operator.attrgetter(self.body)(model)
            for field in ("embed", "layers", "norm", "rotary"):
                found[field] = operator.attrgetter(getattr(self, field))(body)
            found["head"] = operator.attrgetter(self.head)(model)
        except AttributeError as exc:
            hint = ""
            if "rotary" not in found and "embed" in found:
                hint = (
                    " A decoder without a rotary embedding (learned positions, as GPT-2's wpe) "
                    "is not supported by roundpipe.hf."
                )
            raise TypeError(
                f"{type(model).__name__} does not have the layout of family {self.name!r} "
                f"({exc}); register a Family with its attribute paths (docs/hf.md).{hint}"
            ) from None
        local = self.rotary_local and getattr(found["body"], self.rotary_local, None)
        found["rotary_local"] = local or None
        if self.router is not None and not any(map(self.router_of, found["layers"])):
            layer = type(found["layers"][0]).__name__ if len(found["layers"]) else "no layer"
            raise TypeError(
                f"{layer} has no router module at {self.router!r} (family {self.name!r}); "
                f"give the Family the path of the layer's router module (router=)"
            )
        return found

    def unhandled_features(self, config: Any) -> list[str]:
        """The features of :data:`OUTSIDE_LAYER_FEATURES` that ``config`` turns on and this
        family does not implement, as ``name=value``."""
        found = []
        for name, off in OUTSIDE_LAYER_FEATURES.items():
            value = getattr(config, name, None)
            if name not in self.handles and value is not None and value not in off:
                found.append(f"{name}={value!r}")
        return found

    def router_of(self, layer: nn.Module) -> nn.Module | None:
        """The router module of one decoder layer at :attr:`router` (under an older name where
        this transformers has one, see :func:`roundpipe.hf.compat.submodule`), or None for a
        dense layer (no module there)."""
        assert self.router is not None
        try:
            found = compat.submodule(layer, self.router)
        except AttributeError:
            return None
        return found if isinstance(found, nn.Module) else None


# Config attributes that change a model's arithmetic outside its decoder layers (where the
# stages, not the HF layer modules, run it), with the values that mean "off". A family
# implements the ones it lists in ``handles``; any other one turned on is refused at wrap.
OUTSIDE_LAYER_FEATURES: dict[str, tuple[Any, ...]] = {
    "final_logit_softcapping": (0, 0.0),
    "logit_scale": (1, 1.0),
    "logits_scaling": (1, 1.0),
    "embedding_multiplier": (1, 1.0),
    # Gemma 3 as an encoder (EmbeddingGemma): masks that see ahead, built outside the layers.
    "use_bidirectional_attention": (False,),
}


def softcap_logits(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``cap * tanh(logits / cap)`` with ``config.final_logit_softcapping`` (Gemma 2 and 3)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if not cap:
        return None
    return functools.partial(_softcap, cap=float(cap))


def _softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


def gemma_embed_scale(config: Any) -> float:
    """Gemma's embedding normalizer: the square root of the hidden size (multiplied in the
    embeddings' dtype, so bf16 rounds sqrt(3072) to 55.5, as Gemma does)."""
    return float(config.hidden_size) ** 0.5


def granite_embeddings(config: Any) -> Transform | None:
    """``embeddings * config.embedding_multiplier``, the Python number as Granite multiplies."""
    factor = config.embedding_multiplier
    return None if factor == 1 else functools.partial(_times, factor=factor)


def granite_logits(config: Any) -> Transform | None:
    """``logits / config.logits_scaling``, a division as Granite's (not a product by the
    reciprocal, which rounds differently)."""
    scaling = config.logits_scaling
    return None if scaling == 1 else functools.partial(_divided, by=scaling)


def cohere_logits(config: Any) -> Transform | None:
    """``logits * config.logit_scale`` (Cohere)."""
    scale = config.logit_scale
    return None if scale == 1 else functools.partial(_times, factor=scale)


def _times(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _divided(x: torch.Tensor, by: float) -> torch.Tensor:
    return x / by


def layer_attention_types(config: Any) -> list[str]:
    """Per decoder layer, the mask it takes: ``config.layer_types`` where the config has it
    (Qwen2, Qwen3), else ``"sliding_attention"`` for every layer when ``config.sliding_window``
    is set (Mistral), else ``"full_attention"`` (Llama)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)[: config.num_hidden_layers]
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make ``family`` the one used for its ``model_types`` (replacing a registered one)."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a roundpipe.hf.Family, got {family!r}")
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def families() -> dict[str, Family]:
    """The registered families, by ``model_type``."""
    return dict(_FAMILIES)


def family_of(model: nn.Module) -> Family:
    """The family registered for ``model.config.model_type``; ``NotImplementedError`` that
    names the supported ones and how to add one otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = _FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        supported = ", ".join(sorted(_FAMILIES))
        raise NotImplementedError(
            f"roundpipe.hf has no family for model_type {model_type!r} "
            f"({type(model).__name__}); supported: {supported}. A decoder with the Llama layout "
            f"is added with roundpipe.hf.register_family(roundpipe.hf.Family("
            f"{model_type!r}, ({model_type!r},))); other layouts name their parts' attribute "
            f"paths in the Family (docs/hf.md, 'Adding a family')"
        )
    return family


for _name in ("llama", "mistral", "qwen2", "qwen3"):
    register_family(Family(_name, (_name,)))
register_family(Family("qwen3_moe", ("qwen3_moe",), router="mlp.gate", tiled=()))
for _name in ("phi3", "olmo2"):  # their differences from Llama are inside the decoder layers
    register_family(Family(_name, (_name,)))
_SOFTCAP = ("final_logit_softcapping",)
register_family(
    Family(
        "gemma2",
        ("gemma2",),
        embed_scale=gemma_embed_scale,
        logits=softcap_logits,
        handles=_SOFTCAP,
    )
)
register_family(
    Family(
        "gemma3_text",
        ("gemma3_text",),
        rotary_local="rotary_emb_local",
        embed_scale=gemma_embed_scale,  # in its scaled embedding module, so never applied twice
        logits=softcap_logits,
        handles=_SOFTCAP,
    )
)
register_family(
    Family(
        "granite",
        ("granite",),
        embed_scale=granite_embeddings,
        logits=granite_logits,
        handles=("embedding_multiplier", "logits_scaling"),
    )
)
register_family(Family("cohere", ("cohere",), logits=cohere_logits, handles=("logit_scale",)))

# More mixture-of-experts families: where each layer keeps its router. Everything else of theirs
# (Qwen2-MoE's shared expert and its gate, GPT-OSS's attention sinks and its sliding and full
# layers by config.layer_types) runs inside the HF layer modules.
register_family(Family("mixtral", ("mixtral",), router="mlp.gate", tiled=()))
register_family(Family("qwen2_moe", ("qwen2_moe",), router="mlp.gate", tiled=()))
register_family(Family("gpt_oss", ("gpt_oss",), router="mlp.router", tiled=()))
