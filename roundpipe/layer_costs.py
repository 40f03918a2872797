"""Per-layer costs for grouping layers into stages: :func:`measure_layer_costs` times each layer
of an ``nn.Sequential`` on a sample microbatch, and :func:`roundpipe.stages_by_size`
balances those costs (``costs=``) when it groups consecutive layers into stages.

The layers run one at a time on the calling thread, on copies of each layer's parameters and
buffers, swapped into the layer while it is timed and swapped back afterwards (torch's
``_reparametrize_module``, what ``torch.func.functional_call`` does at each call), so no value
the model holds is written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from roundpipe.devices import kind, resolve_devices
from roundpipe.threads.workers import add_note

__all__ = ["measure_layer_costs"]

# Every cost is at least this many seconds, so that stages_by_size never takes a layer as free
# (perf_counter's resolution is coarse on some platforms).
_MIN_COST = 1e-9


def measure_layer_costs(
    model: nn.Sequential,
    sample_input: Any,
    *,
    device: Any = None,
    dtype: torch.dtype | None = None,
    repeats: int = 5,
    backward: bool = True,
) -> list[float]:
    """Seconds that each layer (child) of ``model`` takes on one microbatch, a list to pass as
    ``stages_by_size(model, num_stages=..., costs=...)``.

    ``sample_input`` is one microbatch (the size each stage action sees: the batch divided by
    ``num_microbatch``), the argument of ``model(sample_input)``: layer 0 gets it and every later
    layer gets the output of the one before (a tuple or other nested output stays one
    argument), as in a ``RoundPipe`` call.

    What is timed, per layer: with ``backward=True`` (the default), what a training iteration
    runs for it per microbatch with recompute on: a forward without autograd (the forward pass
    keeps no graph), plus a forward with autograd and the backward to the layer's floating
    inputs (not the sample input's, unless it requires grad) and trainable parameters (the
    recompute and backward; the output gradient is all ones). With ``backward=False``, the
    forward only (inference). Each layer runs once to warm up, then ``repeats`` times; its cost
    is the median. Times are wall-clock seconds (``time.perf_counter``) between two
    synchronizations of ``device``, so they include the host's time to launch the kernels, which
    dominates small layers (device events would miss it). Compare them with each other; they do
    not predict an iteration's time. Every cost is > 0, layers without parameters included.

    ``device``: where to measure, as ``RoundPipe(devices=...)`` takes it (its first device);
    default: the first device of the pool a ``RoundPipe`` would use (``$ROUNDPIPE_DEVICES``,
    else cuda:0, else the CPU). The model stays where it is: one layer at a time, its parameters
    and buffers are copied to ``device``, as a stage is uploaded. ``dtype``: the copies' and the
    sample input's floating tensors are cast to it (``torch.float16`` times an fp32 model as it
    will train after ``.half()``); default: as they are. The caller's autocast state applies,
    as ``forward_backward`` carries it into the stages.

    The model is left as it was. Each module runs in its own training flag, as
    ``forward_backward`` runs it (a new model is in training mode: dropout draws and BatchNorm
    uses batch statistics), and the flags are not changed. Parameters, buffers (BatchNorm's
    running statistics update the copies) and ``.grad`` are not written, and the CPU's and
    ``device``'s random number generators are restored afterwards (``torch.random.fork_rng``).

    Takes a plain ``nn.Sequential``, before it is wrapped (the expected flow:
    ``RoundPipeRunConfig(execute_plan=stages_by_size(seq, num_stages=8,
    costs=measure_layer_costs(seq, x)))``). For a wrapped model, measure ``model.module`` after
    ``model.synchronize()``, so that no step on the optimizer thread writes the parameters while
    they are copied.

    Main thread, outside a ``RoundPipe`` call (while a layer is timed, its parameters and
    buffers are swapped for the copies); blocks until every layer is measured and synchronizes
    ``device``. A layer that fails raises its own exception, with a note naming the
    layer (index and class) and the pass.
    """
    layers = _layers(model)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    target = resolve_devices(device)[0].torch_device
    accelerator = target.type != "cpu"

    def sync() -> None:
        if accelerator:
            kind.synchronize(target)

    x = _to_device(sample_input, target, dtype)
    costs: list[float] = []
    rng_devices = [target.index or 0] if accelerator else []
    with torch.random.fork_rng(devices=rng_devices, device_type=target.type):
        for i, layer in enumerate(layers):
            tensors = _layer_copies(layer, target, dtype)
            # Layer 0's input is the sample as given; later inputs come from a layer, so
            # their floating tensors take a gradient as a stage input does.
            grad_in = None if i == 0 else True
            where = f"measure_layer_costs: layer {i} ({type(layer).__name__})"
            cost, x = _time_layer(layer, tensors, x, grad_in, backward, repeats, sync, where)
            costs.append(max(cost, _MIN_COST))
            del tensors  # this layer's copies go before the next layer's are made
    return costs


def _layers(model: Any) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential):
        from roundpipe.runtime.model import RoundPipe

        if isinstance(model, RoundPipe):
            raise ValueError(
                "measure_layer_costs takes the nn.Sequential, not the RoundPipe: "
                "pass model.module, after model.synchronize()"
            )
        raise ValueError(
            f"measure_layer_costs times the children of a non-empty "
            f"nn.Sequential, got {type(model).__name__}"
        )
    layers = list(model.children())
    if not layers:
        raise ValueError(
            "measure_layer_costs times the children of a non-empty nn.Sequential, got an empty one"
        )
    return layers


def _time_layer(
    layer: nn.Module,
    tensors: dict[str, torch.Tensor],
    x: Any,
    grad_in: bool | None,
    backward: bool,
    repeats: int,
    sync: Callable[[], None],
    where: str,
) -> tuple[float, Any]:
    """The median seconds of ``repeats`` timed runs of ``layer`` on ``x`` (after one warm-up),
    and its output, without autograd, for the next layer. Each run gets fresh copies of ``x``,
    made before its clock starts, so that a layer that writes its input in place (``ReLU(
    inplace=True)``) neither fails on a leaf nor changes ``x``. A failure gets a note naming
    ``where`` and the pass."""
    times: list[float] = []
    out: Any = None
    phase = "forward"
    try:
        # The layer computes on the copies, swapped in once, outside the clock, and swapped
        # back on the way out; torch.func.functional_call would swap them at every call, which
        # takes longer than a small layer computes.
        with _reparametrize_module(layer, tensors, tie_weights=True):
            for run in range(repeats + 1):  # run 0 warms up
                plain = _fresh_input(x, grad_in=False)[1]
                if backward:
                    wrt, inp = _fresh_input(x, grad_in)
                    wrt += [t for t in tensors.values() if t.requires_grad]
                sync()
                start = time.perf_counter()
                phase = "forward"
                with torch.no_grad():
                    out = layer(plain)
                if backward:
                    phase = "forward with autograd"
                    with torch.enable_grad():
                        graph_out = layer(inp)
                        outputs = [
                            t
                            for t in pytree.tree_leaves(graph_out)
                            if isinstance(t, torch.Tensor) and t.requires_grad
                        ]
                        phase = "backward"
                        if outputs and wrt:
                            torch.autograd.grad(
                                outputs,
                                wrt,
                                [torch.ones_like(t) for t in outputs],
                                allow_unused=True,
                            )
                    del graph_out, outputs
                sync()
                if run:
                    times.append(time.perf_counter() - start)
    except BaseException as exc:  # noqa: B036 -- annotated, then re-raised
        add_note(
            exc,
            f"[{where}, {phase}; layer 0 gets the sample input, each later layer "
            f"the output of the one before, as in model(sample_input)]",
        )
        raise
    return statistics.median(times), out


def _layer_copies(
    layer: nn.Module, device: torch.device, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """``layer``'s parameters and buffers by name (for ``_reparametrize_module``), copied to
    ``device``: a parameter as a new leaf that requires grad as it does, a tensor the layer
    holds twice copied once."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        if id(t) not in copies:
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            c = t.detach().to(device=device, dtype=cast, copy=True)
            copies[id(t)] = c.requires_grad_(requires_grad)
        return copies[id(t)]

    tensors = {n: copy(p, p.requires_grad) for n, p in layer.named_parameters()}
    tensors.update((n, copy(b, False)) for n, b in layer.named_buffers())
    return tensors


def _to_device(tree: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``tree`` with its tensors detached and copied to ``device``, floating ones cast to
    ``dtype`` when given; a tensor keeps its ``requires_grad``."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return (
            t.detach()
            .to(device=device, dtype=cast, copy=True)
            .requires_grad_(t.requires_grad and _is_float(t))
        )

    return pytree.tree_map(one, tree)


def _fresh_input(x: Any, grad_in: bool | None) -> tuple[list[torch.Tensor], Any]:
    """A layer input of new tensors with the values of ``x``: the floating tensors that take a
    gradient (all of them with ``grad_in`` True; those of ``x`` that require grad with None) as
    a clone of a new leaf, the others as a detached clone. Returns (the leaves, the input)."""
    leaves: list[torch.Tensor] = []

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if _is_float(t) and (grad_in or (grad_in is None and t.requires_grad)):
            leaf = t.detach().requires_grad_()
            leaves.append(leaf)
            with torch.enable_grad():
                return leaf.clone()
        return t.detach().clone()

    return leaves, pytree.tree_map(one, x)


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()
