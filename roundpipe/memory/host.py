"""The host RAM a wrapped model takes, term by term: :func:`host_terms` and :class:`HostTerms`
(weights, masters, their gradients, an Adam-sized optimizer state, the pinned pool's slack, the
activations held on the host), the masters' dtype rule (:func:`master_dtype_of`) and how bytes
are written (:func:`format_bytes`). Main thread (wrap time), except the pure helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from roundpipe.devices.packed import logical_numel
from roundpipe.devices.pinned import (
    PinnedAllocator,
    module_tensors,
    pinned_layout,
    storage_bytes,
)

__all__ = [
    "HostTerms",
    "OPTIM_STATES",
    "adam_state_bytes",
    "MASTERS_COPY_BUFFER_BYTES",
    "SPILL_BUFFER_BYTES",
    "format_bytes",
    "host_terms",
    "master_dtype_of",
    "stage_grad_bytes",
]

#: the default buffer Adam's state in files streams through (``Adam(state_buffer_bytes=)``)
SPILL_BUFFER_BYTES = 256 << 20
#: the default buffer the master->model copy streams masters in files through
#: (``MastersOnDisk(copy_buffer_bytes=)``)
MASTERS_COPY_BUFFER_BYTES = 64 << 20


def format_bytes(nbytes: float) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``512 B``: for reports and messages."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"


@dataclasses.dataclass(frozen=True)
class HostTerms:
    """The host RAM of a wrapped model, term by term (bytes).

    ``weights``: the model's own parameters and buffers (allocated already, by the caller),
    a packed (quantized) weight as its packed bytes plus its quantization state;
    ``masters``: the master copies of the trainable parameters (``optim_dtype``) this process
    holds: all of them, or with ``ranks`` > 1 (sharded state) the largest rank's share; with
    ``masters_dir`` (:class:`roundpipe.MastersOnDisk`) they are in files there and this is the
    buffer the master->model copy streams them through;
    ``grads``: the masters' gradients (one per trainable parameter, in its master's dtype);
    sharded (``ranks`` > 1) with the gradients handed over stage by stage (``grads_by_stage``:
    a pool of accelerators or of several CPU devices, see [Note: sharded state] in
    :mod:`roundpipe.distributed.sharded`), this rank's share plus two layers' sums on their way to
    their owners; one CPU device's fused call hands every sum at its end, so all of them;
    ``optimizer``: the optimizer's state, estimated as Adam's: two moments per held master in
    its dtype (``optim_states`` "exact"), in bf16 ("bf16"), or 8-bit with an fp32 absmax per
    block of 256 ("8bit"; parameters under 4096 elements exact), as
    ``roundpipe.optim.AdamW(state_dtype=...)`` keeps them; or, with ``optimizer_dir``
    (``Adam(state_dir=...)``), the host buffer it streams through;
    ``next_weights``: the second low-precision copy of the held parameters that roundpipe's
    one-pass asynchronous step writes while the next iteration computes with the first (see
    [Note: the copy in the step] in :mod:`roundpipe.runtime.step_copy`; 0 with the masters in
    files, whose step does not write it);
    ``pinned_overhead``: what the pinned pool takes beyond the weights' bytes (padding and
    block slack, see [Note: the pinned pool]; 0 on a CPU pool, which pins nothing);
    ``activations``: host bytes of stage inputs offloaded to the host (or, on a CPU pool, the
    activations), when known (``memory_plan`` with inputs), else 0.
    ``available``: :func:`host_memory_available` when measured (None: unknown);
    ``weights_allocated``: whether the weights exist already (a model being wrapped) or are
    still to be allocated (a plan from a config), in which case they count against
    ``available`` too."""

    weights: int
    masters: int
    grads: int
    optimizer: int
    pinned_overhead: int
    activations: int = 0
    trainable_numel: int = 0
    frozen_numel: int = 0
    master_dtype: torch.dtype | None = None
    available: int | None = None
    weights_allocated: bool = True
    ranks: int = 1
    optimizer_dir: str | None = None
    grads_by_stage: bool = False
    masters_dir: str | None = None
    next_weights: int = 0
    optim_states: str = "exact"

    @property
    def new_bytes(self) -> int:
        """What is still to be allocated: what wrapping and training add to the host, and the
        weights when they do not exist yet."""
        added = (
            self.masters
            + self.grads
            + self.optimizer
            + self.next_weights
            + self.pinned_overhead
            + self.activations
        )
        return added if self.weights_allocated else added + self.weights

    @property
    def total(self) -> int:
        return self.new_bytes + (self.weights if self.weights_allocated else 0)

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) of each term, for reports."""
        dtype = str(self.master_dtype).removeprefix("torch.") if self.master_dtype else "masters'"
        rows = [
            (
                "model weights and buffers "
                + ("(allocated already)" if self.weights_allocated else "(to allocate)"),
                self.weights,
            ),
            (
                f"master copies ({_count(self.trainable_numel)} trainable params, {dtype})"
                + (f", this rank's share of {self.ranks}" if self.ranks > 1 else "")
                + (
                    f": in files under {self.masters_dir} (copy buffer)" if self.masters_dir else ""
                ),
                self.masters,
            ),
            ("gradients of the masters" + self._grads_note(), self.grads),
            (
                f"optimizer state: in files under {self.optimizer_dir} (streaming buffer)"
                if self.optimizer_dir
                else f"optimizer state (estimated as Adam: {_MOMENTS[self.optim_states]})",
                self.optimizer,
            ),
        ]
        if self.next_weights:
            rows.append(
                ("next weights (the one-pass step's second copy, async)", self.next_weights)
            )
        rows.append(("pinned pool padding and block slack", self.pinned_overhead))
        if self.activations:
            rows.append(("activations held in host memory", self.activations))
        return rows

    def _grads_note(self) -> str:
        if self.ranks == 1:
            return ""
        if self.grads_by_stage:
            return " (this rank's share, plus two layers' sums on their way to their owners)"
        return " (every parameter's until the call's end hands them to their owners)"


def stage_grad_bytes(layers: Sequence[nn.Module], optim_dtype: torch.dtype | None) -> int:
    """The largest gradient sum one of ``layers`` hands over (its trainable parameters in
    their masters' dtype). Reads shapes only."""
    return max(
        (
            sum(
                p.numel() * master_dtype_of(p, optim_dtype).itemsize
                for p in layer.parameters()
                if p.requires_grad
            )
            for layer in layers
        ),
        default=0,
    )


_MOMENTS = {
    "exact": "2 x masters",
    "bf16": "bf16 moments, 4 B/param",
    "8bit": "8-bit moments, about 2 B/param",
}
#: ``host_terms``' ``optim_states``: how Adam's moments are kept
OPTIM_STATES = tuple(_MOMENTS)


def adam_state_bytes(numel: int, master_itemsize: int, optim_states: str) -> int:
    """Host bytes of Adam's two moments of one parameter of ``numel`` elements (exact: in the
    master's dtype), as ``roundpipe.optim.AdamW(state_dtype=...)`` keeps them (see [Note: lean
    moments] in :mod:`roundpipe.optim.lean`). Pure."""
    if optim_states == "exact" or (optim_states == "8bit" and numel < _MIN_8BIT_NUMEL):
        return 2 * numel * master_itemsize
    if optim_states == "bf16":
        return 4 * numel
    if optim_states == "8bit":
        return 2 * numel + 2 * 4 * -(-numel // _BLOCK)
    raise ValueError(f"optim_states={optim_states!r}: one of {OPTIM_STATES}")


# roundpipe.optim.lean's BLOCK and MIN_8BIT_NUMEL (that module imports torch's optimizers; this
# one stays light): checked equal by tests/test_host_memory.py.
_BLOCK = 256
_MIN_8BIT_NUMEL = 4096


def _count(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def master_dtype_of(param: torch.Tensor, optim_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``param``'s master: ``optim_dtype``, else fp32 for fp16/bf16 params, else
    the param's own (as the runtime makes them)."""
    if optim_dtype is not None:
        return optim_dtype
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def host_terms(
    module: nn.Module,
    optim_dtype: torch.dtype | None,
    pinned: PinnedAllocator | None,
    available: int | None = None,
    ranks: int = 1,
    layers: Sequence[nn.Module] | None = None,
    masters_dir: str | None = None,
    masters_buffer: int | None = None,
    optim_states: str = "exact",
    one_pass: bool = True,
) -> HostTerms:
    """What wrapping ``module`` takes from the host, term by term (see :class:`HostTerms`);
    ``pinned``: the pool's allocator on an accelerator pool (None: nothing pinned); ``ranks``:
    data-parallel ranks the state is sharded over (1: not sharded; else the masters and the
    optimizer state of the largest share, see :func:`roundpipe.runtime.placement.shard_by_bytes`);
    ``layers``: with ``ranks`` > 1, the model's layers when its pool hands the gradients over
    stage by stage (None: one CPU device, whose call hands all of them at its end);
    ``masters_dir``: the masters are in files there (:class:`roundpipe.MastersOnDisk`), so the
    host holds only ``masters_buffer`` bytes of them (default: its default copy buffer), and
    Adam's state is taken to be in files there too (``Adam(state_dir=...)``, which such
    masters call for: an Adam in RAM warns), so only its default streaming buffer counts;
    ``optim_states``: how Adam keeps its moments ("exact", "bf16", "8bit"); ``one_pass``:
    count the next weights of roundpipe's one-pass asynchronous step. Reads shapes only. Main
    thread."""
    from roundpipe.runtime.placement import shard_by_bytes  # runtime imports this module

    weights = storage_bytes(t for t in module_tensors(module) if t.numel() > 0)
    if optim_states not in OPTIM_STATES:
        raise ValueError(f"optim_states={optim_states!r}: one of {OPTIM_STATES}")
    trainable = frozen = 0
    sizes = []
    states = []
    lows = []
    dtypes = set()
    for p in module.parameters():
        if p.requires_grad:
            dtype = master_dtype_of(p, optim_dtype)
            dtypes.add(dtype)
            sizes.append(p.numel() * dtype.itemsize)
            states.append(adam_state_bytes(p.numel(), dtype.itemsize, optim_states))
            lows.append(p.numel() * p.element_size())
            trainable += p.numel()
        else:
            frozen += logical_numel(p)
    masters = held = sum(sizes)
    held_states, held_lows = sum(states), sum(lows)
    if ranks > 1:
        share = [0] * ranks
        share_states = [0] * ranks
        share_lows = [0] * ranks
        for owner, size, st, low in zip(shard_by_bytes(sizes, ranks), sizes, states, lows):
            share[owner] += size
            share_states[owner] += st
            share_lows[owner] += low
        largest = max(range(ranks), key=lambda r: share[r])
        held = share[largest]
        held_states, held_lows = share_states[largest], share_lows[largest]
    grads = masters
    if ranks > 1 and layers is not None:
        grads = min(masters, held + 2 * stage_grad_bytes(layers, optim_dtype))
    overhead = pinned_layout(module, pinned).overhead if pinned is not None else 0
    in_ram, optimizer = held, held_states
    next_weights = held_lows if one_pass else 0
    if masters_dir is not None:
        buffer = MASTERS_COPY_BUFFER_BYTES if masters_buffer is None else masters_buffer
        in_ram = min(held, buffer)
        optimizer = min(optimizer, SPILL_BUFFER_BYTES)
        next_weights = 0
    return HostTerms(
        weights=weights,
        masters=in_ram,
        grads=grads,
        optimizer=optimizer,
        pinned_overhead=overhead,
        trainable_numel=trainable,
        frozen_numel=frozen,
        master_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
        available=available,
        ranks=ranks,
        grads_by_stage=ranks > 1 and layers is not None,
        masters_dir=masters_dir,
        optimizer_dir=masters_dir,
        next_weights=next_weights,
        optim_states=optim_states,
    )
