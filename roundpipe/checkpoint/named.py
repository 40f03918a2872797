"""Optimizer state keyed by parameter name, so that a checkpoint of one placement loads into
another (see [Note: sharded checkpoints] in :mod:`roundpipe.checkpoint.state`).

torch's ``optimizer.state_dict()`` numbers the parameters in the order of its param groups,
which is a rank's own order under sharded state: these functions put the names of the masters
in place of the numbers (:func:`by_name`), join the ranks' parts (:func:`merge`), and make the
state dict of a given optimizer out of the named state (:func:`for_optimizer`), after
:func:`problems` has checked that it fits.

Threads: pure functions; any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "Key",
    "param_names",
    "by_name",
    "merge",
    "keep",
    "problems",
    "for_optimizer",
    "resolve",
]


def param_names(optimizer: torch.optim.Optimizer, masters: Mapping[str, torch.Tensor]) -> list[str]:
    """The master's name of each parameter of ``optimizer``, in its state dict's order.
    Raises ``ValueError`` for a parameter that is not one of ``masters``."""
    names_of = {id(m): n for n, m in masters.items()}
    names = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names_of.get(id(p))
            if name is None:
                raise ValueError(
                    f"the optimizer's param group {i} holds a tensor of shape {tuple(p.shape)} "
                    f"that is not one of this process's masters: a checkpoint names the "
                    f"optimizer state by master, so build the optimizer on "
                    f"model.optim_parameters() (or model.parameters() inside OptimizerCtx)"
                )
            names.append(name)
    return names


def by_name(state_dict: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``state_dict`` (torch's layout) with parameter ``names[i]`` in place of number ``i``."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in state_dict["param_groups"]
    ]
    return {
        "param_groups": groups,
        "state": {names[int(i)]: v for i, v in state_dict["state"].items()},
    }


def merge(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ranks' named states (rank order) as one: each group's hyperparameters from the
    first, its parameters those of every rank in order; every rank's state."""
    first = parts[0]
    groups = []
    for i, g in enumerate(first["param_groups"]):
        params = [n for part in parts for n in part["param_groups"][i]["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    return {"param_groups": groups, "state": state}


def keep(named: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``named`` with the state of ``names`` only (a rank reads its own share)."""
    wanted = set(names)
    return {
        "param_groups": named["param_groups"],
        "state": {n: v for n, v in named["state"].items() if n in wanted},
    }


def problems(
    named: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: Sequence[str], where: str
) -> list[str]:
    """What keeps ``named`` from loading into ``optimizer`` (whose parameters are ``names``):
    a different number of param groups, or a parameter here in a group it was not in."""
    saved = named["param_groups"]
    live = optimizer.param_groups
    if len(saved) != len(live):
        return [f"the optimizer has {len(live)} param groups here, {len(saved)} in {where}"]
    found = []
    it = iter(names)
    for i, (g, h) in enumerate(zip(saved, live)):
        members = set(g["params"])
        stray = [n for n in (next(it) for _ in h["params"]) if n not in members]
        if stray:
            found.append(
                f"optimizer param group {i} holds {stray[:5]} here, which {where} does not "
                f"have in that group (build the param groups as the saved run did)"
            )
    return found


def for_optimizer(
    named: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: Sequence[str]
) -> dict[str, Any]:
    """The state dict (torch's layout) of ``optimizer``, whose parameters are ``names``, out of
    ``named``: each group's saved hyperparameters, the state of the parameters it holds."""
    index = {n: i for i, n in enumerate(names)}
    groups, start = [], 0
    for g, h in zip(named["param_groups"], optimizer.param_groups):
        count = len(h["params"])
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    state = {index[n]: v for n, v in named["state"].items() if n in index}
    return {"state": state, "param_groups": groups}


class Key:
    """A tensor not read yet: its key in the checkpoint's files."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def resolve(value: Any, read: Callable[[str], torch.Tensor]) -> Any:
    """``value`` with every :class:`Key` replaced by ``read(key)``."""
    if isinstance(value, Key):
        return read(value.key)
    if isinstance(value, dict):
        return {k: resolve(v, read) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, read) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve(v, read) for v in value)
    return value
