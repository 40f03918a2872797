"""HuggingFace causal LMs in one call: ``roundpipe.hf.wrap(model, **RoundPipe kwargs)``.

Needs transformers (``pip install -e ".[hf]"`` in a roundpipe checkout, which brings peft for
LoRA too). See docs/hf.md.
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        'roundpipe.hf needs transformers: pip install "transformers>=4.56" peft (or '
        'pip install -e ".[hf]" in the roundpipe checkout)'
    ) from exc

from roundpipe.hf.check import CheckReport, WrapCheckError, check_stages
from roundpipe.hf.families import Family, families, family_of, register_family, softcap_logits
from roundpipe.hf.loss import chunked_causal_lm_loss
from roundpipe.hf.wrap import HFRoundPipe, default_loss_chunk_tokens, wrap

__all__ = [
    "wrap",
    "HFRoundPipe",
    "Family",
    "register_family",
    "families",
    "family_of",
    "chunked_causal_lm_loss",
    "default_loss_chunk_tokens",
    "check_stages",
    "CheckReport",
    "WrapCheckError",
    "softcap_logits",
    "Trainer",
]


def __getattr__(name: str):
    # transformers' Trainer imports most of transformers (seconds): imported when
    # roundpipe.hf.Trainer is first used, so wrap and the plan command start without it.
    if name == "Trainer":
        from roundpipe.hf.trainer import Trainer

        return Trainer
    # TRL is an optional extra: imported when roundpipe.hf.SFTTrainer is first used.
    if name == "SFTTrainer":
        from roundpipe.hf.sft import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'roundpipe.hf' has no attribute {name!r}")
