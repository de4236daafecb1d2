"""Deterministic, bucketed batch order with exact mid-epoch resume and rank sharding.

Why a sampler of our own: ComfyUI's built-in trainer draws batch indices inside each step with the global RNG, so a
prefetcher cannot know the next batch and a run is not reproducible once anything else consumes random numbers.
:class:`BucketSampler` decides a whole epoch up front from ``(seed, epoch)`` alone, with private
:class:`torch.Generator` objects, so the loader can read ahead, every rank can compute every other rank's share
without communicating, and a run resumed from :meth:`BucketSampler.state_dict` continues on exactly the batch that
came next.

An epoch, for a given ``(seed, epoch)``:

1. every sample appears ``repeats`` times (its *occurrences*) and uses ONE caption variant for the whole epoch,
   drawn with the epoch's generator, and, when it has a mirror latent, the mirror or not for the whole epoch
   (probability 1/2, its own ``"flip"`` stream); with a regularization set (:class:`Regularization`), each bucket
   also receives its fixed share of the epoch's ``round(ratio × main occurrences)`` regularization occurrences
   (shares by largest remainder over the buckets' regularization occurrences; which ones fill a share is drawn per
   epoch), so the number of batches is the same every epoch;
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

``len(sampler)`` (batches per rank) depends on the bucket sizes, ``batch_size`` and ``world_size`` only, so it is
the same on every rank and in every epoch, and so is each batch's row count at a given position of an epoch on all
ranks' common order. (Train LoRA shares global batches by rows instead, so its order does not depend on the number
of ranks: :mod:`.sharding`.)

Every draw has its own labelled generator, so with no mirror, no dropout and no regularization set the plans (and
the resume fingerprint) are exactly those of the versions before them. Several datasets train together as a
:class:`DatasetMix` (:func:`mix_datasets`: concatenated, each dataset's repeats multiplied in). docs/ARCHITECTURE.md
("The sampler") has the rules and the reasons.

Non-goals: weighting buckets, curriculum orders, changing ``batch_size`` or ``world_size`` mid-run (a state saved
under one configuration is refused by another, because "the next batch" would mean something else).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .dataset import Sample, check_epoch_size
from .dataset_mix import DatasetMix, Regularization, reg_occurrences, reg_shares, unmix
from .latent_buckets import group_buckets
from .seeding import seeded_generator

__all__ = ["BatchPlan", "BucketSampler"]

log = logging.getLogger("dataset_cache.sampler")

_STATE_VERSION = 1
_TAILS = ("drop", "short", "wrap")
FLIP_PROBABILITY = 0.5
"""Chance that a sample with a cached mirror trains mirrored in an epoch (``flip="random"``)."""


@dataclass(frozen=True)
class BatchPlan:
    """What one batch will contain; no tensors, so plans are cheap to compute ahead and to log.

    Attributes:
        epoch: the epoch the batch belongs to.
        index: position of the batch in this rank's share of the epoch (0-based).
        sample_indices: indices into the sampler's ``samples``, one per row of the batch.
        latent_keys: latent entry key of each row.
        caption_keys: conditioning entry key of each row (the epoch's caption variant of that sample).
        bucket: the bucket id shared by every row.
        mirrored: per row, whether ``latent_keys`` holds the sample's mirror latent (empty: no row is mirrored).
        dropped: per row, whether caption dropout replaced the caption by the empty caption (empty: none was).
        mask_keys: per row, the key of the sample's loss-mask entry or ``None`` (empty: no row has a mask). The
            mask belongs to the unmirrored latent; a mirrored row's mask is flipped when the batch is assembled.
        weights: per row, the loss weight of the dataset the row comes from (empty: every row weighs 1.0).
    """

    epoch: int
    index: int
    sample_indices: tuple[int, ...]
    latent_keys: tuple[str, ...]
    caption_keys: tuple[str, ...]
    bucket: Hashable = None
    mirrored: tuple[bool, ...] = ()
    dropped: tuple[bool, ...] = ()
    mask_keys: tuple[str | None, ...] = ()
    weights: tuple[float, ...] = ()


@dataclass(frozen=True)
class _Epoch:
    """One epoch of this rank: rows of sample indices (one row per batch), each sample's caption variant and
    mirror choice, and each row's caption dropout."""

    epoch: int
    rows: list[list[int]]  # [batches][rows] sample indices (rows: batch_size, or fewer for a short batch)
    row_bucket: list[int]  # bucket number of each batch
    variants: list[int]  # caption variant of each sample
    flips: list[bool] | None = None  # per sample: trains its mirror this epoch (None: no sample has one)
    dropped: torch.Tensor | None = None  # bool [batches, batch_size]: caption dropped (None: dropout is off)


def _check_fraction(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a number from 0 to 1, got {value!r:.40}")
    return float(value)


_PAD = -1
"""Marks the missing rows of a short batch in an epoch's ``[batches, batch_size]`` order (``tail="short"``)."""


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


def _dist_rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class BucketSampler:
    """Deterministic bucketed batch plans, one epoch at a time (see the module docstring for the rules).

    Iterating yields the rest of the current epoch as :class:`BatchPlan` objects and moves the position as each plan
    is yielded, so :meth:`state_dict` taken while training on a batch resumes on the batch after it. After the last
    batch of an epoch the position is the start of the next epoch, so ``for epoch in ...: for plan in sampler:``
    walks successive epochs.

    Args:
        samples: the dataset's samples (entry keys only), or a :class:`DatasetMix` of several datasets.
        bucket_of: the bucket of each sample: a callable ``bucket_of(sample) -> hashable`` or a sequence with one
            hashable id per sample (e.g. :func:`~.latent_buckets.buckets_from_reader`). Samples of one batch always
            share a bucket.
        batch_size: rows per batch (>= 1).
        seed: the run's seed; an epoch's order depends on ``(seed, epoch)`` only.
        tail: ``"short"``, ``"drop"`` or ``"wrap"`` (see the module docstring); training uses ``"short"``.
        rank: this process's rank; default: ``torch.distributed``'s when initialised, else 0.
        world_size: number of ranks; default: ``torch.distributed``'s when initialised, else 1.
        shuffle: shuffle samples within buckets and batches across buckets (``False`` keeps dataset order).
        caption_dropout: chance (0..1) that an occurrence trains with its sample's empty caption.
        reg: regularization samples mixed into every epoch (see :class:`Regularization`); ``None``: none.
        name: the dataset's name in messages (a :class:`DatasetMix` names its parts itself).

    Raises:
        ValueError: bad arguments, or no rank would get a single batch.
    """

    def __init__(
        self,
        samples: Sequence[Sample] | DatasetMix,
        bucket_of: Callable[[Sample], Hashable] | Sequence[Hashable],
        batch_size: int,
        seed: int = 0,
        *,
        tail: str = "drop",
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        caption_dropout: float = 0.0,
        reg: Regularization | None = None,
        name: str = "the dataset",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if tail not in _TAILS:
            raise ValueError(f"tail must be one of {_TAILS}, got {tail!r}")
        main, self._names = unmix(samples, name)
        if not main:
            raise ValueError("the dataset has no samples; nothing to sample")
        check_epoch_size(main, "the sampler's dataset")  # one index per occurrence is allocated below
        self._rank, self._world = self._resolve_ranks(rank, world_size)
        self._n_main = len(main)
        self.reg = reg
        reg_samples: Sequence[Sample] = ()
        if reg is not None:
            reg_samples, reg_names = unmix(reg.samples, reg.name)
            self._names += tuple((n, start + self._n_main, stop + self._n_main) for n, start, stop in reg_names)
            self.samples: Sequence[Sample] = [*main, *reg_samples]
        else:
            self.samples = main
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.tail = tail
        self.shuffle = bool(shuffle)
        self.caption_dropout = _check_fraction(caption_dropout, "caption_dropout")
        self._bucket_ids, self._bucket_members = group_buckets(main, bucket_of)
        self._repeats = torch.tensor([s.repeats for s in self.samples], dtype=torch.int64)
        self._n_captions = torch.tensor([len(s.captions) for s in self.samples], dtype=torch.int64)
        self._occurrences = [int(self._repeats[m].sum().item()) for m in self._bucket_members]
        self._reg_members: list[torch.Tensor] = []
        self._reg_quota: list[int] = []
        if reg is not None:
            self._add_reg(reg, reg_samples)
        self._check_dropout()
        self._has_mirror = torch.tensor([s.mirror is not None for s in self.samples], dtype=torch.bool)
        self._any_mirror = bool(self._has_mirror.any())
        self._any_mask = any(s.mask is not None for s in self.samples)
        if self.batch_size > max(self._occurrences):  # every row past that would be a copy: memory for nothing
            raise ValueError(
                f"batch_size {self.batch_size} is larger than the largest bucket ({max(self._occurrences)} "
                "occurrences per epoch), so every batch would be filled with copies; use fit_batch_size() to "
                "clamp it, or a smaller batch_size")
        self._per_bucket = [self._batches_in(n) for n in self._occurrences]
        total = sum(self._per_bucket)
        self._splits = 0  # "short": batches split in two per epoch so that the ranks' shares are equal
        if tail == "drop":
            self._per_rank = total // self._world
        elif tail == "wrap":
            self._per_rank = math.ceil(total / self._world)
        else:
            self._per_rank, self._splits = _short_shares(total, sum(self._occurrences), self._world)
        if self._per_rank == 0:
            raise ValueError(
                f"no batch of {self.batch_size} for each of {self._world} rank(s): buckets hold "
                f"{sorted(self._occurrences, reverse=True)[:8]} occurrences; use tail='short', a smaller batch_size "
                "or more samples"
            )
        self._warn_unused()
        self.fingerprint = self._fingerprint()
        self._epoch = 0
        self._index = 0
        self._cache: dict[int, _Epoch] = {}

    def _add_reg(self, reg: Regularization, reg_samples: Sequence[Sample]) -> None:
        """Bucket the regularization samples by their own latents and fix each bucket's share of an epoch."""
        wanted = reg_occurrences(reg, reg_samples, int(self._repeats[: self._n_main].sum().item()))
        ids, members = group_buckets(reg_samples, reg.bucket_of)
        pools = [int(self._repeats[m + self._n_main].sum().item()) for m in members]
        quota = reg_shares(wanted, pools)
        slot = {b: i for i, b in enumerate(self._bucket_ids)}
        for bucket, q in zip(ids, quota):
            if bucket not in slot and q:  # a shape only the regularization set has: a bucket of its own
                slot[bucket] = len(self._bucket_ids)
                self._bucket_ids.append(bucket)
                self._bucket_members.append(torch.zeros(0, dtype=torch.int64))
                self._occurrences.append(0)
        self._reg_members = [torch.zeros(0, dtype=torch.int64) for _ in self._bucket_ids]
        self._reg_quota = [0] * len(self._bucket_ids)
        for bucket, m, q in zip(ids, members, quota):
            if not q:  # no share (a tiny ratio): the bucket's samples sit this run out
                continue
            self._reg_members[slot[bucket]] = m + self._n_main
            self._reg_quota[slot[bucket]] = q
            self._occurrences[slot[bucket]] += q

    def _check_dropout(self) -> None:
        if self.caption_dropout <= 0:
            return
        used = [range(self._n_main)]
        if any(self._reg_quota):  # regularization rows train too
            used.append(range(self._n_main, len(self.samples)))
        for indices in used:
            for i in indices:
                if self.samples[i].empty_caption is None:
                    s = self.samples[i]
                    raise ValueError(
                        f"caption_dropout {self.caption_dropout} trains some samples with the empty caption, but "
                        f"dataset {self.name_of(i)!r} has no empty caption encoded (sample {s.source or s.latent}); "
                        "re-encode it with Encode Dataset's empty_caption enabled (only the empty caption is "
                        "encoded), or set caption_dropout to 0")

    def name_of(self, index: int) -> str:
        """The name of the dataset that ``samples[index]`` comes from (for messages)."""
        for name, start, stop in self._names:
            if start <= index < stop:
                return name
        raise IndexError(f"sample index {index} out of range: the sampler has {len(self.samples)} samples")

    # ----------------------------------------------------------------------------------------------- construction
    @staticmethod
    def _resolve_ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
        d_rank, d_world = _dist_rank_world()
        world = d_world if world_size is None else int(world_size)
        r = d_rank if rank is None else int(rank)
        if world < 1 or not 0 <= r < world:
            raise ValueError(f"rank must be in [0, world_size); got rank={r}, world_size={world}")
        return r, world

    def _batches_in(self, occurrences: int) -> int:
        if self.tail == "drop":
            return occurrences // self.batch_size
        return math.ceil(occurrences / self.batch_size)

    def _warn_unused(self) -> None:
        if self.tail != "drop":
            return
        small = [b for b, n in zip(self._bucket_ids, self._occurrences) if n < self.batch_size]
        if small:
            log.warning(
                "%d bucket(s) hold fewer than batch_size=%d occurrences and never train with tail='drop' "
                "(e.g. %r); use tail='short' to train them",
                len(small),
                self.batch_size,
                small[0],
            )

    def _fingerprint(self) -> str:
        """Hash of everything that decides what "batch i of epoch e" is, except the seed and the rank.

        The variants and regularization are hashed only when used, so a sampler without them keeps the fingerprint
        (and accepts the resume states) of the versions before them.
        """
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((_STATE_VERSION, self.batch_size, self.tail, self.shuffle, self._world)).encode())
        for b, members in zip(self._bucket_ids, self._bucket_members):
            h.update(repr(b).encode())
            h.update(members.numpy().tobytes())
        for s in self.samples:
            h.update(f"{s.latent}|{','.join(s.captions)}|{s.repeats}\n".encode())
        extra: list[Any] = []
        if self.caption_dropout > 0:
            extra.append(("caption_dropout", self.caption_dropout.hex()))
        if self.reg is not None:
            extra.append(("reg", self._n_main, float(self.reg.ratio).hex(), float(self.reg.weight).hex(),
                          self._reg_quota, [m.tolist() for m in self._reg_members]))
        if any(s.mirror or s.mask or s.empty_caption for s in self.samples):
            extra.append([(s.mirror, s.mask, s.empty_caption) for s in self.samples])
        if extra:
            h.update(repr(extra).encode())
        return h.hexdigest()

    # --------------------------------------------------------------------------------------------- epoch contents
    def _epoch_of(self, epoch: int) -> _Epoch:
        cached = self._cache.get(epoch)
        if cached is None:
            cached = self._build(epoch)
            self._cache = {epoch: cached}  # one epoch at a time: memory stays O(dataset), not O(epochs)
        return cached

    def _build(self, epoch: int) -> _Epoch:
        n_main = self._n_main
        g = seeded_generator(self.seed, epoch, "captions")
        variants = (torch.rand(n_main, generator=g, dtype=torch.float64) * self._n_captions[:n_main]).long()
        if len(self.samples) > n_main:  # regularization samples: their own stream, so the main draws stay put
            g = seeded_generator(self.seed, epoch, "reg-captions")
            reg = torch.rand(len(self.samples) - n_main, generator=g, dtype=torch.float64) * self._n_captions[n_main:]
            variants = torch.cat([variants, reg.long()])
        rows: list[torch.Tensor] = []
        row_bucket: list[int] = []
        for b, members in enumerate(self._bucket_members):
            occ = torch.repeat_interleave(members, self._repeats[members])
            if self._reg_quota and self._reg_quota[b]:
                occ = torch.cat([occ, self._reg_draw(epoch, b)])
            if self.shuffle:
                occ = occ[torch.randperm(len(occ), generator=seeded_generator(self.seed, epoch, "bucket", b))]
            n_batches = self._per_bucket[b]
            need = n_batches * self.batch_size
            if need > len(occ):
                if self.tail == "short":  # the last batch is short: padding marks its missing rows
                    occ = torch.cat([occ, occ.new_full((need - len(occ),), _PAD)])
                else:  # "wrap": complete the last batch with this epoch's first occurrences
                    occ = occ.repeat(math.ceil(need / len(occ)))
            rows.append(occ[:need].view(n_batches, self.batch_size))
            row_bucket += [b] * n_batches
        all_rows = torch.cat(rows)
        buckets = torch.tensor(row_bucket, dtype=torch.int64)
        if self.shuffle:
            perm = torch.randperm(len(all_rows), generator=seeded_generator(self.seed, epoch, "order"))
            all_rows, buckets = all_rows[perm], buckets[perm]
        for _ in range(self._splits):  # "short": equal shares for the ranks, nothing repeated
            all_rows, buckets = _split_longest(all_rows, buckets)
        take = torch.arange(self._per_rank, dtype=torch.int64) * self._world + self._rank
        take = take % len(all_rows)  # "wrap" pads the order with its own first batches
        dropped = None
        if self.caption_dropout > 0:  # per occurrence of the whole epoch, before sharding: every rank agrees
            g = seeded_generator(self.seed, epoch, "dropout")
            dropped = (torch.rand(all_rows.shape, generator=g, dtype=torch.float64) < self.caption_dropout)[take]
        flips: list[bool] | None = None
        if self._any_mirror:  # per sample, like the caption variant
            g = seeded_generator(self.seed, epoch, "flip")
            drawn = torch.rand(len(self.samples), generator=g, dtype=torch.float64) < FLIP_PROBABILITY
            flips = (drawn & self._has_mirror).tolist()
        mine = all_rows[take].tolist()
        if self.tail == "short":
            mine = [[i for i in row if i != _PAD] for row in mine]
        return _Epoch(epoch, mine, buckets[take].tolist(), variants.tolist(), flips, dropped)

    def _reg_draw(self, epoch: int, b: int) -> torch.Tensor:
        """Bucket ``b``'s regularization occurrences of ``epoch``: its fixed share, drawn without replacement from
        the bucket's occurrences (each reg sample × its repeats) in an order seeded per epoch and bucket, cycling
        through them again when the share is larger."""
        members = self._reg_members[b]
        pool = torch.repeat_interleave(members, self._repeats[members])
        order = torch.randperm(len(pool), generator=seeded_generator(self.seed, epoch, "reg", b))
        quota = self._reg_quota[b]
        return pool[order.repeat(math.ceil(quota / len(pool)))[:quota]]

    def plan(self, epoch: int, index: int) -> BatchPlan:
        """Return batch ``index`` of ``epoch`` on this rank (pure: does not move the position)."""
        if not 0 <= index < self._per_rank:
            raise IndexError(f"batch index {index} out of range: an epoch has {self._per_rank} batches per rank")
        ep = self._epoch_of(epoch)
        idx = tuple(ep.rows[index])
        variants = ep.variants
        samples = self.samples
        flips = ep.flips
        mirrored = tuple(flips[i] for i in idx) if flips is not None else ()
        dropped = tuple(ep.dropped[index, :len(idx)].tolist()) if ep.dropped is not None else ()
        captions = tuple(samples[i].captions[variants[i]] for i in idx)
        if dropped:
            captions = tuple(str(samples[i].empty_caption) if d else c  # present: checked in __init__
                             for i, c, d in zip(idx, captions, dropped))
        weight = float(self.reg.weight) if self.reg is not None else 1.0
        return BatchPlan(
            epoch=epoch,
            index=index,
            sample_indices=idx,
            latent_keys=tuple(str(samples[i].mirror) if flips is not None and flips[i] else samples[i].latent
                              for i in idx),  # a flip is drawn only for a sample with a mirror
            caption_keys=captions,
            bucket=self._bucket_ids[ep.row_bucket[index]],
            mirrored=mirrored,
            dropped=dropped,
            mask_keys=tuple(samples[i].mask for i in idx) if self._any_mask else (),
            weights=tuple(1.0 if i < self._n_main else weight for i in idx) if self.reg is not None else (),
        )

    def epoch_plans(self, epoch: int) -> list[BatchPlan]:
        """Return every batch of ``epoch`` on this rank, in order (pure)."""
        return [self.plan(epoch, i) for i in range(self._per_rank)]

    def plans(self, *, epochs: int | None = 1) -> Iterator[BatchPlan]:
        """Yield plans from the current position without moving it: the rest of this epoch and ``epochs - 1`` more
        (``None``: endless). The loader reads ahead with this and moves the position as batches are consumed."""
        epoch, index = self._epoch, self._index
        stop = None if epochs is None else epoch + epochs
        while stop is None or epoch < stop:
            while index < self._per_rank:
                yield self.plan(epoch, index)
                index += 1
            epoch, index = epoch + 1, 0

    def __iter__(self) -> Iterator[BatchPlan]:
        epoch = self._epoch
        while self._epoch == epoch and self._index < self._per_rank:
            plan = self.plan(self._epoch, self._index)
            self.seek(plan.epoch, plan.index + 1)
            yield plan

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._per_rank

    # --------------------------------------------------------------------------------------------------- position
    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._epoch

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, index)`` of the next batch."""
        return self._epoch, self._index

    @property
    def rank(self) -> int:
        """This process's rank (its share of every epoch)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks the epoch is shared among."""
        return self._world

    @property
    def buckets(self) -> dict[Hashable, int]:
        """Bucket id -> occurrences per epoch (samples × repeats, plus the bucket's regularization share), in order
        of first appearance (the main dataset's buckets first)."""
        return dict(zip(self._bucket_ids, self._occurrences))

    @property
    def main_samples(self) -> int:
        """How many of :attr:`samples` are the main dataset's (the regularization samples follow them)."""
        return self._n_main

    @property
    def reg_buckets(self) -> dict[Hashable, int]:
        """Bucket id -> regularization occurrences it holds in every epoch (empty without regularization)."""
        return {b: q for b, q in zip(self._bucket_ids, self._reg_quota) if q}

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (like ``DistributedSampler.set_epoch``)."""
        self.seek(epoch, 0)

    def seek(self, epoch: int, index: int) -> None:
        """Make batch ``index`` of ``epoch`` the next one; ``index == len(self)`` means the next epoch's start."""
        if epoch < 0 or not 0 <= index <= self._per_rank:
            raise ValueError(f"position ({epoch}, {index}) out of range: epochs >= 0, index in [0, {self._per_rank}]")
        if index == self._per_rank:
            epoch, index = epoch + 1, 0
        self._epoch, self._index = int(epoch), int(index)

    def state_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable resume state: ``{"version", "epoch", "batch", "seed", "fingerprint"}``."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "batch": self._index,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "batches_per_epoch": self._per_rank,
        }
        state.update(self._settings())  # only the settings in use: a state without them reads as "off"
        return state

    def _settings(self) -> dict[str, float]:
        out = {}
        if self.caption_dropout > 0:
            out["caption_dropout"] = self.caption_dropout
        if self.reg is not None:
            out["reg_ratio"], out["reg_weight"] = float(self.reg.ratio), float(self.reg.weight)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the batch after the one trained when ``state`` was taken.

        Raises:
            ValueError: the state is malformed or was saved for another dataset, batch size, tail policy, shuffle
                setting, world size or seed.
        """
        try:
            version, epoch, batch = state["version"], int(state["epoch"]), int(state["batch"])
            seed, fingerprint = int(state["seed"]), str(state["fingerprint"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"sampler state is malformed ({exc!r}); expected the dict of state_dict()") from exc
        if version != _STATE_VERSION:
            raise ValueError(f"sampler state version {version} is not supported; expected {_STATE_VERSION}")
        mine = self._settings()
        for key, default in (("caption_dropout", 0.0), ("reg_ratio", None), ("reg_weight", None)):
            saved = state.get(key, default)
            if saved != mine.get(key, default):
                def said(v: object) -> str:
                    return "none (no regularization dataset)" if v is None else repr(v)
                raise ValueError(
                    f"sampler state was saved with {key}={said(saved)} but this sampler has "
                    f"{key}={said(mine.get(key, default))}: the batches would differ; resume with the same setting, "
                    "or start a new run without the state")
        if fingerprint != self.fingerprint:
            raise ValueError(
                "sampler state was saved for a different dataset or configuration (samples, buckets, batch_size, "
                f"tail, shuffle, world_size, variants or regularization samples differ: fingerprint {fingerprint} != "
                f"{self.fingerprint}); resume with the same dataset and settings, or start a new run without the state"
            )
        if seed != self.seed:
            raise ValueError(
                f"sampler state was saved with seed={seed} but this sampler has seed={self.seed}; create the sampler "
                f"with seed={seed} to resume the same order"
            )
        self.seek(epoch, batch)
