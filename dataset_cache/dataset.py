"""Samples and datasets: the ordered lists of entry keys that training iterates.

A dataset never holds tensors. It names, for each training sample, the content key of its latent entry and
the keys of its caption variants' conditioning entries, so the same entries can serve many datasets and a
dataset file stays small (tens of bytes a sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sample", "DatasetInfo"]


@dataclass(frozen=True)
class Sample:
    """One training sample.

    Attributes:
        latent: key of the latent entry (a ComfyUI latent dict, ``{"samples": Tensor[1, C, H, W], ...}``;
            ``[1, C, T, H, W]`` from a video VAE).
        captions: keys of the conditioning entries, one per caption variant; training picks one per epoch.
        repeats: how many times the sample appears in an epoch (kohya ``<repeats>_<name>`` folders).
        source: the source image's path relative to the dataset folder, for reports only.
    """

    latent: str
    captions: tuple[str, ...]
    repeats: int = 1
    source: str | None = None

    def __post_init__(self) -> None:
        if not self.captions:
            raise ValueError(f"sample {self.source or self.latent}: needs at least one caption entry")
        if self.repeats < 1:
            raise ValueError(f"sample {self.source or self.latent}: repeats must be >= 1, got {self.repeats}")


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
