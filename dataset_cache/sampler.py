"""Deterministic, bucketed batch order with exact mid-epoch resume and rank sharding: the plans, the position and
the resume state.

Why a sampler of our own: ComfyUI's built-in trainer draws batch indices inside each step with the global RNG, so a
prefetcher cannot know the next batch and a run is not reproducible once anything else consumes random numbers.
:class:`BucketSampler` decides a whole epoch up front from ``(seed, epoch)`` alone, with private
:class:`torch.Generator` objects, so the loader can read ahead, every rank can compute every other rank's share
without communicating, and a run resumed from :meth:`BucketSampler.state_dict` continues on exactly the batch that
came next.

The rules of an epoch (occurrences and repeats, caption variants, mirrors, the regularization share, batches of one
bucket, the tail policies ``"short"``/``"drop"``/``"wrap"``, the shuffle, the ranks' even shares, caption dropout)
are :mod:`.sampler_epoch`'s, which builds each epoch; this module checks the arguments, fixes what every epoch is
built from, hands out :class:`BatchPlan` objects and keeps the position and the resume state. Buckets come from the
cache's headers (:mod:`.latent_buckets`); several datasets train together as a :class:`~.dataset_mix.DatasetMix`
and a regularization set joins as a :class:`~.dataset_mix.Regularization` (:mod:`.dataset_mix`).

``len(sampler)`` (batches per rank) depends on the bucket sizes, ``batch_size`` and ``world_size`` only, so it is
the same on every rank and in every epoch, and so is each batch's row count at a given position of an epoch on all
ranks' common order. (Train LoRA shares global batches by rows instead, so its order does not depend on the number
of ranks: :mod:`.sharding`.) docs/ARCHITECTURE.md ("The sampler") has the rules and the reasons.

Non-goals: weighting buckets, curriculum orders, changing ``batch_size`` or ``world_size`` mid-run (a state saved
under one configuration is refused by another, because "the next batch" would mean something else).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .checks import check_number
from .dataset import Sample, check_epoch_size
from .dataset_mix import DatasetMix, Regularization, reg_occurrences, reg_shares, unmix
from .latent_buckets import group_buckets
from .sampler_epoch import TAILS, Epoch, EpochBuckets, EpochLayout, build_epoch, count_batches

__all__ = ["BatchPlan", "BucketSampler"]

log = logging.getLogger("dataset_cache.sampler")

_STATE_VERSION = 1


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
        reference_keys: per row, the latent key of the sample's reference image (its mirror's for a mirrored row)
            or ``None`` (empty: no row has one).
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
    reference_keys: tuple[str | None, ...] = ()


def _check_fraction(value: float, what: str) -> float:
    return check_number(what, value, 1.0)


def _dist_rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class BucketSampler:
    """Deterministic bucketed batch plans, one epoch at a time (see :mod:`.sampler_epoch` for the rules).

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
        tail: ``"short"``, ``"drop"`` or ``"wrap"`` (see :mod:`.sampler_epoch`); training uses ``"short"``.
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
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
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
        self._repeats = torch.tensor([s.repeats for s in self.samples], dtype=torch.int64)
        ids, members = group_buckets(main, bucket_of)
        self._buckets = EpochBuckets(ids, members, [int(self._repeats[m].sum().item()) for m in members])
        if reg is not None:
            self._add_reg(reg, reg_samples)
        self._check_dropout()
        self._any_mask = any(s.mask is not None for s in self.samples)
        self._any_reference = any(s.reference is not None for s in self.samples)
        self._layout = self._lay_out()
        self._per_rank = self._layout.per_rank
        self._warn_unused()
        self.fingerprint = self._fingerprint()
        self._epoch = 0
        self._index = 0
        self._cache: dict[int, Epoch] = {}

    def _add_reg(self, reg: Regularization, reg_samples: Sequence[Sample]) -> None:
        """Bucket the regularization samples by their own latents and fix each bucket's share of an epoch."""
        wanted = reg_occurrences(reg, reg_samples, int(self._repeats[: self._n_main].sum().item()))
        ids, members = group_buckets(reg_samples, reg.bucket_of)
        members = [m + self._n_main for m in members]
        pools = [int(self._repeats[m].sum().item()) for m in members]
        self._buckets.add_regularization(ids, members, reg_shares(wanted, pools))

    def _lay_out(self) -> EpochLayout:
        """What every epoch is built from: the buckets' batches and each rank's share of them.

        Raises:
            ValueError: a batch larger than the largest bucket, or no batch for some rank.
        """
        occurrences = self._buckets.occurrences
        if self.batch_size > max(occurrences):  # every row past that would be a copy: memory for nothing
            raise ValueError(
                f"batch_size {self.batch_size} is larger than the largest bucket ({max(occurrences)} "
                "occurrences per epoch), so every batch would be filled with copies; use fit_batch_size() to "
                "clamp it, or a smaller batch_size")
        per_bucket, per_rank, splits = count_batches(occurrences, self.batch_size, self.tail, self._world)
        n_captions = torch.tensor([len(s.captions) for s in self.samples], dtype=torch.int64)
        has_mirror = torch.tensor([s.mirror is not None for s in self.samples], dtype=torch.bool)
        return EpochLayout(
            batch_size=self.batch_size, tail=self.tail, shuffle=self.shuffle, caption_dropout=self.caption_dropout,
            rank=self._rank, world=self._world, n_main=self._n_main, repeats=self._repeats,
            n_captions=n_captions, has_mirror=has_mirror, buckets=self._buckets, per_bucket=per_bucket,
            per_rank=per_rank, splits=splits)

    def _check_dropout(self) -> None:
        if self.caption_dropout <= 0:
            return
        used = [range(self._n_main)]
        if any(self._buckets.reg_quota):  # regularization rows train too
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

    def _warn_unused(self) -> None:
        if self.tail != "drop":
            return
        small = [b for b, n in zip(self._buckets.ids, self._buckets.occurrences) if n < self.batch_size]
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
        for b, members in zip(self._buckets.ids, self._buckets.members):
            h.update(repr(b).encode())
            h.update(members.numpy().tobytes())
        for s in self.samples:
            h.update(f"{s.latent}|{','.join(s.captions)}|{s.repeats}\n".encode())
        extra: list[Any] = []
        if self.caption_dropout > 0:
            extra.append(("caption_dropout", self.caption_dropout.hex()))
        if self.reg is not None:
            extra.append(("reg", self._n_main, float(self.reg.ratio).hex(), float(self.reg.weight).hex(),
                          self._buckets.reg_quota, [m.tolist() for m in self._buckets.reg_members]))
        if any(s.mirror or s.mask or s.empty_caption for s in self.samples):
            extra.append([(s.mirror, s.mask, s.empty_caption) for s in self.samples])
        if self._any_reference:  # else as before references: a saved state still fits
            extra.append([(s.reference, s.reference_mirror) for s in self.samples])
        if extra:
            h.update(repr(extra).encode())
        return h.hexdigest()

    # --------------------------------------------------------------------------------------------- epoch contents
    def _epoch_of(self, epoch: int) -> Epoch:
        cached = self._cache.get(epoch)
        if cached is None:
            cached = build_epoch(self._layout, self.seed, epoch)
            self._cache = {epoch: cached}  # one epoch at a time: memory stays O(dataset), not O(epochs)
        return cached

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
            bucket=self._buckets.ids[ep.row_bucket[index]],
            mirrored=mirrored,
            dropped=dropped,
            mask_keys=tuple(samples[i].mask for i in idx) if self._any_mask else (),
            weights=tuple(1.0 if i < self._n_main else weight for i in idx) if self.reg is not None else (),
            reference_keys=tuple(samples[i].reference_mirror if flips is not None and flips[i]
                                 else samples[i].reference for i in idx) if self._any_reference else (),
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
        return dict(zip(self._buckets.ids, self._buckets.occurrences))

    @property
    def main_samples(self) -> int:
        """How many of :attr:`samples` are the main dataset's (the regularization samples follow them)."""
        return self._n_main

    @property
    def reg_buckets(self) -> dict[Hashable, int]:
        """Bucket id -> regularization occurrences it holds in every epoch (empty without regularization)."""
        return {b: q for b, q in zip(self._buckets.ids, self._buckets.reg_quota) if q}

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
