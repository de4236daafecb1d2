"""Global batches shared among ranks by rows: the batch order of a data-parallel run whatever its number of ranks.

Why not :class:`~.sampler.BucketSampler`'s own ``rank``/``world_size`` (rank *r* takes whole batches ``r, r + W,
...``): there a step of *W* ranks trains *W* batches of up to ``batch_size`` rows cut from the epoch, each possibly
of another bucket, and the epoch is reshaped to a multiple of *W*. So the rows a step trains, and the epoch's length
in steps, change with *W*: 2 ranks × batch 2 do not train what 1 rank × batch 4 trains, and a run cannot continue on
another number of devices.

:class:`RowShardSampler` plans the epoch as one rank with the **global** batch (``batch_size × world_size`` rows,
one bucket) would, and gives each rank a contiguous share of every global batch's rows (:func:`share`). What a step
trains, the number of steps per epoch (the same on every rank) and the resume state depend on the global batch only
— MosaicML Streaming's *elastic determinism*: a run saved on 2 devices × batch 2 continues on 1 device × batch 4 (or
4 × 1) with the very next rows, none repeated or skipped. The trainer draws each row's noise and timestep over the
global batch the same way (``nodes/training/loop.py``), so the ranks together compute what one rank with the global
batch would, up to the order of floating-point sums.

A global batch shorter than ``batch_size × world_size`` (a bucket's last batch under ``tail="short"``) is shared as
evenly as its rows allow, and each row's loss weight is scaled by ``share × world_size / rows`` so that the ranks'
mean gradient is still the global batch's mean; a rank left without a row (fewer rows than ranks) trains a stand-in
row of weight 0 — the global batch's first — so that it takes the step with the others and adds nothing. A stand-in
row has no ``sample_indices`` (it is counted nowhere) and no mask, mirror or dropout flags (it keeps its reference
image: a row is the model call it makes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .dataset import Sample
from .dataset_mix import DatasetMix
from .sampler import BatchPlan, BucketSampler

__all__ = ["RankPlan", "RowShardSampler", "rows_of", "shard_sampler", "share", "share_of"]


@dataclass(frozen=True)
class RankPlan(BatchPlan):
    """One rank's rows of a global batch (see :class:`~.sampler.BatchPlan` for the rest).

    Attributes:
        global_rows: the rows of the global batch.
        first_row: the position of this share's first row in the global batch.
    """

    global_rows: int = 0
    first_row: int = 0


def share(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first row, count)`` of ``rank``'s share of a global batch of ``rows``: as even as it can be, the first
    ``rows % world_size`` ranks one row more; a rank past the rows gets ``(rows, 0)``."""
    base, extra = divmod(rows, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def share_of(plan: BatchPlan, rows: int) -> tuple[int, int]:
    """``(global batch rows, first row)`` of a batch of ``rows`` rows: its share of a global batch, or the batch
    itself (``(rows, 0)``) when it is not a share."""
    if isinstance(plan, RankPlan):
        return plan.global_rows, plan.first_row
    return rows, 0


def rows_of(plan: BatchPlan, start: int, stop: int) -> BatchPlan:
    """The plan of rows ``[start, stop)`` of ``plan`` (the epoch, index and bucket stay the global batch's)."""
    def cut(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return values[start:stop] if values else values  # () means "no row has it": stays ()
    return dataclasses.replace(
        plan, sample_indices=plan.sample_indices[start:stop], latent_keys=plan.latent_keys[start:stop],
        caption_keys=plan.caption_keys[start:stop], mirrored=cut(plan.mirrored), dropped=cut(plan.dropped),
        mask_keys=cut(plan.mask_keys), weights=cut(plan.weights), reference_keys=cut(plan.reference_keys))


class RowShardSampler(BucketSampler):
    """A :class:`BucketSampler` of global batches (``batch_size × world_size`` rows) whose plans are this rank's
    shares of them (:class:`RankPlan`): ``batch_size`` rows each, fewer (weighted, see the module doc) in a short
    global batch.

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

    def plan(self, epoch: int, index: int) -> RankPlan:
        """This rank's share of global batch ``index`` of ``epoch`` (pure)."""
        whole = super().plan(epoch, index)
        rows = len(whole.sample_indices)
        first, count = share(rows, self._row_rank, self._row_world)
        if count == 0:  # fewer rows than ranks: a stand-in that weighs nothing, so this rank steps with the others
            first = 0
            part = dataclasses.replace(rows_of(whole, 0, 1), sample_indices=(), mirrored=(), dropped=(),
                                       mask_keys=(), weights=(0.0,))
        else:
            part = rows_of(whole, first, first + count)
            if count * self._row_world != rows:  # an uneven share: its rows weigh what they weigh in the whole
                scale = count * self._row_world / rows
                part = dataclasses.replace(part, weights=tuple(w * scale for w in part.weights or (1.0,) * count))
        fields = {f.name: getattr(part, f.name) for f in dataclasses.fields(BatchPlan)}
        return RankPlan(**fields, global_rows=rows, first_row=first)

    @property
    def rank(self) -> int:
        """This process's rank (its share of every global batch)."""
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
