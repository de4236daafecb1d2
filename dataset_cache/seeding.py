"""Seeds derived from labelled parts, so every random choice of a run has its own stream.

The sampler (batch order, caption variants) and the trainer (noise, timesteps, adapter init) each draw from a
generator seeded by ``(seed, what, where)``: a choice never shifts because another one consumed random numbers, and
a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["MAX_SEED", "derive_seed", "seeded_generator"]

MAX_SEED = 0xFFFFFFFFFFFFFFFF
"""The largest seed ComfyUI's seed widgets take (a run's ``seed``, ``sample_seed``, a prompt line's ``--d``)."""


def derive_seed(*parts: object) -> int:
    """Mix ``parts`` into a 63-bit seed; stable across processes and Python versions (unlike the salted ``hash()``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``parts``."""
    return torch.Generator().manual_seed(derive_seed(*parts))
