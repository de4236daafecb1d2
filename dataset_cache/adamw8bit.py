"""AdamW with 8-bit block-wise moments (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"), as
``bitsandbytes.optim.AdamW8bit`` computes it: the default optimizer of kohya's sd-scripts GUI and of ai-toolkit, so
their recipes say ``AdamW8bit``. Written here in PyTorch, so no CUDA package is needed.

A tensor of at least ``min_8bit_size`` (4,096) elements keeps each moment as one byte per element, an index into a
256-value "dynamic" code (signed for the first moment, unsigned for the second), and one fp32 scale per block of 256
elements (the block's largest magnitude); a smaller tensor keeps fp32 moments. Each step dequantizes, takes
bitsandbytes' AdamW step of its CPU backend, and quantizes to the nearest code value, as bitsandbytes' PyTorch
quantizer does (its compiled kernels find a code by a binary search that lands on another one for about 0.15% of
values). The 8-bit tensors are updated together, in chunks laid out block after block, so a step is some forty
operations per chunk, whatever the number of tensors, and one view per tensor (its gradient's; the flat views of
weights and moments are kept between steps).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .fp32_state import Fp32State, as_fp32
from .optimizer_closure import closure_loss

__all__ = ["AdamW8bit", "BLOCK", "MIN_8BIT_SIZE", "QUANTIZED_SLOTS", "dynamic_code", "moment_shapes"]

BLOCK = 256
"""Elements per block: each block of a moment has one fp32 scale (bitsandbytes' block size for its optimizers)."""
MIN_8BIT_SIZE = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' ``min_8bit_size``)."""
CHUNK = 1 << 22
"""Elements updated at once (padded to whole blocks): bounds the step's fp32 scratch to about 100 MB."""
KEPT_LAYOUTS = 8
"""Layouts (with their views of weights and moments) kept between steps."""
QUANTIZED_SLOTS = ("exp_avg_q", "exp_avg_absmax", "exp_avg_sq_q", "exp_avg_sq_absmax")
"""The state of an 8-bit tensor: each moment's code indices (uint8, the tensor's shape) and block scales (fp32)."""


def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256 values a moment's byte stands for (fp32, ascending): for each decade ``10^(k-6)``, ``k`` = 0..6,
    ``2^k`` (signed) or ``2^(k+1)`` (unsigned) values, the midpoints of that many equal steps from 0.1 to 1 scaled
    by the decade, mirrored negative when signed; and 0 and 1. Dettmers' dynamic tree code, as bitsandbytes builds
    it."""
    values = []
    for k in range(7):
        count = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
        scaled = 10.0 ** (k - 6) * ((edges[:-1] + edges[1:]) / 2.0)
        values += [scaled, -scaled] if signed else [scaled]
    values.append(torch.tensor([0.0, 1.0]))
    return torch.cat(values).sort().values


def moment_shapes(shape: Sequence[int], min_8bit_size: int = MIN_8BIT_SIZE) -> dict[str, tuple[int, ...]]:
    """The moments' slots and shapes of a tensor of ``shape``: code indices and block scales when it has at least
    ``min_8bit_size`` elements, fp32 moments otherwise."""
    shape = tuple(shape)
    if math.prod(shape) < min_8bit_size:
        return {"exp_avg": shape, "exp_avg_sq": shape}
    blocks = -(-math.prod(shape) // BLOCK)
    return {"exp_avg_q": shape, "exp_avg_absmax": (blocks,), "exp_avg_sq_q": shape, "exp_avg_sq_absmax": (blocks,)}


class _Codes:
    """A device's two codes, their midpoints (what a value is rounded by) and the index of 0 in each."""

    def __init__(self, device: torch.device) -> None:
        signed, unsigned = dynamic_code(True), dynamic_code(False)
        self.signed_zero, self.unsigned_zero = (int(torch.nonzero(code == 0)[0]) for code in (signed, unsigned))
        self.signed, self.unsigned = signed.to(device), unsigned.to(device)
        self.signed_bounds = (self.signed[:-1] + self.signed[1:]) / 2
        self.unsigned_bounds = (self.unsigned[:-1] + self.unsigned[1:]) / 2


class AdamW8bit(Fp32State):
    """``bitsandbytes.optim.AdamW8bit``'s step, with its arguments and defaults (weight decay 0.01).

    Per tensor ``p`` with gradient ``g`` at its step ``t`` (fp32): ``m ← β1·m + (1 − β1)·g``,
    ``v ← β2·v + (1 − β2)·g²``, ``p ← p·(1 − lr·weight_decay)``, then for an 8-bit tensor
    ``p ← p − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps)`` and ``m``, ``v`` quantized back; for a small one
    ``p ← p − lr·√(1 − β2^t)/(1 − β1^t) · m / (√v + eps·√(1 − β2^t))`` (bitsandbytes' two CPU formulas).

    State per tensor: ``step`` (an int) and :data:`QUANTIZED_SLOTS` or fp32 ``exp_avg`` and ``exp_avg_sq``
    (:func:`moment_shapes`); the block scales and small moments stay fp32 across ``load_state_dict``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        checks = (("lr", lr, lr >= 0), ("betas[0]", betas[0], 0 <= betas[0] < 1),
                  ("betas[1]", betas[1], 0 <= betas[1] < 1), ("eps", eps, eps >= 0),
                  ("weight_decay", weight_decay, weight_decay >= 0),
                  ("min_8bit_size", min_8bit_size, min_8bit_size >= 1 and float(min_8bit_size).is_integer()))
        for name, value, ok in checks:
            if not ok or value != value:
                raise ValueError(f"AdamW8bit: invalid {name} {value!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "min_8bit_size": int(min_8bit_size)})
        self._codes: dict[torch.device, _Codes] = {}
        self._layouts: OrderedDict[tuple[Any, ...], _Layout] = OrderedDict()
        """The layouts of the last :data:`KEPT_LAYOUTS` sets of tensors stepped together (a run whose layers skip
        batches, ``module_dropout``, steps other sets)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            by_kind: dict[tuple[bool, int, torch.device], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.is_contiguous():  # its flat view is written through, as bitsandbytes makes it contiguous
                    p.data = p.data.contiguous()
                state = self._state(p, group["min_8bit_size"])
                state["step"] = int(state["step"]) + 1
                by_kind.setdefault(("exp_avg_q" in state, state["step"], p.device), []).append(p)
            for (quantized, t, device), params in by_kind.items():
                if quantized:
                    for chunk in _chunks(params):
                        self._step_quantized(group, chunk, t, self._codes_on(device))
                else:
                    self._step_small(group, params, t)
        return loss

    def _state(self, p: torch.Tensor, min_8bit_size: int) -> dict[str, Any]:
        """``p``'s state, made the first time: zero moments (code indices of 0) of :func:`moment_shapes`."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            for slot, shape in moment_shapes(p.shape, min_8bit_size).items():
                if slot.endswith("_q"):
                    codes = self._codes_on(p.device)
                    zero = codes.signed_zero if slot == "exp_avg_q" else codes.unsigned_zero
                    state[slot] = torch.full(shape, zero, dtype=torch.uint8, device=p.device)
                else:
                    state[slot] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return state

    def _codes_on(self, device: torch.device) -> _Codes:
        if device not in self._codes:
            self._codes[device] = _Codes(device)
        return self._codes[device]

    def _step_small(self, group: dict[str, Any], params: list[torch.Tensor], t: int) -> None:
        """bitsandbytes' fp32-state AdamW step of tensors below ``min_8bit_size``, on their values laid out one after
        another (a bf16 LoRA's scalars and vectors would otherwise take two casts each)."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        views = self._layout(("small", *(id(p) for p in params)), params, blocks=False).views
        states = [self.state[p] for p in params]
        targets = {"value": views.of("value", params), "exp_avg": views.of("exp_avg", [s["exp_avg"] for s in states]),
                   "exp_avg_sq": views.of("exp_avg_sq", [s["exp_avg_sq"] for s in states])}
        grad = as_fp32(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
        value = as_fp32(torch.cat(targets["value"]))
        m, v = torch.cat(targets["exp_avg"]), torch.cat(targets["exp_avg_sq"])
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        c1, c2 = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.add_(m / (v.sqrt() + eps * c2), alpha=-lr * c2 / c1)
        sizes = [p.numel() for p in params]
        for flat, role in ((m, "exp_avg"), (v, "exp_avg_sq"), (value, "value")):
            torch._foreach_copy_(targets[role], list(flat.split(sizes)))

    def _layout(self, key: tuple[Any, ...], params: list[torch.Tensor], blocks: bool = True) -> _Layout:
        """The layout of ``params`` stepped together, kept for the next steps (the least recently used dropped)."""
        if key in self._layouts:
            self._layouts.move_to_end(key)
        else:
            self._layouts[key] = _Layout(params, blocks)
            while len(self._layouts) > KEPT_LAYOUTS:
                self._layouts.popitem(last=False)
        return self._layouts[key]

    def _step_quantized(self, group: dict[str, Any], params: list[torch.Tensor], t: int, codes: _Codes) -> None:
        """bitsandbytes' 8-bit AdamW step of ``params`` laid out block after block (each tensor padded to whole
        blocks with zeros, which change no block's scale and are dropped after)."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        layout = self._layout(tuple(id(p) for p in params), params)
        states = [self.state[p] for p in params]
        flat = {role: layout.views.of(role, [s[role] for s in states]) for role in ("exp_avg_q", "exp_avg_sq_q")}
        flat["value"] = layout.views.of("value", params)
        m = layout.dequantize(flat["exp_avg_q"], [s["exp_avg_absmax"] for s in states], codes.signed,
                              codes.signed_zero)
        v = layout.dequantize(flat["exp_avg_sq_q"], [s["exp_avg_sq_absmax"] for s in states], codes.unsigned,
                              codes.unsigned_zero)
        grad = layout.gather([p.grad.reshape(-1) for p in params if p.grad is not None])
        value = layout.gather(flat["value"])
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        del grad
        c1, c2 = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        denom = (v.sqrt() / c2).add_(eps)
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.addcdiv_(m, denom, value=-lr / c1)
        del denom
        layout.scatter(value, flat["value"])
        del value  # the quantization's scratch below is the step's peak
        for moment, q, scale, code in ((m, "exp_avg_q", "exp_avg_absmax", codes.signed_bounds),
                                       (v, "exp_avg_sq_q", "exp_avg_sq_absmax", codes.unsigned_bounds)):
            indices, scales = layout.quantize(moment, code)
            layout.scatter(indices, flat[q])
            torch._foreach_copy_([s[scale] for s in states], list(scales.split(layout.blocks)))


class _Views:
    """1-D views of persistent tensors (a chunk's weights, their moments), made again only when one's storage
    changed (a state loaded, a weight's data replaced; a cached view keeps its old storage alive, so a new one never
    has its address): a view per tensor and step would be most of the ops a step dispatches."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[list[int], list[torch.Tensor]]] = {}

    def of(self, role: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` as 1-D views (each must be contiguous: the views are written through)."""
        addresses = [t.data_ptr() for t in tensors]
        cached = self._cache.get(role)
        if cached is None or cached[0] != addresses:
            cached = (addresses, [t.view(-1) for t in tensors])
            self._cache[role] = cached
        return cached[1]


class _Layout:
    """Tensors laid out one after another, each padded to whole blocks: a chunk's moments, gradients and values as
    ``(blocks, BLOCK)`` fp32 buffers; for the small tensors (``blocks=False``) only their kept views."""

    def __init__(self, params: Sequence[torch.Tensor], blocks: bool = True) -> None:
        self.sizes = [p.numel() for p in params]
        self.views = _Views()
        if not blocks:  # the small tensors: their views alone
            return
        self.blocks = [-(-n // BLOCK) for n in self.sizes]
        self.pads = [b * BLOCK - n for n, b in zip(self.sizes, self.blocks)]
        self.device = params[0].device
        partial = torch.tensor([i == b - 1 and pad > 0 for b, pad in zip(self.blocks, self.pads) for i in range(b)],
                               pin_memory=self.device.type == "cuda")
        self.partial = partial.to(self.device, non_blocking=True).unsqueeze(1)  # pinned: the step does not wait
        """Per block: a tensor's last block that its elements do not fill."""
        self.pieces: list[int] = []
        """How a laid-out buffer splits: each tensor's elements, then its padding where it has some."""
        self.own: list[int] = []
        """Which of those pieces are the tensors'."""
        for n, pad in zip(self.sizes, self.pads):
            self.own.append(len(self.pieces))
            self.pieces += [n, pad] if pad else [n]

    def _cat(self, flats: Iterable[torch.Tensor], pad_value: float | int, dtype: torch.dtype) -> torch.Tensor:
        """``flats`` one after another, each followed by its padding of ``pad_value``."""
        pad = torch.full((BLOCK,), pad_value, dtype=dtype, device=self.device)
        parts: list[torch.Tensor] = []
        for flat, gap in zip(flats, self.pads):
            parts.append(flat)
            if gap:
                parts.append(pad[:gap])
        return torch.cat(parts)

    def gather(self, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """``flats`` (the chunk's values or gradients, 1-D) in fp32, padded with zeros: ``(blocks, BLOCK)``."""
        return as_fp32(self._cat(flats, 0.0, flats[0].dtype)).view(-1, BLOCK)

    def dequantize(self, indices: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], code: torch.Tensor,
                   zero: int) -> torch.Tensor:
        """A moment in fp32, ``(blocks, BLOCK)``: each index's code value (``indices``: 1-D) times its block's scale
        (padding: 0)."""
        flat = self._cat(indices, zero, torch.uint8)
        return code[flat.long()].view(-1, BLOCK) * torch.cat(list(scales)).unsqueeze(1)

    def quantize(self, moment: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A moment's code indices (uint8, flat and padded) and block scales: each value over its block's largest
        magnitude (a tensor's last, partial block divided by it, the others multiplied by its inverse, as
        bitsandbytes' PyTorch quantizer) rounded to the nearest code value."""
        largest = moment.abs().amax(dim=1, keepdim=True)
        floor = largest.clamp(min=1e-38)
        scaled = torch.where(self.partial, moment / floor, moment * (1.0 / floor)).clamp_(-1, 1)
        indices = torch.bucketize(scaled.view(-1), bounds, out_int32=True).to(torch.uint8)
        return indices, torch.where(self.partial, floor, largest).squeeze(1)

    def scatter(self, flat: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        """Copy ``flat`` (laid out as this layout) into ``into`` (1-D views), the padding dropped."""
        pieces = flat.reshape(-1).split(self.pieces)
        torch._foreach_copy_(list(into), [pieces[i] for i in self.own])


def _chunks(params: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """``params`` in runs of at most :data:`CHUNK` elements (a larger tensor alone)."""
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        n = -(-p.numel() // BLOCK) * BLOCK
        if chunk and size + n > CHUNK:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += n
    if chunk:
        yield chunk
