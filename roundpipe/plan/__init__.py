"""Plans: which stage runs where, when, and with which moves; decided here, executed by
:mod:`roundpipe.runtime.executor`.

* :mod:`~roundpipe.plan.actions`: the typed actions and :class:`Plan` (the order and the
  program), :func:`simulate`.
* :mod:`~roundpipe.plan.build`: :func:`build_plan`, the orders and their lowering.
* :mod:`~roundpipe.plan.partition`: layers per stage (``execute_plan``), :func:`stages_by_size`.
* :mod:`~roundpipe.plan.price`: a plan's timeline per stream from stage costs and a link's
  bandwidth (:func:`price`).
* :mod:`~roundpipe.plan.memory`: a plan's peak memory per device, action by action
  (:func:`device_peaks`).
"""

from roundpipe.plan.actions import (
    Action,
    ActionKind,
    Plan,
    PlanSizes,
    Transfer,
    TransferKind,
    device_stages,
    simulate,
    stage_device,
)
from roundpipe.plan.build import build_plan
from roundpipe.plan.memory import ActionBytes, DevicePeak, StageBytes, device_peaks
from roundpipe.plan.partition import check_execute_plan, partition, stages_by_size
from roundpipe.plan.price import (
    HOST_CONTENTION,
    Costs,
    Span,
    Timeline,
    contention_shown,
    overlapped,
    price,
)

__all__ = [
    "HOST_CONTENTION",
    "Action",
    "ActionBytes",
    "ActionKind",
    "Costs",
    "DevicePeak",
    "Plan",
    "PlanSizes",
    "Span",
    "StageBytes",
    "Timeline",
    "Transfer",
    "TransferKind",
    "build_plan",
    "check_execute_plan",
    "contention_shown",
    "device_peaks",
    "device_stages",
    "overlapped",
    "partition",
    "price",
    "simulate",
    "stage_device",
    "stages_by_size",
]
