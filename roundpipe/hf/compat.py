"""Every difference between the transformers versions roundpipe.hf supports, in one place.

roundpipe asks the installed transformers what it offers (a function's parameters, a model's
methods, what a module returns) rather than comparing version numbers, so a release that keeps
an interface keeps working. The differences met from 4.56 to 5.24:

* the mask builders of ``transformers.masking_utils`` name the embeddings ``input_embeds``
  (to 5.1) or ``inputs_embeds``, the cache ``past_key_values`` (to 5.23) or ``cache``, and
  require ``cache_position`` until 5.2 (:func:`build_mask`);
* the decoder layers take ``cache_position`` until 5.2 (never needed without a cache);
* a mixture-of-experts block's router is a plain ``nn.Linear`` returning the logits (4.x) or a
  router module returning ``(logits, scores, indices)`` (5.x), both at ``mlp.gate``; GPT-OSS's
  router returns ``(scores, indices)`` on 4.x, and transformers' load-balancing loss takes those
  scores where 5.x takes the logits (:func:`router_logits`);
* Mixtral's mixture-of-experts block is ``block_sparse_moe`` on 4.x and ``mlp`` on 5.x
  (:func:`submodule`);
* Qwen2-MoE on 4.x builds its attention mask itself (``_update_causal_mask``, one mask for every
  layer) rather than with ``masking_utils``; the two differ for the padding queries of a
  left-padded row, and the last of those predicts the first real token, a term of the loss
  (:func:`own_mask_builder`);
* gradient checkpointing is ``is_gradient_checkpointing`` / ``gradient_checkpointing_disable``,
  and from 5.24 ``is_activation_checkpointing`` / ``activation_checkpointing_disable`` (the old
  names warn there) (:func:`disable_checkpointing`);
* a model whose attention types take different rotary embeddings (Gemma 3) keeps a second
  rotary module for its sliding layers and passes both to every layer
  (``position_embeddings_global`` / ``_local``) on 4.x, and has one rotary module that takes
  the layer type, with each layer given its own, on 5.x (:func:`position_embeddings`,
  :func:`layer_kwargs`);
* peft reads a model's ``is_gradient_checkpointing`` when it wraps it, which warns from 5.24,
  a warning about peft's code that its user cannot act on (:func:`quiet_checkpointing_names`);
* the pipelines log that a model class they do not know is "not supported" for a task, and keep
  the wrapper classes they accept in ``SUPPORTED_PEFT_TASKS`` (:func:`accept_in_pipelines`);
* Gemma 2 multiplies its token embeddings by the square root of the hidden size in its model's
  forward (4.x and 5.0), or in a scaled embedding module that holds the factor as
  ``embed_scale`` (by 5.5), as Gemma 3's does on every version (:func:`embedding_scales_itself`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "build_mask",
    "mask_builders",
    "router_logits",
    "submodule",
    "own_mask_builder",
    "disable_checkpointing",
    "position_embeddings",
    "layer_kwargs",
    "embedding_scales_itself",
    "quiet_checkpointing_names",
    "accept_in_pipelines",
]


@functools.cache
def _parameters(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def mask_builders() -> dict[str, Callable]:
    """transformers' mask builder per attention type this version has."""
    from transformers import masking_utils

    builders = {"full_attention": masking_utils.create_causal_mask}
    sliding = getattr(masking_utils, "create_sliding_window_causal_mask", None)
    if sliding is not None:
        builders["sliding_attention"] = sliding
    chunked = getattr(masking_utils, "create_chunked_causal_mask", None)
    if chunked is not None:
        builders["chunked_attention"] = chunked
    return builders


def build_mask(
    builder: Callable,
    config: Any,
    embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> Any:
    """``builder(config, embeddings, attention_mask, no cache, position_ids)`` under the
    parameter names this transformers gives them; the mask the model's attention takes (None
    where its kernel needs none)."""
    names = _parameters(builder)
    kwargs: dict[str, Any] = {
        "config": config,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = embeds
    for cache in ("cache", "past_key_values"):
        if cache in names:
            kwargs[cache] = None
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return builder(**kwargs)


def router_logits(output: Any) -> torch.Tensor:
    """What transformers' load-balancing loss takes as the router logits, from what a router
    module returned: the tensor itself (a linear gate) or the first item (a router that also
    returns its top-k; transformers records that item, GPT-OSS's top-k scores on 4.x)."""
    return output[0] if isinstance(output, tuple) else output


# Submodules of a decoder layer that transformers renamed: the current name, then the older
# ones a layer of an older version has instead.
_RENAMED = {"mlp": ("block_sparse_moe",)}  # Mixtral's mixture-of-experts block, 4.x


def submodule(layer: nn.Module, path: str) -> Any:
    """The attribute at ``path`` (dotted) of ``layer``, or at the same path with its first name
    replaced by the older name this version gives it; ``AttributeError`` if neither exists."""
    try:
        return operator.attrgetter(path)(layer)
    except AttributeError:
        first, dot, rest = path.partition(".")
        for older in _RENAMED.get(first, ()):
            if hasattr(layer, older):
                return operator.attrgetter(older + dot + rest)(layer)
        raise


def own_mask_builder(body: nn.Module | None) -> Callable[[Any, torch.Tensor], Any] | None:
    """``build(attention_mask, embeddings)``, the mask of every layer as the decoder ``body``
    builds it itself (``_update_causal_mask``, without a cache), where it has such a method;
    None where it leaves its masks to ``masking_utils`` (:func:`build_mask`)."""
    method = getattr(body, "_update_causal_mask", None)
    if method is None:
        return None
    names = _parameters(method.__func__)  # the function, not the bound method: no body cached

    def build(attention_mask: Any, embeds: torch.Tensor) -> Any:
        cache_position = torch.arange(embeds.shape[1], device=embeds.device)
        kwargs = {"output_attentions": False} if "output_attentions" in names else {}
        return method(attention_mask, embeds, cache_position, None, **kwargs)

    return build


def disable_checkpointing(model: nn.Module) -> None:
    """Turn off transformers' own gradient (activation) checkpointing, by the names this
    version has, without a deprecation warning."""
    on = getattr(model, "is_activation_checkpointing", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    if on is None or disable is None:
        on = getattr(model, "is_gradient_checkpointing", False)
        disable = getattr(model, "gradient_checkpointing_disable", None)
    if on and disable is not None:
        disable()


def position_embeddings(
    rotary: nn.Module,
    rotary_local: nn.Module | None,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    kinds: list[str],
) -> dict[str, Any]:
    """Per attention type in ``kinds``, the rotary ``(cos, sin)`` its layers take: one for all
    (most models), one per type from a rotary that takes the layer type, or the second rotary's
    for the sliding layers (both types are then given, see :func:`layer_kwargs`)."""
    if "layer_type" in _parameters(type(rotary).forward):
        return {kind: rotary(hidden, position_ids, kind) for kind in kinds}
    shared = rotary(hidden, position_ids=position_ids)
    found = {kind: shared for kind in kinds}
    if rotary_local is not None:
        found["full_attention"] = shared
        found["sliding_attention"] = rotary_local(hidden, position_ids=position_ids)
    return found


def layer_kwargs(
    layer: nn.Module, kind: str, mask: Any, position_ids: torch.Tensor, found: dict[str, Any]
) -> dict[str, Any]:
    """The keyword arguments of one decoder layer's call without a cache: its attention type's
    mask and rotary embedding (see :func:`position_embeddings`)."""
    kwargs: dict[str, Any] = {
        "attention_mask": mask,
        "position_ids": position_ids,
        "use_cache": False,
    }
    if "position_embeddings_global" in _parameters(type(layer).forward):
        kwargs["position_embeddings_global"] = found["full_attention"]
        kwargs["position_embeddings_local"] = found["sliding_attention"]
    else:
        kwargs["position_embeddings"] = found[kind]
    return kwargs


def embedding_scales_itself(embed: nn.Module) -> bool:
    """Whether the token embedding module multiplies its output by its own factor (a scaled
    embedding holding an ``embed_scale`` tensor, or peft's wrapper around one), so that the
    factor the family names is already in the embeddings."""
    for module in (embed, getattr(embed, "base_layer", None)):
        if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
            return True
    return False


@contextlib.contextmanager
def quiet_checkpointing_names() -> Iterator[None]:
    """Inside, transformers' FutureWarnings about the old gradient-checkpointing names
    (``is_gradient_checkpointing``, which peft reads when it wraps a model) are not shown.
    Main thread (``warnings.catch_warnings`` changes the process's filters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def accept_in_pipelines(cls: type, task: str = "text-generation") -> None:
    """Let transformers' pipelines of ``task`` take a model of class ``cls`` without logging that
    it is not supported: its name joins the wrapper classes the pipelines accept
    (``transformers.pipelines.base.SUPPORTED_PEFT_TASKS``, where this version has it; else
    nothing changes). Idempotent; main thread (imports transformers.pipelines, about 0.1 s)."""
    try:
        from transformers.pipelines import base
    except ImportError:  # pragma: no cover - a transformers without pipelines
        return
    accepted = getattr(base, "SUPPORTED_PEFT_TASKS", None)
    if isinstance(accepted, dict) and isinstance(accepted.get(task), list):
        if cls.__name__ not in accepted[task]:
            accepted[task].append(cls.__name__)
