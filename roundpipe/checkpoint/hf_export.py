"""A checkpoint's HuggingFace directory: the trained weights of a model made by
:func:`roundpipe.hf.wrap`, written while training goes on, that transformers' ``from_pretrained``
(or peft's, for an adapter) loads.

It follows :meth:`roundpipe.hf.wrap.HFRoundPipe.save_pretrained` (the HF model's own
``save_pretrained`` with the masters' values as its state dict, the config's dtype set to the
saved one), with two differences: nothing is synchronized (the writer thread runs it while the
checkpoint's hold keeps the masters as they were at the save), and the weights come from the
masters, never from the model's parameters (which are one step older than the masters with the
asynchronous step).

Threads: :func:`prepare` on the main thread; :func:`export` on the checkpoint writer thread.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["HFExport", "prepare", "export"]


class HFExport:
    """What the export needs, taken on the main thread: the HF model, its masters by HF name
    (live tensors), the dtype to write and the directory, relative to the checkpoint's (``"."``:
    the checkpoint directory itself, ``in_root``)."""

    def __init__(
        self,
        hf_model: Any,
        masters: dict[str, torch.Tensor],
        dtype: torch.dtype,
        directory: str = "hf",
    ):
        self.hf_model = hf_model
        self.masters = masters
        self.dtype = dtype
        self.directory = directory
        self.in_root = directory in ("", ".")


def prepare(model: Any, dtype: Any, directory: str = "hf") -> HFExport:
    """Main thread: ``model`` must be a wrapped HF model and ``directory`` a plain relative
    name or ``"."``; ``TypeError``/``ValueError`` else."""
    hf_model = getattr(model, "hf_model", None)
    if hf_model is None or not callable(getattr(hf_model, "save_pretrained", None)):
        raise TypeError(
            f"hf=True writes a HuggingFace directory for a model made by roundpipe.hf.wrap; "
            f"this is a {type(model).__name__}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"hf_dtype= takes a floating torch.dtype, got {dtype!r}")
    if not isinstance(directory, str) or (
        directory not in ("", ".")
        and (directory.startswith(".") or "/" in directory or os.sep in directory)
    ):
        raise ValueError(
            f"hf_dir= takes a plain directory name (default 'hf') or '.' (the checkpoint "
            f"directory itself), got {directory!r}"
        )
    masters = {name: m.detach() for name, m in model.optim_named_parameters()}
    return HFExport(hf_model, masters, dtype, "." if directory == "" else directory)


def export(job: HFExport, directory: Path) -> None:
    """Writer thread, while the masters are held: write ``directory``."""
    hf_model = job.hf_model
    masters = {
        name: m if m.dtype == job.dtype else m.to(job.dtype) for name, m in job.masters.items()
    }
    if hasattr(hf_model, "peft_config"):
        # peft keeps the adapter's tensors of the state dict it is given: the masters are the
        # adapter's trainable parameters (the frozen base is not written).
        hf_model.save_pretrained(str(directory), state_dict=masters)
        return
    from roundpipe.hf.names import export_state_dict

    # The masters in ``dtype`` are used for every trained weight (the model's own parameters
    # hold an older step); the frozen ones come from the model, cast to ``dtype``.
    state = export_state_dict(hf_model, masters, job.dtype)
    hf_model.save_pretrained(str(directory), state_dict=state)
    config = directory / "config.json"
    if config.exists():
        values = json.loads(config.read_text())
        name = str(job.dtype).replace("torch.", "")
        for key in ("dtype", "torch_dtype"):  # transformers 5 / 4 spell it differently
            if key in values:
                values[key] = name
        with open(config, "w") as f:
            json.dump(values, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
