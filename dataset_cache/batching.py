"""Slicing a sequence into batches of at most ``n`` items (``itertools.batched`` needs Python 3.12)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["batched"]

T = TypeVar("T")


def batched(items: Sequence[T], n: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of ``items`` of ``n`` items each (the last may be shorter)."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    for i in range(0, len(items), n):
        yield items[i:i + n]
