"""HF calls behave like HF: the keys a transformers causal LM's ``forward`` takes, checked and
turned into what the stages take (:func:`parse_batch`), and the loss transformers computes from
the logits (:func:`causal_lm_loss`).

A key is accepted where roundpipe honours it (``input_ids``, ``attention_mask``, ``labels``,
``position_ids``, ``num_items_in_batch``) or where its value changes nothing
(``return_dict``, ``use_cache=False``, ``output_attentions=False``, an empty cache, ...). Any
other key or value raises ``ValueError`` naming the key, what to do, and every accepted key, so a
batch never reaches a stage with a key the stage does not take.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from roundpipe.hf.loss import IGNORE_INDEX
from roundpipe.hf.stages import shift_labels

__all__ = [
    "HFBatch",
    "parse_batch",
    "positional_batch",
    "count_predicted",
    "causal_lm_loss",
    "ACCEPTED_KEYS",
]

# What each accepted key may be, as the error messages list it.
ACCEPTED_KEYS: dict[str, str] = {
    "input_ids": "required, the token ids",
    "attention_mask": "1 for a real token, 0 for padding",
    "labels": "the input_ids with -100 where no loss is taken",
    "position_ids": "honoured as the model honours them",
    "num_items_in_batch": "divides the token losses' sum, by default the batch's count of "
    "predicted tokens",
    "token_type_ids": "ignored, as the model ignores them",
    "return_dict": "True, False or None",
    "use_cache": "False or None",
    "output_attentions": "False or None",
    "output_hidden_states": "False or None",
    "output_router_logits": "mixture of experts: see docs/hf.md",
    "cache": "None or an empty cache",
    "past_key_values": "None or an empty cache",
    "cache_position": "None or arange(sequence length)",
    "inputs_embeds": "None",
    "logits_to_keep": "0, every position",
}


def _accepted() -> str:
    return "; ".join(f"{key} ({what})" for key, what in ACCEPTED_KEYS.items())


def _refuse(call: str, problem: str, fix: str) -> ValueError:
    return ValueError(
        f"{call}: {problem}; {fix}. Accepted keys of a wrapped HF model's batch: {_accepted()}"
    )


@dataclasses.dataclass(frozen=True)
class HFBatch:
    """A checked batch: ``stage_kwargs`` for the first stage (the embedding: ``input_ids``,
    ``attention_mask``, ``position_ids``), the ``labels`` (None: no loss), the
    ``num_items_in_batch`` the caller gave (None: count them), ``return_dict``, and
    ``output_router_logits`` as given (None: the model's config decides)."""

    stage_kwargs: dict[str, Any]
    labels: torch.Tensor | None
    num_items_in_batch: int | float | None
    return_dict: bool | None
    output_router_logits: bool | None


def _is_off(value: Any) -> bool:
    return value is None or value is False


def _empty_cache(cache: Any) -> bool:
    if cache is None:
        return True
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length()) == 0
    try:
        return len(cache) == 0
    except TypeError:
        return False


def _number(value: Any) -> int | float:
    if isinstance(value, torch.Tensor):
        value = value.item()  # a Trainer passes it as a 0-d tensor
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(type(value).__name__)
    return value


def parse_batch(batch: Mapping[str, Any], call: str) -> HFBatch:
    """Check ``batch`` (the keyword arguments of ``call``, e.g. ``"model(**batch)"``) and split
    it into what the stages take and what the wrapper honours itself. Raises ``ValueError`` for a
    key roundpipe cannot honour or does not know, naming the fix and the accepted keys."""
    if not isinstance(batch, Mapping):
        raise _refuse(
            call,
            f"the batch is a {type(batch).__name__}, not a dict of keyword arguments",
            "pass a dict such as {'input_ids': ..., 'attention_mask': ..., 'labels': ...}",
        )
    unknown = [key for key in batch if key not in ACCEPTED_KEYS]
    if unknown:
        raise _refuse(
            call,
            f"unexpected key(s) {', '.join(map(repr, unknown))}",
            "remove them from the batch (a collator's extra columns are not model inputs)",
        )
    for key in ("use_cache", "output_attentions", "output_hidden_states"):
        if not _is_off(batch.get(key)):
            raise _refuse(
                call,
                f"{key}={batch[key]!r} cannot be honoured: roundpipe runs the model in stages "
                f"and returns the logits and the loss only",
                f"leave {key} out or pass {key}=False",
            )
    for key in ("cache", "past_key_values"):
        if not _empty_cache(batch.get(key)):
            raise _refuse(
                call,
                f"{key} holds a key/value cache with content, which roundpipe does not read",
                f"pass the whole sequence as input_ids and leave {key} out",
            )
    if batch.get("inputs_embeds") is not None:
        raise _refuse(
            call,
            "inputs_embeds cannot be honoured: the token embedding is roundpipe's first stage",
            "pass input_ids instead",
        )
    keep = batch.get("logits_to_keep")
    if keep is not None and not (
        isinstance(keep, int) and not isinstance(keep, bool) and keep == 0
    ):
        raise _refuse(
            call,
            f"logits_to_keep={keep!r} cannot be honoured: roundpipe computes every position's "
            f"logits",
            "leave logits_to_keep out (or 0) and slice the returned logits",
        )
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise _refuse(
            call,
            f"input_ids must be a (batch, sequence) tensor of token ids, got {_describe(ids)}",
            "pass input_ids as the tokenizer or collator makes them",
        )
    labels = batch.get("labels")
    if labels is not None and not (
        isinstance(labels, torch.Tensor) and tuple(labels.shape) == tuple(ids.shape)
    ):
        raise _refuse(
            call,
            f"labels must be a tensor of input_ids' shape {tuple(ids.shape)}, got "
            f"{_describe(labels)}",
            "pass the input_ids with -100 where no loss is taken, as HF's collators make them",
        )
    positions = batch.get("cache_position")
    if positions is not None and not (
        isinstance(positions, torch.Tensor)
        and positions.dim() == 1
        and torch.equal(positions.cpu(), torch.arange(ids.shape[1]))
    ):
        raise _refuse(
            call,
            "cache_position must count the sequence from 0 (roundpipe computes no cache)",
            "leave cache_position out",
        )
    for key in ("return_dict", "output_router_logits"):
        if batch.get(key) not in (None, True, False):
            raise _refuse(call, f"{key}={batch[key]!r} is not a bool", f"pass {key}=True or False")
    num_items = batch.get("num_items_in_batch")
    if num_items is not None:
        try:
            num_items = _number(num_items)
        except (TypeError, ValueError, RuntimeError):
            raise _refuse(
                call,
                f"num_items_in_batch must be a number or a one-element tensor, got "
                f"{_describe(batch['num_items_in_batch'])}",
                "pass the count of predicted tokens (labels other than -100), or leave it out",
            ) from None
    stage_kwargs: dict[str, Any] = {"input_ids": ids}
    mask = batch.get("attention_mask")
    # A mask without padding is no mask to transformers, which then attends causally with no
    # (tokens x tokens) mask (SDPA's and flash's is_causal); kept, its mask is built on the
    # device and, for SDPA, widened to the compute dtype in every layer (a 72k-token sequence:
    # 5 GB of bool mask, 10 GB of bf16 per layer).
    if mask is not None and not (isinstance(mask, torch.Tensor) and bool(mask.all())):
        stage_kwargs["attention_mask"] = mask
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        if position_ids.dim() == 2 and position_ids.shape[0] == 1 and ids.shape[0] > 1:
            # One row for the whole batch, as the model broadcasts it: a row per sample, so
            # that it splits into microbatches with the rest.
            position_ids = position_ids.expand(ids.shape[0], -1).contiguous()
        stage_kwargs["position_ids"] = position_ids
    return HFBatch(
        stage_kwargs=stage_kwargs,
        labels=labels,
        num_items_in_batch=num_items,
        return_dict=batch.get("return_dict"),
        output_router_logits=batch.get("output_router_logits"),
    )


def positional_batch(forward: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``model(input_ids, attention_mask, ...)`` as keyword arguments, by the wrapped model's own
    ``forward`` signature (HF's order); a positional dict is a batch passed the wrong way."""
    if not args:
        return dict(kwargs)
    if any(isinstance(a, Mapping) for a in args):
        raise ValueError(
            "model(batch) got the batch as a positional dict: pass it as keyword arguments, "
            "model(**batch)"
        )
    try:
        bound = inspect.signature(forward).bind_partial(*args)
    except TypeError as exc:
        raise ValueError(
            f"model(...) got {len(args)} positional arguments ({exc}); pass the batch as "
            f"keyword arguments, model(**batch)"
        ) from None
    twice = sorted(set(bound.arguments) & set(kwargs))
    if twice:
        raise ValueError(f"model(...) got {', '.join(twice)} both by position and by keyword")
    return {**bound.arguments, **kwargs}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if value is None else type(value).__name__


def count_predicted(labels: torch.Tensor) -> int:
    """The batch's count of predicted tokens: the shifted labels other than -100."""
    return int((shift_labels(labels) != IGNORE_INDEX).sum())


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | float | None
) -> torch.Tensor:
    """The loss transformers computes from a batch's logits: fp32 cross-entropy of each
    position against the next token's label, summed over the labels other than -100 and divided
    by ``num_items_in_batch`` (None: their count, the mean)."""
    targets = shift_labels(labels).reshape(-1).to(logits.device)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if num_items_in_batch is None:
        num_items_in_batch = int((targets != IGNORE_INDEX).sum())
    return total / num_items_in_batch
