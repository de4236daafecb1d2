"""The closure argument of ``Optimizer.step``, shared by the optimizers this pack makes (Prodigy, Lion, Adafactor,
AdamW8bit): their steps run without gradients, the closure that recomputes the loss with them."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["closure_loss"]


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss ``closure`` returns, computed with gradients enabled, or ``None`` without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
