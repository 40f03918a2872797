"""Optimizers for the fp32 master parameters (``roundpipe.optim``).

:class:`Adam` and :class:`AdamW` are drop-in replacements for torch.optim's (same constructor,
param groups and ``state_dict``) that run torch's fused kernel by default and honour a
GradScaler's ``grad_scale``/``found_inf`` on every path. Build them on the master copies:
``model.optim_parameters()``, or ``model.parameters()`` inside ``with roundpipe.OptimizerCtx():``.
Where their state lives (RAM, or files under ``state_dir``) is chosen at construction
(:mod:`roundpipe.optim.placement`, :mod:`roundpipe.optim.spill`), and how their moments are
kept: exact, bf16 or 8-bit blockwise (``state_dtype``, :mod:`roundpipe.optim.lean`). Inside a
RoundPipe step they write the model's low-precision copy in the same pass over memory as the
update (:mod:`roundpipe.optim.one_pass`), with compiled kernels built on first use
(:mod:`roundpipe.optim.native`). :class:`MastersOnDisk` is
the model's placement that keeps the masters in files too (``RoundPipe(...,
state_placement=roundpipe.MastersOnDisk(DIR))``).
"""

from roundpipe.optim.adam import Adam, AdamW
from roundpipe.optim.master_file import MastersOnDisk
from roundpipe.optim.spill import SpillError

__all__ = ["Adam", "AdamW", "MastersOnDisk", "SpillError"]
