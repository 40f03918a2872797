"""Optimizers for the fp32 master parameters (``roundpipe.optim``).

:class:`Adam` and :class:`AdamW` are drop-in replacements for torch.optim's (same constructor,
param groups and ``state_dict``) that run torch's fused kernel by default and honour a
GradScaler's ``grad_scale``/``found_inf`` on every path. Build them on the master copies:
``model.optim_parameters()``, or ``model.parameters()`` inside ``with roundpipe.OptimizerCtx():``.
"""

from roundpipe.optim.adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
