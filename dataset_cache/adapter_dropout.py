"""Dropout inside the adapters while they train: kohya's ``network_dropout``, ``rank_dropout`` and ``module_dropout``.

kohya's LoRA networks regularize a small dataset by dropping parts of the adapters in each training forward: a
hidden unit of a LoRA (the down projection's output, ``network_dropout``), a rank of it for one image
(``rank_dropout``, the kept ranks scaled by 1/(1 - p)), or a whole layer's change (``module_dropout``). Sampling and
validation use the whole adapters, as kohya's do.

Which layers skip a batch is drawn once per batch (:func:`skipped_layers`, a generator seeded by the batch), so a
model call pays nothing for it. The masks of units and ranks are drawn on the device as each model call needs them,
from torch's global generators, because those are what torch's gradient checkpoint saves before a block's forward
and restores for its recompute: the backward pass then sees the masks the forward drew. The trainer seeds them per
batch too (:func:`seed_generators`), so a run draws the same masks every time and a continued run those of the run
that never stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .checks import check_number

__all__ = ["MAX_DROPOUT", "DropoutRates", "dropped_hidden", "dropped_ranks", "rank_scale", "seed_generators",
           "skipped_layers"]

MAX_DROPOUT = 0.9
"""The largest accepted rate: kohya's guides use 0.1 to 0.3; near 1 a kept unit's 1/(1 - p) scale explodes."""


@dataclass(frozen=True)
class DropoutRates:
    """The probabilities of dropping a LoRA's hidden unit (``network``), a rank for one image (``rank``) and a
    layer's whole change (``module``) in one model call; 0: none."""

    network: float = 0.0
    rank: float = 0.0
    module: float = 0.0

    @property
    def active(self) -> bool:
        """Whether anything is ever dropped."""
        return bool(self.network or self.rank or self.module)

    @property
    def in_activations(self) -> bool:
        """Whether a draw acts on a LoRA's hidden activations (not on its weights alone)."""
        return bool(self.network)

    def validate(self) -> None:
        """Refuse a rate that is not a number from 0 to :data:`MAX_DROPOUT`.

        Raises:
            ValueError: naming the input (``network_dropout``, ``rank_dropout``, ``module_dropout``).
        """
        for name, value in (("network_dropout", self.network), ("rank_dropout", self.rank),
                            ("module_dropout", self.module)):
            check_number(name, value, MAX_DROPOUT, zero="none", hint="kohya's guides use 0.1 to 0.3")


def skipped_layers(count: int, p: float, generator: torch.Generator) -> list[bool]:
    """Which of ``count`` layers leave their change out of a batch (``module_dropout`` ``p``): one CPU draw per
    batch, no device work."""
    if p <= 0.0:
        return [False] * count
    return (torch.rand(count, generator=generator) < p).tolist()


def rank_scale(p: float) -> float:
    """What the kept ranks' change is multiplied by at ``rank_dropout`` ``p``: 1/(1 - p), so its expected size is the
    whole LoRA's. The masks below leave it to the caller's own scale (alpha / rank), one op fewer per model call."""
    return 1.0 / (1.0 - p) if p > 0.0 else 1.0


def _keep(shape: tuple[int, ...], p: float, like: torch.Tensor) -> torch.Tensor:
    """1 for a kept unit, 0 for a dropped one (probability ``p``), in ``like``'s dtype and device: one kernel."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1.0 - p)


def dropped_ranks(up: torch.Tensor, p: float) -> torch.Tensor:
    """``up`` (out × rank, or a convolution's out × rank × 1 × ...) with each rank dropped with probability ``p``
    (its column zeroed; the kept ones are the caller's to scale by :func:`rank_scale`): ``rank_dropout`` where the
    adapter is applied to the weight, one draw for the whole model call (every image of it sees one weight)."""
    if p <= 0.0:
        return up
    return up * _keep((up.shape[1],), p, up).view(1, -1, *([1] * (up.ndim - 2)))


def dropped_hidden(hidden: torch.Tensor, network: float, rank: float, *, channels_first: bool) -> torch.Tensor:
    """A LoRA's hidden activations (its down projection's output) with ``network_dropout`` (each unit, scaled as
    ``torch.nn.functional.dropout``) and ``rank_dropout`` (each rank of each image zeroed; the kept ones are the
    caller's to scale by :func:`rank_scale`), as kohya's LoRA module drops them.

    ``channels_first``: the rank is dimension 1 (a convolution's ``B × rank × ...``), else the last (``B × ... ×
    rank``); dimension 0 is the image.
    """
    if network > 0.0:
        hidden = torch.nn.functional.dropout(hidden, p=network, training=True)
    if rank > 0.0:
        rank_dim = 1 if channels_first else hidden.ndim - 1
        shape = [1] * hidden.ndim
        shape[0], shape[rank_dim] = hidden.shape[0], hidden.shape[rank_dim]
        hidden = hidden * _keep((hidden.shape[0], hidden.shape[rank_dim]), rank, hidden).view(shape)
    return hidden


@contextlib.contextmanager
def seed_generators(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: the CPU's and ``device``'s global generators seeded with ``seed``; after: both as they were (the
    caller's random numbers untouched by a batch's masks)."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
