"""Lion with an 8-bit block-wise moment, as ``bitsandbytes.optim.Lion8bit`` computes it: kohya's ``Lion8bit`` and
ai-toolkit's ``lion8bit``, Lion (:mod:`.lion`) with its one moment kept in a byte per weight. Written here in
PyTorch, so no CUDA package is needed; the code, the quantization and the fused layout are :mod:`.blockwise8bit`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .blockwise8bit import MIN_8BIT_SIZE, Blockwise8bit, Codes, check_8bit_settings, quantized_slots
from .fp32_state import as_fp32

__all__ = ["Lion8bit", "QUANTIZED_SLOTS"]

MOMENTS = {"exp_avg": True}
"""Lion's one moment, whose code is signed."""
QUANTIZED_SLOTS = quantized_slots(MOMENTS)
"""The state of an 8-bit tensor: its moment's code indices (uint8, the tensor's shape) and block scales (fp32)."""


class Lion8bit(Blockwise8bit):
    """``bitsandbytes.optim.Lion8bit``'s step, with its arguments and defaults (lr 1e-4, betas (0.9, 0.99), no weight
    decay).

    Per tensor ``p`` with gradient ``g`` (fp32): ``p ← p·(1 − lr·weight_decay)``,
    ``p ← p − lr·sign(β1·m + (1 − β1)·g)``, then ``m ← β2·m + (1 − β2)·g``, quantized back for an 8-bit tensor.
    (:class:`~.lion.Lion`'s arithmetic; bitsandbytes computes the 8-bit tensors' ``β1·m + (1 − β1)·g`` as two
    products added and the small ones' as ``β1·m`` plus ``g`` scaled in the add, and so does this.)

    State per tensor: ``step`` (an int, as bitsandbytes keeps; Lion's step does not use it) and
    :data:`QUANTIZED_SLOTS` or an fp32 ``exp_avg``; the block scales and small moments stay fp32 across
    ``load_state_dict``.
    """

    MOMENTS = MOMENTS

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        check_8bit_settings("Lion8bit", lr, betas, 0.0, weight_decay, min_8bit_size)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
                                  "min_8bit_size": int(min_8bit_size)})

    def _step_small(self, group: dict[str, Any], params: list[torch.Tensor], t: int) -> None:
        """bitsandbytes' fp32-state Lion step of tensors below ``min_8bit_size``, on their values laid out one after
        another."""
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        targets = self._small_views(params)
        grad = as_fp32(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
        value = as_fp32(torch.cat(targets["value"]))
        m = torch.cat(targets["exp_avg"])
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.add_(m.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_(), alpha=-lr)
        m.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        sizes = [p.numel() for p in params]
        for flat, role in ((m, "exp_avg"), (value, "value")):
            torch._foreach_copy_(targets[role], list(flat.split(sizes)))

    def _step_quantized(self, group: dict[str, Any], params: list[torch.Tensor], t: int, codes: Codes) -> None:
        """bitsandbytes' 8-bit Lion step of ``params`` laid out block after block (each tensor padded to whole
        blocks with zeros, which change no block's scale and are dropped after)."""
        beta1, beta2 = group["betas"]
        lr, decay = group["lr"], group["weight_decay"]
        layout, values = self._chunk(params)
        (m,) = self._dequantized(layout, params, codes)
        grad = layout.gather([p.grad.reshape(-1) for p in params if p.grad is not None])
        value = layout.gather(values)
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.add_((m * beta1).add_(grad * (1.0 - beta1)).sign_(), alpha=-lr)
        m.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        del grad
        layout.scatter(value, values)
        del value
        self._quantize(layout, params, codes, (m,))
