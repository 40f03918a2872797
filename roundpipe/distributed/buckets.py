"""How gradients are grouped into flat buffers for one collective: :class:`Bucket`,
:func:`plan_buckets`, the buckets of each owner's gradients (:func:`owner_buckets`) and the copy
into a bucket's buffer (:func:`pack`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

__all__ = ["Bucket", "plan_buckets", "owner_buckets", "pack"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors all-reduced together in one flat buffer: ``names[i]`` occupies elements
    ``offsets[i] : offsets[i] + numels[i]``; ``index[i]`` is its position in the planned list."""

    dtype: torch.dtype
    names: tuple[str, ...]
    index: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the bucket's flat buffer. Any thread; never blocks."""
        return self.offsets[-1] + self.numels[-1] if self.names else 0

    def __str__(self) -> str:
        size = self.numel * torch.empty((), dtype=self.dtype).element_size()
        return f"Bucket({str(self.dtype).replace('torch.', '')}, {size} bytes: {', '.join(self.names)})"


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of one dtype and at most ``cap_bytes`` each, in the given
    order (a tensor larger than the cap gets a bucket of its own). Pure function: any thread.
    """
    if not isinstance(cap_bytes, int) or isinstance(cap_bytes, bool) or cap_bytes < 1:
        raise ValueError(f"bucket cap must be a positive number of bytes, got {cap_bytes!r}")
    done: list[Bucket] = []
    open_: dict[torch.dtype, list[tuple[str, int, int]]] = {}

    def close(dtype: torch.dtype) -> None:
        entries = open_.pop(dtype)
        offsets, offset = [], 0
        for _, _, n in entries:
            offsets.append(offset)
            offset += n
        done.append(
            Bucket(
                dtype,
                tuple(e[0] for e in entries),
                tuple(e[1] for e in entries),
                tuple(offsets),
                tuple(e[2] for e in entries),
            )
        )

    for i, (name, t) in enumerate(named_tensors):
        entries = open_.get(t.dtype)
        if (
            entries is not None
            and (sum(e[2] for e in entries) + t.numel()) * t.element_size() > cap_bytes
        ):
            close(t.dtype)
        open_.setdefault(t.dtype, []).append((name, i, t.numel()))
    for dtype in list(open_):
        close(dtype)
    return done


def owner_buckets(
    named: Sequence[tuple[str, torch.Tensor]], owners: Sequence[int | None], cap_bytes: int
) -> tuple[list[Bucket], list[int | None]]:
    """The gradient buckets and each one's owner (None: all-reduced): :func:`plan_buckets` over
    each owner's tensors, so that a bucket is summed onto one rank; ``index`` stays the
    position in ``named``."""
    buckets: list[Bucket] = []
    bucket_owners: list[int | None] = []
    for owner in dict.fromkeys(owners):
        positions = [i for i, o in enumerate(owners) if o == owner]
        for b in plan_buckets([named[i] for i in positions], cap_bytes):
            buckets.append(dataclasses.replace(b, index=tuple(positions[j] for j in b.index)))
            bucket_owners.append(owner)
    return buckets, bucket_owners


def pack(flat: torch.Tensor, bucket: Bucket, grads: Sequence[torch.Tensor | None]) -> None:
    """Copy ``grads`` (one per parameter of ``bucket``; None: zeros) into ``flat``, at the
    bucket's offsets."""
    for grad, offset, n in zip(grads, bucket.offsets, bucket.numels):
        piece = flat[offset : offset + n]
        if grad is None:
            piece.zero_()
        else:
            piece.view(grad.shape).copy_(grad)
