"""One epoch of a :class:`~.sampler.BucketSampler`, built from ``(seed, epoch)`` alone: its batch order, the tail
of each bucket, the ranks' even shares and every row's caption variant, mirror and caption dropout.

Why a module of its own: this is the part that must give the same answer on every machine and every rank, for
every epoch, from the seed alone; the sampler around it only keeps the position, the resume state and the plans it
hands out. Everything an epoch is built from is fixed when the sampler is made (:class:`EpochLayout`), so
:func:`build_epoch` is a pure function of the layout, the seed and the epoch.

An epoch, for a given ``(seed, epoch)``:

1. every sample appears ``repeats`` times (its *occurrences*) and uses ONE caption variant for the whole epoch,
   drawn with the epoch's generator, and, when it has a mirror latent, the mirror or not for the whole epoch
   (probability 1/2, its own ``"flip"`` stream); with a regularization set (:class:`~.dataset_mix.Regularization`),
   each bucket also receives its fixed share of the epoch's ``round(ratio × main occurrences)`` regularization
   occurrences (shares by largest remainder over the buckets' regularization occurrences; which ones fill a share
   is drawn per epoch), so the number of batches is the same every epoch;
2. the occurrences of each bucket (same latent shape, so they stack) are permuted and cut into batches of
   ``batch_size``; every batch holds occurrences of one bucket only;
3. the tail of each bucket follows ``tail``: ``"short"`` (what training uses) makes the last batch shorter (kohya's
   rule: a bucket of 5 at batch 4 trains a batch of 4 and one of 1, a bucket smaller than a batch trains as one
   smaller batch), so every occurrence trains exactly once per epoch; ``"drop"`` drops the last incomplete batch
   (the dropped occurrences differ from epoch to epoch because the permutation does; OneTrainer's rule);
   ``"wrap"`` completes it with the bucket's first occurrences of the same epoch (cyclically: a bucket of one
   image at batch 4 trains 4 copies of it, so its image trains more often than its repeats say; kept for the
   plans recorded before ``"short"`` existed);
4. the batches of all buckets are shuffled together (``shuffle=False`` keeps buckets in order of first appearance
   and each bucket's samples in dataset order);
5. with ``world_size`` ranks, every rank gets the same number of batches: rank ``r`` takes batches
   ``r, r + world_size, ...``. Under ``"short"`` an order whose length is not a multiple of ``world_size`` is
   first lengthened by splitting its longest batches in two (the first longest in the order, halves in place), so
   no occurrence is repeated or left out; only when every batch is down to one row and the order still does not
   divide (fewer occurrences than that would need) are its last ``total % world_size`` rows left out. Under
   ``"drop"`` the last ``total % world_size`` batches of the shuffled order are dropped, so shares are disjoint;
   under ``"wrap"`` the order is padded with its own first batches, so the few padding batches are seen twice;
6. caption dropout is drawn per occurrence over that whole order (its own ``"dropout"`` stream), before the order
   is cut into the ranks' shares.

Every draw has its own labelled generator (:mod:`.seeding`), so with no mirror, no dropout and no regularization set
the plans (and the resume fingerprint) are exactly those of the versions before them. docs/ARCHITECTURE.md ("The
sampler") has the rules and the reasons.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .seeding import seeded_generator

__all__ = ["FLIP_PROBABILITY", "TAILS", "Epoch", "EpochBuckets", "EpochLayout", "build_epoch", "count_batches"]

TAILS = ("drop", "short", "wrap")
"""What happens to a bucket's last incomplete batch (see the module docstring)."""

FLIP_PROBABILITY = 0.5
"""Chance that a sample with a cached mirror trains mirrored in an epoch (``flip="random"``)."""

_PAD = -1
"""Marks the missing rows of a short batch in an epoch's ``[batches, batch_size]`` order (``tail="short"``)."""


@dataclass
class EpochBuckets:
    """The buckets of every epoch, in order of first appearance (the main dataset's first, then the shapes only the
    regularization set has), and what each holds per epoch.

    Attributes:
        ids: the bucket ids.
        members: per bucket, the indices of its main samples (empty for a bucket only the regularization set has).
        occurrences: per bucket, occurrences per epoch: its main samples × repeats plus its regularization share.
        reg_members: per bucket, the indices of its regularization samples (empty list: no regularization set).
        reg_quota: per bucket, its regularization occurrences per epoch (empty list: no regularization set).
    """

    ids: list[Hashable]
    members: list[torch.Tensor]
    occurrences: list[int]
    reg_members: list[torch.Tensor] = field(default_factory=list)
    reg_quota: list[int] = field(default_factory=list)

    def add_regularization(self, ids: Sequence[Hashable], members: Sequence[torch.Tensor],
                           quota: Sequence[int]) -> None:
        """Join the regularization buckets ``ids`` (their samples' indices ``members``, their shares ``quota``) to
        the main buckets of the same shape; a shape only they have becomes a bucket of its own, one without a share
        (a tiny ratio) sits this run out."""
        slot = {b: i for i, b in enumerate(self.ids)}
        for bucket, q in zip(ids, quota):
            if bucket not in slot and q:
                slot[bucket] = len(self.ids)
                self.ids.append(bucket)
                self.members.append(torch.zeros(0, dtype=torch.int64))
                self.occurrences.append(0)
        self.reg_members = [torch.zeros(0, dtype=torch.int64) for _ in self.ids]
        self.reg_quota = [0] * len(self.ids)
        for bucket, m, q in zip(ids, members, quota):
            if not q:
                continue
            self.reg_members[slot[bucket]] = m
            self.reg_quota[slot[bucket]] = q
            self.occurrences[slot[bucket]] += q


@dataclass(frozen=True)
class EpochLayout:
    """Everything an epoch is built from besides ``(seed, epoch)``, fixed when the sampler is made.

    Attributes:
        batch_size, tail, shuffle, caption_dropout: the sampler's settings.
        rank, world: this rank and the number of ranks the order is shared among.
        n_main: how many samples are the main dataset's (the regularization samples follow them).
        repeats, n_captions, has_mirror: per sample, its repeats, caption variants and whether it has a mirror.
        buckets: the buckets and what each holds.
        per_bucket: batches of each bucket per epoch.
        per_rank: batches per epoch of each rank.
        splits: batches split in two per epoch so that the ranks' shares are equal (``tail="short"``).
    """

    batch_size: int
    tail: str
    shuffle: bool
    caption_dropout: float
    rank: int
    world: int
    n_main: int
    repeats: torch.Tensor
    n_captions: torch.Tensor
    has_mirror: torch.Tensor
    buckets: EpochBuckets
    per_bucket: list[int]
    per_rank: int
    splits: int


@dataclass(frozen=True)
class Epoch:
    """One epoch of this rank: rows of sample indices (one row per batch), each sample's caption variant and
    mirror choice, and each row's caption dropout."""

    epoch: int
    rows: list[list[int]]  # [batches][rows] sample indices (rows: batch_size, or fewer for a short batch)
    row_bucket: list[int]  # bucket number of each batch
    variants: list[int]  # caption variant of each sample
    flips: list[bool] | None = None  # per sample: trains its mirror this epoch (None: no sample has one)
    dropped: torch.Tensor | None = None  # bool [batches, batch_size]: caption dropped (None: dropout is off)


def count_batches(occurrences: Sequence[int], batch_size: int, tail: str, world: int) -> tuple[list[int], int, int]:
    """``(batches of each bucket, batches per rank, batches to split per epoch)`` of buckets holding
    ``occurrences`` each: the same in every epoch and on every rank.

    Raises:
        ValueError: no rank would get a single batch.
    """
    if tail == "drop":
        per_bucket = [n // batch_size for n in occurrences]
    else:
        per_bucket = [math.ceil(n / batch_size) for n in occurrences]
    total = sum(per_bucket)
    splits = 0
    if tail == "drop":
        per_rank = total // world
    elif tail == "wrap":
        per_rank = math.ceil(total / world)
    else:
        per_rank, splits = _short_shares(total, sum(occurrences), world)
    if per_rank == 0:
        raise ValueError(
            f"no batch of {batch_size} for each of {world} rank(s): buckets hold "
            f"{sorted(occurrences, reverse=True)[:8]} occurrences; use tail='short', a smaller batch_size "
            "or more samples"
        )
    return per_bucket, per_rank, splits


def _short_shares(batches: int, occurrences: int, world: int) -> tuple[int, int]:
    """``(batches per rank, batches to split per epoch)`` under ``tail="short"``.

    ``batches`` (the buckets' batches, last ones short) is rounded up to a multiple of ``world`` by splitting batches
    in two, each split adding one; a split needs a batch of two rows or more, so ``occurrences - batches`` splits
    are possible. When that is too few, every batch becomes one row and the rows past the last multiple of
    ``world`` are left out (the only case in which an occurrence does not train).
    """
    target = -(-batches // world) * world
    if occurrences - batches >= target - batches:
        return target // world, target - batches
    return occurrences // world, occurrences - batches


def build_epoch(layout: EpochLayout, seed: int, epoch: int) -> Epoch:
    """This rank's share of ``epoch`` (pure: the same ``layout``, ``seed`` and ``epoch`` give the same epoch on
    every machine; see the module docstring for the rules)."""
    variants = _draw_variants(layout, seed, epoch)
    all_rows, buckets = _batch_order(layout, seed, epoch)
    for _ in range(layout.splits):  # "short": equal shares for the ranks, nothing repeated
        all_rows, buckets = _split_longest(all_rows, buckets)
    take = torch.arange(layout.per_rank, dtype=torch.int64) * layout.world + layout.rank
    take = take % len(all_rows)  # "wrap" pads the order with its own first batches
    dropped = None
    if layout.caption_dropout > 0:  # per occurrence of the whole epoch, before sharding: every rank agrees
        g = seeded_generator(seed, epoch, "dropout")
        dropped = (torch.rand(all_rows.shape, generator=g, dtype=torch.float64) < layout.caption_dropout)[take]
    flips: list[bool] | None = None
    if bool(layout.has_mirror.any()):  # per sample, like the caption variant
        g = seeded_generator(seed, epoch, "flip")
        drawn = torch.rand(len(layout.has_mirror), generator=g, dtype=torch.float64) < FLIP_PROBABILITY
        flips = (drawn & layout.has_mirror).tolist()
    mine = all_rows[take].tolist()
    if layout.tail == "short":
        mine = [[i for i in row if i != _PAD] for row in mine]
    return Epoch(epoch, mine, buckets[take].tolist(), variants.tolist(), flips, dropped)


def _draw_variants(layout: EpochLayout, seed: int, epoch: int) -> torch.Tensor:
    """Each sample's caption variant for the epoch."""
    n_main = layout.n_main
    g = seeded_generator(seed, epoch, "captions")
    variants = (torch.rand(n_main, generator=g, dtype=torch.float64) * layout.n_captions[:n_main]).long()
    n_reg = len(layout.n_captions) - n_main
    if n_reg > 0:  # regularization samples: their own stream, so the main draws stay put
        g = seeded_generator(seed, epoch, "reg-captions")
        reg = torch.rand(n_reg, generator=g, dtype=torch.float64) * layout.n_captions[n_main:]
        variants = torch.cat([variants, reg.long()])
    return variants


def _batch_order(layout: EpochLayout, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The epoch's batches of every bucket (``[batches, batch_size]``, a short batch padded with ``_PAD``) and each
    batch's bucket number, in training order (shuffled across buckets unless ``shuffle`` is off)."""
    rows: list[torch.Tensor] = []
    row_bucket: list[int] = []
    for b in range(len(layout.buckets.members)):
        rows.append(_bucket_batches(layout, seed, epoch, b))
        row_bucket += [b] * layout.per_bucket[b]
    all_rows = torch.cat(rows)
    buckets = torch.tensor(row_bucket, dtype=torch.int64)
    if layout.shuffle:
        perm = torch.randperm(len(all_rows), generator=seeded_generator(seed, epoch, "order"))
        all_rows, buckets = all_rows[perm], buckets[perm]
    return all_rows, buckets


def _bucket_batches(layout: EpochLayout, seed: int, epoch: int, b: int) -> torch.Tensor:
    """Bucket ``b``'s batches of ``epoch`` (``[batches, batch_size]``): its occurrences, permuted, cut, the tail
    completed by ``tail``."""
    members = layout.buckets.members[b]
    occ = torch.repeat_interleave(members, layout.repeats[members])
    quota = layout.buckets.reg_quota
    if quota and quota[b]:
        occ = torch.cat([occ, _reg_draw(layout, seed, epoch, b)])
    if layout.shuffle:
        occ = occ[torch.randperm(len(occ), generator=seeded_generator(seed, epoch, "bucket", b))]
    n_batches = layout.per_bucket[b]
    need = n_batches * layout.batch_size
    if need > len(occ):
        if layout.tail == "short":  # the last batch is short: padding marks its missing rows
            occ = torch.cat([occ, occ.new_full((need - len(occ),), _PAD)])
        else:  # "wrap": complete the last batch with this epoch's first occurrences
            occ = occ.repeat(math.ceil(need / len(occ)))
    return occ[:need].view(n_batches, layout.batch_size)


def _reg_draw(layout: EpochLayout, seed: int, epoch: int, b: int) -> torch.Tensor:
    """Bucket ``b``'s regularization occurrences of ``epoch``: its fixed share, drawn without replacement from
    the bucket's occurrences (each reg sample × its repeats) in an order seeded per epoch and bucket, cycling
    through them again when the share is larger."""
    members = layout.buckets.reg_members[b]
    pool = torch.repeat_interleave(members, layout.repeats[members])
    order = torch.randperm(len(pool), generator=seeded_generator(seed, epoch, "reg", b))
    quota = layout.buckets.reg_quota[b]
    return pool[order.repeat(math.ceil(quota / len(pool)))[:quota]]


def _split_longest(rows: torch.Tensor, buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the first longest batch of ``rows`` (``[batches, batch_size]``, short batches padded with ``_PAD``)
    into its two halves, the second placed right after the first."""
    lengths = (rows != _PAD).sum(dim=1)
    at = int(torch.argmax(lengths))  # the first of the longest
    n = int(lengths[at])
    first, second = rows[at].clone(), torch.full_like(rows[at], _PAD)
    half = (n + 1) // 2
    second[: n - half] = rows[at, half:n]
    first[half:] = _PAD
    rows = torch.cat([rows[:at], first[None], second[None], rows[at + 1:]])
    buckets = torch.cat([buckets[: at + 1], buckets[at:]])
    return rows, buckets
