"""The per-microbatch context (:class:`WithContext`): values that every layer of a stage needs
besides the previous layer's output (an HF decoder layer's attention mask, position ids and
rotary embeddings).

The model's first layer returns ``WithContext(output, context)``; the runtime hands ``output`` to
the next layer as usual and keeps ``context`` (a pytree) for the microbatch. Every later layer
whose class sets ``takes_context = True`` is called ``layer(x, context)``, with the context on
its own device. Context tensors never carry gradients (they are detached), and the recompute of
a stage sees the very tensors its forward saw.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["WithContext"]


class WithContext(NamedTuple):
    """A first layer's output together with the microbatch's context (see the module doc)."""

    output: Any
    context: Any
