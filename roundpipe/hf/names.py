"""HF names in and out: the wrapped model's tensors under the HF model's own names
(``model.layers.0.self_attn.q_proj.weight``) rather than the stages' (``1.layer.self_attn...``),
for the state dicts, their loads and the export (:class:`HFNames`, :func:`export_state_dict`).

A tied parameter (the input and output embeddings) is one tensor with several HF names; like
``hf_model.state_dict()``, a state dict here lists it under every name, each the same tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["HFNames", "export_state_dict"]


def _names_by_object(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter and buffer of ``module`` (aliases of a shared tensor
    included), in ``state_dict`` order, by the tensor's id."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, b in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(name)
    return names


class HFNames:
    """The names of one wrapped model both ways. ``hf_name[stage_name]``: the HF name of a
    stage parameter (its first, for a tied one, as ``hf_model.named_parameters()`` gives it);
    ``aliases[hf_name]``: every HF name of that tensor. Fixed at construction; any thread."""

    def __init__(self, hf_model: nn.Module, stages: nn.Module) -> None:
        hf = _names_by_object(hf_model)
        self._hf_names = {name for names in hf.values() for name in names}
        self.hf_name: dict[str, str] = {}
        self.aliases: dict[str, list[str]] = {}
        # Any name in the stages' state dict -> every HF name of its tensor.
        self._from_stage: dict[str, list[str]] = {}
        for name, p in stages.named_parameters():
            self.hf_name[name] = hf.get(id(p), [name])[0]
        for tensor_id, names in _names_by_object(stages).items():
            for name in names:
                self._from_stage[name] = hf.get(tensor_id, [name])
        for names in hf.values():
            for name in names:
                self.aliases[name] = names

    def translate_stage_names(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with each key that is a stage name (a checkpoint written when the state
        dicts had the stages' names) under every HF name of its tensor; HF names kept."""
        out: dict[str, Any] = {}
        for key, value in state.items():
            if key in self._hf_names or key not in self._from_stage:
                out[key] = value
        for key, value in state.items():
            if key not in self._hf_names and key in self._from_stage:
                for name in self._from_stage[key]:
                    out.setdefault(name, value)
        return out

    def masters_out(self, masters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``(stage name, master)`` pairs as ``{HF name: master}``, a tied master under each of
        its names."""
        out: dict[str, torch.Tensor] = {}
        for stage_name, master in masters:
            hf_name = self.hf_name.get(stage_name, stage_name)
            for name in self.aliases.get(hf_name, [hf_name]):
                out[name] = master
        return out

    def masters_in(
        self, state: Mapping[str, torch.Tensor], stage_names: Iterable[str]
    ) -> dict[str, torch.Tensor]:
        """``{HF name: value}`` as ``{stage name: value}`` for the masters ``stage_names``. A
        tied master may be given under any of its names (under several: the same values).
        Raises ``ValueError`` naming, in HF names, the masters missing and the keys that name no
        master."""
        state = self.translate_stage_names(state)
        wanted = {self.hf_name.get(n, n): n for n in stage_names}
        out: dict[str, torch.Tensor] = {}
        missing = []
        known: set[str] = set()
        for hf_name, stage_name in wanted.items():
            names = self.aliases.get(hf_name, [hf_name])
            known.update(names)
            present = [n for n in names if n in state]
            if not present:
                missing.append(hf_name)
                continue
            value = state[present[0]]
            for name in present[1:]:
                other = state[name]
                if other is not value and not torch.equal(other, value):
                    raise ValueError(
                        f"master state dict: {present[0]!r} and {name!r} are one tied "
                        f"parameter but the state dict gives them different values; give one "
                        f"value (or the same under both names)"
                    )
            out[stage_name] = value
        unexpected = sorted(set(state) - known)
        if missing or unexpected:
            raise ValueError(
                f"master state dict does not match the masters (HF names, as "
                f"master_state_dict() gives them): missing {sorted(missing)}, unexpected "
                f"{unexpected}"
            )
        return out


def export_state_dict(
    hf_model: nn.Module, masters: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``hf_model.state_dict()`` with each trainable parameter's value taken from its master
    (``masters``: by HF name, each tied master under its first name) and every floating
    parameter in ``dtype``; buffers as they are. A tied parameter is one tensor under each of its
    names. Where a parameter already has ``dtype`` and no master, or the master's rounding to
    ``dtype`` is what the parameter holds (after ``synchronize``), no copy is made."""
    state = hf_model.state_dict()
    values: dict[int, torch.Tensor] = {}
    canonical: dict[int, str] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        if name not in state:
            continue
        if id(p) not in values:
            source = masters.get(first)
            if source is None or (p.dtype == dtype and source.dtype != dtype):
                # No master, or the parameter holds the master rounded to dtype (the
                # master->model copy rounds as a cast does): the parameter itself.
                source = p
            value = source.detach()
            if value.is_floating_point() and value.dtype != dtype:
                value = value.to(dtype)
            values[id(p)] = value
        state[name] = values[id(p)]
    return state
