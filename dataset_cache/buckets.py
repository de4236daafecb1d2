"""Aspect-ratio resolution buckets, kohya style: pure arithmetic on image sizes, no pixel decoding.

A :class:`BucketConfig` generates the bucket list for a target resolution (every bucket's area is at most
``resolution²``, sides are multiples of ``step`` within ``[min_side, max_side]``, optionally limited to
``max_aspect``), assigns each image the bucket whose aspect ratio is closest, and turns that into a
:class:`CropPlan`: resize to cover the bucket, then crop it (center, or a random crop seeded by the config's seed
and a per-image token). Everything is integer arithmetic on sizes, so the same inputs give the same plan on every
machine, and :meth:`CropPlan.key_fields` carries every choice into the latent key.

Differences from kohya's ``BucketManager``, on purpose: aspect distance is measured in log space, so 2:1 and 1:2
are equally far from 1:1 (kohya's linear ``w/h`` distance favours tall buckets); ties go to the first bucket in
sorted order; resize sizes use exact integer rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import xxhash

__all__ = ["CROP_MODES", "FLIP_MODES", "PIXEL_RULES", "BucketConfig", "CropPlan", "crop_plans", "make_buckets",
           "nearest_bucket"]

CROP_MODES = ("center", "random")
"""How the resized image is cut to its bucket."""

FLIP_MODES = ("none", "always", "random")
"""Horizontal flips: ``none``; ``always`` (every image stored mirrored); ``random`` (the image and its mirror are
both cached, and training picks one per epoch: :attr:`.dataset.Sample.mirror`)."""

PIXEL_RULES = "pil:exif-orient,rgb-drop-alpha,i16-scale,resize-then-crop;v1"
"""Names the decode rules of :mod:`.imaging` inside every latent key. Change it whenever those rules change the
pixels (not for Pillow upgrades, whose resampling differences are below VAE noise)."""

_RESIZE_METHOD_NAMES = ("lanczos", "bicubic", "bilinear", "box", "hamming", "nearest")


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes the pixels the VAE encodes. Sizes are ``(width, height)``.

    Attributes:
        source: the image's size as scanned (EXIF orientation applied).
        bucket: the output size.
        resize: the size the image is resized to before cropping (covers the bucket).
        crop: ``(left, top, right, bottom)`` in resized coordinates; ``right - left`` and ``bottom - top`` equal
            the bucket size.
        flip: mirror horizontally after cropping.
        method: resize method name (a key of :data:`.imaging.RESIZE_METHODS`).
    """

    source: tuple[int, int]
    bucket: tuple[int, int]
    resize: tuple[int, int]
    crop: tuple[int, int, int, int]
    flip: bool = False
    method: str = "lanczos"

    def key_fields(self) -> dict[str, Any]:
        """Return every field that changes the pixels fed to the VAE, for :func:`.keys.latent_key`.

        ``source`` is left out: the image's content hash already determines it.
        """
        return {
            "bucket": list(self.bucket),
            "resize": list(self.resize),
            "crop": list(self.crop),
            "flip": self.flip,
            "method": self.method,
            "rules": PIXEL_RULES,
        }


def make_buckets(
    resolution: int, *, step: int = 64, min_side: int = 256, max_side: int | None = None,
    max_aspect: float | None = None,
) -> tuple[tuple[int, int], ...]:
    """Return the sorted ``(width, height)`` buckets of area ``<= resolution²`` (kohya's algorithm).

    The square bucket ``floor(resolution / step) * step`` is always present; for each width from ``min_side`` to
    ``max_side`` in ``step`` increments the tallest height that keeps the area is added, in both orientations.
    See :class:`BucketConfig` for the argument rules.
    """
    _check_positive("step", step)
    _check_positive("resolution", resolution)
    max_side = 2 * resolution // step * step if max_side is None else max_side
    _check_sides(resolution, step, min_side, max_side)
    area = resolution * resolution
    square = resolution // step * step
    found = {(square, square)}
    for width in range(min_side, max_side + 1, step):
        height = min(max_side, area // width // step * step)
        if height >= min_side:
            found.add((width, height))
            found.add((height, width))
    if max_aspect is not None:
        found = {b for b in found if max(b) <= max_aspect * min(b) + 1e-9}
    return tuple(sorted(found))


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"bucket {name} must be a positive int, got {value!r}")


def _check_sides(resolution: int, step: int, min_side: int, max_side: int) -> None:
    _check_positive("min_side", min_side)
    _check_positive("max_side", max_side)
    if min_side % step or max_side % step:
        raise ValueError(f"bucket min_side ({min_side}) and max_side ({max_side}) must be multiples of step ({step})")
    square = resolution // step * step
    if not min_side <= square <= max_side:
        raise ValueError(
            f"bucket resolution {resolution} gives a {square}x{square} square bucket outside "
            f"[min_side={min_side}, max_side={max_side}]; lower min_side or raise max_side"
        )


def nearest_bucket(width: int, height: int, buckets: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """Return the bucket whose aspect ratio is closest to ``width / height`` in log space (first on ties)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    target = math.log(width / height)
    best = min(range(len(buckets)), key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - target), i))
    return buckets[best]


@dataclass(frozen=True)
class BucketConfig:
    """Bucketing and crop settings. Every field that changes pixels reaches the latent key through the plan.

    Attributes:
        resolution: target side; bucket areas are at most ``resolution²``.
        step: bucket sides are multiples of this (64 matches kohya; the VAE needs at least 8, Flux 16).
        min_side: smallest bucket side (multiple of ``step``).
        max_side: largest bucket side (multiple of ``step``); ``None`` means ``2 * resolution`` rounded down.
        max_aspect: drop buckets more elongated than this (e.g. ``4.0``); ``None`` keeps all.
        fixed: ``(width, height)`` to disable bucketing: every image is resized and cropped to this size.
        crop: ``"center"`` or ``"random"`` (seeded per image: same seed and token give the same crop).
        seed: seed of random crops.
        flip: ``"none"``, ``"always"`` (every image is stored mirrored; part of the key) or ``"random"`` (the
            plan is the unflipped one, and :meth:`mirror_plan` gives the mirrored one, cached beside it);
            ``False`` / ``True`` are taken as ``"none"`` / ``"always"``, as before the modes.
        method: resize method: lanczos, bicubic, bilinear, box, hamming or nearest.
        upscale: resize an image smaller than its bucket up to cover it. ``False`` (kohya's
            ``bucket_no_upscale``) gives such an image a bucket of its own size instead, rounded down to ``step``,
            so a small image never becomes a huge latent when ``resolution`` is large; :meth:`plan` refuses an
            image smaller than one step.
    """

    resolution: int = 1024
    step: int = 64
    min_side: int = 256
    max_side: int | None = None
    max_aspect: float | None = None
    fixed: tuple[int, int] | None = None
    crop: str = "center"
    seed: int = 0
    flip: bool | str = "none"
    method: str = "lanczos"
    upscale: bool = True

    def __post_init__(self) -> None:
        _check_positive("step", self.step)
        if self.flip is True or self.flip is False:  # the bool of earlier versions
            object.__setattr__(self, "flip", "always" if self.flip else "none")
        if self.flip not in FLIP_MODES:
            raise ValueError(f"bucket flip must be one of {FLIP_MODES} (or a bool), got {self.flip!r}")
        if self.crop not in CROP_MODES:
            raise ValueError(f"bucket crop must be one of {CROP_MODES}, got {self.crop!r}")
        if self.method not in _RESIZE_METHOD_NAMES:
            raise ValueError(f"resize method must be one of {_RESIZE_METHOD_NAMES}, got {self.method!r}")
        if self.max_aspect is not None and not self.max_aspect >= 1.0:
            raise ValueError(f"bucket max_aspect must be >= 1.0 (long side / short side), got {self.max_aspect!r}")
        if self.fixed is not None:
            w, h = self.fixed
            if not all(isinstance(v, int) and v > 0 and v % self.step == 0 for v in (w, h)):
                raise ValueError(f"fixed size {self.fixed!r} must be two positive multiples of step ({self.step})")
        else:
            self.buckets  # validate now, not at the first plan()  # noqa: B018

    @functools.cached_property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """The sorted ``(width, height)`` buckets (one when ``fixed``)."""
        if self.fixed is not None:
            return ((self.fixed[0], self.fixed[1]),)
        return make_buckets(
            self.resolution, step=self.step, min_side=self.min_side, max_side=self.max_side,
            max_aspect=self.max_aspect,
        )

    def assign(self, width: int, height: int) -> tuple[int, int]:
        """Return the bucket of an image of this (scanned) size."""
        return nearest_bucket(width, height, self.buckets)

    def plan(self, width: int, height: int, *, token: str = "") -> CropPlan:
        """Return the crop plan of an image of this (scanned) size.

        Args:
            width: scanned width (EXIF orientation applied).
            height: scanned height.
            token: seeds random crops together with ``seed``; pass the image's content hash so identical images
                get identical crops (and share one latent) wherever they live. Ignored for center crops.
        """
        bw, bh = self.assign(width, height)
        if not self.upscale and self.fixed is None and (width < bw or height < bh):
            # its own size, cropped to multiples of step: the crop below resizes by exactly 1
            if width < self.step or height < self.step:
                raise ValueError(f"the image is {width}x{height}, smaller than one bucket step ({self.step}) "
                                 "and upscale is off: lower bucket_step, or turn upscale on")
            bw, bh = width // self.step * self.step, height // self.step * self.step
        if width * bh >= height * bw:  # at least as wide as the bucket: match heights
            rw, rh = max(bw, (2 * width * bh + height) // (2 * height)), bh
        else:
            rw, rh = bw, max(bh, (2 * height * bw + width) // (2 * width))
        if self.crop == "center":
            left, top = (rw - bw) // 2, (rh - bh) // 2
        else:
            draw = xxhash.xxh3_64_intdigest(f"{self.seed}\0{token}".encode())
            left, top = draw % (rw - bw + 1), (draw >> 32) % (rh - bh + 1)
        return CropPlan(
            source=(width, height), bucket=(bw, bh), resize=(rw, rh), crop=(left, top, left + bw, top + bh),
            flip=self.flip == "always", method=self.method,
        )

    def at_resolution(self, resolution: int) -> BucketConfig:
        """This config at another ``resolution`` (multi-resolution datasets): its smallest and largest bucket sides
        scaled with the resolution (rounded down to ``step``, at least one step), every other setting the same.

        Raises:
            ValueError: a fixed size (there is no other resolution to bucket at), or a resolution below ``step``.
        """
        if self.fixed is not None:
            raise ValueError("a fixed bucket size has no other resolution")
        if not isinstance(resolution, int) or resolution < self.step:
            raise ValueError(f"resolution {resolution!r} is below the bucket step {self.step}")

        def scaled(side: int) -> int:
            return max(self.step, side * resolution // self.resolution // self.step * self.step)

        return dataclasses.replace(self, resolution=resolution, min_side=scaled(self.min_side),
                                   max_side=None if self.max_side is None else scaled(self.max_side))

    def fit_plan(self, plan: CropPlan, width: int, height: int, *, token: str = "") -> CropPlan:
        """The crop plan of a companion image of ``(width, height)`` (an edit pair's reference) into ``plan``'s
        bucket: resized to cover it and cropped as this config crops (a random crop drawn with ``token``, the
        training image's), mirrored as ``plan`` is. For an image of ``plan``'s source size this is ``plan`` itself,
        so the pair's pixels stay aligned."""
        fitted = dataclasses.replace(self, fixed=plan.bucket, upscale=True).plan(width, height, token=token)
        return dataclasses.replace(fitted, flip=plan.flip)

    def mirror_plan(self, plan: CropPlan) -> CropPlan:
        """Return ``plan`` mirrored: the plan of the image's mirror for ``flip="random"`` (its key fields are
        those of ``flip="always"``, so a switch between the modes re-encodes nothing already cached)."""
        return dataclasses.replace(plan, flip=not plan.flip)

    def describe(self) -> dict[str, Any]:
        """Return the settings as plain JSON (for a dataset's info, so reports can say how it was bucketed)."""
        return {
            "resolution": self.resolution, "step": self.step, "min_side": self.min_side, "max_side": self.max_side,
            "max_aspect": self.max_aspect, "fixed": list(self.fixed) if self.fixed else None, "crop": self.crop,
            "seed": self.seed, "flip": _described_flip(self.flip), "method": self.method, "upscale": self.upscale,
        }


def _described_flip(mode: str | bool) -> bool | str:
    """The flip as a dataset's info states it: ``False`` / ``True`` for none / always (as written before the
    modes, so the info of datasets encoded before stays as it was), ``"random"`` for random."""
    if mode == "none" or mode == "always":
        return mode == "always"
    return mode


def crop_plans(configs: Sequence[BucketConfig], width: int, height: int, token: str,
               center: dict[tuple[int, int, int], CropPlan] | None = None) -> list[CropPlan]:
    """A source's crop plan at each resolution of ``configs`` (``EncodeSettings.bucket_configs()``), in order, a
    plan two resolutions share once (a small source with upscale off keeps its own size at every resolution above
    it). ``center``: center crops already made, by ``(resolution, width, height)`` (they depend on nothing else),
    filled as they are made: planning a folder makes each once.

    Raises:
        ValueError: a resolution cannot plan the source (named by :meth:`BucketConfig.plan`).
    """
    plans: list[CropPlan] = []
    for config in configs:
        if config.crop == "center" and center is not None:
            key = (config.resolution, width, height)
            plan = center.get(key)
            if plan is None:
                plan = center[key] = config.plan(width, height)
        else:
            plan = config.plan(width, height, token=token)
        if plan not in plans:
            plans.append(plan)
    return plans
