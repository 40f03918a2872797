"""Token tiles for the token-wise parts of a decoder layer: its MLP and the norms around it run
on ``tokens`` tokens at a time, each tile under ``torch.utils.checkpoint`` (non-reentrant, the
RNG state preserved as torch preserves it), so that no (tokens x intermediate) tensor of the
whole microbatch exists at once: the forward with grad (a stage's recompute) keeps only each
tile's input (a view of the layer's hidden states), and the backward recomputes one tile's
intermediates at a time. The tiles' outputs are concatenated.

The tiles are the microbatch's tokens with its rows flattened (``(rows x seq, hidden)``, split
every ``tokens`` rows), so a tile may span two sequences: the modules tiled are token-wise
(each output token depends on its own input token only), which is what makes the split exact.
Which modules a family tiles is its :attr:`roundpipe.hf.Family.tiled`; a mixture-of-experts
block is not tiled (its router's outputs are read per layer call).

How it is switched: :func:`install` gives each tiled module a ``forward`` that tiles only
inside :func:`tiles` on the calling thread (roundpipe's :class:`~roundpipe.hf.stages.Decoder`
opens it around its layer), and only when the input has more tokens than a tile; everywhere
else (the user calling the HF model directly, a short microbatch) the module's own forward
runs unchanged. Its parameters, names and ``repr`` do not change.

Numerics: a tile's outputs and input gradients are the untiled ones row for row (bitwise
where the matmul kernel's result for a row does not depend on the rows beside it, as on the
CPU in fp32); the weights' gradients are the sum of the tiles' partial sums, equal to the
untiled ones up to the order of that sum (fp32: within 1e-5 relative).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.memory.repeats import eliding, runs

__all__ = ["install", "tiles", "tiled_modules"]

_local = threading.local()


@contextlib.contextmanager
def tiles(tokens: int | None) -> Iterator[None]:
    """Inside, on this thread, the modules :func:`install` tiled run in tiles of ``tokens``
    tokens (None or 0: untiled). Any thread; nests (the innermost applies)."""
    before = getattr(_local, "tokens", None)
    _local.tokens = tokens or None
    try:
        yield
    finally:
        _local.tokens = before


def install(layer: nn.Module, names: Sequence[str]) -> list[str]:
    """Give the direct submodules of ``layer`` named ``names`` (those it has) the tiling
    ``forward`` (see the module doc); returns the names tiled. Installing twice changes
    nothing. Main thread, before the layer runs."""
    done = []
    for name in names:
        module = getattr(layer, name, None)
        if not isinstance(module, nn.Module):
            continue
        if not isinstance(vars(module).get("forward"), types.MethodType):
            # An instance attribute, found before the class's forward by nn.Module.__call__;
            # deepcopy binds it to the copy.
            module.forward = types.MethodType(_tiled_forward, module)
            # Its backward runs it again on the stage's tensors, swapped in for the tile: no
            # other thread may run it meanwhile (see [Note: overlapped recompute]).
            vars(module)["_roundpipe_runs_in_backward"] = True
        done.append(name)
    return done


def tiled_modules(layer: nn.Module) -> list[str]:
    """The names of ``layer``'s direct submodules that :func:`install` tiled."""
    return [
        name
        for name, module in layer.named_children()
        if getattr(vars(module).get("forward"), "__func__", None) is _tiled_forward
    ]


def _tiled_forward(self: nn.Module, hidden: Any, *args: Any, **kwargs: Any) -> Any:
    # The module's own forward, called unbound: torch.compile traces that on every version
    # (``function.__get__`` breaks its graph before torch 2.13).
    forward = type(self).forward
    tokens = getattr(_local, "tokens", None)
    if (
        tokens is None
        or args
        or kwargs
        or not isinstance(hidden, torch.Tensor)
        or hidden.dim() < 2
        or hidden.shape[:-1].numel() <= tokens
    ):
        return forward(self, hidden, *args, **kwargs)
    shape = hidden.shape
    flat = hidden.reshape(-1, shape[-1])
    grad = torch.is_grad_enabled()
    # The tensors the module computes with now: while roundpipe runs the stage they are the
    # stage's upload (or a plan's fake copies), which the module no longer holds
    # when the backward recomputes a tile.
    tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
    outs: list[torch.Tensor] = []
    pieces = flat.split(tokens)
    elide = eliding()  # inside a memory trace: see [Note: elided repeats]
    for k, piece in enumerate(pieces):
        if not runs(k, len(pieces), elide):  # a middle tile, stood in for
            outs.append(_StandIn.apply(piece, outs[1].shape, outs[1].dtype, *tensors.values()))
        elif grad:
            outs.append(checkpoint(_call_with, self, tensors, piece, use_reentrant=False))
        else:  # nothing is kept for a backward: a tile at a time is all it takes
            outs.append(forward(self, piece))
    out = torch.cat(outs)
    del outs  # the tiles' outputs: cat's backward keeps only their sizes
    return out.reshape(*shape[:-1], out.shape[-1])


class _StandIn(torch.autograd.Function):
    """A tile a memory trace does not run (fake tensors only, see [Note: elided repeats] in
    :mod:`roundpipe.memory.repeats`): what the tile leaves behind, its output in the forward
    and its input's gradient in the backward, with no values."""

    @staticmethod
    def forward(
        ctx: Any, piece: torch.Tensor, shape: torch.Size, dtype: torch.dtype, *tensors: Any
    ) -> torch.Tensor:
        ctx.piece = (piece.shape, piece.dtype)
        ctx.count = len(tensors)
        return piece.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        shape, dtype = ctx.piece
        grad_piece = grad.new_empty(shape, dtype=dtype) if ctx.needs_input_grad[0] else None
        return (grad_piece, None, None, *[None] * ctx.count)


def _call_with(module: nn.Module, tensors: dict[str, torch.Tensor], piece: torch.Tensor) -> Any:
    # A tile has no more tokens than a tile: the module's own forward runs.
    return torch.func.functional_call(module, tensors, (piece,))
