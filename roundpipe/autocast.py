"""Carrying thread-local autocast state and RNG state into the device workers.

Autocast state is thread-local, so what the caller set around ``forward``/``forward_backward`` is
invisible on a worker: :func:`capture_autocast` reads it at the call (as
``torch/utils/checkpoint.py``'s ``_get_autocast_kwargs`` does) and :func:`autocast_context`
applies it on the worker, in every stage forward, recompute and ``loss_fn``, never in backward.

RNG: see [Note: RNG chains].
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Iterable, List, Optional

import torch

if TYPE_CHECKING:
    from roundpipe.devices import Backend

__all__ = ["AutocastState", "capture_autocast", "resolve_autocast", "autocast_context",
           "RNGState", "chain_starts", "rng_scope", "restore_global", "uses_rng", "RNG_LOCK"]


@dataclasses.dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


def capture_autocast(device_type: str) -> AutocastState:
    """The calling thread's autocast state for ``device_type``. Never blocks."""
    return AutocastState(device_type, torch.is_autocast_enabled(device_type),
                         torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())


def resolve_autocast(setting: Any, device_type: str) -> AutocastState:
    """``None``: the caller's state; ``False``: disabled; a dtype: enabled with that dtype.
    Call it on the thread that called ``forward``/``forward_backward``."""
    caller = capture_autocast(device_type)
    if setting is None:
        return caller
    if setting is False:
        return dataclasses.replace(caller, enabled=False)
    if isinstance(setting, torch.dtype):
        return dataclasses.replace(caller, enabled=True, dtype=setting)
    raise ValueError(f"autocast must be None (the caller's state), False or a torch.dtype, "
                     f"got {setting!r}")


def autocast_context(state: AutocastState) -> contextlib.AbstractContextManager:
    """Apply ``state`` on the current (worker) thread."""
    if not state.enabled:
        # A worker thread starts with autocast off; enter a context only if a layer left it on.
        if not torch.is_autocast_enabled(state.device_type):
            return contextlib.nullcontext()
        return torch.autocast(state.device_type, enabled=False)
    return torch.autocast(state.device_type, dtype=state.dtype, enabled=True,
                          cache_enabled=state.cache_enabled)


# [Note: RNG chains]
# The CPU default generator is process-global and shared by concurrent CPU workers, so which
# worker runs a stage, and when, must not decide which random numbers it draws.
# * Each microbatch has an RNG chain: stage s of microbatch m starts from the state in which
#   stage s-1 of microbatch m ended.
# * A single-microbatch call starts its chain from the caller's current global state, so one
#   microbatch on one worker draws exactly what plain PyTorch draws (dropout masks included).
#   With M > 1 microbatches, one base seed is drawn from the global generator at the call and
#   microbatch m's chain is seeded from (base, m).
# * A stage "uses RNG" if preserve_rng_state=True; with None (the default), if it contains a
#   dropout module (nn.Dropout family) in training mode, or if it is not known yet to draw no
#   random numbers: the first call of a stage (per training/eval mode) runs in the chain and
#   records whether the generator moved (``_ScopeResult.drew``); stages that did not draw run
#   outside the chain from then on. So functional randomness (F.dropout, dropout_p of
#   scaled_dot_product_attention, torch.rand) is found without naming it. Such a stage runs its
#   forward (and its recompute) holding RNG_LOCK: set the global state to the chain state, run,
#   capture the end state for the next stage. Recompute restores the saved start state under the
#   lock, so it reproduces the masks. Stages that do not use RNG run without the lock,
#   concurrently. preserve_rng_state=False turns the chain off (recompute may then draw other
#   masks).
# * After the call the global generator is left deterministic: for M = 1 in the state where the
#   chain ended (as plain PyTorch), for M > 1 just after the base seed was drawn.
# * On an accelerator, a chain state also holds a device generator state, taken from device 0;
#   whichever device runs a stage gets it, so masks do not depend on the pool's size. Device 0's
#   generator is left as the CPU's is; the other devices' get their state from before the call.
# Result: with a fixed seed, parameters are bitwise identical for any number of CPU workers.

RNG_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class RNGState:
    """A chain state: the CPU generator state and, on CUDA, the worker device's state."""

    cpu: torch.Tensor
    device: Optional[torch.Tensor] = None


def uses_rng(modules: Iterable[torch.nn.Module], preserve_rng_state: Optional[bool]) -> Optional[bool]:
    """Whether a stage made of ``modules`` (its layers) must run in an RNG chain: the setting if
    given, True if it holds a dropout module in training mode, else None (unknown: probe it)."""
    if preserve_rng_state is not None:
        return bool(preserve_rng_state)
    has_dropout = any(isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training
                      for layer in modules for sub in layer.modules())
    return True if has_dropout else None


def _mix(base: int, mb_index: int) -> int:
    # splitmix64 of (base, m): distinct, well-spread seeds per microbatch.
    x = (base + 0x9E3779B97F4A7C15 * (mb_index + 1)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def chain_starts(num_microbatch: int, backend: Backend) -> List[RNGState]:
    """The start state of each microbatch's chain; draws the base seed when M > 1.

    Call on the caller's thread at the start of the call (it may advance the global generator).
    """
    if num_microbatch == 1:
        return [RNGState(torch.get_rng_state(), backend.get_rng_state())]
    base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    starts = []
    for m in range(num_microbatch):
        seed = _mix(base, m)
        gen = torch.Generator()
        gen.manual_seed(seed)
        starts.append(RNGState(gen.get_state(), backend.seeded_rng_state(seed)))
    return starts


class _ScopeResult:
    """What an :func:`rng_scope` reports: ``end``, the state the body ended in (None without a
    start state), and ``drew``, whether the body moved a generator."""

    __slots__ = ("end", "drew")

    def __init__(self) -> None:
        self.end: Optional[RNGState] = None
        self.drew = False

    def __enter__(self) -> "_ScopeResult":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


# What rng_scope returns for a stage outside the RNG chain: shared, so that the per-action path
# allocates nothing for it. Never written (end and drew keep their defaults).
_NO_SCOPE = _ScopeResult()


def rng_scope(start: Optional[RNGState], backend: Backend) -> contextlib.AbstractContextManager:
    """Run the body with the global RNG set to ``start`` under :data:`RNG_LOCK`; the object the
    ``with`` yields has ``end``, the state the body ended in, and ``drew``. ``start=None``: no RNG
    handling, no lock (``end`` stays None). The returned object may be entered again (each entry
    starts from ``start``), on any thread: checkpoint enters it for a recompute, which on an
    accelerator runs on the autograd engine's device thread, maybe more than once if a recompute
    fails. Blocks on the lock."""
    if start is None:
        return _NO_SCOPE
    return _ChainScope(start, backend)


class _ChainScope:
    """The context manager of :func:`rng_scope` for a stage in the RNG chain. Its state is the
    start and the backend, both given at construction: nothing is read from the entering
    thread's locals."""

    __slots__ = ("_start", "_backend", "_result")

    def __init__(self, start: RNGState, backend: Backend) -> None:
        self._start = start
        self._backend = backend
        self._result: Optional[_ScopeResult] = None

    def __enter__(self) -> _ScopeResult:
        RNG_LOCK.acquire()
        try:
            torch.set_rng_state(self._start.cpu)
            self._backend.set_rng_state(self._start.device)
        except BaseException:
            RNG_LOCK.release()
            raise
        self._result = _ScopeResult()
        return self._result

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        result, self._result = self._result, None
        try:
            if exc_type is None and result is not None:
                start = self._start
                result.end = RNGState(torch.get_rng_state(), self._backend.get_rng_state())
                result.drew = not (torch.equal(result.end.cpu, start.cpu)
                                   and _same_or_none(result.end.device, start.device))
        finally:
            RNG_LOCK.release()


def _same_or_none(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def restore_global(state: RNGState, backend: Backend) -> None:
    """Set the global generator(s) to ``state`` (caller's thread, after the call)."""
    with RNG_LOCK:
        torch.set_rng_state(state.cpu)
        backend.set_rng_state(state.device)
