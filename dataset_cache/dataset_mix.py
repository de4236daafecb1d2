"""Which samples an epoch draws from: several datasets trained together, and a regularization set at a ratio.

Why a module of its own: what a mix or a regularization set *is* (its parts, their repeats, the checks that refuse
what no sampler could hold, how many regularization occurrences an epoch gets and how they are shared among the
buckets) is decided before any batch order exists and is read by the nodes that build mixes without a sampler.
:class:`~.sampler.BucketSampler` takes a :class:`DatasetMix` wherever it takes a sample list and a
:class:`Regularization` as its ``reg``; docs/ARCHITECTURE.md ("The sampler") has the rules and the reasons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from .dataset import MAX_EPOCH_OCCURRENCES, MAX_REPEATS, Sample, check_epoch_size

__all__ = [
    "DatasetMix",
    "DatasetPart",
    "Regularization",
    "mix_datasets",
    "reg_occurrences",
    "reg_shares",
    "shared_samples",
    "unmix",
]


@dataclass(frozen=True)
class DatasetPart:
    """One dataset of a mix (kohya's ``[[datasets.subsets]]`` with ``num_repeats``).

    Attributes:
        name: the dataset's name, for messages.
        samples: its samples.
        repeats: multiplies every sample's own repeats (1: as encoded).
    """

    name: str
    samples: Sequence[Sample]
    repeats: int = 1


@dataclass(frozen=True)
class DatasetMix:
    """Samples of one or more datasets trained together: the parts concatenated in order, each part's repeats
    multiplied into its samples' repeats. Made by :func:`mix_datasets`; :class:`~.sampler.BucketSampler` takes it
    wherever it takes a sample list, and names the part a sample comes from in its messages.

    Attributes:
        samples: every part's samples, in order.
        parts: ``(name, number of samples)`` of each part, in order.
    """

    samples: tuple[Sample, ...]
    parts: tuple[tuple[str, int], ...]

    def name_of(self, index: int) -> str:
        """The name of the dataset that ``samples[index]`` comes from."""
        at = 0
        for name, count in self.parts:
            at += count
            if index < at:
                return name
        raise IndexError(f"sample index {index} is past the mix's {at} samples")


def mix_datasets(parts: Sequence[DatasetPart]) -> DatasetMix:
    """Concatenate datasets with per-dataset repeats, refusing what no sampler could hold.

    Raises:
        ValueError: no part, a part's repeats not an int from 1 to ``MAX_REPEATS``, a sample whose repeats times its
            dataset's reach past ``MAX_REPEATS``, or an epoch past ``MAX_EPOCH_OCCURRENCES`` (each names the dataset).
    """
    if not parts:
        raise ValueError("no dataset to train on: give at least one")
    out: list[Sample] = []
    for part in parts:
        if type(part.repeats) is not int or not 1 <= part.repeats <= MAX_REPEATS:
            raise ValueError(f"dataset {part.name!r}: repeats must be an int from 1 to {MAX_REPEATS}, got "
                             f"{part.repeats!r:.40}")
        for sample in part.samples:
            total = sample.repeats * part.repeats
            if total > MAX_REPEATS:
                raise ValueError(
                    f"dataset {part.name!r}: sample {sample.source or sample.latent} repeats {sample.repeats} times "
                    f"(its folder's count) × {part.repeats} (the dataset's repeats) = {total}, above the limit of "
                    f"{MAX_REPEATS}; lower the dataset's repeats")
            out.append(sample if part.repeats == 1 else replace(sample, repeats=total))
    check_epoch_size(out, "the datasets " + " + ".join(f"{p.name!r}×{p.repeats}" for p in parts))
    return DatasetMix(tuple(out), tuple((p.name, len(p.samples)) for p in parts))


def unmix(samples: Sequence[Sample] | DatasetMix, name: str
          ) -> tuple[Sequence[Sample], tuple[tuple[str, int, int], ...]]:
    """The sample list and ``(dataset name, first index, end index)`` of each of its datasets (a plain list is one
    dataset called ``name``)."""
    if isinstance(samples, DatasetMix):
        spans, at = [], 0
        for part, count in samples.parts:
            spans.append((part, at, at + count))
            at += count
        return samples.samples, tuple(spans)
    return samples, ((name, 0, len(samples)),)


@dataclass(frozen=True)
class Regularization:
    """A second set of samples mixed into every epoch at a ratio, with its own loss weight (kohya's reg folders,
    DreamBooth's prior preservation).

    Attributes:
        samples: the regularization samples (a list or a :class:`DatasetMix`).
        bucket_of: their buckets, as :class:`~.sampler.BucketSampler`'s ``bucket_of`` (their own latents' shapes).
        ratio: regularization occurrences per occurrence of the main dataset in an epoch (rounded to an integer
            count per epoch; 0: none).
        weight: loss weight of a regularization row (a main row weighs 1.0).
        name: the dataset's name, for messages.
    """

    samples: Sequence[Sample] | DatasetMix
    bucket_of: Callable[[Sample], Hashable] | Sequence[Hashable]
    ratio: float = 1.0
    weight: float = 1.0
    name: str = "the regularization dataset"


def _check_ratio(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value and math.isfinite(value)):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r:.40}")
    return float(value)


def reg_occurrences(reg: Regularization, reg_samples: Sequence[Sample], main_total: int) -> int:
    """How many regularization occurrences every epoch holds: ``round(ratio × main_total)``, half rounding up.

    Args:
        reg: the regularization set (its ratio and weight are checked here).
        reg_samples: its samples (:func:`unmix` of ``reg.samples``).
        main_total: the main dataset's occurrences per epoch (samples × repeats).

    Raises:
        ValueError: a ratio or weight that is not a finite number >= 0, no regularization sample, or an epoch past
            ``MAX_EPOCH_OCCURRENCES`` (each names the regularization dataset).
    """
    ratio = _check_ratio(reg.ratio, f"{reg.name}: ratio")
    _check_ratio(reg.weight, f"{reg.name}: loss weight")
    if not reg_samples:
        raise ValueError(f"{reg.name} has no samples; encode a folder of regularization images or leave the "
                         "regularization dataset unconnected")
    wanted = math.floor(ratio * main_total + 0.5)  # per epoch; half rounds up
    if main_total + wanted > MAX_EPOCH_OCCURRENCES:
        raise ValueError(f"{reg.name}: ratio {ratio} × {main_total} occurrences of the main dataset makes "
                         f"{main_total + wanted} occurrences per epoch, above the limit of "
                         f"{MAX_EPOCH_OCCURRENCES}; lower the ratio or the repeats")
    return wanted


def reg_shares(wanted: int, pools: Sequence[int]) -> list[int]:
    """Each regularization bucket's fixed share of the epoch's ``wanted`` occurrences, in proportion to its
    ``pools`` (the bucket's regularization samples × repeats; their sum > 0), so the count is the same every epoch.

    Largest remainder: each bucket gets ``wanted`` × its share of the pool, rounded down; the units left go to the
    largest fractional parts (ties: the bucket that appeared first).
    """
    pool_total = sum(pools)
    quota = [wanted * n // pool_total for n in pools]
    rest = sorted(range(len(pools)), key=lambda k: (-(wanted * pools[k] % pool_total), k))
    for k in rest[: wanted - sum(quota)]:
        quota[k] += 1
    return quota


def shared_samples(main: Sequence[Sample] | DatasetMix, reg: Sequence[Sample] | DatasetMix) -> list[Sample]:
    """The regularization samples whose latent (or mirror) the main dataset trains too: the same image, crop and VAE
    (keys are content addresses, so this holds across caches). A dataset used as its own regularization set shares
    all of them."""
    main_samples = main.samples if isinstance(main, DatasetMix) else main
    reg_samples = reg.samples if isinstance(reg, DatasetMix) else reg
    trained = {k for s in main_samples for k in (s.latent, s.mirror) if k is not None}
    return [s for s in reg_samples if s.latent in trained or (s.mirror is not None and s.mirror in trained)]
