"""QLoRA: a peft LoRA model over a base that transformers loaded quantized with bitsandbytes
(``BitsAndBytesConfig(load_in_4bit=True, ...)``), checked before :func:`roundpipe.hf.wrap`
changes anything, and the packed sizes the memory plan gives a quantized weight.

* :func:`quantization_of`: how a model is quantized (None, ``"nf4"``, ``"fp4"``, ``"int8"``,
  or another method's name).
* :func:`check_quantized`: refuse what roundpipe cannot train, by name (another quantization
  method, 8 bits, a quantized model without adapters, a bitsandbytes outside the supported
  range or without the kernels the pool needs); bitsandbytes is imported here, only for a
  quantized model.
* :func:`prepare_quantized`: what wrap sets on the quantized layers (see
  [Note: the packed layout stays]).
* :func:`packed_layout` / :func:`packed_weight_bytes`: the tensors and host bytes of one
  quantized weight, packed data and quantization state, as bitsandbytes lays it out;
  :func:`quantize_on_meta`: a model on the meta device quantized as transformers loads it in 4
  bits (the plan from a config, ``python -m roundpipe plan --quantize``).

The weights travel packed: see [Note: packed parameters] in :mod:`roundpipe.devices.packed`.
Main thread (wrap time), except the pure :func:`packed_weight_bytes`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from roundpipe.devices.packed import is_packed, quant_state_of

__all__ = [
    "EIGHT_BIT",
    "BITSANDBYTES_CEILING",
    "BITSANDBYTES_FLOOR",
    "QUANTIZATIONS",
    "check_quantized",
    "packed_layout",
    "packed_weight_bytes",
    "prepare_quantized",
    "quantization_of",
    "quantize_on_meta",
]

#: The oldest bitsandbytes whose CPU backend runs NF4 and FP4 (0.46 quantizes NF4 only there),
#: which the tests and the emulated device need; the ``qlora`` extra's floor.
BITSANDBYTES_FLOOR = (0, 47, 0)
#: The first bitsandbytes release this one does not claim (its next major version).
BITSANDBYTES_CEILING = (1, 0, 0)
_EXTRA = 'pip install "bitsandbytes>=0.47,<1" (the qlora extra: pip install -e ".[hf,qlora]")'

#: What ``python -m roundpipe plan --quantize`` takes, and what wrap trains.
QUANTIZATIONS = ("nf4", "fp4")

#: Why 8-bit weights are refused, and what to do instead.
EIGHT_BIT = (
    "8-bit weights (BitsAndBytesConfig(load_in_8bit=True)) are not streamed: bitsandbytes' "
    "Linear8bitLt keeps its int8 weight and scales in the module's MatmulLtState, which its "
    "forward rewrites (and, with llm_int8_threshold, the outlier columns), and computes another "
    "way on the CPU than on a GPU, so its weights cannot travel as a copy. Load the base in 4 "
    "bits: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') (half the bytes), "
    "or unquantized"
)


def _quant_config(base: nn.Module) -> dict[str, Any] | None:
    found = getattr(getattr(base, "config", None), "quantization_config", None)
    if found is None:
        return None
    if isinstance(found, dict):
        return found
    to_dict = getattr(found, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(found))


def _has_8bit(model: nn.Module) -> bool:
    return any(type(p).__name__ == "Int8Params" for p in model.parameters())


def quantization_of(base: nn.Module) -> str | None:
    """How ``base`` (a ``*ForCausalLM``, or a peft model around one) is quantized: None (not
    quantized), ``"nf4"``/``"fp4"`` (bitsandbytes' 4 bits), ``"int8"`` (bitsandbytes' 8 bits),
    or the config's ``quant_method`` for another method (``"gptq"``, ``"awq"``, ...). Read from
    ``config.quantization_config`` and from the weights themselves. Main thread."""
    config = _quant_config(base)
    method = None
    if config is not None:
        raw = config.get("quant_method")
        method = str(getattr(raw, "value", raw)) if raw is not None else None
        if method not in (None, "bitsandbytes"):
            return method
        if config.get("load_in_8bit"):
            return "int8"
        if config.get("load_in_4bit"):
            return str(config.get("bnb_4bit_quant_type") or "fp4")
    if _has_8bit(base):
        return "int8"
    for p in base.parameters():
        state = quant_state_of(p)
        if state is not None:
            return str(getattr(state, "quant_type", "fp4"))
    return None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _bitsandbytes() -> Any:
    """bitsandbytes, in the supported range; ImportError naming the extra otherwise."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ImportError(
            f"roundpipe.hf.wrap of a model quantized with bitsandbytes needs bitsandbytes: {_EXTRA}"
        ) from exc
    version = str(getattr(bitsandbytes, "__version__", "0"))
    if not BITSANDBYTES_FLOOR <= _version(version) < BITSANDBYTES_CEILING:
        raise ImportError(
            f"bitsandbytes {version} is outside the range roundpipe supports "
            f"(>= {'.'.join(map(str, BITSANDBYTES_FLOOR))}, < "
            f"{'.'.join(map(str, BITSANDBYTES_CEILING))}: older releases have no CPU kernels "
            f"for FP4): {_EXTRA}"
        )
    return bitsandbytes


def _probe_kernels(bnb: Any, quant_type: str, device: torch.device) -> None:
    """Quantize one block on the host and dequantize it on ``device`` with bitsandbytes' own
    kernels, as a layer will; RuntimeError naming what is missing if either cannot run."""
    where = "the CPU (quantizing on the host)"
    try:
        values = torch.linspace(-1, 1, 64)
        packed, state = bnb.functional.quantize_4bit(values, blocksize=64, quant_type=quant_type)
        where = f"{device} (dequantizing on the device)"
        state.to(device)
        out = bnb.functional.dequantize_4bit(packed.to(device), state)
        err = float((out.float().cpu().reshape(-1) - values).abs().max())
    except Exception as exc:
        raise RuntimeError(
            f"bitsandbytes {bnb.__version__} cannot run its {quant_type} kernels on {where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. Install a "
            f"bitsandbytes built for this machine: {_EXTRA}"
        ) from exc
    if not math.isfinite(err) or err > 0.25:
        raise RuntimeError(
            f"bitsandbytes {bnb.__version__}'s {quant_type} kernels on {device} give wrong "
            f"values (a round trip of one block is off by {err:.3g}); please report"
        )


def check_quantized(model: nn.Module, base: nn.Module, device_type: str) -> str | None:
    """Before :func:`roundpipe.hf.wrap` changes anything: None for a model that is not
    quantized, else its 4-bit type (``"nf4"``/``"fp4"``) after checking that roundpipe can
    train it, and raising what it cannot, by name: another quantization method or 8 bits
    (``NotImplementedError``), a quantized model without adapters to train (``ValueError``), a
    bitsandbytes missing or outside the supported range (``ImportError``, naming the ``qlora``
    extra), or without the kernels the pool's device type needs (``RuntimeError``).
    ``device_type``: the pool's (``"cpu"``, ``"cuda"``, ``"emu"``). Main thread."""
    kind = quantization_of(base)
    if kind is None:
        return None
    name = type(base).__name__
    if kind == "int8":
        raise NotImplementedError(f"{name}: {EIGHT_BIT}")
    if kind not in QUANTIZATIONS:
        raise NotImplementedError(
            f"{name} is quantized with {kind!r}: roundpipe streams bitsandbytes' 4-bit weights "
            f"(NF4, FP4) only. Load the base with transformers' BitsAndBytesConfig("
            f"load_in_4bit=True, bnb_4bit_quant_type='nf4'), or unquantized"
        )
    if not callable(getattr(model, "get_base_model", None)):
        raise ValueError(
            f"{name} is quantized ({kind}) but has no adapters: its quantized weights cannot "
            f"train, so there is nothing to train. Add LoRA adapters first: "
            f"peft.get_peft_model(model, LoraConfig(r=16, target_modules=...)), then wrap the "
            f"peft model"
        )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"the peft model over quantized {name} ({kind}) has no trainable parameter: "
            f"nothing to train (are its adapters disabled or frozen?)"
        )
    packed = [n for n, p in model.named_parameters() if is_packed(p)]
    if not packed:
        raise NotImplementedError(
            f"{name}'s config says {kind} but no weight carries a bitsandbytes quantization "
            f"state (a model quantized after loading, or by another tool?); load it with "
            f"from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))"
        )
    bnb = _bitsandbytes()
    for n, p in model.named_parameters():
        state = quant_state_of(p)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"{n} is in bitsandbytes' CPU inference layout (an evaluation forward on a CPU "
                f"with AVX512-BF16 repacked it), which no device kernel reads: load the model "
                f"again and wrap it before evaluating it on the CPU"
            )
    kinds = {str(getattr(quant_state_of(p), "quant_type", kind)) for p in model.parameters()}
    for quant_type in sorted(kinds & set(QUANTIZATIONS)):
        _probe_kernels(bnb, quant_type, torch.device(device_type))
    return kind


# [Note: the packed layout stays]
# bitsandbytes' Linear4bit repacks its weight in place into a CPU-only layout the first time it
# runs an evaluation forward on a CPU with AVX512-BF16 (``support_avx512bf16_for_cpu``): the
# self-check of wrap is such a forward, and so is model(**batch) on a CPU pool. The repacked
# weight is one no device kernel reads, and its gradient path is gone, so wrap turns that off
# on every quantized layer: the weights stay in the layout they were loaded in, the one that
# streams.
def prepare_quantized(model: nn.Module) -> None:
    """Keep the quantized layers' packed layout (see [Note: the packed layout stays]). Main
    thread, after :func:`check_quantized`."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            vars(module)["support_avx512bf16_for_cpu"] = False


def packed_layout(
    numel: int,
    quant: str,
    double_quant: bool = True,
    blocksize: int = 64,
    nested_blocksize: int = 256,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of one weight of ``numel`` values as bitsandbytes quantizes it to ``quant``
    (``"nf4"``/``"fp4"``), name -> (shape, dtype): the packed ``data`` (two values a byte), one
    ``absmax`` per block of ``blocksize`` (fp32, or with ``double_quant`` 8-bit, with one fp32
    ``nested_absmax`` per ``nested_blocksize`` blocks, their 256-entry ``nested_code`` and an
    ``offset``), and the 16-entry ``code`` of the 4-bit values. Pure; any thread."""
    if quant not in QUANTIZATIONS:
        raise ValueError(f"quantization {quant!r}: one of {', '.join(QUANTIZATIONS)}")
    blocks = -(-numel // blocksize)
    f32 = torch.float32
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "data": (((numel + 1) // 2, 1), torch.uint8),
        "absmax": ((blocks,), torch.uint8 if double_quant else f32),
        "code": ((16,), f32),
    }
    if double_quant:
        layout["nested_absmax"] = ((-(-blocks // nested_blocksize),), f32)
        layout["nested_code"] = ((256,), f32)
        layout["offset"] = ((), f32)
    return layout


def packed_weight_bytes(numel: int, quant: str, double_quant: bool = True) -> int:
    """Host bytes of one weight of ``numel`` values quantized to ``quant`` by bitsandbytes, its
    packed data and quantization state (:func:`packed_layout`), as transformers loads it: 0.5
    bytes a value and about 1/64 more (double quantization) or 1/16 (without), plus 1,092 or
    64 bytes of codes. Pure; any thread."""
    return sum(
        math.prod(shape) * dtype.itemsize
        for shape, dtype in packed_layout(numel, quant, double_quant).values()
    )


def quantize_on_meta(
    model: nn.Module,
    quant: str,
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Quantize a model built on the meta device as transformers' ``BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double_quant,
    bnb_4bit_compute_dtype=compute_dtype)`` loads it: every ``nn.Linear`` but the output
    embedding becomes bitsandbytes' ``Linear4bit`` whose weight is packed, with a quantization
    state of meta tensors of :func:`packed_layout`'s shapes, so a memory plan of it counts what
    a loaded model holds and traces bitsandbytes' own layers. Returns how many layers it
    quantized. Main thread; imports bitsandbytes (``ImportError`` naming the extra)."""
    bnb = _bitsandbytes()
    QuantState = bnb.functional.QuantState
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is output:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=double_quant,
                quant_type=quant,
                device="meta",
            )
            numel = child.in_features * child.out_features
            shapes = packed_layout(numel, quant, double_quant)

            def meta(key: str, shapes: Any = shapes) -> torch.Tensor:
                shape, dtype = shapes[key]
                return torch.empty(shape, dtype=dtype, device="meta")

            nested = None
            if double_quant:
                nested = QuantState(
                    absmax=meta("nested_absmax"),
                    code=meta("nested_code"),
                    blocksize=256,
                    dtype=torch.float32,
                )
            state = QuantState(
                absmax=meta("absmax"),
                shape=torch.Size((child.out_features, child.in_features)),
                code=meta("code"),
                blocksize=64,
                quant_type=quant,
                dtype=compute_dtype,
                offset=meta("offset") if double_quant else None,
                state2=nested,
            )
            layer.weight = bnb.nn.Params4bit(
                meta("data"),
                requires_grad=False,
                quant_state=state,
                blocksize=64,
                compress_statistics=double_quant,
                quant_type=quant,
                quant_storage=torch.uint8,
                module=layer,
                bnb_quantized=True,
            )
            layer.quant_state = state
            if child.bias is not None:
                layer.bias = nn.Parameter(
                    torch.empty_like(child.bias, device="meta"), requires_grad=False
                )
            setattr(parent, name, layer)
            count += 1
    return count
