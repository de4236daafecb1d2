"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"), as
``transformers.optimization.Adafactor`` computes it: the optimizer kohya's sd-scripts and FluxGym train Flux LoRAs
with (``optimizer_type adafactor`` with ``relative_step=False scale_parameter=False warmup_init=False``).

A matrix's second moment is kept as its row and column means (the ``exp_avg_sq_row`` and ``exp_avg_sq_col`` slots),
a vector's whole; each update is the gradient over the moment's square root, clipped to an RMS of
``clip_threshold``, times the step size. The same arithmetic as transformers' (checked against it step by step in
the tests), written with fused multi-tensor operations where the work is elementwise: per matrix only its three
means and the outer product of its row and column factors are operations of their own (transformers' loop makes
about 20 per tensor, and with ``scale_parameter`` reads each tensor's RMS back to the host). Nothing here reads a
value back: a step never waits for the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .fp32_state import Fp32State, fp32_copies
from .optimizer_closure import closure_loss

__all__ = ["Adafactor", "GROUP_STATE", "factored_shapes"]

GROUP_STATE = ("step",)
"""What Adafactor keeps in its parameter group: the step count its decay and relative step size follow (restored
with the per-tensor state when a run continues)."""


def factored_shapes(shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The shapes of the second-moment slots of a tensor of ``shape``: its row and column means for a tensor of two
    dimensions or more (the last two factored, as transformers'), the tensor's own otherwise."""
    shape = tuple(shape)
    if len(shape) >= 2:
        return {"exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:]}
    return {"exp_avg_sq": shape}


class Adafactor(Fp32State):
    """``transformers.optimization.Adafactor``'s step, with its arguments and defaults.

    Per step ``t`` and tensor ``p`` with gradient ``g`` (fp32): ``ρ = lr``, or with ``relative_step``
    ``min(1e-6·t if warmup_init else 1e-2, 1/√t)``; ``α = ρ·max(eps[1], RMS(p))`` with ``scale_parameter``, else
    ``ρ``; ``β₂ = 1 − t^decay_rate``; the moment of ``g² + eps[0]`` (factored for a matrix: row and column means)
    updated by ``β₂``; ``u = g / √moment`` (a matrix's from its row factor over the row mean's mean and its column
    factor), ``u ← α·u / max(1, RMS(u)/clip_threshold)``; with ``beta1`` the moving average ``m ← β1·m + (1 − β1)·u``
    is the update; ``p ← p − α·weight_decay·p − u``.

    State: per tensor ``exp_avg_sq_row`` and ``exp_avg_sq_col`` (a matrix) or ``exp_avg_sq``, ``exp_avg`` with
    ``beta1``, fp32 (also after ``load_state_dict``: :class:`~.fp32_state.Fp32State`); the step count in the
    parameter group (:data:`GROUP_STATE`).
    """

    def __init__(self, params: Iterable[Any], lr: float | None = None, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = True,
                 warmup_init: bool = False) -> None:
        if lr is not None and relative_step:
            raise ValueError("Adafactor: a learning rate and relative_step=True cannot be combined (relative_step "
                             "finds its own step size)")
        if warmup_init and not relative_step:
            raise ValueError("Adafactor: warmup_init=True needs relative_step=True")
        if lr is None and not relative_step:
            raise ValueError("Adafactor: relative_step=False needs a learning rate")
        checks = (("eps[0]", eps[0], eps[0] >= 0), ("eps[1]", eps[1], eps[1] >= 0),
                  ("clip_threshold", clip_threshold, clip_threshold > 0), ("decay_rate", decay_rate, decay_rate < 0),
                  ("beta1", beta1, beta1 is None or 0 <= beta1 < 1),
                  ("weight_decay", weight_decay, weight_decay >= 0), ("lr", lr, lr is None or lr > 0))
        for name, value, ok in checks:
            if not ok or value != value:
                raise ValueError(f"Adafactor: invalid {name} {value!r}")
        super().__init__(params, {"lr": lr, "eps": tuple(eps), "clip_threshold": clip_threshold,
                                  "decay_rate": decay_rate, "beta1": beta1, "weight_decay": weight_decay,
                                  "scale_parameter": scale_parameter, "relative_step": relative_step,
                                  "warmup_init": warmup_init, "step": 0})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["step"] += 1
            for matrices in (True, False):
                chosen = [p for p in params if (p.grad.ndim >= 2) == matrices]
                if chosen:
                    self._step_group(group, chosen, matrices)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], factored: bool) -> None:
        """One step of ``params`` (all matrices, or all not), in fp32 (a bf16 tensor through an fp32 copy)."""
        t = group["step"]
        eps1, eps2 = group["eps"]
        grads = fp32_copies([p.grad for p in params if p.grad is not None])
        values = fp32_copies(params)
        beta2t = 1.0 - math.pow(t, group["decay_rate"])
        squared = list(torch._foreach_mul(grads, grads))
        torch._foreach_add_(squared, eps1)
        if factored:
            updates = self._factored(params, grads, squared, beta2t)
        else:
            moments = [self._slot(p, "exp_avg_sq") for p in params]
            torch._foreach_mul_(moments, beta2t)
            torch._foreach_add_(moments, squared, alpha=1.0 - beta2t)
            updates = list(torch._foreach_rsqrt(moments))
            torch._foreach_mul_(updates, grads)
        torch._foreach_div_(updates, _clip_scales(updates, group["clip_threshold"]))
        step_sizes = self._step_sizes(group, values, eps2, t)
        torch._foreach_mul_(updates, step_sizes)
        if group["beta1"] is not None:
            beta1 = group["beta1"]
            averages = [self._slot(p, "exp_avg", like=p) for p in params]
            torch._foreach_mul_(averages, beta1)
            torch._foreach_add_(averages, updates, alpha=1.0 - beta1)
            updates = averages
        if group["weight_decay"] != 0:
            decays = torch._foreach_mul(values, step_sizes)
            torch._foreach_add_(values, decays, alpha=-group["weight_decay"])
        torch._foreach_sub_(values, updates)
        copied = [i for i, (p, value) in enumerate(zip(params, values)) if value is not p]
        if copied:
            torch._foreach_copy_([params[i] for i in copied], [values[i] for i in copied])

    def _factored(self, params: list[torch.Tensor], grads: list[torch.Tensor], squared: list[torch.Tensor],
                  beta2t: float) -> list[torch.Tensor]:
        """The matrices' ``g / √moment`` from their row and column means (transformers' ``_approx_sq_grad``)."""
        rows = [self._slot(p, "exp_avg_sq_row") for p in params]
        cols = [self._slot(p, "exp_avg_sq_col") for p in params]
        torch._foreach_mul_(rows, beta2t)
        torch._foreach_add_(rows, [s.mean(dim=-1) for s in squared], alpha=1.0 - beta2t)
        torch._foreach_mul_(cols, beta2t)
        torch._foreach_add_(cols, [s.mean(dim=-2) for s in squared], alpha=1.0 - beta2t)
        row_factors = torch._foreach_div(rows, [r.mean(dim=-1, keepdim=True) for r in rows])
        torch._foreach_rsqrt_(row_factors)
        col_factors = torch._foreach_rsqrt(cols)
        updates = [torch.mul(r.unsqueeze(-1), c.unsqueeze(-2)) for r, c in zip(row_factors, col_factors)]
        torch._foreach_mul_(updates, grads)
        return updates

    def _step_sizes(self, group: dict[str, Any], values: list[torch.Tensor], eps2: float,
                    t: int) -> float | list[torch.Tensor]:
        """Each tensor's step size ``α`` (transformers' ``_get_lr``): one number, or with ``scale_parameter`` one
        0-dim tensor per tensor (its RMS, at least ``eps[1]``, times ``ρ``), never read back."""
        if group["relative_step"]:
            ceiling = 1e-6 * t if group["warmup_init"] else 1e-2
            rho = min(ceiling, 1.0 / math.sqrt(t))
        else:
            rho = float(group["lr"])
        if not group["scale_parameter"]:
            return rho
        scales = _rms(values)
        torch._foreach_clamp_min_(scales, eps2)
        torch._foreach_mul_(scales, rho)
        return scales

    def _slot(self, p: torch.Tensor, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``p``'s state ``name`` (fp32 zeros of its slot's shape the first time)."""
        state = self.state[p]
        if name not in state:
            shape = tuple(p.shape) if like is not None else factored_shapes(p.shape)[name]
            state[name] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return state[name]



def _rms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's root mean square, as transformers' ``_rms``: its L2 norm over √(element count)."""
    norms = list(torch._foreach_norm(tensors))
    torch._foreach_div_(norms, [math.sqrt(t.numel()) for t in tensors])
    return norms


def _clip_scales(updates: list[torch.Tensor], threshold: float) -> list[torch.Tensor]:
    """Each update's divisor ``max(1, RMS(u)/clip_threshold)``."""
    scales = _rms(updates)
    torch._foreach_div_(scales, threshold)
    torch._foreach_clamp_min_(scales, 1.0)
    return scales
