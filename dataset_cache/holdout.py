"""A validation split: a share of a dataset's sources held out of training, and measured as its validation set.

OneTrainer and SimpleTuner can hold out part of the training folder for a validation loss; here a held-out set
needed a second folder and a second Encode Dataset. :func:`hold_out` takes it from the dataset itself. A source is
held out whole (every sample it gives: its resolutions of ``extra_resolutions``, its clip windows), so no image is
in both sets. Which sources: the ``round(share × sources)`` (at least one) of the lowest xxh64 of their identity
(the source's path in its folder, or its latent key for a sample without one), so the split is the same on every
run and machine, whatever the seed, and a source added to the folder moves at most the one source it displaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from .dataset import Sample
from .dataset_mix import DatasetMix

__all__ = ["MAX_VAL_SPLIT", "HeldOut", "check_val_split", "hold_out", "source_name", "source_rank"]

MAX_VAL_SPLIT = 0.5
"""The largest share held out: past half the dataset, the training set is the smaller one."""


def check_val_split(value: object) -> float:
    """``value`` as a float when it is a number from 0 (no split) to :data:`MAX_VAL_SPLIT`.

    Raises:
        ValueError: naming ``val_split``, the value and the range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= MAX_VAL_SPLIT:
        raise ValueError(f"val_split must be a number from 0 (no split) to {MAX_VAL_SPLIT:g}, got {value!r:.40}")
    return float(value)


@dataclass(frozen=True)
class HeldOut:
    """What :func:`hold_out` split: ``train`` (the mix without the held-out sources), ``validation`` (their samples,
    each once) and ``sources`` (their names, sorted)."""

    train: DatasetMix
    validation: tuple[Sample, ...]
    sources: tuple[str, ...]

    def describe(self, share: float) -> str:
        """One line for the run's summary."""
        shown = ", ".join(self.sources[:3]) + (", ..." if len(self.sources) > 3 else "")
        return (f"val_split {share:g}: {len(self.sources)} source(s) held out of training for the validation loss "
                f"({len(self.validation)} samples: {shown})")


def source_name(sample: Sample) -> str:
    """The source a sample comes from: its path in its folder, or its latent key for a sample without one."""
    return sample.source if sample.source else sample.latent


def source_rank(name: str) -> tuple[int, str]:
    """A source's place in the fixed order the split (and the choice of sampled captions) takes sources in: the xxh64
    of its name, the name itself on a tie. The same on every run and machine; a new source moves few others."""
    return xxhash.xxh64_intdigest(name.encode("utf-8", "surrogatepass")), name


def hold_out(mix: DatasetMix, share: float) -> HeldOut:
    """Split ``mix`` into training samples and the held-out sources' samples (see the module docstring).

    Raises:
        ValueError: ``share`` out of range, or it would hold out every source (naming the counts).
    """
    share = check_val_split(share)
    sources = list(dict.fromkeys(source_name(s) for s in mix.samples))
    count = max(1, round(share * len(sources)))
    if count >= len(sources):
        raise ValueError(f"val_split {share:g} holds out {count} of the dataset's {len(sources)} source(s), leaving "
                         "none to train on; lower val_split, or give a val_dataset of other images")
    ranked = sorted(sources, key=source_rank)
    held = set(ranked[:count])
    kept: list[Sample] = []
    validation: list[Sample] = []
    parts: list[tuple[str, int]] = []
    at = 0
    for name, size in mix.parts:
        part = mix.samples[at:at + size]
        at += size
        train = [s for s in part if source_name(s) not in held]
        kept += train
        validation += [s for s in part if source_name(s) in held]
        parts.append((name, len(train)))
    # each held-out sample once: a mix of one dataset twice names it twice
    return HeldOut(DatasetMix(tuple(kept), tuple(parts)), tuple(dict.fromkeys(validation)), tuple(sorted(held)))
