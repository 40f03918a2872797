"""The refusals: a wrap that would not fit the host (:class:`HostMemoryError`, at construction)
and a call whose planned peak would not fit a device (:class:`DeviceMemoryError`, at the first
``forward_backward`` on an accelerator pool), each before anything is allocated, and the switch
that turns both off (``ROUNDPIPE_SKIP_MEMORY_CHECK``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.memory.host import HostTerms, format_bytes, ranks_to_fit

if TYPE_CHECKING:
    from roundpipe.memory.report import DeviceMemory

__all__ = [
    "SKIP_CHECK_ENV",
    "DeviceMemoryError",
    "HostMemoryError",
    "check_device_memory",
    "check_host_memory",
    "skip_memory_check",
]

# The environment variable that turns off roundpipe's memory checks (HostMemoryError, and the
# device check of the first forward_backward).
SKIP_CHECK_ENV = "ROUNDPIPE_SKIP_MEMORY_CHECK"


def skip_memory_check() -> bool:
    """Whether ``ROUNDPIPE_SKIP_MEMORY_CHECK`` is set to a true value. Any thread."""
    return os.environ.get(SKIP_CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class HostMemoryError(MemoryError):
    """Wrapping the model would allocate more host RAM than the host has available (measured
    before allocating): the message lists each term, what is available, and the options."""


def check_host_memory(terms: HostTerms, what: str, offload_activations: bool = False) -> None:
    """Raise :class:`HostMemoryError` if ``terms.new_bytes`` exceeds ``terms.available``
    (unknown availability passes). ``what`` names the model in the message."""
    if terms.available is None or terms.new_bytes <= terms.available:
        return
    lines = [
        f"{what} would allocate about {format_bytes(terms.new_bytes)} of host RAM, more than "
        f"the {format_bytes(terms.available)} available (MemAvailable, or the memory cgroup's "
        f"limit minus its usage): the process would be killed by the OOM killer mid-run.",
    ]
    width = max(len(label) for label, _ in terms.rows())
    for label, nbytes in terms.rows():
        lines.append(f"  {label:<{width}}  {format_bytes(nbytes):>10}")
    lines.append(
        f"  {'to allocate (all but the weights)':<{width}}  {format_bytes(terms.new_bytes):>10}"
    )
    lines.append(f"  {'available':<{width}}  {format_bytes(terms.available):>10}")
    options = [
        "train LoRA adapters on a frozen base (requires_grad_(False) on the base parameters "
        "before wrapping): frozen parameters get no master, gradient or optimizer state",
        "for a model in bf16, keep the masters in bf16: RoundPipe(..., optim_dtype="
        "torch.bfloat16) halves the masters, their gradients and the optimizer state (less "
        "precise updates)",
    ]
    if terms.next_grads or terms.next_weights:
        left, fits = _left(terms, terms.next_grads + terms.next_weights)
        options.append(
            f"step synchronously: model.step(fn, is_async=False) (the Trainer's "
            f"async_step=False) holds one copy of the weights "
            f"and one set of the masters' gradients, where the asynchronous step writes the "
            f"next weights beside them and may hold the next call's gradients too: about "
            f"{format_bytes(left)} to allocate ({fits}), at the cost of the step's overlap "
            f"with the next iteration"
        )
    options.extend(_state_options(terms))
    if terms.pinned_overhead > terms.weights // 20:
        options.append(
            "let torch's pinned allocator take large blocks at their size "
            "(PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64): the pinned pool then takes "
            "the weights' bytes, not the next powers of two"
        )
    if offload_activations:
        options.append(
            "offload_activations=True keeps the stage inputs in pinned host memory: turn it "
            "off or use fewer microbatches"
        )
    options.append(
        "if the estimate is wrong for your optimizer (it assumes Adam's two moments per "
        f"master), skip this check: RoundPipe(..., memory_check=False) or {SKIP_CHECK_ENV}=1"
    )
    lines.append("Options:")
    lines.extend(f"  - {o}" for o in options)
    raise HostMemoryError("\n".join(lines))


def _left(terms: HostTerms, saved: int) -> tuple[int, str]:
    """What is left to allocate once ``saved`` bytes are not, and whether that alone fits."""
    assert terms.available is not None
    left = terms.new_bytes - saved
    return left, "which alone fits" if left <= terms.available else "not enough alone"


def _state_options(terms: HostTerms) -> list[str]:
    """The placements for state larger than one machine's RAM, as options of a refused wrap,
    each with what it would leave to allocate (skipping one already chosen)."""
    assert terms.available is not None
    options = []
    fit = ranks_to_fit(terms) if terms.ranks == 1 else None
    if fit is not None:
        n, per_machine = fit
        options.append(
            f"shard the masters and the optimizer state over {n} or more machines "
            f"(torchrun, one rank per machine; RoundPipe(..., state_placement="
            f"roundpipe.distributed.ShardedState())): about "
            f"{format_bytes(per_machine)} to allocate per machine at {n}, with a margin of one "
            f"layer's gradients (ranks on one machine share its RAM, so it takes machines, not "
            f"processes)"
        )
    if not terms.optimizer_dir and terms.optimizer:
        left, fits = _left(terms, terms.optimizer)
        options.append(
            f"keep Adam's state in files on a fast disk: roundpipe.optim.AdamW(..., "
            f"state_dir=DIR) streams it through a bounded buffer, about "
            f"{format_bytes(left)} to allocate besides that buffer ({fits}); this check "
            f"counts the state in RAM, so wrap with memory_check=False when you do"
        )
    if terms.ranks == 1 and not terms.masters_dir and terms.masters:
        left = terms.new_bytes - terms.optimizer - terms.masters
        fits = "which fits" if left <= terms.available else "still too much"
        options.append(
            f"keep the masters in files too: RoundPipe(..., state_placement="
            f"roundpipe.MastersOnDisk(DIR)) with AdamW(..., state_dir=DIR) leaves the fp16 "
            f"weights and the gradients in RAM (6 bytes per parameter, 10 with the next "
            f"call's gradients of an asynchronous step), about "
            f"{format_bytes(left)} to allocate besides the two buffers ({fits})"
        )
    return options


class DeviceMemoryError(torch.OutOfMemoryError):
    """A call's planned peak on a device exceeds what the device has free, found before
    anything of the call was allocated. A ``torch.OutOfMemoryError``, so code that handles
    out-of-memory (a smaller batch, say) handles it too; the message gives the numbers and
    the options."""


def check_device_memory(devices: Sequence[DeviceMemory], what: str, cfg: Any) -> None:
    """Raise :class:`DeviceMemoryError` if a device's planned peak exceeds what it has free
    (unknown passes). ``cfg``: the resolved run config, for the options."""
    over = [d for d in devices if not d.fits]
    if not over:
        return
    dev = over[0]
    assert dev.available is not None
    lines = [
        f"{what}: this forward_backward would need about {format_bytes(dev.peak + dev.reserve)} "
        f"on {dev.device}, which has {format_bytes(dev.available)} free (planned before "
        f"allocating anything; the peak is during {dev.during or dev.at}):"
    ]
    terms = list(dev.terms)
    if dev.reserve:
        terms.append((f"reserve ({dev.reserve_note})", dev.reserve))
    width = max(len(t) for t, _ in terms) if terms else 10
    for term, nbytes in terms:
        lines.append(f"  {term:<{width}}  {format_bytes(nbytes):>10}")
    for other in over[1:]:
        lines.append(
            f"  ({other.device} too: {format_bytes(other.peak)} of "
            f"{format_bytes(other.available or 0)} free)"
        )
    options = [
        f"more microbatches (num_microbatch={cfg.num_microbatch * 2}): smaller activations "
        f"per action",
    ]
    if not cfg.offload_activations:
        options.append(
            "offload_activations=True: the stage inputs kept for the backward wait in host memory"
        )
    if cfg.device_memory_budget == "none":
        options.append(
            'device_memory_budget="auto": prefetch and keep stage inputs only where they fit'
        )
    if not cfg.recompute:
        options.append("recompute=True: keep only each stage's input, not its activations")
    options.append("shorter sequences or a smaller batch")
    options.append(
        "smaller stages (execute_plan / roundpipe.stages_by_size): a device holds two "
        "stages' weights and gradient sums at once"
    )
    options.append(
        "device_grad_dtype=torch.float16 (or bfloat16): gradient sums in the stage's dtype"
    )
    options.append(
        f"to run anyway (the plan may be wrong for your model): RoundPipe(..., "
        f"memory_check=False) or {SKIP_CHECK_ENV}=1"
    )
    lines.append("Options (RoundPipeRunConfig):")
    lines.extend(f"  - {o}" for o in options)
    raise DeviceMemoryError("\n".join(lines))
