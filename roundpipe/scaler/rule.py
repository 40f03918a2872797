"""The loss-scale update rule as a thread-free object: torch's ``_amp_update_scale_`` plus
roundpipe's extras (hysteresis, bounds, the collapse streak, the stale-scale cap).

:class:`ScaleRule` knows nothing of threads or of the double buffer: :class:`roundpipe.GradScaler`
owns one and calls :meth:`ScaleRule.apply` on whichever thread runs its update (see
[Note: the scale double buffer] in :mod:`roundpipe.scaler.grad_scaler`). Tests drive it directly.

:func:`check_hyper` and :func:`check_hyper_field` are the one validation of the hyperparameters:
the scaler's constructor, its setters and ``load_state_dict`` all call them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["COLLAPSE_STREAK", "ScaleHyper", "ScaleRule", "check_hyper", "check_hyper_field"]

# A streak of this many consecutive overflows at min_scale is reported once (by the scaler).
COLLAPSE_STREAK = 3


@dataclass
class ScaleHyper:
    """The rule's hyperparameters. ``hysteresis``: back off only on the ``hysteresis``-th
    consecutive overflow (1: every overflow, as torch); ``min_scale``/``max_scale``: bounds
    (None: unbounded)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def copy(self) -> ScaleHyper:
        return replace(self)

    @property
    def plain(self) -> bool:
        """torch's rule alone (no extra needs the overflow flag on the host)."""
        return self.hysteresis == 1 and self.min_scale is None and self.max_scale is None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_hyper_field(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming the rule if ``value`` is not valid for the field ``name`` of
    :class:`ScaleHyper` (or ``"scale"``, the scale itself). Any thread; never blocks."""
    if name == "growth_factor":
        if not (_is_number(value) and math.isfinite(value) and value > 1.0):
            raise ValueError(f"growth_factor must be a finite number > 1.0, got {value!r}")
    elif name == "backoff_factor":
        if not (_is_number(value) and 0.0 < value < 1.0):
            raise ValueError(f"backoff_factor must be in (0, 1), got {value!r}")
    elif name == "growth_interval":
        if not (_is_int(value) and value >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {value!r}")
    elif name == "hysteresis":
        if not (_is_int(value) and value >= 1):
            raise ValueError(
                "hysteresis must be an int >= 1 (1 backs off on every overflow, as torch), "
                f"got {value!r}"
            )
    elif name in ("min_scale", "max_scale", "scale", "init_scale", "new_scale", "front_scale"):
        if value is None and name in ("min_scale", "max_scale"):
            return
        if not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    else:
        raise AssertionError(f"check_hyper_field: unknown field {name!r}, please report")


def check_hyper(hyper: ScaleHyper, init_scale: float | None = None) -> None:
    """Validate every field of ``hyper`` (and that ``init_scale``, if given, lies within its
    bounds); raise ``ValueError`` naming the first rule broken. Any thread; never blocks.

    A scale set later (``update(new_scale=)``, a loaded state) need not lie within the bounds,
    as in torch; the rule clamps it at its next update.
    """
    for name in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis"):
        check_hyper_field(name, getattr(hyper, name))
    check_hyper_field("min_scale", hyper.min_scale)
    check_hyper_field("max_scale", hyper.max_scale)
    lo = 0.0 if hyper.min_scale is None else hyper.min_scale
    hi = math.inf if hyper.max_scale is None else hyper.max_scale
    if lo > hi:
        raise ValueError(f"min_scale={lo} must not exceed max_scale={hi}")
    if init_scale is not None:
        check_hyper_field("init_scale", init_scale)
        if not lo <= init_scale <= hi:
            raise ValueError(
                f"init_scale={init_scale} must lie within [min_scale, max_scale] = [{lo}, {hi}]"
            )


class ScaleRule:
    """The running scale and what the update rule keeps between updates.

    State: ``scale`` (0-d float32), ``growth_tracker`` (0-d int32) and ``skipped_steps`` (0-d
    int64), tensors on one device, changed in place; ``steps`` (updates that consumed an overflow
    flag), ``hysteresis_left`` and ``collapse_streak`` (host ints); ``hyper``.

    Not thread-safe: one thread at a time may call it (the scaler's back side decides which).
    With the plain hyperparameters (:attr:`ScaleHyper.plain`) :meth:`apply` is torch's
    ``torch._amp_update_scale_`` and does not sync with the device; the extras read the overflow
    flag on the host (one sync).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        hyper: ScaleHyper | None = None,
        *,
        growth_tracker: int = 0,
        skipped_steps: int = 0,
        steps: int = 0,
        hysteresis_left: int | None = None,
        collapse_streak: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.hyper = ScaleHyper() if hyper is None else hyper
        check_hyper(self.hyper, init_scale)
        self.hyper.growth_factor = float(self.hyper.growth_factor)
        self.hyper.backoff_factor = float(self.hyper.backoff_factor)
        device = torch.device(device)
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), growth_tracker, dtype=torch.int32, device=device)
        self.skipped_steps = torch.full((), skipped_steps, dtype=torch.int64, device=device)
        self.steps = steps
        self.hysteresis_left = self.hyper.hysteresis if hysteresis_left is None else hysteresis_left
        self.collapse_streak = collapse_streak

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def to_(self, device: torch.device) -> None:
        """Move the state tensors to ``device`` (the scaler's lazy init). Copies, no sync."""
        self.scale = self.scale.to(device)
        self.growth_tracker = self.growth_tracker.to(device)
        self.skipped_steps = self.skipped_steps.to(device)

    def apply(self, found_inf: torch.Tensor, stale_scale: torch.Tensor | None = None) -> None:
        """One update on a step whose overflow flag (summed over devices) is ``found_inf``.

        torch's rule (overflow: scale *= backoff, tracker = 0; else tracker += 1 and, at
        ``growth_interval``, scale *= growth, tracker = 0), with the extras:

        - hysteresis: an overflow while ``hysteresis_left`` > 1 is tolerated (the scale is kept,
          the tracker zeroed); the ``hysteresis``-th consecutive overflow, and each one after it,
          backs off. A step without overflow refills ``hysteresis_left`` (consecutive hysteresis;
          see docs/scaler.md for how this differs from DeepSpeed's default).
        - ``stale_scale``: the scale that produced the gradients when it differs from ``scale``
          (an async update); an overflow then sets ``min(scale, stale_scale * backoff)``, so an
          overflow that a stale scale repeats is not backed off twice.
        - bounds: the result is clamped into [min_scale, max_scale]; ``collapse_streak`` counts
          consecutive backed-off overflows at ``min_scale``.
        """
        hyper = self.hyper
        self.steps += 1
        overflow = found_inf > 0
        self.skipped_steps += overflow
        if not hyper.plain:
            if bool(overflow):
                self.hysteresis_left = max(self.hysteresis_left - 1, 0)
                if self.hysteresis_left > 0:
                    self.growth_tracker.zero_()  # tolerated: the step is skipped, the scale kept
                    return
                at_min = hyper.min_scale is not None and self.scale.item() <= hyper.min_scale
                self.collapse_streak = self.collapse_streak + 1 if at_min else 0
            else:
                self.hysteresis_left = hyper.hysteresis
                self.collapse_streak = 0
        before = None if stale_scale is None else self.scale.clone()
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            found_inf,
            hyper.growth_factor,
            hyper.backoff_factor,
            hyper.growth_interval,
        )
        if before is not None and stale_scale is not None:
            backed_off = torch.minimum(before, stale_scale * hyper.backoff_factor)
            self.scale.copy_(torch.where(overflow, backed_off, self.scale))
        if hyper.min_scale is not None or hyper.max_scale is not None:
            self.scale.clamp_(min=hyper.min_scale, max=hyper.max_scale)

    def values(self) -> tuple[float, int, int]:
        """(scale, growth tracker, skipped steps) as Python numbers. Syncs with the device."""
        return (
            self.scale.item(),
            int(self.growth_tracker.item()),
            int(self.skipped_steps.item()),
        )

    def load_(
        self,
        scale: float,
        hyper: ScaleHyper,
        *,
        growth_tracker: int,
        skipped_steps: int,
        steps: int,
        hysteresis_left: int,
        collapse_streak: int,
    ) -> None:
        """Replace the whole state (a checkpoint's), in place on the current device. The caller
        validated it (:func:`check_hyper`), so nothing here can fail half way."""
        self.hyper = hyper
        self.scale.fill_(scale)
        self.growth_tracker.fill_(growth_tracker)
        self.skipped_steps.fill_(skipped_steps)
        self.steps = steps
        self.hysteresis_left = hysteresis_left
        self.collapse_streak = collapse_streak
