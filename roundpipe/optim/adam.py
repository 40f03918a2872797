"""Adam and AdamW for the fp32 master parameters, fused by default.

:class:`Adam` and :class:`AdamW` take torch.optim's constructor (same arguments, same defaults),
keep its param groups and its ``state_dict`` format (a checkpoint loads into either library), and
compute the same update. What differs is how a step runs; see [Note: fused by default] and
[Note: fused layout rule].

Where the parameters come from: build the optimizer on the fp32 master copies, either
``model.optim_parameters()`` or ``model.parameters()`` inside ``with roundpipe.OptimizerCtx():``.
An optimizer built on the low-precision (fp16/bf16) parameters the stages compute with is
almost always a mistake here (updates below the fp16 resolution vanish); it is not rejected,
because plain torch allows it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from roundpipe.optim.kernel import FUSED_DEVICE_TYPES, group_allows_fused, param_fits_fused
from roundpipe.optim.placement import OptimizerStatePlacement, StateInRAM, make_placement
from roundpipe.threads import optimizer_thread

__all__ = ["Adam", "AdamW"]


# [Note: fused by default]
# torch.optim.Adam runs its fused kernel (one pass that reads param, grad, exp_avg, exp_avg_sq
# and writes param, exp_avg, exp_avg_sq) only when asked with fused=True; by default it runs the
# foreach path on accelerators and the per-tensor for-loop on CPU, both of which make several
# passes over memory. The optimizer step is memory bound (see benchmarks/results/optim.md), so
# here ``fused=None`` means "auto": every parameter that the fused kernel can take goes
# through it, and the rest goes through torch's own foreach/for-loop path exactly as
# torch.optim.Adam(fused=None) would run it. The choice is made per parameter on every step, so
# a group added later with add_param_group (complex, on an unsupported device, foreach=True,
# differentiable=True, ...) is always stepped correctly.
#
# The fused kernel takes a parameter when the group does not ask otherwise (fused is not False,
# foreach is not True, not differentiable), the parameter is a plain dense Tensor/Parameter on a
# device with fused kernels, and its dtype is floating point, or complex64/complex128: Adam on a
# complex tensor is Adam on its real view (torch's own paths do the same), so complex parameters
# are fused through ``torch.view_as_real``, which torch.optim.Adam(fused=True) refuses.
#
# GradScaler: ``_step_supports_amp_scaling`` is True while every parameter takes the fused path;
# a scaler then sets ``grad_scale``/``found_inf`` on the optimizer and the kernel unscales and
# skips inside the update, so the gradients are read once. Any parameter that takes torch's path
# (statically, or this step because of its layout) still honours those two attributes: its
# gradients are unscaled in place and its update is skipped when found_inf is set. So the
# attribute is an efficiency hint to the scaler, never a correctness condition.

# [Note: fused layout rule]
# The CPU fused kernel walks each tensor's memory linearly. torch (checked on 2.13) neither
# checks nor fixes strides on CPU, so a gradient whose strides differ from its parameter's (a
# transposed grad, an expanded grad, a sliced non-dense parameter) silently gets a wrong update
# with torch.optim.Adam(fused=True) (CUDA raises instead, pytorch/pytorch#106951). A parameter
# is fused only when the parameter, its gradient and its state are all dense with the same
# memory order (strides of size-1 dimensions do not matter); otherwise that parameter takes
# torch's path for this step.

_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")
_TORCH_HAS_DECOUPLED = (
    "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters
)


class Adam(torch.optim.Adam):
    r"""Adam with torch.optim.Adam's constructor, math and ``state_dict``, fused by default.

    Build it on the fp32 master parameters: ``model.optim_parameters()``, or
    ``model.parameters()`` inside ``with roundpipe.OptimizerCtx():``. Built on the fp16/bf16
    model parameters it still works (as plain torch does) but is almost always a mistake.

    Arguments are torch.optim.Adam's, with one difference in meaning: ``fused=None`` (the
    default) runs torch's fused kernel for every parameter it can take and torch's foreach or
    for-loop path for the rest (see [Note: fused by default] in this module). ``fused=True``
    additionally checks, here and in :meth:`add_param_group`, that every parameter can be
    fused; ``fused=False`` runs exactly torch's non-fused path.

    Where the state lives is chosen here, once (:mod:`roundpipe.optim.placement`):
    ``state_dir=None`` (the default) keeps the moments in RAM as torch does, and refuses with a
    ``MemoryError`` naming ``state_dir`` when they cannot fit the free host RAM;
    ``state_dir="/nvme/run1"`` keeps them in a file under that directory, streamed through
    ``state_buffer_bytes`` of host memory on each step (default 256 MiB; reads of the next
    chunks prefetched and writes behind the update, see :mod:`roundpipe.optim.spill`): every
    parameter must then take the fused kernel on the host (a contiguous float or complex
    tensor in host memory, no fused=False/foreach/differentiable/capturable), and the result is
    bitwise the in-RAM optimizer's. I/O failures raise :class:`roundpipe.optim.SpillError`.

    Implementation options (``foreach``, ``fused``, ``capturable``, ``differentiable``) belong
    to this optimizer, not to a checkpoint: :meth:`load_state_dict` keeps them, so a checkpoint
    of a foreach torch.optim.Adam loads into a fused roundpipe Adam and the other way round.

    Threads: ``step`` normally runs on the optimizer thread (``model.step(...)``). Every public
    method may be called from any thread; called off the optimizer thread, it first waits for
    the work already launched there (``roundpipe.optim_thread.synchronize()``, which may re-raise
    a failure of that work), so it never races a queued step. On the optimizer thread it never
    waits. ``param_groups`` and ``state`` belong to the optimizer thread while launched work is
    pending; other threads touch them only through these methods. The tensors that
    :meth:`state_dict` returns are the live state, as in torch: save them before launching the
    next step.
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
        state_buffer_bytes: int | None = None,
    ) -> None:
        """Any thread; does not wait for the optimizer thread (no launched work can use it yet)."""
        self._placement: OptimizerStatePlacement = make_placement(state_dir, state_buffer_bytes)
        if fused and differentiable:
            raise RuntimeError(
                "Adam: fused=True cannot be combined with differentiable=True (the "
                "fused kernel has no autograd); pass fused=None or fused=False"
            )
        if fused and foreach:
            raise RuntimeError(
                "Adam: fused=True and foreach=True select two different "
                "implementations; pass only one of them"
            )
        extra = {}
        if decoupled_weight_decay:
            if not _TORCH_HAS_DECOUPLED:
                raise RuntimeError(
                    f"roundpipe.optim.Adam(decoupled_weight_decay=True) and AdamW "
                    f"need a torch whose Adam has decoupled_weight_decay; "
                    f"torch {torch.__version__} does not: upgrade torch"
                )
            extra["decoupled_weight_decay"] = True
        self._constructed = False
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            **extra,
        )
        self._constructed = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._constructed = True  # unpickled or deep-copied: past construction
        self.__dict__.setdefault("_placement", StateInRAM())

    # -- GradScaler protocol (see [Note: fused by default]) -------------------------------------
    @property
    def _step_supports_amp_scaling(self) -> bool:
        return all(
            group_allows_fused(group) and all(param_fits_fused(p) for p in group["params"])
            for group in self.param_groups
        )

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        # torch.optim.Adam.__init__ assigns True for fused=True. Here the flag is derived from
        # the param groups on every read, so an assignment carries no information.
        pass

    # -- public methods -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as torch. Any thread; off the optimizer thread it first waits for
        launched work. With ``fused=True`` (the group's or the default), raises if a parameter
        cannot be fused and leaves the optimizer unchanged."""
        if getattr(self, "_constructed", False):
            _wait_for_launched_work()
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._placement.check_group(self, group)
        except BaseException:
            self.param_groups.pop()
            raise
        if group["fused"]:
            if group["differentiable"] or group["foreach"]:
                self.param_groups.pop()
                raise RuntimeError(
                    "Adam: a param group with fused=True cannot also set "
                    "differentiable=True or foreach=True; pass fused=None"
                )
            group_index = len(self.param_groups) - 1
            for index, p in enumerate(group["params"]):
                if not param_fits_fused(p):
                    self.param_groups.pop()
                    raise RuntimeError(
                        f"Adam(fused=True) needs every parameter to be a dense floating-point or "
                        f"complex64/complex128 Tensor on a device with fused kernels "
                        f"({sorted(FUSED_DEVICE_TYPES)}); param_groups[{group_index}]['params']"
                        f"[{index}] is a {type(p).__name__} of {p.dtype} on "
                        f"{p.device.type}. Pass fused=None (the default) to fuse what fits and "
                        f"step the rest with torch's foreach/for-loop path, or fused=False"
                    )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch. Any thread; off the optimizer thread it first waits for
        launched work (a queued step may still read the gradients)."""
        _wait_for_launched_work()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam's state dict (loadable by torch). Any thread; off the optimizer
        thread it first waits for launched work, so the state is not torn by a running step."""
        _wait_for_launched_work()
        return self._placement.state_dict(self, super().state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a roundpipe or torch Adam state dict, keeping this optimizer's implementation
        options (foreach, fused, capturable, differentiable). Any thread; off the optimizer
        thread it first waits for launched work."""
        _wait_for_launched_work()
        impl = [{key: group[key] for key in _IMPL_KEYS} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, options in zip(self.param_groups, impl):
            group.update(options)
        self._placement.after_load(self)

    def close(self) -> None:
        """Release what the state's placement holds: with ``state_dir``, its file (removed) and
        I/O threads; the optimizer cannot step afterwards. Idempotent; collecting the optimizer
        does the same. Any thread; off the optimizer thread it first waits for launched work."""
        _wait_for_launched_work()
        self._placement.close()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every parameter with a gradient; returns ``closure()``'s loss.

        Normally runs on the optimizer thread. Any thread may call it; off the optimizer thread
        it first waits for launched work, then runs the step synchronously. Honours
        ``grad_scale``/``found_inf`` set by a GradScaler on every path (the gradients may be
        left unscaled in place). With float hyperparameters the fused path never syncs the host
        with a device; a parameter on torch's path reads ``found_inf`` on the host.
        """
        _wait_for_launched_work()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            self._placement.step(self, grad_scale, found_inf)
        return loss

    # -- private ----------------------------------------------------------------------------------


def _wait_for_launched_work() -> None:
    # Returns at once on the optimizer thread itself (see roundpipe.optim_thread.synchronize).
    optimizer_thread.synchronize()


class AdamW(Adam):
    r"""AdamW (decoupled weight decay) with torch.optim.AdamW's constructor and defaults.

    Everything in :class:`Adam` holds (fused by default, where the fp32 masters come from,
    which thread may call what); like torch's, it is Adam with ``decoupled_weight_decay=True``
    and a default ``weight_decay`` of 1e-2, and a loaded state dict cannot turn that off.
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        state_buffer_bytes: int | None = None,
    ) -> None:
        """Any thread; does not wait for the optimizer thread."""
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            state_dir=state_dir,
            state_buffer_bytes=state_buffer_bytes,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
