"""roundpipe: mixed-precision training of models larger than one accelerator's memory.

Low-precision (fp16/bf16) parameters that the stages compute with and fp32 master copies that
the optimizer updates live in host memory; microbatches flow through the stages of an
``nn.Sequential`` on a pool of devices, and the optimizer runs one step behind on a background
thread. See README.md and docs/.
"""

from roundpipe import checkpoint, distributed, optim, optim_thread
from roundpipe.devices.pinned import pin_module
from roundpipe.layer_costs import measure_layer_costs
from roundpipe.memory.checks import HostMemoryError
from roundpipe.memory.probe import host_memory_available
from roundpipe.microbatch import MicrobatchInfo
from roundpipe.microbatch_context import WithContext
from roundpipe.monitor import TrainingHistory, TrainingMonitor
from roundpipe.optim.master_file import MastersOnDisk
from roundpipe.plan import stages_by_size
from roundpipe.runtime import (
    DeviceMemoryError,
    MemoryPlan,
    OptimizerCtx,
    RoundPipe,
    RoundPipeRunConfig,
    StageNotTraceable,
    UnevenMicrobatchWarning,
)
from roundpipe.scaler.grad_scaler import GradScaler, ScaleCollapseWarning, ScalerSnapshot

__version__ = "0.1.0"

__all__ = [
    "RoundPipe",
    "RoundPipeRunConfig",
    "OptimizerCtx",
    "stages_by_size",
    "WithContext",
    "MicrobatchInfo",
    "UnevenMicrobatchWarning",
    "measure_layer_costs",
    "GradScaler",
    "ScaleCollapseWarning",
    "ScalerSnapshot",
    "TrainingHistory",
    "TrainingMonitor",
    "MemoryPlan",
    "MastersOnDisk",
    "HostMemoryError",
    "DeviceMemoryError",
    "StageNotTraceable",
    "host_memory_available",
    "pin_module",
    "checkpoint",
    "distributed",
    "optim",
    "optim_thread",
    "__version__",
]


def __getattr__(name: str):
    # roundpipe.hf imports transformers: only when it is used, so that `import roundpipe` works
    # without the optional extra.
    if name == "hf":
        import importlib

        return importlib.import_module("roundpipe.hf")
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
