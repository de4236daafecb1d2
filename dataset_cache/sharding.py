"""Global batches shared among ranks by rows: the batch order of a data-parallel run whatever its number of ranks.

Why not :class:`~.sampler.BucketSampler`'s own ``rank``/``world_size`` (rank *r* takes whole batches ``r, r + W,
...``): there a step of *W* ranks trains *W* batches of ``batch_size`` rows cut from the epoch, each possibly of
another bucket, and the epoch is padded with its own first batches to a multiple of *W*. So the rows a step trains,
and the epoch's length in steps, change with *W*: 2 ranks × batch 2 do not train what 1 rank × batch 4 trains, and a
run cannot continue on another number of devices.

:class:`RowShardSampler` plans the epoch as one rank with the **global** batch (``batch_size × world_size`` rows,
one bucket) would, and gives rank *r* rows ``[r·b, (r+1)·b)`` of every global batch. What a step trains, the number
of steps per epoch (the same on every rank, with no padding) and the resume state depend on the global batch only
— MosaicML Streaming's *elastic determinism*: a run saved on 2 devices × batch 2 continues on 1 device × batch 4
(or 4 × 1) with the very next rows, none repeated or skipped. The trainer draws each row's noise and timestep over
the global batch the same way (``nodes/training/loop.py``), so the ranks together compute what one rank with the
global batch would, up to the order of floating-point sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .dataset import Sample
from .sampler import BatchPlan, BucketSampler, DatasetMix

__all__ = ["RowShardSampler", "rows_of", "shard_sampler"]


def rows_of(plan: BatchPlan, start: int, stop: int) -> BatchPlan:
    """The plan of rows ``[start, stop)`` of ``plan`` (the epoch, index and bucket stay the global batch's)."""
    def cut(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return values[start:stop] if values else values  # () means "no row has it": stays ()
    return dataclasses.replace(
        plan, sample_indices=plan.sample_indices[start:stop], latent_keys=plan.latent_keys[start:stop],
        caption_keys=plan.caption_keys[start:stop], mirrored=cut(plan.mirrored), dropped=cut(plan.dropped),
        mask_keys=cut(plan.mask_keys), weights=cut(plan.weights))


class RowShardSampler(BucketSampler):
    """A :class:`BucketSampler` of global batches (``batch_size × world_size`` rows) whose plans are this rank's
    rows of each: ``batch_size`` rows, ``[rank·batch_size, (rank+1)·batch_size)``.

    Everything else is the global sampler's: ``len()`` (global batches per epoch, the same on every rank),
    positions, :meth:`seek`, :meth:`state_dict` and the fingerprint, which do not depend on ``world_size`` — a state
    saved with one number of ranks loads with another when the global batch is the same.

    Args:
        samples, bucket_of, seed, **options: as :class:`BucketSampler` (``rank``/``world_size`` excepted).
        batch_size: rows per rank per batch.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.

    Raises:
        ValueError: bad arguments (as :class:`BucketSampler`, for the global batch).
    """

    def __init__(self, samples: Sequence[Sample] | DatasetMix,
                 bucket_of: Callable[[Sample], Hashable] | Sequence[Hashable], batch_size: int, seed: int = 0, *,
                 rank: int, world_size: int, **options: Any) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        super().__init__(samples, bucket_of, batch_size * world_size, seed, rank=0, world_size=1, **options)
        self.rank_batch_size = int(batch_size)
        self._row_rank = int(rank)
        self._row_world = int(world_size)

    def plan(self, epoch: int, index: int) -> BatchPlan:
        """Rows ``[rank·b, (rank+1)·b)`` of global batch ``index`` of ``epoch`` (pure)."""
        start = self._row_rank * self.rank_batch_size
        return rows_of(super().plan(epoch, index), start, start + self.rank_batch_size)

    @property
    def rank(self) -> int:
        """This process's rank (its rows of every global batch)."""
        return self._row_rank

    @property
    def world_size(self) -> int:
        """Number of ranks each global batch is shared among."""
        return self._row_world


def shard_sampler(samples: Sequence[Sample] | DatasetMix,
                  bucket_of: Callable[[Sample], Hashable] | Sequence[Hashable], batch_size: int, seed: int = 0, *,
                  rank: int = 0, world_size: int = 1, **options: Any) -> BucketSampler:
    """The trainer's sampler: a plain :class:`BucketSampler` for one rank (exactly the plans of before), a
    :class:`RowShardSampler` of global batches ``batch_size × world_size`` for several."""
    if world_size == 1 and rank == 0:
        return BucketSampler(samples, bucket_of, batch_size, seed, rank=0, world_size=1, **options)
    return RowShardSampler(samples, bucket_of, batch_size, seed, rank=rank, world_size=world_size, **options)
