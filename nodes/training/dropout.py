"""kohya's adapter dropout (:mod:`dataset_cache.adapter_dropout`) on ComfyUI's training adapters.

ComfyUI applies a training adapter either as a weight function (``adapter(w)``: the layer's changed weight) or, in
bypass mode, around the layer's forward as ``g(f(x) + h(x))``. A run with dropout gives each layer's adapter a
subclass of its own class (the same object, parameters and state: its ``__class__`` swapped, as torch's
parametrizations do) whose ``__call__``, ``h`` and ``g`` drop while :class:`AdapterDropout` is drawing, which is
during a batch's training forward and backward only; otherwise (samples, validation, the memory probe) they are
ComfyUI's. The norms' and biases' changes (ComfyUI's ``BiasDiff``) are left whole, as kohya trains none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from comfy.weight_adapter.base import WeightAdapterTrainBase, tucker_weight_from_conv

from ...dataset_cache.adapter_dropout import (DropoutRates, dropped_hidden, dropped_ranks, rank_scale,
                                              seed_generators, skipped_layers)
from ...dataset_cache.seeding import derive_seed, seeded_generator

__all__ = ["AdapterDropout"]

_CONVS = (F.conv1d, F.conv2d, F.conv3d)


class AdapterDropout:
    """A run's dropout: the rates, the adapters given it, and whether a training batch is drawing now.

    Each batch's draws come from seeds of the run's ``seed``, the batch's global number and the process's rank, so
    a run draws the same every time; several ranks draw their own (their rows differ).
    """

    def __init__(self, rates: DropoutRates, seed: int, adapters: Sequence[Any]) -> None:
        self.rates = rates
        self.seed = seed
        self.drawing = False
        self._swapped: list[tuple[Any, type]] = []
        if rates.active:
            self._attach([a for a in adapters if isinstance(a, WeightAdapterTrainBase)])

    @contextlib.contextmanager
    def batch(self, index: int, device: torch.device, rank: int = 0) -> Iterator[None]:
        """Drop inside: batch ``index``'s forward and backward. The layers that skip it are chosen on entry; the
        global generators (units' and ranks' masks) are seeded for it, and as they were after."""
        if not self._swapped:
            yield
            return
        adapters = [adapter for adapter, _cls in self._swapped]
        generator = seeded_generator(self.seed, "module dropout", index, rank)
        for adapter, skip in zip(adapters, skipped_layers(len(adapters), self.rates.module, generator)):
            adapter._streamcache_skip = skip
        masks = seed_generators(derive_seed(self.seed, "dropout", index, rank), device) \
            if self.rates.network or self.rates.rank else contextlib.nullcontext()
        with masks:
            self.drawing = True
            try:
                yield
            finally:
                self.drawing = False
                for adapter in adapters:
                    adapter._streamcache_skip = False

    def detach(self) -> None:
        """Give every adapter its own class back (the run's LoRA is then ComfyUI's adapters, as made)."""
        for adapter, cls in self._swapped:
            adapter.__class__ = cls
            del adapter._streamcache_dropout, adapter._streamcache_skip
        self._swapped.clear()

    def _attach(self, adapters: list[Any]) -> None:
        per_rank = self.rates.network or self.rates.rank
        for adapter in adapters:
            if per_rank and not _is_lora(adapter):
                raise ValueError(f"network_dropout and rank_dropout drop a LoRA's ranks, and this run trains "
                                 f"{type(adapter).__name__} adapters (algorithm, or the existing_lora's kind): set "
                                 "them to 0 (module_dropout drops any adapter)")
        for adapter in adapters:
            cls = type(adapter)
            adapter.__class__ = _dropping(cls)
            adapter._streamcache_dropout = self
            adapter._streamcache_skip = False
            self._swapped.append((adapter, cls))


def _is_lora(adapter: Any) -> bool:
    return all(isinstance(getattr(adapter, n, None), torch.nn.Module) for n in ("lora_up", "lora_down"))


class _Dropping(WeightAdapterTrainBase):
    """What each adapter of a run with dropout gains, in front of its own class (:func:`_dropping`)."""

    _streamcache_dropout: AdapterDropout
    _streamcache_skip: bool  # this layer's change left out of the batch drawing now

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        """The layer's weight with the change, some of it dropped (weight functions: the whole batch shares one)."""
        if self._streamcache_skip:
            return w
        dropout = self._streamcache_dropout
        if dropout.drawing and dropout.rates.rank:
            return _lora_weight(self, w, dropout.rates.rank)
        return super().__call__(w)

    def h(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        """Bypass mode's added output, some of it dropped (per image, as kohya's)."""
        if self._streamcache_skip:
            return base_out.new_zeros(())
        dropout = self._streamcache_dropout
        if dropout.drawing and (dropout.rates.network or dropout.rates.rank):
            return _lora_output(self, x, dropout.rates)
        return super().h(x, base_out)

    def g(self, y: torch.Tensor) -> torch.Tensor:
        """Bypass mode's output transform (OFT's rotation), left out with the rest of a skipped layer's change."""
        return y if self._streamcache_skip else super().g(y)


_CLASSES: dict[type, type] = {}


def _dropping(cls: type) -> type:
    """``cls`` with :class:`_Dropping` in front (one subclass per adapter class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Dropping{cls.__name__}", (_Dropping, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _lora_weight(adapter: Any, w: torch.Tensor, rank_p: float) -> torch.Tensor:
    """``w`` plus the LoRA's change alpha/rank · up @ down with its ranks dropped (one draw for the model call)."""
    up, down = dropped_ranks(adapter.lora_up.weight, rank_p), adapter.lora_down.weight
    if adapter.lora_mid is None:
        diff = up @ down
    else:
        diff = tucker_weight_from_conv(up, down, adapter.lora_mid.weight)
    return (w + adapter.alpha * (rank_scale(rank_p) / adapter.rank) * diff.reshape(w.shape)).to(w.dtype)


def _lora_output(adapter: Any, x: torch.Tensor, rates: DropoutRates) -> torch.Tensor:
    """The LoRA's added output up(drop(down(x))) · alpha/rank for bypass mode: the layer's own convolution (stride,
    padding) for the down projection of a convolution, 1 × 1 for the rest, as ComfyUI's ``h``."""
    scale = adapter.alpha * (getattr(adapter, "multiplier", 1.0) * rank_scale(rates.rank) / adapter.rank)
    down, up = adapter.lora_down.weight, adapter.lora_up.weight
    mid = adapter.lora_mid.weight if adapter.lora_mid is not None else None
    if not getattr(adapter, "is_conv", False):
        hidden = F.linear(x, down)
        if mid is not None:
            hidden = F.linear(hidden, mid)
        return F.linear(dropped_hidden(hidden, rates.network, rates.rank, channels_first=False), up) * scale
    dims = adapter.conv_dim
    conv, ones = _CONVS[dims - 1], [1] * dims
    if down.dim() == 2:
        channels = getattr(adapter, "in_channels", None)
        down = down.view(down.shape[0], channels, *adapter.kernel_size) if channels is not None \
            else down.view(*down.shape, *ones)
    hidden = conv(x, down, **getattr(adapter, "kw_dict", {}))
    if mid is not None:
        hidden = conv(hidden, mid.view(*mid.shape, *ones) if mid.dim() == 2 else mid)
    hidden = dropped_hidden(hidden, rates.network, rates.rank, channels_first=True)
    return conv(hidden, up.view(*up.shape, *ones) if up.dim() == 2 else up) * scale
