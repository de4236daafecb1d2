"""Which cached captions a run generates its sample images from, and the sampling settings' ranges.

kohya, OneTrainer and ai-toolkit generate images from a list of prompts every so many steps, so a user sees what the
LoRA learns, not only its loss. Here the prompts are captions the cache already holds (their conditionings were
encoded with the dataset), so sampling needs no text encoder during training: a few sources of the validation set
when there is one (captions the LoRA never trained on), else of the dataset. They are of one bucket, so their
images form one batch (a ComfyUI ``LATENT``); the bucket with the most sources, and in it the sources first in
:func:`~.holdout.source_rank`'s order, so the same captions on every run and machine, whatever the seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .dataset import Sample
from .holdout import source_name, source_rank

__all__ = ["MAX_SAMPLE_CFG", "MAX_SAMPLE_COUNT", "MAX_SAMPLE_SIZE", "MAX_SAMPLE_STEPS", "MIN_SAMPLE_SIZE",
           "check_sample_size", "check_sampling", "choose_sample_rows"]

MAX_SAMPLE_COUNT = 16
"""The most captions sampled: each costs ``sample_steps`` model calls (twice with CFG) at every sampling."""
MAX_SAMPLE_STEPS = 100
"""The most denoising steps per sample (20-30 is usual for Euler)."""
MAX_SAMPLE_CFG = 30.0
"""The largest classifier-free guidance scale."""
MIN_SAMPLE_SIZE = 64
MAX_SAMPLE_SIZE = 8192
"""The range of ``sample_width`` and ``sample_height`` in pixels (0: the bucket's)."""


def check_sample_size(width: object, height: object) -> None:
    """Refuse a sample size that is not both 0 (the bucket of the captions) or both pixels in range.

    Raises:
        ValueError: naming ``sample_width`` / ``sample_height``, the value and the range.
    """
    for name, value in (("sample_width", width), ("sample_height", height)):
        if type(value) is not int or not (value == 0 or MIN_SAMPLE_SIZE <= value <= MAX_SAMPLE_SIZE):
            raise ValueError(f"{name} must be 0 (the size of the captions' bucket) or a whole number of pixels from "
                             f"{MIN_SAMPLE_SIZE} to {MAX_SAMPLE_SIZE}, got {value!r:.20}")
    if (width == 0) != (height == 0):
        raise ValueError(f"sample_width {width} and sample_height {height}: set both (the sample images' size in "
                         "pixels) or leave both at 0 (the size of the captions' bucket)")


def check_sampling(count: object, every: object, steps: object, cfg: object) -> None:
    """Refuse sampling settings out of their ranges, naming the field.

    Raises:
        ValueError: naming ``sample_count``, ``sample_every``, ``sample_steps`` or ``sample_cfg``, the value and the
            range.
    """
    for name, value, low, high in (("sample_count", count, 0, MAX_SAMPLE_COUNT), ("sample_every", every, 0, None),
                                   ("sample_steps", steps, 1, MAX_SAMPLE_STEPS)):
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise ValueError(f"{name} must be a whole number {bound}, got {value!r:.20}")
    if not (isinstance(cfg, (int, float)) and not isinstance(cfg, bool) and math.isfinite(cfg)
            and 1 <= cfg <= MAX_SAMPLE_CFG):
        raise ValueError(f"sample_cfg must be a number from 1 (no guidance: the model's own prediction) to "
                         f"{MAX_SAMPLE_CFG:g}, got {cfg!r:.20}")


def choose_sample_rows(samples: Sequence[Sample], buckets: Sequence[tuple[int, ...]],
                       count: int) -> tuple[tuple[Sample, ...], tuple[int, ...]]:
    """Up to ``count`` samples of one bucket, one per source, and that bucket's latent shape (see the module
    docstring). Each keeps its first caption (a caption file's first line, as written), its empty caption and its
    reference image (an edit model's sample edits it); its mirror and mask are dropped (a sample image is
    generated, not read).

    Raises:
        ValueError: ``samples`` is empty, or ``buckets`` does not give one shape per sample.
    """
    if not samples:
        raise ValueError("sample_count: there are no samples to take captions from")
    if len(buckets) != len(samples):
        raise ValueError(f"sample_count: {len(samples)} samples but {len(buckets)} latent shapes")
    by_bucket: dict[tuple[int, ...], dict[str, Sample]] = {}
    for sample, shape in zip(samples, buckets):
        by_bucket.setdefault(tuple(shape), {}).setdefault(source_name(sample), sample)

    def preference(shape: tuple[int, ...]) -> tuple[int, tuple[int, str]]:
        sources = by_bucket[shape]
        return -len(sources), min(source_rank(name) for name in sources)

    shape = min(by_bucket, key=preference)
    names = sorted(by_bucket[shape], key=source_rank)[:count]
    chosen = tuple(dataclasses.replace(by_bucket[shape][name], captions=by_bucket[shape][name].captions[:1],
                                       repeats=1, mirror=None, mask=None, reference_mirror=None) for name in names)
    return chosen, shape
