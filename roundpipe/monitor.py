"""``roundpipe.TrainingMonitor``: per-iteration loss, scale in use and skipped steps, recorded
without blocking the training loop, and a PNG plot of them.

See docs/monitor.md for the user's view and [Note: monitor attribution] for how skipped steps
are placed on the iteration axis.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from roundpipe.scaler.host_copy import HostCopy

__all__ = ["TrainingMonitor", "TrainingHistory"]

# Losses older than this many records are converted to floats once they are ready (never
# waiting), so a long run does not keep a tensor per iteration alive.
_KEEP_LAZY = 1024


# [Note: monitor attribution]
# The monitor reads the scaler only through ``GradScaler.snapshot()``, which never waits for the
# optimizer thread. Its ``scale_in_use`` is the front scale, so a snapshot taken after
# ``forward_backward`` and before ``scaler.update()`` gives exactly the scale the iteration's loss
# was multiplied by. Its counters (``steps``, ``skipped_steps``) come from the newest *finished*
# update, which in async mode runs one or two iterations behind the loop. The monitor therefore
# places skipped steps by update number, not by the iteration at which it saw them: with one
# scaler step per iteration, update number ``steps_at_start + j + 1`` belongs to the j-th
# recorded iteration. When several updates finish between two records, the snapshot says only
# how many of them were skipped; those are attributed to the newest of them. ``history()`` takes
# one more snapshot, so after ``model.synchronize()`` every update of the run has been seen.


@dataclass(frozen=True)
class TrainingHistory:
    """What a :class:`TrainingMonitor` recorded, as plain Python numbers.

    ``iterations[i]``, ``loss[i]`` and ``scale[i]`` describe the i-th recorded iteration (``scale``
    is the scale in use, empty without a scaler). ``skipped_iterations`` lists the iterations
    whose optimizer step was skipped because gradients overflowed (see [Note: monitor
    attribution]); ``skipped_steps`` is the scaler's total, including steps before the monitor.
    """

    iterations: list[int]
    loss: list[float]
    scale: list[float]
    skipped_iterations: list[int]
    skipped_steps: int


def _host_loss(loss: torch.Tensor | float) -> HostCopy:
    """A 0-d loss on its way to the host (see [Note: host copies] in scaler/host_copy.py): storing it
    never syncs the device, reading it (``history()``, off the hot path) waits for its copy."""
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        raise ValueError(f"the loss must be a scalar (one element), got shape {tuple(loss.shape)}")
    return HostCopy(loss)


@dataclass(frozen=True, slots=True)
class _Record:
    iteration: int
    loss: HostCopy
    divide_by: float  # the loss is scaled by this (1.0 when not scaled)
    scale: float | None
    steps: int
    skipped_steps: int


class TrainingMonitor:
    """Records the loss, the scale in use and the skipped steps of every iteration, never
    blocking the loop, and plots them.

    Usage (one :meth:`record` per iteration, after ``forward_backward`` and before
    ``scaler.update()``)::

        monitor = TrainingMonitor(scaler)
        for x, y in loader:
            loss = model.forward_backward(...)
            monitor.record(loss, scaled=True)
            model.step(...)
            scaler.update()
        model.synchronize()
        monitor.save_plot("training.png")   # needs matplotlib (the "plot" extra)

    Threads: main thread only (the thread that calls ``scaler.update()``); the monitor is not
    shared with the workers or the optimizer thread. :meth:`record` never waits for the
    optimizer thread and does not sync on the loss; the scaler's figures come from
    ``scaler.snapshot()``, which reads host numbers that the scaler's updates published (no
    device sync). :meth:`history` and :meth:`save_plot` convert the recorded losses to
    numbers and may wait for the device that holds them.

    Create the monitor right before the loop (after loading a checkpoint, if any): it counts the
    scaler's updates from there on.

    Args:
        scaler: the :class:`roundpipe.GradScaler` of the loop, whose scale in use and skipped
            steps are recorded with each loss (None: losses only).
        first_iteration: the number of the first recorded iteration (e.g. the iteration a
            resumed run starts at); the history and the plot count from it.
    """

    def __init__(self, scaler=None, *, first_iteration: int = 0) -> None:
        self._scaler = scaler
        self._records: list[_Record] = []
        self._compacted = 0  # records before this index hold converted losses (or not-ready ones)
        self._first_iteration = int(first_iteration)
        snap = scaler.snapshot() if scaler is not None else None
        self._steps_at_start = snap.steps if snap is not None else 0
        self._skipped_at_start = snap.skipped_steps if snap is not None else 0

    def __len__(self) -> int:
        return len(self._records)

    def record(self, loss: torch.Tensor | float, *, scaled: bool = False) -> None:
        """Record one iteration. Main thread; never waits for the optimizer thread, never syncs
        on the loss (see the class docstring for the scaler's snapshot).

        Call it before ``scaler.update()``, so the scale in use is the one this iteration's
        loss used.

        Args:
            loss: a scalar tensor (detached here; ``forward_backward``'s return value as is) or
                a float.
            scaled: the loss was multiplied by the scaler's scale (as in ``loss_fn=lambda o, y:
                scaler.scale(...)``): the monitor stores it as is and divides it by the scale in
                use when it converts it, so the history shows the unscaled loss. Needs the
                monitor to know the scaler (``ValueError`` otherwise).
        """
        scale: float | None = None
        steps = skipped = 0
        if self._scaler is not None:
            snap = self._scaler.snapshot()
            scale, steps, skipped = snap.scale_in_use, snap.steps, snap.skipped_steps
        if scaled and scale is None:
            raise ValueError(
                "record(loss, scaled=True) needs the monitor to know the scaler: "
                "TrainingMonitor(scaler)"
            )
        self._records.append(
            _Record(
                iteration=self._first_iteration + len(self._records),
                loss=_host_loss(loss),
                divide_by=scale if scaled and scale is not None else 1.0,
                scale=scale,
                steps=steps,
                skipped_steps=skipped,
            )
        )
        if len(self._records) - self._compacted >= 2 * _KEEP_LAZY:
            self._compact()

    def _compact(self) -> None:
        """Convert the losses of all but the newest ``_KEEP_LAZY`` records whose values are
        ready; never waits (a value still on its way stays a tensor until read)."""
        end = len(self._records) - _KEEP_LAZY
        for record in self._records[self._compacted : end]:
            if record.loss.ready():
                record.loss.value()
        self._compacted = end

    def history(self) -> TrainingHistory:
        """Everything recorded so far, as Python numbers. Main thread; may wait for the device
        that holds the recorded losses, never for the optimizer thread. Takes one more scaler
        snapshot, so that steps whose update finished after the last :meth:`record` count (call
        ``model.synchronize()`` first to see all of them)."""
        records = self._records
        loss = [r.loss.value() / r.divide_by for r in records]
        scale = [r.scale for r in records if r.scale is not None]  # all or none: set per monitor
        points = [(r.steps, r.skipped_steps) for r in records]
        total = 0
        if self._scaler is not None:
            snap = self._scaler.snapshot()
            points.append((snap.steps, snap.skipped_steps))
            total = snap.skipped_steps
        return TrainingHistory(
            iterations=[r.iteration for r in records],
            loss=loss,
            scale=scale,
            skipped_iterations=self._skipped_iterations(points, len(records)),
            skipped_steps=total,
        )

    def _skipped_iterations(self, points: list[tuple[int, int]], num_records: int) -> list[int]:
        # See [Note: monitor attribution].
        skipped: list[int] = []
        prev_skipped = self._skipped_at_start
        for steps, count in points:
            if count > prev_skipped:
                newest = steps - self._steps_at_start - 1  # record index of the newest update
                for j in range(newest - (count - prev_skipped) + 1, newest + 1):
                    if 0 <= j < num_records:
                        skipped.append(self._first_iteration + j)
            prev_skipped = max(prev_skipped, count)
        return sorted(set(skipped))

    def save_plot(self, path: str | os.PathLike, title: str | None = None) -> None:
        """Write a PNG with the loss and, with a scaler, the scale in use (log axis); skipped
        steps are marked on both. Main thread; converts the history (see :meth:`history`).

        Needs matplotlib (``python -m pip install matplotlib``, or the ``plot`` extra of the
        checkout: ``python -m pip install -e ".[plot]"``); without it raises ImportError.

        Args:
            path: the PNG file to write.
            title: the figure's title (None: none).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError(
                "TrainingMonitor.save_plot needs matplotlib; install it with `python -m pip "
                "install matplotlib` (or, in the roundpipe checkout, `python -m pip install -e "
                "'.[plot]'`)"
            ) from exc
        hist = self.history()
        with_scale = bool(hist.scale)
        # Figure + Agg canvas rather than pyplot: no global figure state, no GUI backend.
        fig = Figure(figsize=(8, 6 if with_scale else 3.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(2 if with_scale else 1, 1, sharex=True, squeeze=False)[:, 0]
        index = {it: i for i, it in enumerate(hist.iterations)}
        skipped = [it for it in hist.skipped_iterations if it in index]

        ax = axes[0]
        finite = [v if math.isfinite(v) else float("nan") for v in hist.loss]
        ax.plot(hist.iterations, finite, color="tab:blue", linewidth=1.2, label="loss")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        if with_scale:
            ax = axes[1]
            ax.plot(
                hist.iterations,
                hist.scale,
                color="tab:green",
                linewidth=1.2,
                drawstyle="steps-post",
                label="scale in use",
            )
            ax.set_yscale("log", base=2)
            ax.set_ylabel("loss scale")
            ax.grid(True, alpha=0.3)
            if skipped:
                ax.scatter(
                    skipped,
                    [hist.scale[index[it]] for it in skipped],
                    marker="x",
                    color="tab:red",
                    zorder=3,
                    label="skipped step",
                )
        for ax in axes:
            for it in skipped:
                ax.axvline(it, color="tab:red", alpha=0.25, linewidth=0.8)
        if skipped:
            axes[0].plot([], [], color="tab:red", alpha=0.5, label=f"skipped step ({len(skipped)})")
        axes[0].legend(loc="upper right")
        if with_scale:
            axes[1].legend(loc="lower right")
        axes[-1].set_xlabel("iteration")
        fig.suptitle(title or "roundpipe training")
        fig.savefig(os.fspath(path), format="png", dpi=100)
