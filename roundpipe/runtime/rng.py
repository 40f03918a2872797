"""RNG chains: which random numbers each stage draws, whichever worker runs it and when (see
[Note: RNG chains]).

* The primitives: :class:`RNGState`, :func:`chain_starts`, :func:`rng_scope` (re-enterable, so a
  checkpoint recompute on autograd's device thread can enter it), :func:`restore_global`.
* One call's chains (:class:`CallRng`, :func:`plan_call_rng`): which stages run in a chain, the
  start state of each microbatch's chain, and the generator states restored after the call
  (:func:`restore_after_call`); which probed stages drew (:func:`learn_rng_use`), remembered per
  model in an :data:`RngMemo`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from roundpipe.devices import Backend

__all__ = [
    "RNG_LOCK",
    "RNGState",
    "CallRng",
    "RngMemo",
    "chain_starts",
    "rng_scope",
    "restore_global",
    "uses_rng",
    "plan_call_rng",
    "learn_rng_use",
    "restore_after_call",
]


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
    device: torch.Tensor | None = None


def uses_rng(modules: Iterable[torch.nn.Module], preserve_rng_state: bool | None) -> bool | None:
    """Whether a stage made of ``modules`` (its layers) must run in an RNG chain: the setting if
    given, True if it holds a dropout module in training mode, else None (unknown: probe it)."""
    if preserve_rng_state is not None:
        return bool(preserve_rng_state)
    has_dropout = any(
        isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training
        for layer in modules
        for sub in layer.modules()
    )
    return True if has_dropout else None


def _mix(base: int, mb_index: int) -> int:
    # splitmix64 of (base, m): distinct, well-spread seeds per microbatch.
    x = (base + 0x9E3779B97F4A7C15 * (mb_index + 1)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def chain_starts(num_microbatch: int, backend: Backend) -> list[RNGState]:
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
        self.end: RNGState | None = None
        self.drew = False

    def __enter__(self) -> _ScopeResult:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


# What rng_scope returns for a stage outside the RNG chain: shared, so that the per-action path
# allocates nothing for it. Never written (end and drew keep their defaults).
_NO_SCOPE = _ScopeResult()


def rng_scope(start: RNGState | None, backend: Backend) -> contextlib.AbstractContextManager:
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
        self._result: _ScopeResult | None = None

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
                result.drew = not (
                    torch.equal(result.end.cpu, start.cpu)
                    and _same_or_none(result.end.device, start.device)
                )
        finally:
            RNG_LOCK.release()


def _same_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def restore_global(state: RNGState, backend: Backend) -> None:
    """Set the global generator(s) to ``state`` (caller's thread, after the call)."""
    with RNG_LOCK:
        torch.set_rng_state(state.cpu)
        backend.set_rng_state(state.device)


# Per model: for each probed stage (its layers' ids and training flags), whether it drew.
RngMemo = dict


@dataclasses.dataclass(frozen=True)
class CallRng:
    """One call's RNG chains (see [Note: RNG chains]). ``stage_rng``: per stage, whether it runs
    in the chain; ``probe_keys``: per stage, its memo key if it runs in the chain only to learn
    whether it draws (else None); ``starts``: each microbatch's chain start (None: no stage
    draws); ``after_draw``: the global state after the base seed was drawn; ``others``: the
    generator states of the pool's other devices before the call, restored after it (their
    stages set them to chain states)."""

    stage_rng: tuple[bool, ...]
    probe_keys: tuple[tuple | None, ...]
    starts: tuple[RNGState, ...] | None
    after_draw: RNGState | None
    others: tuple[tuple[Backend, torch.Tensor | None], ...]


def plan_call_rng(
    stage_layers: Sequence[Sequence[torch.nn.Module]],
    num_microbatch: int,
    preserve_rng_state: bool | str,
    memo: RngMemo,
    backends: Sequence[Backend],
) -> CallRng:
    """Main thread, at the start of a call: its chains (may advance the global generator)."""
    setting = None if preserve_rng_state == "auto" else bool(preserve_rng_state)
    stage_rng, probe_keys = [], []
    for modules in stage_layers:
        known = uses_rng(modules, setting)
        key = None
        if known is None:  # see [Note: RNG chains]: probe the stage until it is known
            key = tuple((id(m), m.training) for m in modules)
            known = memo.get(key)
            if known is None:
                known = True
            else:
                key = None
        stage_rng.append(known)
        probe_keys.append(key)
    starts = after = None
    others: tuple[tuple[Backend, torch.Tensor | None], ...] = ()
    if any(stage_rng):
        backend0 = backends[0]
        starts = tuple(chain_starts(num_microbatch, backend0))
        after = RNGState(torch.get_rng_state(), backend0.get_rng_state())
        others = tuple((b, b.get_rng_state()) for b in backends[1:])
    return CallRng(tuple(stage_rng), tuple(probe_keys), starts, after, others)


def learn_rng_use(memo: RngMemo, rng: CallRng, drew: Sequence[bool]) -> None:
    """Main thread, after a call succeeded: remember whether each probed stage drew."""
    for key, did in zip(rng.probe_keys, drew):
        if key is not None:
            memo[key] = did


def restore_after_call(rng: CallRng, backend0: Backend, end: RNGState | None) -> None:
    """Main thread, after a call: leave the global RNG deterministic (see [Note: RNG chains]).
    ``end``: where a single microbatch's chain ended, if the call succeeded."""
    if rng.starts is None:
        return
    # First the other devices (an emulated device's generator is the CPU's, which device 0's
    # restore below then sets).
    for backend, state in rng.others:
        backend.set_rng_state(state)
    assert rng.after_draw is not None
    restore_global(end if end is not None and len(rng.starts) == 1 else rng.after_draw, backend0)
