"""The wrap's self-check: roundpipe's stages against the model's own forward, before any training.

A cut of the model (the embedding, the first two decoder layers of each attention type, the
final norm and the head) computes in fp32 on the CPU (its weights swapped for fp32 copies for
the check's duration), and the same tiny padded batch of random tokens goes through
transformers' forward of the cut and through roundpipe's stages built on the same modules. The
embedding's output, every layer's output, the logits and the loss must agree
(:data:`TOLERANCE`); if they do not, :class:`WrapCheckError` names the first part that differs
(the embedding's scaling, a layer's mask or rotary embedding, the head's soft-capping or
scaling, the router's load-balancing loss) and what to do. So a family that is not listed, or a
transformers release that changed a model, can never train a model other than the one loaded.

Cost: the fp32 copies of the cut's weights (for an 8B Llama 5.5 GiB, mostly the embedding and
the head) and a forward of 2 x 16 tokens through it twice (docs/hf.md has the measured time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from roundpipe.hf.families import Family
from roundpipe.hf.stages import IGNORE_INDEX, Decoder, Embed, Head, shift_labels
from roundpipe.microbatch_context import WithContext

__all__ = ["WrapCheckError", "CheckReport", "check_stages", "TOLERANCE"]

# Largest difference allowed, relative to the reference's largest magnitude (fp32 on both
# sides, the same weights and kernels: what differs is only the order of a few sums).
TOLERANCE = 1e-4
_LOSS_TOLERANCE = 1e-5

_REPORT = (
    "Wrap with check=False to train anyway (at your own risk), register a Family that "
    "implements it (docs/hf.md, 'Adding a family'), or report it with the model's config."
)


class WrapCheckError(ValueError):
    """roundpipe's stages computed something other than the model's own forward."""


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What the self-check compared: the cut's layers (indices in the model), the largest
    relative difference of the logits, the two losses, and the seconds it took."""

    layers: tuple[int, ...]
    logits_difference: float
    loss: float
    reference_loss: float
    seconds: float


def _cut_layers(kinds: list[str], per_kind: int = 2) -> list[int]:
    """The first ``per_kind`` layers of each attention type, in model order."""
    taken: dict[str, int] = {}
    chosen = []
    for i, kind in enumerate(kinds):
        if taken.get(kind, 0) < per_kind:
            taken[kind] = taken.get(kind, 0) + 1
            chosen.append(i)
    return chosen


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    scale = max(float(reference.abs().max()), 1.0)
    return float((ours.float() - reference.float()).abs().max()) / scale


def _same(ours: Any, reference: Any) -> bool:
    """Tensors (or tuples of them) within :data:`TOLERANCE`; other objects (None, a flex
    attention BlockMask) are not compared."""
    if isinstance(ours, torch.Tensor) or isinstance(reference, torch.Tensor):
        if not (
            isinstance(ours, torch.Tensor)
            and isinstance(reference, torch.Tensor)
            and ours.shape == reference.shape
        ):
            return False
        if not reference.is_floating_point():  # a boolean mask
            return torch.equal(ours, reference)
        return _relative(ours, reference) <= TOLERANCE
    if isinstance(ours, (tuple, list)) and isinstance(reference, (tuple, list)):
        return len(ours) == len(reference) and all(map(_same, ours, reference))
    return True


def _simple_path(path: str) -> bool:
    return "." not in path


class _Capture:
    """Each decoder layer's keyword arguments and output in transformers' own forward."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.inputs: list[tuple[Any, dict[str, Any]]] = []
        self.outputs: list[Any] = []
        self.handles = []
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.inputs.append((hidden, kwargs))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.outputs.append(output[0] if isinstance(output, tuple) else output)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batch(vocab: int, rows: int, tokens: int) -> dict[str, torch.Tensor]:
    """Random tokens; the last row right-padded over its last quarter."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (rows, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, tokens - max(tokens // 4, 1) :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def check_stages(
    base: nn.Module,
    family: Family,
    kinds: list[str],
    loss_chunk_tokens: int,
    *,
    rows: int = 2,
    tokens: int = 16,
) -> CheckReport | None:
    """Compare roundpipe's stages with ``base``'s own forward (a ``*ForCausalLM``) on a cut of
    it; raise :class:`WrapCheckError` naming the first part that differs. Returns what was
    compared, or None (with a warning) where it cannot run: weights on the meta device, or
    parts at nested attribute paths. Main thread; allocates the fp32 copies of the cut's weights
    for its duration."""
    parts = family.parts(base)
    paths = [family.embed, family.layers, family.norm, family.rotary, family.head]
    if not all(map(_simple_path, paths)) or not _simple_path(family.body):
        warnings.warn(
            f"roundpipe.hf.wrap: the self-check needs the parts of family {family.name!r} at "
            f"plain attribute names; it was skipped",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    layers = list(parts["layers"])
    chosen = _cut_layers(kinds)
    if family.router is not None and not any(family.router_of(layers[i]) for i in chosen):
        # Dense layers first (Qwen2-MoE's mlp_only_layers): the cut takes the first layer with
        # a router too, so the load-balancing loss has something to compare.
        routed = [i for i, layer in enumerate(layers) if family.router_of(layer) is not None]
        chosen = sorted(chosen + routed[:1])
    held = nn.ModuleDict(
        {
            "embed": parts["embed"],
            "norm": parts["norm"],
            "head": parts["head"],
            "rotary": parts["rotary"],
            "layers": nn.ModuleList([layers[i] for i in chosen]),
        }
    )
    if parts["rotary_local"] is not None:
        held["rotary_local"] = parts["rotary_local"]
    if any(t.is_meta for t in (*held.parameters(), *held.buffers())):
        warnings.warn(
            "roundpipe.hf.wrap: the model's weights are on the meta device, so the self-check "
            "cannot run its forward; it was skipped",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    start = time.perf_counter()
    with (
        torch.no_grad(),
        _in_fp32_eval(held),
        _cut_in_place(base, family, layers_of(held), [kinds[i] for i in chosen]) as config,
    ):
        batch = _batch(int(config.vocab_size), rows, tokens)
        capture = _Capture(layers_of(held))
        try:
            reference = base(**batch, use_cache=False)
        except Exception as exc:
            raise WrapCheckError(
                f"roundpipe.hf self-check: the model's own forward did not run on a cut of it "
                f"({type(exc).__name__}: {exc}), so the stages could not be compared with it. "
                f"{_REPORT}"
            ) from exc
        finally:
            capture.remove()
        report = _compare(
            family, config, held, getattr(base, family.body), chosen,
            [kinds[i] for i in chosen], loss_chunk_tokens, batch, capture, reference,
        )  # fmt: skip
    return dataclasses.replace(report, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _in_fp32_eval(held: nn.Module) -> Iterator[None]:
    """``held``'s modules in eval mode, their floating parameters and buffers swapped for fp32
    copies (one per tensor: tied weights stay tied), put back afterwards: the model itself is
    never written, and no module is copied."""
    swapped: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for name, t in [
        *held.named_parameters(remove_duplicate=False),
        *held.named_buffers(remove_duplicate=False),
    ]:
        if t.is_floating_point():
            if id(t) not in made:
                made[id(t)] = t.detach().float()
            swapped[name] = made[id(t)]
    modes = [(m, m.training) for m in held.modules()]
    held.eval()
    try:
        with _reparametrize_module(held, swapped):
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def layers_of(held: nn.ModuleDict) -> nn.ModuleList:
    layers = held["layers"]
    assert isinstance(layers, nn.ModuleList)
    return layers


@contextlib.contextmanager
def _cut_in_place(
    base: nn.Module, family: Family, layers: nn.ModuleList, kinds: list[str]
) -> Iterator[Any]:
    """``base`` with only the cut's decoder layers, and a config that says so, for the
    context's duration: the body's layer list and three config fields are swapped, then put
    back (the check runs on the main thread before the model is wrapped, nothing else runs
    it meanwhile)."""
    body = getattr(base, family.body)
    config = base.config
    saved_layers = getattr(body, family.layers)
    fields: dict[str, Any] = {"num_hidden_layers": len(kinds), "use_cache": False}
    if getattr(config, "layer_types", None) is not None:
        fields["layer_types"] = list(kinds)
    saved = {name: getattr(config, name) for name in fields}
    try:
        for name, value in fields.items():
            setattr(config, name, value)
        setattr(body, family.layers, layers)
        yield config
    finally:
        setattr(body, family.layers, saved_layers)
        for name, value in saved.items():
            setattr(config, name, value)


def _compare(
    family: Family,
    config: Any,
    held: nn.ModuleDict,
    body: nn.Module,
    chosen: list[int],
    kinds: list[str],
    loss_chunk_tokens: int,
    batch: dict[str, torch.Tensor],
    capture: _Capture,
    reference: Any,
) -> CheckReport:
    parts = {
        "body": body,  # the cut's: a body that builds its own mask builds the cut's
        "embed": held["embed"],
        "norm": held["norm"],
        "head": held["head"],
        "rotary": held["rotary"],
        "rotary_local": held["rotary_local"] if "rotary_local" in held else None,
    }
    count = int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
    embed = Embed(parts, config, kinds, family)
    out = embed(
        batch["input_ids"], batch["attention_mask"], batch["labels"], num_items_in_batch=count
    )
    assert isinstance(out, WithContext)
    x, context = out.output, out.context
    name = type(held["embed"]).__name__
    if not capture.inputs or not _same(x, capture.inputs[0][0]):
        raise WrapCheckError(
            f"roundpipe.hf self-check: the embedding's output differs from the model's own "
            f"(relative difference {_relative(x, capture.inputs[0][0]):.2e}): the model scales "
            f"or shifts its token embeddings ({name}) in a way family {family.name!r} does not "
            f"(embed_scale=). {_REPORT}"
        )
    for j, (layer, kind) in enumerate(zip(layers_of(held), kinds)):
        decoder = Decoder(layer, family, config, kind)
        hidden_in = x[0] if isinstance(x, tuple) else x
        try:
            x = decoder(x, context)
        except Exception as exc:  # where the model's own forward ran: the stage is wrong
            raise WrapCheckError(
                f"roundpipe.hf self-check: decoder layer {chosen[j]} ({kind}) raised where the "
                f"model's own forward ran ({type(exc).__name__}: {exc}). {_REPORT}"
            ) from exc
        hidden = x[0] if isinstance(x, tuple) else x
        if not _same(hidden, capture.outputs[j]):
            part = _layer_part(decoder, kind, context, capture.inputs[j][1], hidden_in)
            raise WrapCheckError(
                f"roundpipe.hf self-check: decoder layer {chosen[j]} ({kind}) gives another "
                f"output than in the model's own forward (relative difference "
                f"{_relative(hidden, capture.outputs[j]):.2e}): {part}. {_REPORT}"
            )
    head = Head(parts, config, loss_chunk_tokens, family)
    inference = {k: v for k, v in context.items() if k not in ("shift_labels", "num_items")}
    logits = head(x, inference)
    difference = _relative(logits, reference.logits)
    if logits.shape != reference.logits.shape or difference > TOLERANCE:
        features = ", ".join(
            f"{k}={getattr(config, k)!r}"
            for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            if getattr(config, k, None) is not None
        )
        raise WrapCheckError(
            f"roundpipe.hf self-check: the logits differ from the model's own (relative "
            f"difference {difference:.2e}): the model transforms its logits after the head "
            f"({features or 'a step its config does not name'}) in a way family "
            f"{family.name!r} does not (logits=). {_REPORT}"
        )
    loss = head(x, context)
    ours, theirs = float(loss), float(reference.loss)
    if abs(ours - theirs) > _LOSS_TOLERANCE * max(abs(theirs), 1.0):
        moe = getattr(config, "output_router_logits", False)
        cause = (
            "the router's load-balancing loss (router_aux_loss_coef) differs: check the "
            "family's router= path"
            if moe
            else "the loss over the same logits differs"
        )
        raise WrapCheckError(
            f"roundpipe.hf self-check: loss {ours:.6f}, the model's own {theirs:.6f}: {cause}. "
            f"{_REPORT}"
        )
    return CheckReport(tuple(chosen), difference, ours, theirs, 0.0)


def _layer_part(
    decoder: Decoder, kind: str, context: dict[str, Any], theirs: dict[str, Any], x: Any
) -> str:
    """Which of a layer's inputs differs: its rotary embedding, its mask, or neither."""
    from roundpipe.hf import compat

    ours = compat.layer_kwargs(
        decoder.layer,
        kind,
        context["attention_masks"][kind],
        context["position_ids"],
        context["position_embeddings"],
    )
    for key in ("position_embeddings", "position_embeddings_global", "position_embeddings_local"):
        if key in theirs and key in ours and not _same(ours[key], theirs[key]):
            return f"its rotary embedding ({key}) differs from the one the model gives it"
    if "attention_mask" in theirs and not _same(ours["attention_mask"], theirs["attention_mask"]):
        return f"its attention mask ({kind}) differs from the one the model builds"
    return (
        "its inputs are the model's, so the layer is called differently (keyword arguments "
        "the model passes that roundpipe does not)"
    )
