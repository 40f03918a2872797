"""Whole-state checkpoints in one call: :func:`save` (written behind the compute) and
:func:`load` (verified before anything changes). See docs/checkpointing.md.

Modules, by concern:

* ``files``: the safetensors shards (written and read without a copy), the tagged JSON, the
  directory's life cycle ([Note: the checkpoint format]).
* ``manifest``: ``manifest.json``, the checks of a checkpoint's files and versions, the
  checkpoints of a directory.
* ``state``: what a checkpoint holds, which thread takes each part, how it is put back
  ([Note: a consistent checkpoint]).
* ``named``: the optimizer state by parameter name, so a checkpoint of N ranks with sharded
  state loads on M ([Note: sharded checkpoints] in ``state``).
* ``writer``: :func:`save`, the writer thread, :class:`PendingCheckpoint`.
* ``reader``: :func:`load`, :func:`latest`.
* ``hf_export``: the HuggingFace directory of a wrapped HF model.
"""

from roundpipe.checkpoint.files import CheckpointFormatError
from roundpipe.checkpoint.reader import latest, load
from roundpipe.checkpoint.writer import PendingCheckpoint, save, wait

__all__ = ["save", "load", "latest", "wait", "PendingCheckpoint", "CheckpointFormatError"]
