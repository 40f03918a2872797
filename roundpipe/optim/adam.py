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
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from roundpipe.optim import native
from roundpipe.optim.kernel import FUSED_DEVICE_TYPES, group_allows_fused, param_fits_fused
from roundpipe.optim.lean import (
    MIN_8BIT_NUMEL,
    StateKind,
    kind_of_state_dtype,
    state_kind_of_group,
)
from roundpipe.optim.master_file import file_of_master
from roundpipe.optim.one_pass import LOW_GRAD_DTYPES
from roundpipe.optim.placement import (
    OptimizerStatePlacement,
    StateInRAM,
    lean_numel,
    make_placement,
)
from roundpipe.runtime.grad_router import torch_has_grad_dtype
from roundpipe.threads import optimizer_thread
from roundpipe.user_frame import user_stacklevel

__all__ = ["Adam", "AdamW", "state_kind_mismatch"]


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

# [Note: one pass and lean moments]
# Two things this Adam does beyond torch's, both with the compiled kernels of
# roundpipe.optim.native (built in the background on first use; until then, or without a
# compiler, torch's kernels give the same bits):
#   * inside a RoundPipe step, the master->model copy is written in the same pass as the update
#     (see [Note: the copy in the step] in roundpipe/runtime/step_copy.py): bitwise torch's fused
#     step followed by the copy, with each master read once;
#   * ``state_dtype=torch.bfloat16`` or ``"8bit"`` keeps the moments in 4 or about 2 bytes per
#     parameter instead of 8 (see [Note: lean moments] in roundpipe/optim/lean.py). The kind is
#     a param group key, "state_dtype" (absent: exact, torch's), saved in the state dict, and a
#     state dict of one kind is refused by another (load_state_dict names both). Lean groups
#     take fp32 host parameters and no amsgrad, capturable, differentiable, foreach=True or
#     fused=False (ValueError at construction or add_param_group, which then changes nothing).

_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")
_LEAN_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")
_TORCH_HAS_DECOUPLED = (
    "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters
)


def check_grad_dtype(
    dtype: torch.dtype, who: str, *, state_dir: Any = None, state_option: str = "state_dir"
) -> None:
    """``ValueError`` unless gradients in ``dtype`` can be handed to roundpipe's Adam (see
    [Note: gradients in their summed dtype] in :mod:`roundpipe.runtime.grad_router`): bf16 or
    fp16, a torch whose tensors have ``grad_dtype``, and no state streamed through files
    (``state_dir``, given as ``state_option``). ``who`` names the caller's option."""
    if dtype not in LOW_GRAD_DTYPES:
        raise ValueError(
            f"{who} takes torch.bfloat16 or torch.float16 (the dtype "
            f"RoundPipeRunConfig(device_grad_dtype=...) sums in), or None; got {dtype!r}"
        )
    if not torch_has_grad_dtype():
        raise ValueError(
            f"{who} needs a torch whose tensors have grad_dtype (2.10 or newer); torch "
            f"{torch.__version__} does not: upgrade torch, or leave grad_dtype=None (the "
            f"gradients then arrive in the masters' dtype)"
        )
    if state_dir is not None:
        raise ValueError(
            f"{who} with {state_option}: the streamed step reads fp32 gradients; give one of them"
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

    ``state_dtype`` chooses how the moments are kept (see [Note: lean moments] in
    :mod:`roundpipe.optim.lean`): None (the default) exactly as torch keeps them, in the
    parameters' dtype (8 bytes per fp32 parameter); ``torch.bfloat16`` (or ``"bf16"``) in
    bf16, 4 bytes; ``"8bit"``, blockwise-quantized 8-bit moments as bitsandbytes' 8-bit Adam
    keeps them, about 2 bytes (parameters of fewer than 4096 elements keep exact moments, said
    once). The update is computed in fp32 either way. Lean moments need fp32 parameters in host
    memory and refuse ``amsgrad``, ``capturable``, ``differentiable``, ``foreach=True``,
    ``fused=False`` and ``state_dir``.

    Inside a RoundPipe step (``model.step(...)``) the step also writes the model's
    low-precision copy of each master in the same pass over memory, instead of the model's
    separate master->model copy (see [Note: the copy in the step] in
    :mod:`roundpipe.runtime.step_copy`; the same bits): 30 bytes of memory traffic per fp32
    parameter instead of 34. An asynchronous step writes it into a second copy (2 bytes per
    fp16/bf16 parameter of host RAM); ``write_copy=False`` leaves the copy to the model, as
    before, without it. It needs the compiled kernels, built in the background at the first
    construction (``g++`` and ``ninja``; until they are built, or if the build fails, with one
    warning, torch's kernels give the same results).

    ``grad_dtype`` (``torch.bfloat16`` or ``torch.float16``; default None: the masters' dtype)
    takes the masters' gradients in that dtype: each master's ``grad_dtype`` is set to it, so
    a RoundPipe whose device sums the gradients in it (``RoundPipeRunConfig(
    device_grad_dtype=...)``) hands them over as they are, 2 bytes a parameter instead of 4 in
    host RAM and in the step's reads, with the same results as the fp32 gradients they would
    have been converted to (see [Note: gradients in their summed dtype]). It needs torch 2.10
    or newer, fp32 masters in host memory (not in files, no ``state_dir``), and the
    gradients to arrive after construction. Other optimizers must not step these masters
    (torch's read one dtype), and ``GradScaler.unscale_`` then unscales in that dtype.

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
        state_dtype: torch.dtype | str | None = None,
        write_copy: bool = True,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """Any thread; does not wait for the optimizer thread (no launched work can use it
        yet), unless ``grad_dtype`` is given (it changes the masters)."""
        self._state_kind = kind_of_state_dtype(state_dtype)
        self.write_copy = bool(write_copy)
        self._said_small = False
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
        if self._state_kind is not StateKind.EXACT:
            self.defaults["state_dtype"] = self._state_kind.value
        self.grad_dtype = grad_dtype
        if grad_dtype is not None:
            self._take_gradients_in(grad_dtype, state_dir)
        self._constructed = True
        native.start_build()

    def _take_gradients_in(self, dtype: torch.dtype, state_dir: Any) -> None:
        """[Note: gradients in their summed dtype]: the parameters' ``grad_dtype`` set to
        ``dtype``, after checking that this step can take them."""
        check_grad_dtype(dtype, "Adam(grad_dtype=...)", state_dir=state_dir)
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_leaf:
                raise ValueError(
                    f"Adam(grad_dtype={dtype}) takes fp32 masters in host memory (roundpipe's "
                    f"model.optim_parameters()), got a {p.dtype} parameter on {p.device}"
                )
            if file_of_master(p) is not None:
                raise ValueError(
                    "Adam(grad_dtype=...) with masters in files (roundpipe.MastersOnDisk): their "
                    "step reads fp32 gradients; leave grad_dtype=None"
                )
        _wait_for_launched_work()  # the masters' .grad belong to the optimizer thread
        for p in params:
            if p.grad is not None and p.grad.dtype != dtype:
                raise ValueError(
                    f"Adam(grad_dtype={dtype}): a master already has a {p.grad.dtype} gradient; "
                    f"build the optimizer before the first forward_backward, or after "
                    f"zero_grad()"
                )
            p.grad_dtype = dtype

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._constructed = True  # unpickled or deep-copied: past construction
        self.__dict__.setdefault("grad_dtype", None)
        self.__dict__.setdefault("_placement", StateInRAM())
        self.__dict__.setdefault("_state_kind", StateKind.EXACT)
        self.__dict__.setdefault("_said_small", True)
        self.__dict__.setdefault("write_copy", True)

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
        kind = getattr(self, "_state_kind", StateKind.EXACT)
        if kind is not StateKind.EXACT and isinstance(param_group, dict):
            param_group = {"state_dtype": kind.value, **param_group}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if "state_dtype" in group:
                group["state_dtype"] = kind_of_state_dtype(group["state_dtype"]).value
                if group["state_dtype"] == StateKind.EXACT.value:
                    del group["state_dtype"]
            _check_lean_group(group, len(self.param_groups) - 1)
            self._placement.check_group(self, group)
        except BaseException:
            self.param_groups.pop()
            raise
        self._say_small(group)
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
        options (foreach, fused, capturable, differentiable). A state dict whose moments are of
        another kind than this optimizer's (exact, bf16, 8-bit: ``state_dtype``) is refused
        with a ``ValueError`` that names both, before anything changes. Any thread; off the
        optimizer thread it first waits for launched work."""
        _wait_for_launched_work()
        problem = state_kind_mismatch(state_dict, self)
        if problem is not None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: {problem}")
        impl = [{key: group[key] for key in _IMPL_KEYS} for group in self.param_groups]
        # torch casts every floating state tensor to its parameter's dtype on load: keep the
        # lean moments (bf16 values, 8-bit codes) as they are.
        stripped, lean = _strip_lean(state_dict)
        super().load_state_dict(stripped)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, tensors in lean.items():
            p = params[index]
            self.state[p].update({k: t.to(device=p.device) for k, t in tensors.items()})
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
    def _say_small(self, group: dict) -> None:
        """8-bit moments: say once which parameters keep exact ones (too small for blocks)."""
        if self._said_small or state_kind_of_group(group) is not StateKind.EIGHT_BIT:
            return
        small = [p for p in group["params"] if not lean_numel(StateKind.EIGHT_BIT, p)]
        if small:
            self._said_small = True
            warnings.warn(
                f"{type(self).__name__}(state_dtype='8bit'): {len(small)} parameter(s) of fewer "
                f"than {MIN_8BIT_NUMEL} elements (biases, norms: "
                f"{sum(p.numel() for p in small):,} elements in all) keep exact fp32 moments; "
                f"8-bit blocks would save nothing there",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def _check_lean_group(group: dict, index: int) -> None:
    """Raise ``ValueError`` if a group with lean moments asks what their kernels do not do."""
    kind = state_kind_of_group(group)
    if kind is StateKind.EXACT:
        return
    what = f"param_groups[{index}] with state_dtype={kind.value!r}"
    for key, bad, fix in (
        ("amsgrad", True, "amsgrad=False"),
        ("capturable", True, "capturable=False"),
        ("differentiable", True, "differentiable=False"),
        ("foreach", True, "foreach=None"),
        ("fused", False, "fused=None"),
    ):
        if group.get(key) is bad:
            raise ValueError(
                f"Adam: {what} cannot take {key}={bad}: lean moments are stepped by their own "
                f"kernel, which has no {key} variant. Pass {fix}, or state_dtype=None for "
                f"exact moments"
            )
    for i, p in enumerate(group["params"]):
        if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError(
                f"Adam: {what}: params[{i}] is a {p.dtype} tensor on {p.device}"
                f"{'' if p.is_contiguous() else ' (not contiguous)'}; lean moments step fp32 "
                f"masters in host memory (model.optim_parameters() of a RoundPipe with "
                f"fp32 masters). Keep it in a group with state_dtype=None"
            )


def state_kind_mismatch(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``state_dict`` (an Adam state dict) cannot load into ``optimizer`` because its
    moments are of another kind (exact, bf16, 8-bit), or None. Reads only the param groups'
    ``state_dtype`` and the moments' dtypes; never blocks."""
    saved = state_dict.get("param_groups", [])
    state = state_dict.get("state", {})
    for i, (old, new) in enumerate(zip(saved, optimizer.param_groups)):
        try:
            old_kind = state_kind_of_group(old)
        except ValueError:
            return f"param group {i} of the state dict has an unknown state_dtype {old.get('state_dtype')!r}"
        new_kind = state_kind_of_group(new)
        if old_kind is not new_kind:
            return (
                f"param group {i} of the state dict keeps {old_kind.value} moments "
                f"(state_dtype={old_kind.value!r}) and this optimizer's keeps "
                f"{new_kind.value} moments; moments are not converted from one kind to "
                f"another: build the optimizer with state_dtype={_arg(old_kind)} to load it"
            )
        for index in old.get("params", []):
            entry = state.get(index) or {}
            moment = entry.get("exp_avg")
            if not isinstance(moment, Tensor):
                continue
            eight_bit = moment.dtype == torch.uint8 or "exp_avg_absmax" in entry
            if old_kind is StateKind.EXACT and eight_bit:
                return (
                    f"parameter {index} of the state dict has 8-bit moments but its group names "
                    f"none (no state_dtype): it was not saved by roundpipe's Adam"
                )
            allowed = {
                StateKind.EXACT: None,
                StateKind.BF16: (torch.bfloat16,),
                # a small parameter of an 8-bit group keeps exact (fp32) moments
                StateKind.EIGHT_BIT: (torch.uint8, torch.float32),
            }[old_kind]
            if allowed is not None and moment.dtype not in allowed:
                return (
                    f"parameter {index} of the state dict has {moment.dtype} moments, not "
                    f"those of state_dtype={old_kind.value!r}"
                )
    return None


def _arg(kind: StateKind) -> str:
    return {
        StateKind.EXACT: "None",
        StateKind.BF16: "torch.bfloat16",
        StateKind.EIGHT_BIT: "'8bit'",
    }[kind]


def _strip_lean(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Tensor]]]:
    """``state_dict`` without the lean moments of its lean groups' parameters (a shallow copy),
    and those moments by parameter index."""
    lean: dict[int, dict[str, Tensor]] = {}
    state = dict(state_dict.get("state", {}))
    for group in state_dict.get("param_groups", []):
        if state_kind_of_group(group) is StateKind.EXACT:
            continue
        for index in group["params"]:
            entry = state.get(index)
            if not entry or not isinstance(entry.get("exp_avg"), Tensor):
                continue
            if entry["exp_avg"].dtype not in (torch.bfloat16, torch.uint8):
                continue  # a small parameter of an 8-bit group: exact moments
            lean[index] = {k: v for k, v in entry.items() if k in _LEAN_KEYS}
            state[index] = {k: v for k, v in entry.items() if k not in _LEAN_KEYS}
    return {**state_dict, "state": state}, lean


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
        state_dtype: torch.dtype | str | None = None,
        write_copy: bool = True,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """Any thread; does not wait for the optimizer thread unless ``grad_dtype`` is given."""
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
            state_dtype=state_dtype,
            write_copy=write_copy,
            grad_dtype=grad_dtype,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
