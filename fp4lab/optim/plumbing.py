"""What every fp4lab optimizer's `step` does around its own update rule."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """torch.optim's closure protocol: re-evaluate the loss with gradients enabled, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def dense_grads(group: dict, optimizer: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) of each parameter of `group` that has a gradient; sparse ones are refused."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{optimizer} does not support sparse gradients")
        yield p, p.grad
