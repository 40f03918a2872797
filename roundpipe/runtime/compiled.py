"""Layers through ``torch.compile``: the policy (which pools compile, with which arguments) that
``RoundPipe(compile=...)`` and ``roundpipe.hf.wrap(compile=...)`` share. See [Note: compiled
layers]."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from roundpipe.runtime.grad_access import internal_grad_reads

__all__ = ["COMPILED_DEVICE_TYPES", "allow_layer_graphs", "compile_options", "compiled_layer"]

# [Note: compiled layers]
# On a fast GPU the host is what bounds a streamed layer: a HF decoder layer's forward is about
# seventy small ops, and a microbatched run issues each of them once per microbatch, three times
# (forward, recompute, backward), where a whole-batch run issues them once. torch.compile turns
# a layer into a few fused kernels with one cheap call each, on the forward, the recompute and
# the backward (AOTAutograd's compiled backward, which autograd's device thread runs).
#
# What makes one compilation serve every layer and every upload: each layer module is compiled
# as it is (RoundPipe's stage layers; for roundpipe.hf.wrap, the HF decoder layer inside each
# Decoder stage), and torch.compile treats a module's parameters as inputs of the graph
# (guarded on shape, dtype and device, not identity, from torch 2.5), so the device copies
# swapped in for a run (see [Note: the layer's device tensors]) and the other layers of the
# same class reuse the graph. A forward without grad and a recompute with grad are two graphs.
#
# Random numbers: the forward and the recompute are different graphs, and inductor's own random
# kernels would draw different dropout masks in each, so the recompute's gradient would belong
# to another forward. ``fallback_random`` makes inductor draw through torch's generator, as
# eager code does, so the stage's captured RNG state replays the same masks (as for eager
# layers, see roundpipe/runtime/rng.py).
#
# Graphs: with and without grad, with a mask or none, one row or more, first shapes and then
# symbolic ones: a run of varied batches makes a dozen or so, past torch's default limit of 8
# per function, so compiling raises that limit (:func:`allow_layer_graphs`).
#
# Where a layer runs eagerly: in the memory plan's trace on fake tensors, which counts the eager
# layer's activations (inductor's partitioner usually saves fewer; on the GPU the Qwen3 shape's
# measured peak was the same), and on device types inductor does not target (the emulated one).

# Device types torch.compile's default backend generates code for.
COMPILED_DEVICE_TYPES = ("cuda", "cpu", "xpu")
# Before this torch, torch.compile guards a module's parameters by identity, so every layer and
# every upload would compile again.
COMPILE_MIN_TORCH = (2, 5)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


# Graphs one layer's code may need: with and without grad, a mask or none (no padding),
# a microbatch of one row or more, its first shapes and then symbolic ones, per attention kind:
# more than torch's default limit (8), past which it runs the layer eagerly.
LAYER_GRAPHS = 64


def allow_layer_graphs() -> None:
    """Raise torch.compile's per-function graph limit to at least :data:`LAYER_GRAPHS`
    (``recompile_limit``; ``cache_size_limit`` before torch 2.6). A process setting: a higher
    limit than the user's is kept."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), LAYER_GRAPHS))


def compiled_layer(module: torch.nn.Module, options: dict[str, Any]) -> Callable[..., Any]:
    """What runs in place of ``module(*args, **kwargs)``: ``torch.compile(module, **options)``,
    with the graph limit raised (:func:`allow_layer_graphs`) and the parameters' ``.grad``
    reads torch.compile makes as it traces counted as roundpipe's own (no warning about the
    wrapped model's gradients)."""
    allow_layer_graphs()
    compiled = torch.compile(module, **options)

    def call(*args: Any, **kwargs: Any) -> Any:
        with internal_grad_reads():
            return compiled(*args, **kwargs)

    return call


def compile_options(compile: Any, device_type: str) -> dict[str, Any] | None:
    """``torch.compile``'s arguments for ``compile`` (``RoundPipe``'s or
    ``roundpipe.hf.wrap``'s) on a pool of ``device_type`` devices, or None where the layers run
    eagerly.

    None (the default) compiles on CUDA where torch can build its GPU kernels (Triton is
    installed, torch >= 2.5), else runs eagerly; False never compiles; True is torch's
    defaults; a mapping is taken as given. A compile asked for on a device type inductor does
    not target warns and runs eagerly. Inductor (the default backend) gets ``fallback_random``
    unless the mapping's ``options`` set it (see [Note: compiled layers])."""
    if compile is None:
        compile = device_type == "cuda" and _torch_version() >= COMPILE_MIN_TORCH and _has_triton()
    if compile is False:
        return None
    if compile is True:
        options: dict[str, Any] = {}
    elif isinstance(compile, Mapping):
        options = dict(compile)
    else:
        raise TypeError(
            f"compile must be a bool, None or a dict of torch.compile's arguments, got {compile!r}"
        )
    if _torch_version() < COMPILE_MIN_TORCH:
        raise RuntimeError(
            f"compile=... needs torch>=2.5 (before it, torch.compile compiles every layer "
            f"and every upload again); this is torch {torch.__version__}: upgrade torch, or "
            f"pass compile=False"
        )
    if device_type not in COMPILED_DEVICE_TYPES:
        warnings.warn(
            f"compile=...: {device_type} devices run the layers eagerly (torch.compile's "
            f"code targets {', '.join(COMPILED_DEVICE_TYPES)})",
            UserWarning,
            stacklevel=3,
        )
        return None
    if options.get("backend", "inductor") == "inductor":
        inductor = dict(options.get("options") or {})
        inductor.setdefault("fallback_random", True)
        options["options"] = inductor
    return options
