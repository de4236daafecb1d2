"""Prodigy: Adam whose step size finds itself (Mishchenko & Defazio, 2023, "Prodigy: An Expeditiously Adaptive
Parameter-Free Learner"), the optimizer LoRA trainers reach for when they do not want to tune a learning rate.

kohya's sd-scripts, OneTrainer and ai-toolkit offer it through the ``prodigyopt`` package; ComfyUI's trainer does not
offer it, and a package a ComfyUI user must install by hand is one most never get. This is the same algorithm with
the package's defaults (its arithmetic is checked against it in the tests), written for a LoRA's many small tensors:
the package's loop runs about ten operations and two device synchronizations (``.item()``) per tensor and step,
tens of thousands of operations for an SDXL LoRA; here every operation of a step is a fused multi-tensor one (a
fixed count, whatever the LoRA's size), and a step synchronizes once, for the two sums that set the step size
(accumulated in fp64, as the package adds its per-tensor sums in Python floats).

The step size ``d`` is estimated from how far the weights have moved from where they started against the gradients
(its running numerator and denominator), never shrinks, and multiplies ``lr``: leave ``lr`` at 1.0 (a schedule or
warm-up on it works as on Adam's). Its running values live in the parameter groups (``d``, ``d_max``,
``d_numerator``, ``k``), so a continued run must restore them with the per-tensor state (:data:`GROUP_STATE`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .optimizer_closure import closure_loss

__all__ = ["Prodigy", "GROUP_STATE"]

GROUP_STATE = ("d", "d_max", "d_numerator", "k")
"""The parameter-group values that carry Prodigy's state from step to step (restored on continuing a run)."""


def _total_dot(a: list[torch.Tensor], b: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``sum_i a_i · b_i`` over every tensor pair, in fp64, by fused operations only: the products' positive parts'
    L1 norm minus their negative parts' (torch has no fused per-tensor sum). Its rounding error is bounded by the
    sum of the products' magnitudes, as a plain sum's is. ``b`` is used as scratch."""
    torch._foreach_mul_(b, a)
    positive = torch._foreach_clamp_min(b, 0.0)
    torch._foreach_clamp_max_(b, 0.0)
    wide = _sum_dtype(a)
    return (torch.stack(torch._foreach_norm(positive, 1, dtype=wide)).sum()
            - torch.stack(torch._foreach_norm(b, 1, dtype=wide)).sum())


def _sum_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """fp64 for the step size's sums, where the device has it (Apple's MPS has no fp64: fp32 there)."""
    return torch.float32 if any(t.device.type == "mps" for t in tensors) else torch.float64


def _betas(group: dict[str, Any]) -> tuple[float, float, float]:
    """A group's Adam betas and the estimate's ``beta3`` (``None``: ``sqrt(beta2)``, the package's default)."""
    beta1, beta2 = group["betas"]
    return beta1, beta2, group["beta3"] if group["beta3"] is not None else math.sqrt(beta2)


class Prodigy(torch.optim.Optimizer):
    """Adam with Prodigy's step size (``prodigyopt.Prodigy`` with ``decouple=True``, ``slice_p=1``, no FSDP).

    Per-tensor state: ``exp_avg``, ``exp_avg_sq``, ``s`` (the gradients' running sum the denominator reads) and
    ``p0`` (the tensor's starting value), each the tensor's shape, and ``step``.

    Args:
        params: tensors to optimize, or parameter groups (every group with a rate > 0 must have the same rate).
        lr: multiplies the estimated step size; 1.0 as its authors advise.
        betas: Adam's averaging coefficients.
        beta3: the estimate's averaging coefficient; ``None`` is ``sqrt(betas[1])``.
        eps: added to the denominator's root (times ``d``).
        weight_decay: decoupled (AdamW-style) weight decay, times the step size.
        use_bias_correction: Adam's bias correction on the step size.
        safeguard_warmup: leave ``lr`` out of the estimate's denominator, as advised with a learning-rate warm-up.
        d0: the first estimate. d_coef: scales every estimate. growth_rate: the most ``d`` may grow in a step.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                 beta3: float | None = None, eps: float = 1e-8, weight_decay: float = 0.0,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False, d0: float = 1e-6,
                 d_coef: float = 1.0, growth_rate: float = math.inf) -> None:
        checks = (("lr", lr, lr >= 0), ("d0", d0, d0 > 0), ("eps", eps, eps > 0), ("d_coef", d_coef, d_coef > 0),
                  ("betas[0]", betas[0], 0 < betas[0] < 1), ("betas[1]", betas[1], 0 <= betas[1] < 1),
                  ("weight_decay", weight_decay, weight_decay >= 0), ("growth_rate", growth_rate, growth_rate >= 1))
        for name, value, ok in checks:
            if not ok or value != value:
                raise ValueError(f"Prodigy: invalid {name} {value!r}")
        defaults = {"lr": lr, "betas": betas, "beta3": beta3, "eps": eps, "weight_decay": weight_decay,
                    "d": d0, "d0": d0, "d_max": d0, "d_numerator": 0.0, "d_coef": d_coef, "k": 0,
                    "growth_rate": growth_rate, "use_bias_correction": use_bias_correction,
                    "safeguard_warmup": safeguard_warmup}
        super().__init__(params, defaults)

    def _live(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Each tensor with a gradient, with its group; its state made on first sight."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["s"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["p0"] = p.detach().clone()
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                out.append((group, p))
        return out

    def _moments(self, live: list[tuple[dict[str, Any], torch.Tensor]], d: float, dlr: float
                 ) -> tuple[float, float]:
        """Update the moving averages and ``s`` of the tensors of groups with a rate > 0; return the sums the
        estimate needs, ``sum(grad · (p0 - p))`` and ``sum(|s|)``, read in one synchronization."""
        first = self.param_groups[0]
        beta1, beta2, beta3 = _betas(first)
        d0 = first["d0"]
        on = [p for group, p in live if group["lr"] > 0]
        if not on:
            return 0.0, 0.0
        grads = [p.grad for p in on if p.grad is not None]  # every one: _live took those with a gradient
        states = [self.state[p] for p in on]
        dot = _total_dot(grads, torch._foreach_sub([s["p0"] for s in states], on))
        avg, avg_sq, s = ([st[k] for st in states] for k in ("exp_avg", "exp_avg_sq", "s"))
        torch._foreach_mul_(avg, beta1)
        torch._foreach_add_(avg, grads, alpha=d * (1 - beta1))
        torch._foreach_mul_(avg_sq, beta2)
        torch._foreach_addcmul_(avg_sq, grads, grads, value=d * d * (1 - beta2))
        torch._foreach_mul_(s, beta3)
        torch._foreach_add_(s, grads, alpha=(d / d0) * (d if first["safeguard_warmup"] else dlr))
        total = torch.stack(torch._foreach_norm(s, 1, dtype=_sum_dtype(s))).sum()
        numerator, denominator = torch.stack([dot, total]).tolist()
        return numerator, denominator

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step: the moving averages, a new estimate of the step size ``d``, then Adam's update with it."""
        loss = closure_loss(closure)
        first = self.param_groups[0]
        beta1, beta2, beta3 = _betas(first)
        k, d, d_max, d0 = first["k"], first["d"], first["d_max"], first["d0"]
        lr = max(group["lr"] for group in self.param_groups)
        if any(group["lr"] not in (lr, 0.0) for group in self.param_groups):
            raise RuntimeError("Prodigy: parameter groups may differ in rate only by a rate of 0")
        correction = math.sqrt(1 - beta2 ** (k + 1)) / (1 - beta1 ** (k + 1)) if first["use_bias_correction"] else 1
        dlr = d * lr * correction
        live = self._live()
        dot, denominator = self._moments(live, d, dlr)
        if denominator == 0:  # no gradient, all zero, or every rate 0: nothing to estimate from, no step
            return loss
        numerator = first["d_numerator"] * beta3 + (d / d0) * dlr * dot
        if lr > 0:
            d_hat = first["d_coef"] * numerator / denominator
            if d == d0:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * first["growth_rate"])
        for group in self.param_groups:
            group.update(d=d, d_max=d_max, d_numerator=numerator, k=k + 1)
        self._update(live, d, dlr)
        return loss

    def _update(self, live: list[tuple[dict[str, Any], torch.Tensor]], d: float, dlr: float) -> None:
        """Adam's update with the new ``d`` in the denominator and the step's ``dlr``, decay first."""
        for group in self.param_groups:
            params = [p for g, p in live if g is group]
            if not params:
                continue
            states = [self.state[p] for p in params]
            for state in states:
                state["step"] += 1
            denoms = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_add_(denoms, d * group["eps"])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["weight_decay"] * dlr)
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms, value=-dlr)
