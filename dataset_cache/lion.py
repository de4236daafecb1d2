"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): each weight moves by the learning rate
times the sign of an interpolation of its momentum and gradient, so every step has the same size per weight.

kohya's sd-scripts (``--optimizer_type Lion``) and ai-toolkit offer it through the ``lion-pytorch`` package; it
keeps one moment per weight where Adam keeps two. Its steps are ±lr per weight, larger than Adam's typical ones,
so its rates are usually 3-10 times below AdamW's. The same arithmetic as the package (checked against it in the
tests, bit for bit in fp32), written with fused multi-tensor operations: a fixed number of operations per step
whatever the LoRA's tensor count, and no synchronization.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .optimizer_closure import closure_loss

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """``lion_pytorch.Lion`` (its defaults: weight decay scaled by the rate, as AdamW's; no Triton kernel): for each
    tensor ``p`` with gradient ``g`` and moment ``m``, ``p ← p·(1 − lr·wd) − lr·sign(β1·m + (1 − β1)·g)``, then
    ``m ← β2·m + (1 − β2)·g``.

    Per-tensor state: ``exp_avg`` (the moment, the tensor's shape and dtype), nothing else.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"Lion: lr must be above 0, got {lr!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas!r}")
        if not weight_decay >= 0:
            raise ValueError(f"Lion: weight_decay must be 0 or more, got {weight_decay!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                moments.append(state["exp_avg"])
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            beta1, beta2 = group["betas"]
            if wd > 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            update = torch._foreach_mul(moments, beta1)
            torch._foreach_add_(update, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_mul_(moments, beta2)
            torch._foreach_add_(moments, grads, alpha=1.0 - beta2)
        return loss
