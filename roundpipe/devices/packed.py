"""Packed parameters: weights kept quantized in host memory (bitsandbytes' 4-bit ``Params4bit``,
as transformers loads a model with ``BitsAndBytesConfig(load_in_4bit=True)``), whose layer
computes from their packed data and the tensors they carry beside it, their quantization state.

* :func:`carried`: the tensors a parameter carries (none for a plain tensor).
* :func:`packed_copy`: a copy of a packed parameter (on a device, or fake) that carries copies
  of its state, as its layer reads them.
* :func:`carried_bytes`: what the carried tensors take.

Nothing here imports bitsandbytes: a packed parameter is recognised by what it carries (see
[Note: packed parameters]). Any thread; nothing is written but the copies made.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "carried",
    "carried_bytes",
    "is_packed",
    "logical_numel",
    "packed_copy",
    "quant_state_of",
]

# [Note: packed parameters]
# A bitsandbytes 4-bit weight is a ``Params4bit`` whose data is the packed weight (two 4-bit
# codes a byte, ``uint8`` of shape (numel / 2, 1)) and whose ``quant_state`` (a QuantState)
# holds what dequantizes it: ``absmax`` (one scale per block of ``blocksize`` values), ``code``
# (the 16 values of NF4 or FP4), and with double quantization ``absmax`` in 8 bits, its own
# scales (``state2.absmax``, one per 256 blocks), their code (``state2.code``) and ``offset``.
# Its layer (``Linear4bit.forward``) reads ``self.weight.quant_state`` and hands it to
# bitsandbytes' kernels, which dequantize on the tensors' device. So a packed weight travels as
# its data plus every tensor of its state: the device copy is a plain tensor of the packed data
# with a ``quant_state`` attribute that is a shallow copy of the host QuantState whose tensors
# are device copies (the host state is never changed: ``Params4bit.to`` would move the host's
# QuantState itself, and its layer's too). The copy is what the layer sees while it runs (see
# [Note: the layer's device tensors] in roundpipe.devices.accelerator), and what the memory
# plan's traces run on (fake tensors, the same way). The carried tensors are pinned with the
# weights, counted in the host terms and in each stage's upload, and uploaded with the stage,
# each once. The state's non-tensor fields (shape, dtype, blocksize, quant type) are shared.


def quant_state_of(t: torch.Tensor) -> Any:
    """The quantization state a packed parameter carries (its ``quant_state``), else None.
    Reads the tensor's own attributes only (never a class property)."""
    state = vars(t).get("quant_state") if hasattr(t, "__dict__") else None
    return state if state is not None and hasattr(state, "absmax") else None


def is_packed(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a quantization state (see [Note: packed parameters])."""
    return quant_state_of(t) is not None


def logical_numel(t: torch.Tensor) -> int:
    """The number of values ``t`` stands for: a packed weight's unpacked shape's (its
    quantization state's ``shape``), else its own."""
    state = quant_state_of(t)
    shape = getattr(state, "shape", None) if state is not None else None
    return int(torch.Size(shape).numel()) if shape is not None else t.numel()


def _state_tensors(state: Any) -> Iterable[tuple[Any, str, torch.Tensor]]:
    """(owner, attribute, tensor) of every tensor in a quantization state, nested states
    included, in a fixed order."""
    for key, value in sorted(vars(state).items()):
        if isinstance(value, torch.Tensor):
            yield state, key, value
        elif value is not None and hasattr(value, "absmax") and hasattr(value, "__dict__"):
            yield from _state_tensors(value)


def carried(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``t`` carries beside its data (its quantization state's), each once; [] for
    a plain tensor."""
    state = quant_state_of(t)
    if state is None:
        return []
    seen: dict[int, torch.Tensor] = {}
    for _, _, tensor in _state_tensors(state):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def carried_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of what ``tensors`` carry (each carried tensor once). Reads shapes only."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        for c in carried(t):
            seen.setdefault(id(c), c)
    return sum(c.numel() * c.element_size() for c in seen.values())


def _state_copy(state: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    out = _copy.copy(state)
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(out, key, copy(value))
        elif value is not None and hasattr(value, "absmax") and hasattr(value, "__dict__"):
            setattr(out, key, _state_copy(value, copy))
    return out


def packed_copy(
    t: torch.Tensor,
    copy_data: Callable[[torch.Tensor], torch.Tensor],
    copy_state: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """A copy of packed parameter ``t``: ``copy_data`` of its data as a plain tensor (never
    through the parameter class's own ``.to``), carrying a copy of its quantization state whose
    tensors are ``copy_state`` of the host's (see [Note: packed parameters]). None when ``t`` is
    not packed. The copy never requires grad: a packed weight is frozen."""
    state = quant_state_of(t)
    if state is None:
        return None
    data = copy_data(torch.Tensor.detach(t).as_subclass(torch.Tensor))
    data.quant_state = _state_copy(state, copy_state)  # type: ignore[attr-defined]
    for key in ("blocksize", "quant_type", "quant_storage", "compress_statistics"):
        if key in vars(t):
            setattr(data, key, vars(t)[key])
    return data
