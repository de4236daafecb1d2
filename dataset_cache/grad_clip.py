"""Gradient clipping by the global norm, measured every step without waiting for the device.

kohya (``--max_grad_norm``), OneTrainer and ai-toolkit all clip a step's gradients to a global L2 norm of 1 by
default: one batch with an outlier image or a high-noise timestep then moves the LoRA at most as far as an ordinary
one, where without clipping it can undo what many steps learned. ComfyUI's own trainer does not clip, so clipping is
off unless asked for (``max_norm`` 0).

The norm is computed whether or not it clips, for the report: it is the number a user looks at to choose a
``max_norm`` and to see a run diverging before its loss does. Nothing here reads a value back to the host: the
scale is applied on the device as ``min(1, max_norm / (norm + 1e-6))`` (what ``torch.nn.utils.clip_grad_norm_``
does), and the caller reads the norm when it reads the step's loss.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .checks import check_number

__all__ = ["MAX_GRAD_NORM", "CLIP_EPSILON", "check_max_grad_norm", "clip_gradients", "gradient_norm"]

MAX_GRAD_NORM = 1e4
"""The largest accepted ``max_grad_norm``: past it nothing a LoRA's gradients reach would be clipped."""
CLIP_EPSILON = 1e-6
"""Added to the norm before dividing (``torch.nn.utils.clip_grad_norm_``'s): a zero gradient is scaled by 1."""


def check_max_grad_norm(value: object) -> None:
    """Refuse a ``max_grad_norm`` that is not a number from 0 (no clipping) to :data:`MAX_GRAD_NORM`.

    Raises:
        ValueError: naming ``max_grad_norm``, the value and the usual setting.
    """
    check_number("max_grad_norm", value, MAX_GRAD_NORM, zero="no clipping",
                 hint="1.0 is kohya's, OneTrainer's and ai-toolkit's default")


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` as a 0-d fp32 tensor on the first one's device (on the CPU when empty).

    Each device's gradients are reduced by one fused kernel in fp32, whatever their dtype: a bf16 LoRA's norm is
    then as exact as an fp32 one's (``clip_grad_norm_`` sums bf16 norms in bf16, which is off by up to 0.4%).
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    first = grads[0].device
    norms = [n.to(first) for device_grads in _by_device(grads).values()
             for n in torch._foreach_norm(device_grads, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global L2 norm is at most ``max_norm`` (0: leave them) and
    return the norm they had before, as :func:`gradient_norm` measures it.

    Gradients below the limit are multiplied by exactly 1 (no branch on the device's value, so no wait for it):
    they are unchanged bit for bit. Parameters without a gradient are skipped.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = gradient_norm(grads)
    if max_norm > 0 and grads:
        scale = (max_norm / (norm + CLIP_EPSILON)).clamp(max=1.0)
        for device, device_grads in _by_device(grads).items():
            torch._foreach_mul_(device_grads, scale.to(device))
    return norm


def _by_device(grads: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """``grads`` grouped by device, in order (a fused kernel takes one device's tensors)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device, []).append(g)
    return groups
