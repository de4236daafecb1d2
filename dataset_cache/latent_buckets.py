"""Which rows can share a batch: a sample's bucket is its stored latent's shape, and a batch holds one bucket.

Why a module of its own: the buckets are found from the cache's headers (no tensor read) and the batch size is
fitted to them before a sampler exists (Train LoRA does both while planning its run), and the sampler groups
samples by whatever bucket ids it is given. (``buckets.py`` is something else: the aspect-ratio buckets images are
cropped to when they are encoded.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from .dataset import Sample
from .reading import EntryHeaders

__all__ = ["LATENT_RANKS", "buckets_from_reader", "fit_batch_size", "group_buckets"]

LATENT_RANKS = (4, 5)
"""Ranks of a stored latent: ``[1, C, H, W]`` from image VAEs, ``[1, C, T, H, W]`` from video VAEs."""


def buckets_from_reader(reader: EntryHeaders, samples: Sequence[Sample]) -> list[tuple[int, ...]]:
    """Return each sample's bucket: its latent's shape without the leading 1 — ``(C, H, W)`` for images,
    ``(C, T, H, W)`` for video VAEs — read from headers only (no tensor I/O). Rows of one bucket stack.

    Args:
        reader: an open :class:`~dataset_cache.format.reader.CacheReader`: its ``tensor_shapes(key)`` (or else
            ``get(key)``, lazy) gives the latent dict's ``"samples"`` shape from the shard header.
        samples: the dataset's samples.

    Raises:
        KeyError: a sample's latent entry is not in the cache.
        ValueError: a latent is not a ``[1, C, H, W]`` or ``[1, C, T, H, W]`` ``"samples"`` tensor (the loader
            stacks rows along the first dimension).
    """
    out: list[tuple[int, ...]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    header = getattr(reader, "tensor_shapes", None) or reader.get  # shapes only; get() gives lazy tensors
    for i, s in enumerate(samples):
        shape = shapes.get(s.latent)
        if shape is None:
            value = header(s.latent)
            if not isinstance(value, dict) or "samples" not in value:
                raise ValueError(
                    f"sample {i} ({s.source or s.latent}): latent entry {s.latent} is not a latent dict with a "
                    f"'samples' tensor (got {type(value).__name__}); re-encode the dataset"
                )
            leaf = value["samples"]
            shape = tuple(int(d) for d in (leaf if isinstance(leaf, torch.Size) else leaf.shape))
            if len(shape) not in LATENT_RANKS or shape[0] != 1:
                raise ValueError(
                    f"sample {i} ({s.source or s.latent}): latent entry {s.latent} has samples shape {list(shape)}, "
                    "expected [1, C, H, W] (images) or [1, C, T, H, W] (video VAEs); store one image or clip per "
                    "latent entry"
                )
            shapes[s.latent] = shape
        out.append(shape[1:])
    return out


def fit_batch_size(samples: Sequence[Sample], bucket_of: Sequence[Hashable], batch_size: int) -> int:
    """The largest batch size up to ``batch_size`` that a bucketed epoch can fill without copies.

    A batch holds one bucket, so rows beyond the largest bucket's occurrences per epoch (samples × repeats) would
    only repeat its samples; a batch size far past the dataset must not turn into memory (a batch of 10000 on 4
    images). Under ``tail="short"`` smaller buckets train shorter batches.
    """
    occurrences: dict[Hashable, int] = {}
    for s, b in zip(samples, bucket_of):
        occurrences[b] = occurrences.get(b, 0) + s.repeats
    return max(1, min(int(batch_size), max(occurrences.values(), default=1)))


def group_buckets(
    samples: Sequence[Sample], bucket_of: Callable[[Sample], Hashable] | Sequence[Hashable]
) -> tuple[list[Hashable], list[torch.Tensor]]:
    """The bucket ids in order of first appearance and, for each, the indices of its samples (in dataset order).

    Args:
        samples: the samples to group.
        bucket_of: a callable ``bucket_of(sample) -> hashable`` or a sequence with one hashable id per sample.

    Raises:
        ValueError: ``bucket_of`` is a sequence of another length than ``samples``.
    """
    if callable(bucket_of):
        ids = [bucket_of(s) for s in samples]
    else:
        ids = list(bucket_of)
        if len(ids) != len(samples):
            raise ValueError(f"bucket_of has {len(ids)} ids for {len(samples)} samples; give one per sample")
    order: dict[Hashable, list[int]] = {}
    for i, b in enumerate(ids):
        order.setdefault(b, []).append(i)
    return list(order), [torch.tensor(m, dtype=torch.int64) for m in order.values()]
