"""Samples and datasets: the ordered lists of entry keys that training iterates.

A dataset never holds tensors. It names, for each training sample, the content key of its latent entry and
the keys of its caption variants' conditioning entries, so the same entries can serve many datasets and a
dataset file stays small (tens of bytes a sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "DatasetInfo", "MAX_REPEATS", "MAX_EPOCH_OCCURRENCES", "check_epoch_size"]


MAX_REPEATS = 10_000
"""Repeats of one sample. kohya users pick 1 to a few hundred; past this a number is a typo or an attack (a dataset
file saying 10^12 would make the sampler allocate terabytes)."""

MAX_EPOCH_OCCURRENCES = 1 << 26
"""Samples × repeats in one epoch (67M). The sampler holds one index per occurrence (8 bytes, twice), so an epoch
costs at most about 1 GB of RAM here; at a hundred samples a second it would last a week."""


def check_epoch_size(samples: Sequence[Sample], where: str) -> None:
    """Refuse a dataset whose epoch is larger than :data:`MAX_EPOCH_OCCURRENCES` (before anything allocates).

    Raises:
        ValueError: naming ``where`` (the dataset or folder), the size and the limit.
    """
    total = sum(s.repeats for s in samples)
    if total > MAX_EPOCH_OCCURRENCES:
        raise ValueError(f"{where}: {len(samples)} samples × their repeats make {total} occurrences per epoch, above "
                         f"the limit of {MAX_EPOCH_OCCURRENCES}; lower the repeat counts")


def _reference_problem(sample: Sample) -> str | None:
    """Why ``sample``'s reference columns do not fit its mirror (``None``: they do): a mirrored row trains with the
    mirrored reference, so a sample with a mirror and a reference needs both, and a reference mirror needs both."""
    if sample.reference_mirror is not None and (sample.reference is None or sample.mirror is None):
        return "reference_mirror needs a reference and a mirror"
    if sample.reference is not None and sample.mirror is not None and sample.reference_mirror is None:
        return "a sample with a mirror and a reference needs the reference's mirror (reference_mirror)"
    return None


@dataclass(frozen=True)
class Sample:
    """One training sample.

    Attributes:
        latent: key of the latent entry (a ComfyUI latent dict, ``{"samples": Tensor[1, C, H, W], ...}``;
            ``[1, C, T, H, W]`` from a video VAE).
        captions: keys of the conditioning entries, one per caption variant (each caption line, and each line's
            shuffled-tag variants); training picks one per epoch.
        repeats: how many times the sample appears in an epoch (kohya ``<repeats>_<name>`` folders).
        source: the source image's path relative to the dataset folder, for reports only.
        mirror: key of the latent of the horizontally mirrored image (``flip="random"``); training picks the
            latent or its mirror per epoch. ``None``: no mirror is cached.
        mask: key of the loss-mask entry (``{"mask": Tensor[1, 1, h, w]}`` at latent resolution, for ``latent``;
            the mirror's mask is its mirror image). ``None``: every element weighs the same.
        empty_caption: key of the empty caption's conditioning (same text encoder as ``captions``), which caption
            dropout trains with. ``None``: not encoded, so the sample cannot be dropped.
        reference: key of the latent of the sample's reference image (the image an edit model such as Flux Kontext
            edits, encoded at the latent's size), which training puts in the row's conditioning as ComfyUI's
            ReferenceLatent node does. ``None``: the sample has none.
        reference_mirror: key of the mirrored reference's latent, trained with ``mirror``. ``None``: no mirror.
    """

    latent: str
    captions: tuple[str, ...]
    repeats: int = 1
    source: str | None = None
    mirror: str | None = None
    mask: str | None = None
    empty_caption: str | None = None
    reference: str | None = None
    reference_mirror: str | None = None

    def __post_init__(self) -> None:
        if not self.captions:
            raise ValueError(f"sample {self.source or self.latent}: needs at least one caption entry")
        if type(self.repeats) is not int or not 1 <= self.repeats <= MAX_REPEATS:
            raise ValueError(f"sample {self.source or self.latent}: repeats must be an int from 1 to {MAX_REPEATS}, "
                             f"got {self.repeats!r:.40}")
        for name in ("mirror", "mask", "empty_caption", "reference", "reference_mirror"):
            value = getattr(self, name)
            if value is not None and (type(value) is not str or not value):
                raise ValueError(f"sample {self.source or self.latent}: {name} must be an entry key or None, "
                                 f"got {value!r:.40}")
        problem = _reference_problem(self)
        if problem:
            raise ValueError(f"sample {self.source or self.latent}: {problem}")

    @classmethod
    def checked_elsewhere(cls, latent: str, captions: tuple[str, ...], repeats: int, source: str | None,
                          mirror: str | None, mask: str | None, empty_caption: str | None,
                          reference: str | None = None, reference_mirror: str | None = None) -> Sample:
        """A sample whose fields the caller has already checked as :meth:`__post_init__` would.

        A dataset file's columns are checked whole at C speed (:func:`~.format.dataset_file.parse_dataset`);
        checking each sample again in ``__post_init__`` was a third of reading a 5k-sample dataset file.
        """
        sample, set_ = object.__new__(cls), object.__setattr__
        set_(sample, "latent", latent)  # one field at a time keeps the instance dicts' shared keys (a dict given
        set_(sample, "captions", captions)  # whole would take 190 bytes more per sample)
        set_(sample, "repeats", repeats)
        set_(sample, "source", source)
        set_(sample, "mirror", mirror)
        set_(sample, "mask", mask)
        set_(sample, "empty_caption", empty_caption)
        if reference is not None:  # else the class's None: a dataset without references keeps 7 keys a sample
            set_(sample, "reference", reference)
        if reference_mirror is not None:
            set_(sample, "reference_mirror", reference_mirror)
        return sample

    def keys(self) -> tuple[str, ...]:
        """Every entry key the sample references (latent, mirror, mask, captions, empty caption, references), each
        once.

        What a dataset keeps alive: ``clean`` keeps these, ``verify`` checks them, a copy copies them.
        """
        keys = [self.latent]
        if self.mirror is not None:
            keys.append(self.mirror)
        if self.mask is not None:
            keys.append(self.mask)
        keys.extend(self.captions)
        if self.empty_caption is not None:
            keys.append(self.empty_caption)
        if self.reference is not None:
            keys.append(self.reference)
        if self.reference_mirror is not None:
            keys.append(self.reference_mirror)
        return tuple(dict.fromkeys(keys))


@dataclass(frozen=True)
class DatasetInfo:
    """What the manifest says about one dataset, without loading its sample list.

    Attributes:
        name: the dataset's name inside the cache.
        file: path of its sample-list file, relative to the cache root.
        samples: number of samples (before repeats).
        info: free-form JSON metadata (encoder fingerprints, settings, source folder).
    """

    name: str
    file: str
    samples: int
    info: dict[str, Any] = field(default_factory=dict)
