"""Tracing the device memory of each stage without running it: the stage's forward (as a
streamed forward runs it, without grad) and its forward with grad and backward (as a recompute
or the last stage runs them) on fake tensors (``FakeTensorMode``: shapes, no data, no compute),
counting the bytes of the storages the ops create while they are alive (see
[Note: live bytes]). What comes out, per stage and microbatch, is a
:class:`roundpipe.plan.ActionBytes`, which :func:`roundpipe.plan.device_peaks` walks through a
plan's program.

A stage that fake tensors cannot run (an output whose shape depends on the data, a host tensor
kept on the module) raises :class:`StageNotTraceable` inside; if its weights and input are small
(``REAL_RUN_LIMIT``) it is measured by a real run on the CPU instead (zeros for inputs the fake
trace of the stage before could not give values for), else it is reported untraced, and so is
every stage after it, whose input is then unknown.

Main thread. Nothing of the model changes: the layers run on fake copies of the parameters and
buffers, attributes a layer sets on itself are put back, and a real run's RNG draws are undone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.autocast import AutocastState, autocast_context
from roundpipe.devices.packed import carried, packed_copy
from roundpipe.memory.live import LiveBytes
from roundpipe.memory.repeats import elided
from roundpipe.microbatch import MicrobatchInfo
from roundpipe.microbatch_context import WithContext
from roundpipe.plan import ActionBytes
from roundpipe.runtime.stages import Stage

__all__ = [
    "REAL_RUN_LIMIT",
    "StageNotTraceable",
    "StageTraces",
    "interpolate_traces",
    "trace_stages",
]

# A stage that fake tensors cannot run is measured with a real CPU run when its weights and
# input take at most this many bytes.
REAL_RUN_LIMIT = 256 * 2**20


class StageNotTraceable(RuntimeError):
    """A stage could not run on fake tensors, so its activations are not known from a trace: the
    message names the stage and what failed (``MemoryPlan.untraced`` lists them)."""


# [Note: live bytes]
# A TorchDispatchMode sees every op a stage runs, forward and backward (autograd runs backward
# ops under the modes of the thread that called it, on its device thread too). Each storage an
# op creates on the traced device is counted once, from when it is made until torch frees it (a
# finalizer on the storage object, which torch keeps alive as long as the storage), so ``live``
# is what a caching allocator would hold for the stage's tensors and ``peak`` its maximum.
# Views share their base's storage and are not counted again; storages that existed before (the
# stage's input, its weights, the gradient it is handed) are never counted. This is what the
# emulated device measures per storage (see [Note: emulated device memory] in
# roundpipe.testing.emu); a CUDA allocator adds its block rounding and workspaces to it.
class _LiveBytes(TorchDispatchMode):
    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        # The bytes of the storages made since the last reset, alive now, and their peak.
        self.count = LiveBytes()
        self.counting = True
        self._known: set[int] = set()

    def know(self, tree: Any) -> None:
        """Never count ``tree``'s storages (they exist outside what is traced)."""
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self._add_known(t.untyped_storage())

    def _add_known(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._known:
            self._known.add(key)
            # Forgotten when freed: a later storage may be made at the same address.
            weakref.finalize(storage, self._known.discard, key)

    def reset(self) -> int:
        """Count from here: ``live`` and ``peak`` start at 0, and only storages made from now on
        count (a finalizer of an older one, run late by the garbage collector, changes nothing).
        Returns 0, the base the caller subtracts."""
        self.count.forget()
        return 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def _count(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.count or key in self._known:
            return
        if not self.counting:
            self._add_known(storage)
            return
        self.count.add(key, storage.nbytes())
        weakref.finalize(storage, self.count.remove, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._count(out)
        elif isinstance(out, (tuple, list)):  # no storage in a device or a size (prim ops)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out


@dataclasses.dataclass
class StageTraces:
    """What :func:`trace_stages` found: ``bytes``, per stage and microbatch, the stage's
    :class:`ActionBytes` (None where it is not known); ``untraced``: per stage that fake
    tensors could not run, why, and ``measured``: the stages measured by a real CPU run
    instead."""

    bytes: list[list[ActionBytes | None]]
    untraced: dict[int, StageNotTraceable]
    measured: list[int]


def interpolate_traces(a: StageTraces, b: StageTraces, t: float) -> StageTraces:
    """The traces of a size between (``0 < t < 1``) or beyond two traced ones, ``a`` at
    ``t = 0`` and ``b`` at ``t = 1``: each count ``a + t * (b - a)``, rounded, at least 0;
    None where either is. Exact where every count is affine in the size, as a decoder's are in
    the tokens of a sequence past its MLP tile and loss chunk (a tile or chunk adds the same
    ops); elsewhere an estimate, which a search checks with real traces (the plan command's
    ``--max-seq-len``). The stages not traced or measured are ``b``'s. Any thread."""
    if len(a.bytes) != len(b.bytes) or any(len(x) != len(y) for x, y in zip(a.bytes, b.bytes)):
        raise ValueError("interpolate_traces needs traces of the same stages and microbatches")

    def mix(x: ActionBytes | None, y: ActionBytes | None) -> ActionBytes | None:
        if x is None or y is None:
            return None
        values = {
            f.name: max(
                0, round(getattr(x, f.name) + t * (getattr(y, f.name) - getattr(x, f.name)))
            )
            for f in dataclasses.fields(ActionBytes)
        }
        return ActionBytes(**values)

    rows = [[mix(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a.bytes, b.bytes)]
    return StageTraces(rows, dict(b.untraced), list(b.measured))


def _nbytes_new(tree: Any, before: set[int]) -> int:
    """Bytes of the storages in ``tree`` not among ``before`` (each storage once)."""
    seen: dict[int, int] = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in before:
                seen[key] = storage.nbytes()
    return sum(seen.values())


def _storages(tree: Any) -> set[int]:
    return {
        t.untyped_storage()._cdata for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)
    }


def _leaves(tree: Any) -> list[Any]:
    return [tree] if isinstance(tree, torch.Tensor) else pytree.tree_leaves(tree)


@contextlib.contextmanager
def _attributes_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Whatever a layer sets on itself while traced (a cache of fake tensors) is put back."""
    saved = []
    for root in modules:
        for m in root.modules():
            attrs = vars(m)
            inner = {k: dict(v) for k, v in attrs.items() if isinstance(v, dict)}
            saved.append((attrs, dict(attrs), inner))
    try:
        yield
    finally:
        for attrs, before, inner in saved:
            attrs.clear()
            attrs.update(before)
            for k, v in inner.items():
                attrs[k].clear()
                attrs[k].update(v)


def _run_layers(
    stage: Stage,
    inp: tuple[tuple, dict],
    context: Any,
    tensors: dict[int, dict[str, torch.Tensor]],
) -> tuple[Any, Any]:
    """The stage's layers on ``tensors`` (per layer module, its parameters and buffers), as
    :mod:`roundpipe.runtime.stage_ops` runs them; returns (output, context)."""
    args, kwargs = inp
    x: Any = None
    for i, layer in enumerate(stage.layers):
        call_args: tuple
        call_kwargs: dict = {}
        if i == 0 and stage.index == 0:
            call_args, call_kwargs = args, kwargs
        else:
            if i == 0:
                x = args[0]
            call_args = (x, context) if layer.takes_context else (x,)
        x = torch.func.functional_call(
            layer.module, tensors[id(layer.module)], call_args, call_kwargs
        )
        if i == 0 and stage.index == 0 and isinstance(x, WithContext):
            x, context = x.output, x.context
    return x, context


def _stage_tensors(
    stage: Stage, make: Callable[[torch.Tensor, bool], torch.Tensor]
) -> tuple[dict[int, dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Per layer module, ``make(t, trainable)`` of each parameter and buffer (each tensor once,
    as an upload makes them; a packed weight as its data carrying its quantization state, see
    [Note: packed parameters] in :mod:`roundpipe.devices.packed`), and the copies of the
    trainable parameters, in the stage's order of its trainable params."""
    trainable = {id(rec.param) for rec in stage.params if rec.param.requires_grad}
    copies: dict[int, torch.Tensor] = {}

    def carry(t: torch.Tensor) -> torch.Tensor:
        c = copies.get(id(t))
        if c is None:
            c = copies[id(t)] = make(t, False)
        return c

    def copy(t: torch.Tensor, leaf: bool) -> torch.Tensor:
        c = copies.get(id(t))
        if c is None:
            c = packed_copy(t, lambda d: make(d, False), carry)
            c = copies[id(t)] = make(t, leaf) if c is None else c
        return c

    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for module in stage.modules:
        named = {n: copy(p, id(p) in trainable) for n, p in module.named_parameters()}
        named.update({n: copy(b, False) for n, b in module.named_buffers()})
        tensors[id(module)] = named
    leaves = [copies[id(rec.param)] for rec in stage.params if rec.param.requires_grad]
    return tensors, leaves


@dataclasses.dataclass
class _Call:
    """What a traced call runs: the last stage's loss and labels, autocast, grad inputs."""

    training: bool
    loss_fn: Callable | None
    loss_takes_microbatch: bool
    labels: Sequence[Any]
    sizes: Sequence[int]
    autocast: AutocastState
    input_grad: bool
    real_runs: bool = True


def _trace_one(
    stage: Stage,
    last: bool,
    inp: tuple[tuple, dict],
    context: Any,
    m: int,
    call: _Call,
    live: _LiveBytes,
    device: torch.device,
    make: Callable[[torch.Tensor, bool], torch.Tensor],
    label: Any,
) -> tuple[ActionBytes, Any, Any]:
    """One stage for one microbatch, fake or real (``make`` makes its weights); returns its
    bytes, its no-grad output and the context (for the next stage)."""
    tensors, params = _stage_tensors(stage, make)
    carried_copies = [c for named in tensors.values() for t in named.values() for c in carried(t)]
    live.know((inp, context, list(tensors.values()), carried_copies))
    # The forward a streamed FORWARD runs: no grad, only the output is kept.
    with live:
        return _traced(stage, last, inp, context, m, call, live, device, tensors, params, label)


def _traced(
    stage: Stage,
    last: bool,
    inp: tuple[tuple, dict],
    context: Any,
    m: int,
    call: _Call,
    live: _LiveBytes,
    device: torch.device,
    tensors: dict[int, dict[str, torch.Tensor]],
    params: list[torch.Tensor],
    label: Any,
) -> tuple[ActionBytes, Any, Any]:
    before = _storages((inp, context))
    out: Any = None
    forward_peak = output = made = 0
    # The last stage of a training call runs no FORWARD (its LAST runs the forward with grad,
    # traced below), so its no-grad forward is not traced: it would only cost the time.
    if not (last and stage.index > 0):
        base = live.reset()
        with torch.no_grad(), autocast_context(call.autocast):
            out, context = _run_layers(stage, inp, context, tensors)
        forward_peak = live.count.peak - base
        output = _nbytes_new(out, before)
        made = _nbytes_new(context, before) if stage.index == 0 else 0
    if not call.training:
        return (
            ActionBytes(_nbytes_new(inp, set()), output, forward_peak, context=made),
            out,
            context,
        )
    # The forward with grad and the backward a recompute (or LAST) runs.
    wants = (lambda x: x.requires_grad) if stage.index == 0 else torch.is_floating_point
    with live.paused():
        leaves, spec = pytree.tree_flatten(inp)
        cut = [
            x.detach().requires_grad_() if isinstance(x, torch.Tensor) and wants(x) else x
            for x in leaves
        ]
        wrt = [x for x in cut if isinstance(x, torch.Tensor) and x.requires_grad]
        grad_inp = pytree.tree_unflatten(cut, spec)
    if stage.index == 0 and not call.input_grad:
        wrt = []
    base = live.reset()
    with torch.enable_grad():
        with autocast_context(call.autocast):
            out_g, _ = _run_layers(stage, grad_inp, context, tensors)
            if last:
                lbl = pytree.tree_map(
                    lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, label
                )
                outputs = [_loss(call, out_g, lbl, m)]
                del lbl
        graph = live.count.live - base
        grad_forward_peak = live.count.peak - base
        if out is None:  # not run without grad: its output, as the forward with grad made it
            output = _nbytes_new(out_g, before)
            out = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out_g)
        if last:
            grad_outputs = [torch.ones_like(outputs[0])]
        else:
            outputs = [o for o in _leaves(out_g) if isinstance(o, torch.Tensor) and o.requires_grad]
            with live.paused():  # the gradient the stage after hands over: not this stage's
                grad_outputs = [torch.ones_like(o) for o in outputs]
        inputs = wrt + params
        live.count.reset_peak()  # the backward's own peak, still counted from before the forward
        grads: list[Any] = [None] * len(inputs)
        if outputs and inputs:
            grads = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        grad_phase_peak = live.count.peak - base
        backward_end = live.count.live - base
    del grad_outputs
    input_grad = _nbytes_new([g for g in grads[: len(wrt)] if g is not None], set())
    param_grads = _nbytes_new([g for g in grads[len(wrt) :] if g is not None], set())
    return (
        ActionBytes(
            input=_nbytes_new(inp, set()),
            output=output,
            forward_peak=forward_peak,
            graph=graph,
            grad_forward_peak=grad_forward_peak,
            backward_peak=max(grad_forward_peak, grad_phase_peak),
            grad_phase_peak=grad_phase_peak,
            backward_end=backward_end,
            input_grad=input_grad,
            param_grads=param_grads,
            context=made,
        ),
        out,
        context,
    )


def _loss(call: _Call, out: Any, label: Any, m: int) -> torch.Tensor:
    if call.loss_fn is None:
        # No loss_fn given: a stand-in whose gradient is as large as the output.
        floats = [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if not floats:
            raise ValueError("the last stage has no floating output to take a loss of")
        total = floats[0].float().sum()
        for o in floats[1:]:
            total = total + o.float().sum()
        return total
    if call.loss_takes_microbatch:
        info = MicrobatchInfo(m, call.sizes[m], sum(call.sizes), len(call.sizes))
        return call.loss_fn(out, label, info)
    return call.loss_fn(out, label)


def _fake_like(tree: Any, device: torch.device, cast: torch.dtype | None) -> Any:
    """Fresh fake tensors (inside a FakeTensorMode) of ``tree``'s shapes on ``device``; floating
    ones in ``cast`` when given (as stage 0's inputs are cast to the params' dtype)."""

    def make(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtype = cast if cast is not None and x.is_floating_point() else x.dtype
        t = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device)
        return t.requires_grad_(x.requires_grad) if t.is_floating_point() else t

    return pytree.tree_map(make, tree)


def _real_like(tree: Any) -> Any:
    """Real CPU tensors for a real run: a real tensor as it is, a fake one as zeros."""
    from torch._subclasses.fake_tensor import FakeTensor

    def make(x: Any) -> Any:
        if isinstance(x, FakeTensor):
            return torch.zeros(x.shape, dtype=x.dtype).requires_grad_(x.requires_grad)
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(make, tree)


def trace_stages(
    stages: Sequence[Stage],
    chunks: Sequence[tuple[tuple, dict]],
    device: torch.device,
    cast_dtype: torch.dtype | None,
    autocast: AutocastState,
    training: bool,
    labels: Sequence[Any] = (),
    loss_fn: Callable | None = None,
    loss_takes_microbatch: bool = False,
    sizes: Sequence[int] = (),
    real_runs: bool = True,
) -> StageTraces:
    """Per stage and microbatch, the device bytes of its actions (see the module doc), traced
    on fake tensors on ``device`` (microbatches of the same shapes traced once). ``loss_fn``
    None: the last stage's loss is a stand-in whose gradient is the size of its output.
    ``real_runs``: a stage fake tensors cannot run may be measured by a real CPU run (else it
    is reported untraced). Main thread."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    call = _Call(
        training,
        loss_fn,
        loss_takes_microbatch,
        labels,
        sizes,
        autocast,
        input_grad=training
        and any(x.requires_grad for x in pytree.tree_leaves(chunks) if isinstance(x, torch.Tensor)),
        real_runs=real_runs,
    )
    S = len(stages)
    table: list[list[ActionBytes | None]] = [[None] * len(chunks) for _ in stages]
    untraced: dict[int, StageNotTraceable] = {}
    measured: list[int] = []
    done: dict[Any, list[ActionBytes | None]] = {}
    for m, chunk in enumerate(chunks):
        label = labels[m] if training and m < len(labels) else None
        leaves, spec = pytree.tree_flatten((chunk, label))
        key = (
            spec,
            tuple(
                (tuple(x.shape), x.dtype, x.requires_grad)
                if isinstance(x, torch.Tensor)
                else repr(x)
                for x in leaves
            ),
        )
        if key not in done:
            done[key] = _trace_microbatch(
                stages, chunk, label, m, call, device, cast_dtype, untraced, measured,
                FakeTensorMode,
            )  # fmt: skip
        for s in range(S):
            table[s][m] = done[key][s]
    return StageTraces(table, untraced, sorted(set(measured)))


def _trace_microbatch(
    stages: Sequence[Stage],
    chunk: tuple[tuple, dict],
    label: Any,
    m: int,
    call: _Call,
    device: torch.device,
    cast_dtype: torch.dtype | None,
    untraced: dict[int, StageNotTraceable],
    measured: list[int],
    fake_mode_cls: Any,
) -> list[ActionBytes | None]:
    row: list[ActionBytes | None] = []
    mode = fake_mode_cls(allow_non_fake_inputs=True)
    live = _LiveBytes(device.type)

    def fake(t: torch.Tensor, leaf: bool) -> torch.Tensor:
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return copy.requires_grad_(leaf)

    def real(t: torch.Tensor, leaf: bool) -> torch.Tensor:
        # Leaves share the host parameter's storage; buffers are copied (a training-mode
        # layer updates them in place).
        return t.detach().requires_grad_(leaf) if leaf else t.detach().clone()

    inp: Any = None
    context: Any = None
    failed: int | None = None
    # Stages already traced, by what decides their bytes (see [Note: identical stages]).
    priced: dict[Any, tuple[ActionBytes, Any, Any]] = {}
    for s, stage in enumerate(stages):
        if failed is not None:
            untraced.setdefault(
                s,
                StageNotTraceable(
                    f"stage {s}: not traced, its input is the output of stage {failed}, "
                    f"which could not be traced"
                ),
            )
            row.append(None)
            continue
        last = s == len(stages) - 1 and call.training
        key = None if s == 0 or last else _stage_key(stage, inp, context)
        if key is not None and key in priced:
            bytes_, out, context = priced[key]
            inp = ((out,), {})
            row.append(bytes_)
            continue
        try:
            with mode, _attributes_kept(stage.modules), elided():
                if s == 0:
                    inp = _fake_like(chunk, device, cast_dtype)
                    fake_label = _fake_like(label, torch.device("cpu"), None)
                else:
                    inp = _fake_like(inp, device, None)
                    context = _fake_like(context, device, None)
                    fake_label = _fake_like(label, torch.device("cpu"), None)
                bytes_, out, context = _trace_one(
                    stage, last, inp, context, m, call, live, device, fake, fake_label
                )
            if key is not None:
                priced[key] = (bytes_, out, context)
            inp = ((out,), {})
            row.append(bytes_)
            continue
        except Exception as exc:  # noqa: BLE001 -- any failure of the layers: reported below
            reason = StageNotTraceable(
                f"stage {s} ({', '.join(layer.describe() for layer in stage.layers)}) could "
                f"not run on fake tensors: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
            reason.__cause__ = exc
        measured_bytes = None
        if call.real_runs:
            with _attributes_kept(stage.modules):
                measured_bytes = _real_run(
                    stage, s, last, chunk, inp, context, label, m, call, real
                )
        if measured_bytes is None:
            untraced[s] = reason
            failed = s
            row.append(None)
            continue
        bytes_, out, context = measured_bytes
        inp = ((out,), {})
        measured.append(s)
        row.append(bytes_)
    return row


# [Note: identical stages]
# A decoder of 80 layers is 80 stages whose bytes are the same: same module structure (its
# repr, which names every submodule with its sizes and settings, and its class), the same
# parameters and buffers (shapes, dtypes, strides, requires_grad), and the same input and
# context (shapes, dtypes, requires_grad; non-tensors by repr). A stage whose key equals one
# traced before in the same microbatch reuses that trace (its bytes and its output), so a
# plan prices one layer, not every layer: planning a 70B model costs about what a 2-layer cut
# does. The first stage (it takes the batch) and the last (it takes the loss) are always
# traced. A module whose memory depends on something its repr does not show (an attribute
# set outside __init__'s submodules) says so in its extra_repr, as roundpipe.hf's Decoder
# does with its attention type.
def _stage_key(stage: Stage, inp: Any, context: Any) -> Any:
    """What decides a stage's traced bytes (see [Note: identical stages]); None: not
    comparable (an input that is not a tensor tree of known shapes)."""
    layers = []
    for layer in stage.layers:
        described = describe_module(layer.module)
        if described is None:
            return None
        layers.append((*described, layer.takes_context))
    return (tuple(layers), tree_signature(inp), tree_signature(context))


def tree_signature(tree: Any) -> tuple:
    """A pytree's structure and its leaves' shapes, dtypes, ``requires_grad`` and device types
    (other leaves by their repr): what a trace of it depends on."""
    leaves, spec = pytree.tree_flatten(tree)
    return (
        str(spec),
        tuple(
            (tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
            if isinstance(x, torch.Tensor)
            else repr(x)
            for x in leaves
        ),
    )


_DESCRIBED: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "roundpipe_described_modules", default=None
)


def describe_module(module: nn.Module) -> tuple | None:
    """What decides ``module``'s traced bytes besides its inputs: its type, its repr and its
    tensors' shapes, strides, dtypes and ``requires_grad`` (see [Note: identical stages]); None
    if a hook may keep or make tensors its repr does not show. Inside
    :func:`described_modules` each module is described once (its repr walks every submodule)."""
    cache = _DESCRIBED.get()
    if cache is not None and id(module) in cache:
        return cache[id(module)]
    hooks = any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in module.modules()
    )
    described = None
    if not hooks:
        tensors = [
            (n, tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
            for n, t in (*module.named_parameters(), *module.named_buffers())
        ]
        described = (type(module), repr(module), tuple(tensors))
    if cache is not None:
        cache[id(module)] = described
    return described


@contextlib.contextmanager
def described_modules(cache: dict[int, Any]) -> Iterator[None]:
    """Within it, :func:`describe_module` keeps each description in ``cache`` (by the module's
    id: the caller keeps the modules alive and unchanged as long as it reuses ``cache``)."""
    token = _DESCRIBED.set(cache)
    try:
        yield
    finally:
        _DESCRIBED.reset(token)


def _real_run(
    stage: Stage,
    s: int,
    last: bool,
    chunk: tuple[tuple, dict],
    inp: Any,
    context: Any,
    label: Any,
    m: int,
    call: _Call,
    real: Callable[[torch.Tensor, bool], torch.Tensor],
) -> tuple[ActionBytes, Any, Any] | None:
    """The stage measured by a real run on the CPU, if it is small enough; None if not (or if
    the real run fails too)."""
    source = chunk if s == 0 else inp
    input_bytes = sum(
        x.numel() * x.element_size()
        for x in pytree.tree_leaves(source)
        if isinstance(x, torch.Tensor)
    )
    if stage.upload_bytes + input_bytes > REAL_RUN_LIMIT:
        return None
    cpu = dataclasses.replace(call, autocast=dataclasses.replace(call.autocast, device_type="cpu"))
    live = _LiveBytes("cpu")
    try:
        with torch.random.fork_rng(devices=[]):
            return _trace_one(
                stage,
                last,
                _real_like(source),
                _real_like(context),
                m,
                cpu,
                live,
                torch.device("cpu"),
                real,
                _real_like(label),
            )
    except Exception:  # noqa: BLE001 -- not measurable either: reported as untraced
        return None
