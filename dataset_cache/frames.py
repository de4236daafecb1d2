"""Which frames a clip gives: what a clip is, the frame settings, the frame indices they pick, and a clip's key.

Kept apart from :mod:`.video` (which reads videos with PyAV) because everything here is plain arithmetic on names,
counts and rates: planning, listing and keying a clip need it without decoding anything, and a clip's latent key,
which users' caches are addressed by, is made here and nowhere else.

A clip is one training sample made of frames. Two kinds are found by :mod:`.listing`:

* a video file (``.mp4 .webm .mov .mkv``, any case), read by :mod:`.video`;
* a folder of frames whose name ends in ``.frames`` (``walk.frames/0001.png``, ``0002.png``...): its images, in
  natural name order (``2.png`` before ``10.png``), are the clip's frames. Its caption is ``walk.txt`` beside the
  folder, as for a video ``walk.mp4``. The suffix keeps every folder of an existing image dataset an image folder.

:class:`FrameSettings` says which frames a clip gives: ``frames`` of them, taken ``first`` (the first N),
``uniform`` (evenly spread over the clip, as ComfyUI's Sample Video Frame node does) or ``every_k`` (every k-th
from the start), optionally after resampling a video to ``fps`` frames a second. A video VAE compresses time:
WAN's gives ``1 + (T - 1) // 4`` latent frames for T frames, so only counts ``1 + 4m`` use every frame;
``stride`` (the VAE's temporal compression, as ComfyUI's ``VAE.temporal_compression_decode()`` reports it)
rounds every count down to such a number. A clip too short for ``frames`` gives as many as it has, rounded the
same way, and so lands in a bucket of its own: buckets are ``(frames, height, width)``; :meth:`FrameSettings.
shortfall` says why, for the report that names each such clip.

A clip's latent key holds the frames it takes (:func:`clip_key_fields`: the source frame indices, not the settings
that chose them), so two settings that take the same frames share one latent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "VIDEO_EXTENSIONS",
    "FRAMES_SUFFIX",
    "SAMPLING_MODES",
    "MAX_CLIP_FRAMES",
    "MAX_CLIPS_PER_VIDEO",
    "MAX_CLIP_PIXEL_BYTES",
    "VIDEO_RULES",
    "MIN_FPS",
    "MAX_FPS",
    "FrameSettings",
    "clip_folder_of",
    "frame_order",
    "clip_key_fields",
    "legacy_clip_key_fields",
]

VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv"})
"""Video file extensions (compared lowercased)."""

FRAMES_SUFFIX = ".frames"
"""A folder whose name ends in this (any case) is one clip: its images are the frames."""

SAMPLING_MODES = ("first", "uniform", "every_k")
"""How a clip's frames are picked (see :class:`FrameSettings`)."""

MAX_CLIP_FRAMES = 4097
"""Frames one clip may give: 1 + 4 * 1024, far above what a video model trains on (WAN: 81)."""

MAX_CLIPS_PER_VIDEO = 64
"""Clips one video (or frame folder) may give: each is a latent to encode and store, and a sample of the dataset
(musubi-tuner's extraction of a long video into clips; 64 windows of 81 frames span a 5-minute video at 16 fps)."""

MAX_CLIP_PIXEL_BYTES = 2 << 30
"""Decoded float32 pixels of one clip at its bucket size (2 GiB: 81 frames at 1280×720 take 0.9 GiB). A clip
above it is left out as a failure naming it, before anything is decoded."""

VIDEO_RULES = "av:rgb24,decode-order,resize-then-crop;v1"
"""Names the decode rules of :func:`.video.load_clip` inside every clip's latent key (see ``PIXEL_RULES``). It
lives beside the keys it enters, as ``PIXEL_RULES`` lives in :mod:`.buckets`; a change to the pixels ``load_clip``
gives must change it."""

MIN_FPS = 0.01
"""Lowest resampling rate (one frame every 100 s) besides 0, which keeps a video's own rate. Below it the rate is
no training setting, and a rate near 0 made the resampling step divide by zero."""

MAX_FPS = 1000.0
"""Highest resampling rate (a video's frames repeated to reach it)."""

_DIGITS = re.compile(r"(\d+)")


def clip_folder_of(relpath: str) -> str | None:
    """The relative path of the ``.frames`` folder holding file ``relpath``, or ``None`` when it is not a frame."""
    parent = relpath.rpartition("/")[0]
    name = parent.rpartition("/")[2]
    return parent if name.lower().endswith(FRAMES_SUFFIX) and len(name) > len(FRAMES_SUFFIX) else None


def frame_order(name: str) -> tuple[Any, ...]:
    """Sort key of a frame's file name: digit runs compare as numbers (``2.png`` before ``10.png``), ties by
    name, so the order never depends on zero padding or on the directory listing."""
    parts = _DIGITS.split(name.lower())
    return (tuple((0, int(p), p) if i % 2 else (1, 0, p) for i, p in enumerate(parts)), name)


@dataclass(frozen=True)
class FrameSettings:
    """Which frames a clip gives. Every field reaches the latent key of each clip.

    Attributes:
        frames: frames per clip (at most; a shorter clip gives fewer, see the module docstring).
        sampling: ``first``, ``uniform`` or ``every_k`` (see :data:`SAMPLING_MODES`).
        every: k of ``every_k`` (ignored by the other modes).
        fps: resample a video to this many frames a second before sampling; ``0`` keeps its own rate. Frame
            folders have no rate: they are taken as they are.
        stride: the VAE's temporal compression (WAN: 4): frame counts are rounded down to ``1 + stride * m``.
            ``1`` takes any count; ``0`` means the VAE encodes still images only, so clips are refused; ``None``
            means not known yet (the VAE was not loaded): clip keys are then marked unresolved, so the VAE is
            asked for, and such a plan cannot be encoded.
        clips: how many clips (samples) each video gives (musubi-tuner's ``frame_extraction`` ``uniform`` with
            ``frame_sample``): windows of the frames ``first`` or ``every_k`` take, their starts spread evenly from
            the video's start to where the last window ends at its end (see :meth:`windows`). Not with
            ``uniform``, whose one clip already spans the whole video.
    """

    frames: int = 17
    sampling: str = "first"
    every: int = 1
    fps: float = 0.0
    stride: int | None = 1
    clips: int = 1

    def __post_init__(self) -> None:
        if type(self.frames) is not int or not 1 <= self.frames <= MAX_CLIP_FRAMES:
            raise ValueError(f"frame count must be an int from 1 to {MAX_CLIP_FRAMES}, got {self.frames!r}")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"frame sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        if type(self.every) is not int or not 1 <= self.every <= MAX_CLIP_FRAMES:
            raise ValueError(f"frame step (k of every_k) must be an int from 1 to {MAX_CLIP_FRAMES}, "
                             f"got {self.every!r}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not (
                math.isfinite(self.fps) and (self.fps == 0 or MIN_FPS <= self.fps <= MAX_FPS)):
            raise ValueError(f"fps must be 0 (each video's own rate) or a rate from {MIN_FPS:g} to {MAX_FPS:g} "
                             f"frames a second, got {self.fps!r}")
        if self.stride is not None and (type(self.stride) is not int or not 0 <= self.stride <= 64):
            raise ValueError(f"frame stride (the VAE's temporal compression) must be None or an int from 0 to 64, "
                             f"got {self.stride!r}")
        if type(self.clips) is not int or not 1 <= self.clips <= MAX_CLIPS_PER_VIDEO:
            raise ValueError(f"clips_per_video must be an int from 1 to {MAX_CLIPS_PER_VIDEO}, got {self.clips!r:.40}")
        if self.clips > 1 and self.sampling == "uniform":
            raise ValueError(f"clips_per_video {self.clips} takes several windows of a video, and frame_sampling "
                             "uniform spreads one clip over the whole video: use frame_sampling first (consecutive "
                             "frames) or every_k, or clips_per_video 1")

    def fit(self, count: int) -> int:
        """Round a frame count down to ``1 + stride * m`` (unchanged for stride 0, 1 or unknown)."""
        step = self.stride or 1
        return 1 + (count - 1) // step * step

    @property
    def effective_frames(self) -> int:
        """``frames`` rounded to what the VAE takes (see :meth:`fit`)."""
        return self.fit(self.frames)

    def _resampled(self, total: int, rate: Fraction | None) -> tuple[int, Fraction]:
        """The clip's length after resampling to :attr:`fps`, and the source frames per resampled frame."""
        if type(total) is not int or total < 1:
            raise ValueError(f"a clip needs at least one frame, got {total!r}")
        if self.fps and rate is not None and rate > 0:
            step = Fraction(rate) / Fraction(self.fps).limit_denominator(1_000_000)
            return max(1, math.ceil(total / step)), step
        return total, Fraction(1)

    def available(self, total: int, rate: Fraction | None = None) -> int:
        """How many frames the sampling finds in a clip of ``total`` frames, before :attr:`frames` caps them and
        :meth:`fit` rounds them (every k-th of the resampled clip for ``every_k``, else all of it)."""
        length, _ = self._resampled(total, rate)
        return 1 + (length - 1) // self.every if self.sampling == "every_k" else length

    def indices(self, total: int, rate: Fraction | None = None) -> tuple[int, ...]:
        """Return the source frame indices (in decode order) a clip of ``total`` frames gives.

        Args:
            total: the clip's frame count (>= 1).
            rate: the video's frame rate; with :attr:`fps` set the clip is first resampled to it (frame ``j`` of
                the resampled clip is source frame ``floor(j * rate / fps)``).
        """
        return self._window(total, rate, 0)

    def _window(self, total: int, rate: Fraction | None, start: int) -> tuple[int, ...]:
        """The source frame indices of the clip whose first frame is ``start`` of the resampled clip."""
        length, step = self._resampled(total, rate)
        n = self.fit(min(self.frames, self.available(total, rate)))
        virtual: Sequence[int]
        if self.sampling == "first":
            virtual = range(start, start + n)
        elif self.sampling == "every_k":
            virtual = range(start, start + n * self.every, self.every)
        elif n == 1:
            virtual = range(length // 2, length // 2 + 1)
        else:  # evenly spread, exact integer rounding of i * (length - 1) / (n - 1)
            virtual = [(2 * i * (length - 1) + (n - 1)) // (2 * (n - 1)) for i in range(n)]
        return tuple(min(total - 1, math.floor(j * step)) for j in virtual)

    def span(self, total: int, rate: Fraction | None = None) -> int:
        """How many frames of the resampled clip one window covers, first to last taken."""
        n = self.fit(min(self.frames, self.available(total, rate)))
        return (n - 1) * self.every + 1 if self.sampling == "every_k" else n

    def windows(self, total: int, rate: Fraction | None = None) -> tuple[tuple[int, ...], ...]:
        """Return the source frame indices of each clip a video of ``total`` frames gives: :attr:`clips` windows
        (the first is :meth:`indices`), starting at ``round(j * (length - span) / (clips - 1))`` of the resampled
        clip, so the last ends at the video's end. A video shorter than ``clips`` windows end to end gives
        overlapping ones; windows that take the same frames are one (a video too short for one window gives
        one clip)."""
        if self.clips == 1:
            return (self.indices(total, rate),)
        length, _ = self._resampled(total, rate)
        last, gaps = max(0, length - self.span(total, rate)), self.clips - 1
        starts = dict.fromkeys((2 * j * last + gaps) // (2 * gaps) for j in range(self.clips))
        return tuple(dict.fromkeys(self._window(total, rate, start) for start in starts))

    def shortfall(self, total: int, rate: Fraction | None = None) -> str | None:
        """Why a clip of ``total`` frames gives fewer than the :attr:`effective_frames` asked, in words for the
        report (``None`` when it gives them all)."""
        found = self.available(total, rate)
        taken = self.fit(min(self.frames, found))
        if taken >= self.effective_frames:
            return None
        length, _ = self._resampled(total, rate)
        why = f"it has {total} frame{'s' if total != 1 else ''}"
        if length != total:
            why += f" at {float(rate or 0):g} fps, {length} at fps {float(self.fps):g}"
        if self.sampling == "every_k" and self.every > 1:
            why += f"; every {self.every}-th of them gives {found}"
        if taken < min(self.frames, found):
            why += f"; {min(self.frames, found)} rounded down to 1 + {self.stride}·m for the VAE"
        return f"{taken} of {self.effective_frames} frames ({why})"

    def key_fields(self) -> dict[str, Any]:
        """The settings as the clip keys of earlier versions held them (see :func:`legacy_clip_key_fields`)."""
        return {"frames": self.frames, "sampling": self.sampling, "every": self.every, "fps": float(self.fps),
                "stride": self.stride, "rules": VIDEO_RULES}

    def describe(self) -> dict[str, Any]:
        """The user's settings as plain JSON (a dataset's info); the stride comes from the VAE, not the user."""
        out: dict[str, Any] = {"frames": self.frames, "sampling": self.sampling, "every": self.every,
                               "fps": float(self.fps)}
        if self.clips != 1:  # absent in datasets stored before it: one clip per video
            out["clips"] = self.clips
        return out


def clip_key_fields(kind: str, indices: Sequence[int], stride: int | None) -> dict[str, Any]:
    """The ``extra`` fields of a clip's latent key: the frames it takes (``kind`` and the source frame
    ``indices``) and the decode rules, not the settings that chose them, so settings that take the same frames
    share one latent (``frame_count`` 10 and 9 with WAN's VAE). An unknown ``stride`` (the VAE not loaded yet)
    gives a key no stored clip has, so the VAE is asked for.
    """
    fields: dict[str, Any] = {"kind": kind, "indices": list(indices), "rules": VIDEO_RULES}
    if stride is None:
        fields["unresolved"] = True
    return {"clip": fields}


def legacy_clip_key_fields(settings: FrameSettings, kind: str, indices: Sequence[int]) -> dict[str, Any]:
    """The ``extra`` fields of a clip's latent key as earlier builds made them (the frame settings, the VAE's
    stride, the kind and the indices): a cache they filled keeps its clips' latents for unchanged settings."""
    return {"clip": {**settings.key_fields(), "kind": kind, "indices": list(indices)}}
