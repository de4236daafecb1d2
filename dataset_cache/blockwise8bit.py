"""What bitsandbytes' 8-bit block-wise optimizers share (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), in PyTorch: the dynamic codes, moments kept as code indices with a scale per block, and the fused
layout their steps run on. :mod:`.adamw8bit` and :mod:`.lion8bit` add their arithmetic.

A tensor of at least ``min_8bit_size`` (4,096) elements keeps each moment as one byte per element, an index into a
256-value "dynamic" code (signed for a moment that may be negative, unsigned for a square), and one fp32 scale per
block of 256 elements (the block's largest magnitude); a smaller tensor keeps fp32 moments. Each step dequantizes,
takes the optimizer's step of bitsandbytes' CPU backend, and quantizes to the nearest code value, as bitsandbytes'
PyTorch quantizer does (its compiled kernels find a code by a binary search that lands on another one for about
0.15% of values). The 8-bit tensors are updated together, in chunks laid out block after block, so a step is a few
dozen operations per chunk, whatever the number of tensors, and one view per tensor (its gradient's; the flat views
of weights and moments are kept between steps).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .fp32_state import Fp32State, as_fp32
from .optimizer_closure import closure_loss

__all__ = ["BLOCK", "CHUNK", "KEPT_LAYOUTS", "MIN_8BIT_SIZE", "Blockwise8bit", "Codes", "Layout",
           "check_8bit_settings", "dynamic_code", "moment_shapes", "quantized_slots"]

BLOCK = 256
"""Elements per block: each block of a moment has one fp32 scale (bitsandbytes' block size for its optimizers)."""
MIN_8BIT_SIZE = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' ``min_8bit_size``)."""
CHUNK = 1 << 22
"""Elements updated at once (padded to whole blocks): bounds the step's fp32 scratch to about 100 MB."""
KEPT_LAYOUTS = 8
"""Layouts (with their views of weights and moments) kept between steps."""


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


def quantized_slots(moments: Iterable[str]) -> tuple[str, ...]:
    """The state slots of an 8-bit tensor's ``moments``: each one's code indices (``<moment>_q``, uint8, the
    tensor's shape) and block scales (``<moment>_absmax``, fp32)."""
    return tuple(slot for moment in moments for slot in (f"{moment}_q", f"{moment}_absmax"))


def moment_shapes(shape: Sequence[int], moments: Iterable[str], min_8bit_size: int = MIN_8BIT_SIZE
                  ) -> dict[str, tuple[int, ...]]:
    """The slots and shapes of ``moments`` of a tensor of ``shape``: code indices and block scales when it has at
    least ``min_8bit_size`` elements, fp32 moments otherwise."""
    shape = tuple(shape)
    if math.prod(shape) < min_8bit_size:
        return {moment: shape for moment in moments}
    blocks = -(-math.prod(shape) // BLOCK)
    return {slot: shape if slot.endswith("_q") else (blocks,) for slot in quantized_slots(moments)}


def check_8bit_settings(name: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                        min_8bit_size: int) -> None:
    """Refuse the settings bitsandbytes refuses (and a ``min_8bit_size`` that is not a whole number above 0).

    Raises:
        ValueError: naming the optimizer, the setting and its value.
    """
    checks = (("lr", lr, lr >= 0), ("betas[0]", betas[0], 0 <= betas[0] < 1),
              ("betas[1]", betas[1], 0 <= betas[1] < 1), ("eps", eps, eps >= 0),
              ("weight_decay", weight_decay, weight_decay >= 0),
              ("min_8bit_size", min_8bit_size, min_8bit_size >= 1 and float(min_8bit_size).is_integer()))
    for setting, value, ok in checks:
        if not ok or value != value:
            raise ValueError(f"{name}: invalid {setting} {value!r}")


class Codes:
    """A device's two codes (by ``signed``), their midpoints (what a value is rounded by) and the index of 0 in
    each."""

    def __init__(self, device: torch.device) -> None:
        self.values: dict[bool, torch.Tensor] = {}
        self.bounds: dict[bool, torch.Tensor] = {}
        self.zero: dict[bool, int] = {}
        for signed in (True, False):
            code = dynamic_code(signed)
            self.zero[signed] = int(torch.nonzero(code == 0)[0])
            self.values[signed] = code.to(device)
            self.bounds[signed] = (self.values[signed][:-1] + self.values[signed][1:]) / 2


class Blockwise8bit(Fp32State):
    """An optimizer whose moments :data:`MOMENTS` (name → whether its code is signed) are 8-bit for tensors of at
    least ``min_8bit_size`` elements (a group setting), fp32 for the others; a step count per tensor. A subclass
    steps the 8-bit tensors of one chunk (:meth:`_step_quantized`, through :meth:`_dequantized` and
    :meth:`_quantize`) and the small ones together (:meth:`_step_small`, through :meth:`_small_views`)."""

    MOMENTS: Mapping[str, bool] = {}

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._quantized_slot = f"{next(iter(self.MOMENTS))}_q"
        """A slot only an 8-bit tensor's state has."""
        self._codes: dict[torch.device, Codes] = {}
        self._layouts: OrderedDict[tuple[Any, ...], Layout] = OrderedDict()
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
                by_kind.setdefault((self._quantized_slot in state, state["step"], p.device), []).append(p)
            for (quantized, t, device), params in by_kind.items():
                if quantized:
                    for chunk in _chunks(params):
                        self._step_quantized(group, chunk, t, self._codes_on(device))
                else:
                    self._step_small(group, params, t)
        return loss

    def _step_quantized(self, group: dict[str, Any], params: list[torch.Tensor], t: int, codes: Codes) -> None:
        raise NotImplementedError

    def _step_small(self, group: dict[str, Any], params: list[torch.Tensor], t: int) -> None:
        raise NotImplementedError

    def _state(self, p: torch.Tensor, min_8bit_size: int) -> dict[str, Any]:
        """``p``'s state, made the first time: zero moments (code indices of 0) of :func:`moment_shapes`."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            for slot, shape in moment_shapes(p.shape, self.MOMENTS, min_8bit_size).items():
                if slot.endswith("_q"):
                    zero = self._codes_on(p.device).zero[self.MOMENTS[slot.removesuffix("_q")]]
                    state[slot] = torch.full(shape, zero, dtype=torch.uint8, device=p.device)
                else:
                    state[slot] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return state

    def _codes_on(self, device: torch.device) -> Codes:
        if device not in self._codes:
            self._codes[device] = Codes(device)
        return self._codes[device]

    def _layout(self, key: tuple[Any, ...], params: list[torch.Tensor], blocks: bool = True) -> Layout:
        """The layout of ``params`` stepped together, kept for the next steps (the least recently used dropped)."""
        if key in self._layouts:
            self._layouts.move_to_end(key)
        else:
            self._layouts[key] = Layout(params, blocks)
            while len(self._layouts) > KEPT_LAYOUTS:
                self._layouts.popitem(last=False)
        return self._layouts[key]

    def _small_views(self, params: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """The kept flat views of small ``params`` (``"value"``) and of each of their fp32 moments, by name."""
        views = self._layout(("small", *(id(p) for p in params)), params, blocks=False).views
        states = [self.state[p] for p in params]
        return {"value": views.of("value", params),
                **{moment: views.of(moment, [s[moment] for s in states]) for moment in self.MOMENTS}}

    def _chunk(self, params: list[torch.Tensor]) -> tuple[Layout, list[torch.Tensor]]:
        """A chunk's layout and its weights' kept flat views."""
        layout = self._layout(tuple(id(p) for p in params), params)
        return layout, layout.views.of("value", params)

    def _dequantized(self, layout: Layout, params: list[torch.Tensor], codes: Codes) -> list[torch.Tensor]:
        """The chunk's moments in fp32, ``(blocks, BLOCK)``, in :data:`MOMENTS`' order."""
        states = [self.state[p] for p in params]
        return [layout.dequantize(layout.views.of(f"{m}_q", [s[f"{m}_q"] for s in states]),
                                  [s[f"{m}_absmax"] for s in states], codes.values[signed], codes.zero[signed])
                for m, signed in self.MOMENTS.items()]

    def _quantize(self, layout: Layout, params: list[torch.Tensor], codes: Codes,
                  moments: Sequence[torch.Tensor]) -> None:
        """Store the chunk's fp32 ``moments`` (:data:`MOMENTS`' order) as code indices and block scales."""
        states = [self.state[p] for p in params]
        for moment, (m, signed) in zip(moments, self.MOMENTS.items()):
            indices, scales = layout.quantize(moment, codes.bounds[signed])
            layout.scatter(indices, layout.views.of(f"{m}_q", [s[f"{m}_q"] for s in states]))
            torch._foreach_copy_([s[f"{m}_absmax"] for s in states], list(scales.split(layout.blocks)))


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


class Layout:
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
