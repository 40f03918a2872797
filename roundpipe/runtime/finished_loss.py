"""The loss ``forward_backward`` returns: a plain detached tensor whose ``backward()`` says what
to do instead.

``forward_backward`` has run the backward already (the gradients are in the masters'
``.grad``), so its loss has no graph, and torch's own error for ``loss.backward()`` ("element 0
of tensors does not require grad and does not have a grad_fn") does not say why or what comes
next. :class:`FinishedLoss` is a ``torch.Tensor`` subclass that changes nothing else: its
``__torch_function__`` is torch's disabled one, so every operation on it (``loss * 2``,
``loss.detach()``, ``loss.cpu()``) returns a plain tensor, and ``float(loss)``, ``.item()``,
``.numpy()``, comparisons, f-string formats, ``copy.deepcopy`` and pickling (as a plain tensor: ``torch.load``
with ``weights_only=True`` reads it) behave as for the tensor it views. No copy: it shares the
loss's storage.

Threads: any; it is made on the main thread by ``forward_backward``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FinishedLoss", "finished"]


class FinishedLoss(torch.Tensor):
    """A loss whose backward has run: a detached tensor that behaves as one, except that
    :meth:`backward` raises ``RuntimeError`` naming the next call (``model.step(...)``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def backward(self, *args: Any, **kwargs: Any) -> None:
        if self.requires_grad:  # a graph was attached to it since: torch's own backward
            return super().backward(*args, **kwargs)
        raise RuntimeError(
            "loss.backward() on the loss that model.forward_backward() returned: "
            "forward_backward has already run the backward (the gradients are in the masters' "
            ".grad), so this loss has no graph. Drop the backward() call; the next call is "
            "model.step(step_fn), e.g. model.step(lambda: (opt.step(), opt.zero_grad())). To "
            "run the backward yourself, use the differentiable forward instead: "
            "loss_fn(model(x), y).backward() (a wrapped HF model: model(**batch).loss.backward())"
        )

    def __format__(self, spec: str) -> str:
        return self.as_subclass(torch.Tensor).__format__(spec)

    def __repr__(self, **kwargs: Any) -> Any:  # type: ignore[override]  # tensor(...), as before
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> FinishedLoss:
        return self.as_subclass(torch.Tensor).clone().as_subclass(FinishedLoss)


def finished(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` (detached) as a :class:`FinishedLoss`: the same storage, no copy. A tensor of
    another subclass (a device's wrapper tensor) is returned detached, as it is."""
    loss = loss.detach()
    return loss.as_subclass(FinishedLoss) if type(loss) is torch.Tensor else loss
