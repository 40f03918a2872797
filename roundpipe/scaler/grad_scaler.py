"""``roundpipe.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose scale is double-buffered
between the compute threads and the optimizer thread.

See [Note: the scale double buffer] for the contract and docs/scaler.md for the user's view.
"""

from __future__ import annotations

import enum
import inspect
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
from torch._subclasses.fake_tensor import FakeTensor

from roundpipe.scaler import finite_check
from roundpipe.scaler.host_copy import HostCopy
from roundpipe.scaler.rule import (
    COLLAPSE_STREAK,
    ScaleHyper,
    ScaleRule,
    check_hyper,
    check_hyper_field,
)
from roundpipe.threads import optimizer_thread
from roundpipe.threads.optimizer_thread import on_optimizer_thread
from roundpipe.threads.step_context import check_optimizer_params

__all__ = [
    "AgreesOnOverflow",
    "GradScaler",
    "OptState",
    "ScalerSnapshot",
    "ScaleCollapseWarning",
    "note_step_launched",
]


# [Note: the scale double buffer]
# The scaler keeps three scales (0-d float32 tensors on the scaler's device):
#
#   front  ``_front``  what scale() multiplies by. Read by the compute threads (main, device
#                      workers); replaced only by update() on the main thread, between iterations.
#   back   ``_back``   what unscale_()/step() divide by. It is always the scale that produced the
#                      gradients being stepped.
#   newest ``_rule.scale``  the running scale that the update rule U evolves (torch's
#                      ``_scale``); U itself is the thread-free :class:`ScaleRule` ``_rule``.
#
# back, the rule (newest, the growth tracker, the hyperparameters U reads) and the per-optimizer
# states form
# the *back side*. The back side is touched by one thread at a time: the optimizer thread, or the
# main thread while no launched work can touch it (the scaler's own last launched item has run,
# and, if steps use the scaler, no launched step is still to run; see ``_claim_back_side``).
#
# Let s_k be the scale iteration k's losses were multiplied by.
#   Sync update (every step of iteration k returned before update()): U runs at once on the
#     main thread; s_{k+1} = newest after U on step k; front = back = newest. Bit for bit
#     torch.amp.GradScaler.
#   Async update (a step of iteration k was launched and not waited for): update() waits only for
#     U of step k-1 (launched by the previous update(), finished while iteration k computed),
#     hands its result to the compute side as s_{k+1}, and launches U for step k on the optimizer
#     thread, behind step k. That U sets back = s_{k+1}, so step k+1 divides by the scale that
#     produced its gradients. s_0 = s_1 = init_scale.
#   Overflow rule in U: on an overflow in a step scaled by s_k (= back when U runs), the new scale
#     is min(newest, s_k * backoff) (and the tracker 0); in sync mode newest == s_k, so it is
#     torch's newest * backoff. An overflow that a stale scale repeats is thus not backed off
#     twice: U of step k-1 already set newest = s_{k-1} * backoff, and step k, scaled by the same
#     stale s_k = s_{k-1}, leaves it there.
#
# Each U publishes a ``_Published`` record (a clone of newest, the counters, the hyperparameters,
# and a HostCopy of newest, the tracker and the skipped steps): the result of its work item, so
# the main thread reads it only after the item's event is set. The getters and snapshot() read
# those host copies and the front scale's (``_front_copy``), never a device tensor: monitoring
# never syncs the device, and neither does U (a host copy is started without waiting).

# [Note: which update]
# update() is async exactly when a launched step that uses this scaler has not been waited for.
# "Uses" is what the launch saw: model.step and optim_thread.launch search the step function
# (roundpipe.step_check) and hand the launched item to the scalers they found
# (note_step_launched); a model keeps the scalers its earlier steps used, so its later steps
# count for them too. Steps of other models, plain loops stepping on the main thread and
# launches of other libraries do not change this scaler's mode: nothing process-wide is read.
# An update() that finds neither such a launch nor a step() on the main thread since the
# previous update() is refused at once (a step function that uses the scaler where the search
# cannot see it would otherwise race it): the error says to name the scaler in the function.


class AgreesOnOverflow(Protocol):
    """What a scaler needs of data parallelism (:class:`roundpipe.distributed.DataParallel` is
    one): every rank's inf/NaN flags made into one flag, the same on every rank."""

    def agree_found_inf(
        self, found_per_device: dict[torch.device, torch.Tensor], like: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]: ...


class OptState(enum.Enum):
    """Where an optimizer is in the iteration, as in torch.amp.GradScaler."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class ScaleCollapseWarning(RuntimeWarning):
    """Gradients keep overflowing although the scale is already at ``min_scale``."""


@dataclass(frozen=True)
class ScalerSnapshot:
    """A non-blocking view of a :class:`GradScaler` for monitoring.

    ``scale_in_use``: what ``scale()`` multiplies by now (the front scale).
    ``newest_scale``: the newest scale the update rule has produced (in async mode it runs one
    update ahead of ``scale_in_use``). ``growth_tracker``, ``steps`` (updates that consumed inf
    checks) and ``skipped_steps`` (those whose gradients overflowed) come from the same update.
    """

    scale_in_use: float
    newest_scale: float
    growth_tracker: int
    steps: int
    skipped_steps: int


def _sum_flags(flags: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The sum of inf/NaN flags from several devices, on ``device`` (None: no flags), added in
    order as torch's GradScaler does."""
    total = None
    for flag in flags:
        flag = flag.to(device, non_blocking=True)
        total = flag if total is None else total + flag
    return total


@dataclass(frozen=True)
class _Published:
    setter_seq: int  # the newest main-thread setter already applied on the back side
    scale: torch.Tensor
    numbers: HostCopy  # scale, growth tracker, skipped steps
    steps: int
    collapse_streak: int
    hyper: ScaleHyper

    @property
    def scale_value(self) -> float:
        return self.numbers.values()[0]

    @property
    def growth_tracker(self) -> int:
        return int(self.numbers.values()[1])

    @property
    def skipped_steps(self) -> int:
        return int(self.numbers.values()[2])


class _PerOptimizerState:
    __slots__ = ("stage", "found_inf_per_device", "found_inf")

    def __init__(self) -> None:
        self.stage = OptState.READY
        self.found_inf_per_device: dict[torch.device, torch.Tensor] = {}
        self.found_inf: torch.Tensor | None = None  # summed over devices, set by step()


def _resolve_device(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@dataclass(frozen=True)
class _LoadedState:
    scale: float
    front_scale: float
    hyper: ScaleHyper
    growth_tracker: int
    skipped_steps: int
    steps: int
    hysteresis_left: int
    collapse_streak: int
    initialized: bool


def _count(name: str, value: Any, low: int = 0, high: float = float("inf")) -> int:
    """An integer count from a state dict (an integral float, as an older file may hold, too)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(
            f"GradScaler.load_state_dict: {name} must be an int in [{low}, {high}], got {value!r}"
        )
    return value


def _parse_state_dict(state_dict: dict[str, Any], current: ScaleHyper) -> _LoadedState:
    """Read and validate a state dict of :class:`GradScaler` or of torch's, with the
    constructor's rules (:func:`check_hyper`); raise ``ValueError`` naming what is wrong.
    Touches no scaler, so a refused state dict changes nothing."""
    missing = [
        k
        for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        if k not in state_dict
    ]
    if missing:
        raise ValueError(f"GradScaler.load_state_dict: the state dict lacks {missing}")
    extra = state_dict.get("roundpipe", {})
    interval = state_dict["growth_interval"]
    if isinstance(interval, float) and interval.is_integer():
        interval = int(interval)
    hyper = ScaleHyper(
        state_dict["growth_factor"],
        state_dict["backoff_factor"],
        interval,
        extra.get("hysteresis", current.hysteresis),
        extra.get("min_scale", current.min_scale),
        extra.get("max_scale", current.max_scale),
    )
    scale = state_dict["scale"]
    try:
        check_hyper(hyper)
        check_hyper_field("scale", scale)
        front = extra.get("front_scale", scale)
        check_hyper_field("front_scale", front)
    except ValueError as e:
        raise ValueError(f"GradScaler.load_state_dict: {e}") from None
    hyper.growth_factor = float(hyper.growth_factor)
    hyper.backoff_factor = float(hyper.backoff_factor)
    return _LoadedState(
        scale=float(scale),
        front_scale=float(front),
        hyper=hyper,
        growth_tracker=_count("_growth_tracker", state_dict["_growth_tracker"]),
        skipped_steps=_count("skipped_steps", extra.get("skipped_steps", 0)),
        steps=_count("steps", extra.get("steps", 0)),
        hysteresis_left=_count(
            "hysteresis_left", extra.get("hysteresis_left", hyper.hysteresis), 0, hyper.hysteresis
        ),
        collapse_streak=_count("collapse_streak", extra.get("collapse_streak", 0)),
        initialized=bool(extra.get("initialized", False)),
    )


def _check_not_on_model_params(optimizer: torch.optim.Optimizer) -> None:
    """In a RoundPipe step function, an optimizer without gradients is most likely one built on
    the model's own parameters (gradients go to the masters): raise the RuntimeError that says so
    and how to fix it. Elsewhere a no-op."""
    check_optimizer_params(optimizer)


def note_step_launched(scalers: Iterable[GradScaler], item: optimizer_thread.WorkItem) -> None:
    """Record that the launched step ``item`` uses each of ``scalers`` (``model.step`` or
    ``optim_thread.launch`` found them in the function it launched): the main thread may not
    touch their back side while the step may run, and their next :meth:`GradScaler.update` is
    asynchronous while it is not waited for (see [Note: which update]). The launching thread,
    right after the launch; never blocks."""
    for scaler in scalers:
        scaler._note_step(item)


class GradScaler:
    """A drop-in for :class:`torch.amp.GradScaler` whose scale is double-buffered between the
    compute threads and the roundpipe optimizer thread, so :meth:`update` never waits for a
    running step. See [Note: the scale double buffer] and docs/scaler.md.

    Same constructor, methods and defaults as torch's, except that ``device=None`` (the default)
    means CUDA when it is available and the CPU otherwise. Opt-in extras, all off by default:
    ``hysteresis`` (back off only on the ``hysteresis``-th consecutive overflow, and on every
    consecutive overflow after it), ``min_scale`` / ``max_scale`` (bounds; a run whose gradients
    keep overflowing at ``min_scale`` raises a :class:`ScaleCollapseWarning`), ``data_parallel``
    (agree on overflows over a :class:`roundpipe.distributed.DataParallel`'s ranks, see
    :meth:`join_data_parallel`), :meth:`snapshot` for monitoring, :meth:`step_was_skipped`, and
    ``up_to_date`` on every getter.

    Call sequence, once per iteration, and who calls each step:

    1. :meth:`scale` the loss: inside ``loss_fn``, on the device workers (or wherever the loss
       is computed).
    2. :meth:`unscale_` (only to read or clip the true gradients), then :meth:`step`: where the
       optimizer steps, inside the step function on the optimizer thread with ``model.step``,
       else on the main thread.
    3. :meth:`update`: the main thread, after ``model.step``; it never waits for the step.

    Threads. Attributes owned by the main thread: ``_front``, ``_front_copy``,
    ``_front_replicas``, ``_mirror``, ``_published``, ``_pending``, ``_last_item``,
    ``_launch_mark``, ``_stepped_on_main``, ``_newest_step`` (written by the launching thread,
    see [Note: which update]). Attributes of the back side (``_scale``, ``_back``,
    ``_growth_tracker``, ``_hyper``, ``_per_optimizer_states``, counters) are touched by the
    optimizer thread, or by the main thread when no launched work can touch them.
    ``_used_by_steps`` (launched steps use the scaler) is set by the optimizer thread, or by the
    launching thread when ``model.step`` finds the scaler in a step function; read by the main
    thread. Device workers only read ``_front`` (through :meth:`scale`).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        data_parallel: AgreesOnOverflow | None = None,
    ) -> None:
        self._device = _resolve_device(device)
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn(
                "roundpipe.GradScaler was asked for CUDA, but CUDA is not available: disabling "
                "it (as torch.amp.GradScaler does). Pass device='cpu' or leave device unset.",
                stacklevel=2,
            )
            self._enabled = False
        if not self._enabled:
            return
        # Back side. The rule validates the hyperparameters; its tensors move to the device of
        # the first scaled output.
        self._rule = ScaleRule(
            init_scale,
            ScaleHyper(
                growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
            ),
        )
        # Before the lazy init: the front scale to start with (load_state_dict may change it).
        self._init_front = float(init_scale)
        self._init_lock = threading.Lock()
        self._back: torch.Tensor | None = None
        # Whether back == newest (always after a sync update): then the overflow rule's
        # min(newest, back) is a no-op and is skipped, keeping sync mode torch's exact kernels.
        self._back_is_newest = True
        self._failures_seen = optimizer_thread.failure_count()
        self._per_optimizer_states: dict[int, _PerOptimizerState] = defaultdict(_PerOptimizerState)
        # Front side (main thread).
        self._front: torch.Tensor | None = None
        self._front_copy: HostCopy | None = None  # the front scale's value, with _front
        self._front_replicas: dict[torch.device, torch.Tensor] = {}
        self._mirror = self._rule.hyper.copy()
        # Main-thread setters are numbered; the back side records the newest it applied, so a
        # record published before a setter ran does not overwrite the mirror with an old value.
        self._setter_seq = 0
        self._setter_applied = 0
        self._published: _Published | None = None
        self._pending: optimizer_thread.WorkItem | None = None  # the last launched update
        # What a step since the previous update() looks like from the main thread: a launch
        # (model.step) or a step()/unscale_() called on the main thread itself.
        # The newest launched step found to use this scaler (note_step_launched), and what it
        # was at the previous update().
        self._newest_step: optimizer_thread.WorkItem | None = None
        self._launch_mark: optimizer_thread.WorkItem | None = None
        self._stepped_on_main = False
        self._last_item: optimizer_thread.WorkItem | None = None  # the last launched back work
        self._used_by_steps = False
        self._data_parallel: AgreesOnOverflow | None = None
        if data_parallel is not None:
            self.join_data_parallel(data_parallel)

    # ------------------------------------------------------------------------------------------
    # lazy initialisation (as torch: on the device of the first scaled output)
    # ------------------------------------------------------------------------------------------

    @property
    def data_parallel(self) -> AgreesOnOverflow | None:
        """The :class:`roundpipe.distributed.DataParallel` whose ranks agree on this scaler's
        overflows (None: this process decides alone). Any thread; never blocks."""
        return self._data_parallel if self._enabled else None

    def join_data_parallel(self, data_parallel: AgreesOnOverflow | None) -> None:
        """Agree on inf/NaN gradients with the ranks of ``data_parallel`` (one all-reduce per
        ``unscale_``/``step``), so that every rank skips the same steps; None leaves it.

        A scaler that a step of a model with a DataParallel uses joins it by itself (at the
        launch that first uses it) and leaves it at ``close()``; call this for a scaler whose
        ``step`` runs outside ``model.step``. Main thread, between iterations; never blocks.

        Args:
            data_parallel: the DataParallel to agree over, or None.
        """
        if self._enabled:
            self._data_parallel = data_parallel

    def _note_step(self, item: optimizer_thread.WorkItem) -> None:
        """See :func:`note_step_launched`."""
        self._used_by_steps = True
        self._newest_step = item

    def _lazy_init(self, device: torch.device) -> None:
        with self._init_lock:
            if self._front is not None:
                return
            full = lambda v: torch.full((), v, dtype=torch.float32, device=device)  # noqa: E731
            self._rule.to_(device)
            self._back = full(self._init_front)
            self._published = self._publish()
            front_tensor = full(self._init_front)
            self._front_copy = HostCopy(front_tensor)
            self._front = front_tensor  # last: scale() reads it without the lock

    def _back_scale(self) -> torch.Tensor:
        """The back scale; after :meth:`_lazy_init` (which callers check first)."""
        back = self._back
        assert back is not None, "GradScaler: the back side is read before its lazy init"
        return back

    def _check_initialized(self, funcname: str) -> None:
        if self._front is None:
            raise RuntimeError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not "
                "use scaler.scale(loss or outputs) earlier in the iteration."
            )

    # ------------------------------------------------------------------------------------------
    # compute side
    # ------------------------------------------------------------------------------------------
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(
        self, outputs: torch.Tensor | Iterable[torch.Tensor]
    ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or an iterable of tensors, by the scale (as torch).

        Any thread; never blocks and does not incur a CPU-device sync. The compute threads
        multiply by the front scale, the optimizer thread by the back scale.

        Args:
            outputs: a tensor (usually the loss), or a list, tuple or other iterable of them
                (nested too); a list or tuple comes back as one, another iterable as a map.
        """
        if not self._enabled:
            return outputs

        def apply(value):
            if isinstance(value, FakeTensor):
                # A memory plan traces loss_fn on fake tensors: scale by a fake of the same
                # dtype, and leave the scaler's state (its lazily made scale) alone.
                return value * torch.ones((), dtype=torch.float32, device=value.device)
            if isinstance(value, torch.Tensor):
                return value * self._scale_on(value.device)
            if isinstance(value, Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._front is None:
            self._lazy_init(device)
        front, back = self._front, self._back
        assert front is not None and back is not None  # set together by _lazy_init
        if on_optimizer_thread():
            return back.to(device, non_blocking=True)
        replicas = self._front_replicas
        replica = replicas.get(device)
        if replica is None:
            # Benign race between workers: both compute the same copy; a dict store is atomic.
            replica = replicas[device] = front.to(device, non_blocking=True)
        return replica

    def _set_front(self, value: torch.Tensor, copy: HostCopy) -> None:
        """Main thread, between iterations: the compute side uses ``value`` (whose value
        ``copy`` holds first) from now on."""
        self._front_replicas = {}
        self._front_copy = copy
        self._front = value

    def _front_value(self) -> float:
        assert self._front_copy is not None  # set with _front
        return self._front_copy.values()[0]

    # ------------------------------------------------------------------------------------------
    # back side: unscale_ / step
    # ------------------------------------------------------------------------------------------
    def _claim_back_side(self, what: str) -> None:
        """Before the calling thread touches the back side: the optimizer thread always may; the
        main thread waits for the scaler's own launched work and refuses if a launched step may
        be touching it right now."""
        if on_optimizer_thread():
            self._used_by_steps = True
            return
        # Only steps can touch it besides its own items, and only if they use this scaler: a
        # scaler of a plain loop on the main thread is not held up by an unrelated RoundPipe.
        if self._used_by_steps and optimizer_thread.has_pending_launch():
            raise RuntimeError(
                f"GradScaler.{what} was called on the main thread while a step launched on the "
                "optimizer thread (e.g. by model.step), which uses this scaler, has not finished, "
                "so both threads would touch the scaler at once. Call it inside the step function "
                "instead, or wait first (model.step(..., is_async=False) or "
                "roundpipe.optim_thread.synchronize())."
            )
        self._wait_last_item()

    def _note_main_thread_step(self) -> None:
        if not on_optimizer_thread():
            self._stepped_on_main = True

    def _launch(self, fn: Any, *args: Any) -> optimizer_thread.WorkItem:
        """The scaler's own back-side work, owned by it (see [Note: error reporting] in
        roundpipe.threads.optimizer_thread); it changes the scaler only, so a checkpoint's hold does not
        stop it (its state was taken when the checkpoint's item ran)."""
        return optimizer_thread.launch_work(fn, args, owners=(self,), touches=("scaler",))

    def _wait_last_item(self) -> None:
        item = self._last_item
        if item is not None:
            self._last_item = None
            item.wait()  # raises its failure if nobody reported it yet

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
        check_only: bool = False,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale the gradients by ``inv_scale`` and flag inf/NaN, per device (torch's pass).
        ``check_only`` (``inv_scale`` is 1): a gradient the device already checked is not read
        again (see [Note: checked on the device] in :mod:`roundpipe.scaler.finite_check`)."""
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        checked: dict[torch.device, bool] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    known = finite_check.nonfinite(grad) if check_only else None
                    if known is not None:
                        checked[grad.device] = checked.get(grad.device, False) or known
                        continue
                    if grad.is_sparse:
                        # Duplicate fp16 indices could overflow when summed later: coalesce first.
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grads[grad.device][grad.dtype].append(grad)
            found_per_device: dict[torch.device, torch.Tensor] = {}
            for device in [*grads, *checked]:
                if device not in found_per_device:
                    found_per_device[device] = found_inf.to(device, copy=True)
            for device, per_dtype in grads.items():
                found = found_per_device[device]
                inv = inv_scale.to(device)
                for same_dtype in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, inv)
            for device, any_nonfinite in checked.items():
                if any_nonfinite:
                    found_per_device[device].fill_(1.0)
        # Under data parallelism every rank must skip the same steps: agree on the flag.
        data_parallel = self._data_parallel
        if data_parallel is None:
            return found_per_device
        return data_parallel.agree_found_inf(found_per_device, found_inf)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the back scale and check them for inf/NaN (as torch).

        Call it where the step runs: inside the step function (optimizer thread) when steps are
        launched with ``model.step``, else on the main thread. Does not block and does not incur
        a CPU-device sync (one all-reduce under data parallelism).

        Args:
            optimizer: the optimizer whose parameters' gradients to unscale; once per
                optimizer and iteration, before its ``step``.
        """
        if not self._enabled:
            return
        self._check_initialized("unscale_")
        self._claim_back_side("unscale_()")
        self._note_main_thread_step()
        state = self._per_optimizer_states[id(optimizer)]
        if state.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        back = self._back_scale()
        inv_scale = back.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=back.device)
        state.found_inf_per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        state.stage = OptState.UNSCALED

    def _found_inf_sum(self, state: _PerOptimizerState) -> torch.Tensor:
        device = self._back_scale().device
        total = _sum_flags(state.found_inf_per_device.values(), device)
        if total is None:  # no gradient to check (a fused step without grads): nothing overflowed
            return torch.zeros((), dtype=torch.float32, device=device)
        return total

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and step the optimizer unless gradients
        overflowed (as torch); returns what ``optimizer.step`` returns.

        Call it where the step runs (see :meth:`unscale_`). Optimizers that set
        ``_step_supports_amp_scaling`` (torch's fused Adam, roundpipe.optim) receive
        ``grad_scale``/``found_inf`` and unscale inside their own kernel. Whether the step was
        skipped: :meth:`step_was_skipped`.

        .. warning::
            For an optimizer that does not unscale in its own kernel, this reads the inf/NaN
            flag on the host: it syncs with the device that holds the gradients (on the
            optimizer thread, when launched with ``model.step``).

        Args:
            optimizer: the optimizer to step.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step`` (no ``closure``: ``RuntimeError``).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_initialized("step")
        self._claim_back_side("step()")
        self._note_main_thread_step()
        state = self._per_optimizer_states[id(optimizer)]
        if state.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = self._fused_step(optimizer, state, args, kwargs)
        else:
            if state.stage is OptState.READY:
                self.unscale_(optimizer)
            if not state.found_inf_per_device:
                _check_not_on_model_params(optimizer)
                # torch's exception type and words, plus the cause.
                raise AssertionError(
                    "No inf checks were recorded for this optimizer: none of its "
                    "parameters has a gradient. Run backward() on a scaled loss "
                    "before step(), or step only optimizers whose parameters "
                    "got gradients."
                )
            state.found_inf = self._found_inf_sum(state)
            retval = None
            if not state.found_inf.item():
                retval = optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: _PerOptimizerState, args: tuple, kwargs: dict
    ) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer; optimizers should read `grad_scale` and `found_inf` instead.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs = dict(kwargs, grad_scaler=self)
            retval = optimizer.step(*args, **kwargs)
            if state.found_inf_per_device:
                state.found_inf = self._found_inf_sum(state)
            return retval
        if state.stage is OptState.READY:
            # Only look for inf/NaN (inverse scale 1): the optimizer unscales in its own kernel,
            # so the gradients are read once more, not twice.
            back = self._back_scale()
            one = torch.ones((), dtype=torch.float32, device=back.device)
            found = torch.zeros((), dtype=torch.float32, device=back.device)
            state.found_inf_per_device = self._unscale_grads_(
                optimizer, one, found, True, check_only=True
            )
            optimizer.grad_scale = back * getattr(optimizer, "grad_scale", 1)  # type: ignore[attr-defined]
        else:
            optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
        state.found_inf = self._found_inf_sum(state)
        # A sum over several devices can be 2.0, and torch's CPU fused kernels skip only on 1.0.
        optimizer.found_inf = (  # type: ignore[attr-defined]
            state.found_inf
            if len(state.found_inf_per_device) == 1
            else state.found_inf.clamp(max=1.0)
        )
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``step(optimizer)`` of this iteration skipped the update (inf/NaN gradients).

        Call it on the thread that called ``step`` (usually inside the step function), after
        ``step`` and before ``update``.

        .. warning::
            Syncs with the device that holds the gradients.

        Args:
            optimizer: the optimizer given to this iteration's ``step``.
        """
        if not self._enabled:
            return False
        state = self._per_optimizer_states.get(id(optimizer))
        if state is None or state.stage is not OptState.STEPPED or state.found_inf is None:
            raise RuntimeError(
                "step_was_skipped() needs scaler.step(optimizer) to have run in this iteration, "
                "before update(); call it right after step(), on the same thread."
            )
        return bool(state.found_inf.item())

    # ------------------------------------------------------------------------------------------
    # update
    # ------------------------------------------------------------------------------------------
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, is_async: bool | None = None
    ) -> None:
        """Update the scale after every step of the iteration (as torch), without waiting for a
        running step.

        Main thread only (on the optimizer thread it would wait for itself: RuntimeError). Mode:
        asynchronous (lag one) when a step of this iteration was launched on the optimizer thread
        and not waited for, synchronous (exactly torch) otherwise, and always for a scaler whose
        ``step()`` ran on the main thread in this iteration and that no launched step uses;
        ``is_async`` forces one.
        The async mode waits only for the previous iteration's update. ``new_scale`` sets the
        scale; the compute side uses it from the next iteration on. Re-raises a failure of
        earlier launched work. An update with no step since the previous one (e.g. called twice
        in an iteration) raises RuntimeError at once. See [Note: the scale double buffer].

        Never syncs with the device: each update starts a non-blocking host copy of the scale,
        which the getters read.

        Args:
            new_scale: a float or a one-element tensor to set the scale to (the growth tracker
                is left alone, as torch); None: the update rule decides.
            is_async: force the async (True) or sync (False) update; None: decided from how
                the iteration's step ran.
        """
        if not self._enabled:
            return
        if on_optimizer_thread():
            raise RuntimeError(
                "GradScaler.update() was called on the optimizer thread, where it would wait for "
                "itself. Call scaler.update() on the main thread, after model.step(...)."
            )
        self._check_initialized("update")
        new_value = None if new_scale is None else self._check_new_scale(new_scale)
        # See [Note: which update]: only the launched steps that use this scaler count.
        newest = launch_mark = self._newest_step
        stepped_by_launch = launch_mark is not self._launch_mark
        launched = newest is not None and not optimizer_thread.was_waited(newest)
        if is_async is None:
            is_async = launched
        if new_value is None and not stepped_by_launch and not self._stepped_on_main:
            # Left alone, the update would find no step (launched: it fails on the optimizer
            # thread, reported one iteration later; sync: it races a step roundpipe did not see);
            # the call that is wrong is this one.
            raise RuntimeError(
                "GradScaler.update() was called with no step that uses this scaler since the "
                "previous update(): no step launched on the optimizer thread (model.step) refers "
                "to it and scaler.step() did not run on this thread. Call scaler.update() once "
                "per iteration, after model.step(...). If the step function does use the scaler "
                "through an object roundpipe does not search (its closure, globals, defaults, "
                "bound method objects and one level of callables are searched), name the scaler "
                "in the step function, e.g. model.step(lambda: (scaler.step(opt), ...))."
            )
        self._launch_mark = launch_mark
        self._stepped_on_main = False
        # The iteration's bookkeeping completes even when earlier launched work failed (else the
        # next iteration's step would find this one's state); the failures, oldest first (the
        # root cause before what followed from it), are raised afterwards.
        if is_async:
            self._update_async(new_value)
        else:
            if launched:
                optimizer_thread.wait_all()
            self._update_sync(new_value)
        optimizer_thread.raise_failures(self)

    def _check_new_scale(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        assert self._front is not None  # update() checked the lazy init
        device = self._front.device
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError(
                    "new_scale should be a float or a 1-element tensor with requires_grad=False."
                )
            value = new_scale.detach().reshape(()).to(device, torch.float32, copy=True)
        else:
            check_hyper_field("new_scale", new_scale)
            value = torch.full((), float(new_scale), dtype=torch.float32, device=device)
        return value

    def _update_sync(self, new_value: torch.Tensor | None) -> None:
        if self._last_item is not None:
            self._last_item.wait(report=False)
            self._last_item = None
        self._pending = None
        published = self._back_update(new_value, next_back=None)
        self._adopt(published)
        self._set_front(published.scale, published.numbers)

    def _update_async(self, new_value: torch.Tensor | None) -> None:
        previous = self._pending
        if previous is not None and previous.wait(report=False):
            self._adopt(previous.result())
        # else: nothing pending, or it failed (reported now or before): keep the last published.
        if new_value is not None:
            hand_out, copy = new_value, HostCopy(new_value)
        else:
            assert self._published is not None  # published by _lazy_init
            hand_out, copy = self._published.scale.clone(), self._published.numbers
        self._set_front(hand_out, copy)
        self._pending = self._last_item = self._launch(self._back_update, new_value, hand_out)

    def _adopt(self, published: _Published) -> None:
        self._published = published
        if published.setter_seq == self._setter_seq:
            self._mirror = published.hyper.copy()
        if published.collapse_streak == COLLAPSE_STREAK:
            warnings.warn(
                f"GradScaler: gradients overflowed {published.collapse_streak} times in a row with "
                f"the scale at min_scale={published.hyper.min_scale}: the run is diverging. Check "
                "the learning rate and the data, or train in bf16.",
                ScaleCollapseWarning,
                stacklevel=4,
            )

    def _back_update(
        self, new_value: torch.Tensor | None, next_back: torch.Tensor | None
    ) -> _Published:
        """U on the back side (optimizer thread in async mode, main thread in sync mode).

        ``next_back`` is the scale the compute side was handed for the next iteration (async), or
        None (sync: it is the new scale itself).
        """
        failures = optimizer_thread.failure_count()
        scale = self._rule.scale
        try:
            if new_value is not None:
                scale.copy_(new_value)
            else:
                found_inf = self._combined_found_inf()
                if found_inf is not None:
                    # [Note: the scale double buffer], overflow rule: the back scale produced
                    # the gradients; it is stale when it differs from the newest scale.
                    stale = None if self._back_is_newest else self._back_scale()
                    self._rule.apply(found_inf, stale_scale=stale)
                elif failures == self._failures_seen:
                    raise AssertionError(
                        "No inf checks were recorded prior to update: no scaler.step(optimizer) "
                        "ran since the previous update(). Call update() once per iteration, "
                        "after the step."
                    )
                # else: launched work (the step) failed since the last update and that failure
                # is reported on the main thread; this iteration simply had no step.
        finally:
            self._failures_seen = failures
            # Even if U failed, the next step must divide by what the compute side was handed.
            self._per_optimizer_states = defaultdict(_PerOptimizerState)
            self._back_scale().copy_(scale if next_back is None else next_back)
            self._back_is_newest = next_back is None or new_value is not None
        return self._publish()

    def _combined_found_inf(self) -> torch.Tensor | None:
        return _sum_flags(
            (
                t
                for state in self._per_optimizer_states.values()
                for t in state.found_inf_per_device.values()
            ),
            self._rule.device,
        )

    def _publish(self) -> _Published:
        rule = self._rule
        scale = rule.scale.clone()
        return _Published(
            self._setter_applied,
            scale,
            HostCopy(scale, rule.growth_tracker, rule.skipped_steps),
            rule.steps,
            rule.collapse_streak,
            rule.hyper.copy(),
        )

    # ------------------------------------------------------------------------------------------
    # getters and setters
    # ------------------------------------------------------------------------------------------
    def get_scale(self, up_to_date: bool = False) -> float:
        """The scale as a Python float (1.0 when disabled).

        Never blocks by default: the front scale on the compute threads (what ``scale()`` uses),
        the back scale on the optimizer thread (what produced the gradients being stepped).
        ``up_to_date=True`` waits until every launched step, update and setter has been applied
        and returns the newest scale, the one the next ``update()`` hands to the compute side.

        .. warning::
            ``up_to_date=True`` waits for the optimizer thread and syncs with the device that
            holds the scale; keep it out of the per-iteration loop. On the optimizer thread
            the call reads the back scale, which syncs with its device too.

        Args:
            up_to_date: wait for every launched step, update and setter first.
        """
        if not self._enabled:
            return 1.0
        if up_to_date:
            self._sync_back_side()
            return self._rule.scale.item()
        if self._front is None:
            return self._init_front
        if on_optimizer_thread():
            return self._back_scale().item()  # the optimizer thread may sync: it runs the steps
        return self._front_value()

    def _sync_back_side(self) -> None:
        """Wait until every launched step, update and setter has run, re-raising failures.
        Afterwards the back side may be read on this thread; the next update() still hands out
        what the pending update produced."""
        if on_optimizer_thread():
            return
        optimizer_thread.wait_all()
        optimizer_thread.raise_failures(self)
        item = self._last_item
        if item is not None:
            item.wait()

    def _hyper_value(self, name: str, up_to_date: bool):
        if up_to_date or on_optimizer_thread():
            self._sync_back_side()
            return getattr(self._rule.hyper, name)
        return getattr(self._mirror, name)

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """The growth factor.

        Args:
            up_to_date: False (default): never block, the value the compute side sees now.
                True: wait until every setter launched so far has been applied.
        """
        return self._hyper_value("growth_factor", up_to_date)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """The backoff factor.

        Args:
            up_to_date: False (default): never block, the value the compute side sees now.
                True: wait until every setter launched so far has been applied.
        """
        return self._hyper_value("backoff_factor", up_to_date)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """The growth interval.

        Args:
            up_to_date: False (default): never block, the value the compute side sees now.
                True: wait until every setter launched so far has been applied.
        """
        return self._hyper_value("growth_interval", up_to_date)

    def get_hysteresis(self, up_to_date: bool = False) -> int:
        """Consecutive overflows needed to back off.

        Args:
            up_to_date: False (default): never block, the value the compute side sees now.
                True: wait until every setter launched so far has been applied.
        """
        return self._hyper_value("hysteresis", up_to_date)

    def _get_growth_tracker(self, up_to_date: bool = False) -> int:
        if not self._enabled:
            return 0
        if up_to_date:
            self._sync_back_side()
            return int(self._rule.growth_tracker.item())
        published = self._published
        if published is None:  # before the lazy init: the rule's tensors are on the host
            return int(self._rule.growth_tracker.item())
        return published.growth_tracker

    def get_growth_tracker(self, up_to_date: bool = False) -> int:
        """Consecutive non-overflowing updates since the last growth or backoff (torch's
        ``_get_growth_tracker``).

        Args:
            up_to_date: False (default): never block, the value of the newest finished update.
                True: wait for every launched step and update.
        """
        return self._get_growth_tracker(up_to_date)

    def _set_hyper(self, name: str, value: Any) -> None:
        """Setters: the compute side sees the value at once (getters); the back side gets it in
        launch order, on the optimizer thread when launched work may be touching it."""
        if on_optimizer_thread():
            setattr(self._rule.hyper, name, value)
            return
        setattr(self._mirror, name, value)
        self._setter_seq += 1
        newest = self._newest_step
        if (newest is not None and not optimizer_thread.was_waited(newest)) or (
            self._last_item is not None and not self._last_item.done()
        ):
            self._last_item = self._launch(self._apply_hyper, name, value, self._setter_seq)
        else:
            self._wait_last_item()
            self._apply_hyper(name, value, self._setter_seq)

    def _apply_hyper(self, name: str, value: Any, seq: int) -> None:
        setattr(self._rule.hyper, name, value)
        self._setter_applied = seq

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor. Any thread; never blocks.

        Args:
            new_factor: a finite number > 1; ``ValueError`` otherwise.
        """
        check_hyper_field("growth_factor", new_factor)
        if self._enabled:
            self._set_hyper("growth_factor", float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor. Any thread; never blocks.

        Args:
            new_factor: a number in (0, 1); ``ValueError`` otherwise.
        """
        check_hyper_field("backoff_factor", new_factor)
        if self._enabled:
            self._set_hyper("backoff_factor", float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval. Any thread; never blocks.

        Args:
            new_interval: an int >= 1; ``ValueError`` otherwise.
        """
        check_hyper_field("growth_interval", new_interval)
        if self._enabled:
            self._set_hyper("growth_interval", new_interval)

    def is_enabled(self) -> bool:
        """Whether scaling is on. Any thread; never blocks."""
        return self._enabled

    # ------------------------------------------------------------------------------------------
    # monitoring
    # ------------------------------------------------------------------------------------------
    def snapshot(self) -> ScalerSnapshot:
        """A non-blocking monitoring view (see :class:`ScalerSnapshot`). Main thread.

        It never waits for the optimizer thread: ``newest_scale`` and the counters come from the
        newest update that has finished.
        """
        if not self._enabled:
            return ScalerSnapshot(1.0, 1.0, 0, 0, 0)
        if self._front is None:
            scale = self.get_scale()
            _, tracker, skipped = self._rule.values()  # before the lazy init: on the host
            return ScalerSnapshot(scale, scale, tracker, self._rule.steps, skipped)
        published = self._published
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is None:
            published = pending.result()
        assert published is not None  # published by _lazy_init
        return ScalerSnapshot(
            scale_in_use=self._front_value(),
            newest_scale=published.scale_value,
            growth_tracker=published.growth_tracker,
            steps=published.steps,
            skipped_steps=published.skipped_steps,
        )

    # ------------------------------------------------------------------------------------------
    # checkpointing
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (a torch scaler can load them) plus ``"roundpipe"``, what exact
        resume of an async run needs. Waits for the optimizer thread; call it after update().
        Empty when disabled."""
        if not self._enabled:
            return {}
        self._sync_back_side()
        initialized = self._front is not None
        return self._state_dict(
            self._front_value() if initialized else self.get_scale(), initialized
        )

    def state_dict_in_order(self) -> Callable[[], dict[str, Any]]:
        """For :mod:`roundpipe.checkpoint`, which takes the state without waiting: the front
        side (the scale the next iteration multiplies by) now; the returned function, run on
        the optimizer thread behind the work launched so far, returns what :meth:`state_dict`
        would return now. Main thread; never blocks. Raises ``RuntimeError`` between a launched
        step and :meth:`update` (the state then holds half an iteration: the step's overflow
        check, which only ``update()`` consumes)."""
        if not self._enabled:
            return dict
        if on_optimizer_thread():
            raise RuntimeError("GradScaler.state_dict_in_order() is for the main thread")
        if self._newest_step is not self._launch_mark or self._stepped_on_main:
            raise RuntimeError(
                "a checkpoint of this GradScaler was asked for between model.step() (or "
                "scaler.step()) and scaler.update(): the scaler then holds half an iteration "
                "that only update() completes. Save after scaler.update() (or before the step)"
            )
        initialized = self._front is not None
        front = self._front_value() if initialized else self.get_scale()
        return lambda: self._state_dict(front, initialized)

    def _state_dict(self, front: float, initialized: bool) -> dict[str, Any]:
        """The state dict with the front scale ``front``, where the back side may be read;
        ``initialized``: whether the lazy init had run (read by the main thread)."""
        rule = self._rule
        hyper = rule.hyper
        scale, tracker, skipped = rule.values()
        return {
            "scale": scale,
            "growth_factor": hyper.growth_factor,
            "backoff_factor": hyper.backoff_factor,
            "growth_interval": hyper.growth_interval,
            "_growth_tracker": tracker,
            "roundpipe": {
                "front_scale": front,
                "hysteresis": hyper.hysteresis,
                "hysteresis_left": rule.hysteresis_left,
                "min_scale": hyper.min_scale,
                "max_scale": hyper.max_scale,
                "steps": rule.steps,
                "skipped_steps": skipped,
                "collapse_streak": rule.collapse_streak,
                "initialized": initialized,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch.amp.GradScaler. Main thread; waits for the
        optimizer thread. A no-op when disabled (as torch).

        The state dict is checked with the constructor's rules first: a bad one (a scale of -5,
        a growth factor of 0.5, a growth interval of 0, a missing key) raises ``ValueError``
        before anything changes.

        Args:
            state_dict: what :meth:`state_dict` (or torch's) returned.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        loaded = _parse_state_dict(state_dict, self._rule.hyper)  # refuses before any change
        self._sync_back_side()
        self._rule.load_(
            loaded.scale,
            loaded.hyper,
            growth_tracker=loaded.growth_tracker,
            skipped_steps=loaded.skipped_steps,
            steps=loaded.steps,
            hysteresis_left=loaded.hysteresis_left,
            collapse_streak=loaded.collapse_streak,
        )
        self._mirror = loaded.hyper.copy()
        self._setter_applied = self._setter_seq
        self._init_front = loaded.front_scale
        self._back_is_newest = loaded.front_scale == loaded.scale
        self._pending = None
        if self._front is not None:
            device = self._front.device
            with self._init_lock:
                self._front = None
            self._lazy_init(device)
        elif loaded.initialized:
            # Saved after a scale() (e.g. between forward_backward and the step): the next call
            # may be the step, which needs the scale before any scale() ran in this process.
            self._lazy_init(torch.device(self._device))

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "roundpipe.GradScaler is not picklable (it holds thread hand-offs); save "
            "scaler.state_dict() and load it with load_state_dict() instead."
        )
