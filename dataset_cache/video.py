"""Video clips as samples: frame settings, which frames a clip gives, and streaming their pixels.

A clip is one training sample made of frames. Two kinds are found by :mod:`.listing`:

* a video file (``.mp4 .webm .mov .mkv``, any case), read with PyAV (``av``), which ComfyUI itself requires;
  the library imports it only when a video is met and names the file when it is missing;
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

Decoding never holds a whole clip: frames are decoded in order up to the last one sampled, and only sampled
frames are converted, resized and cropped, straight into the clip's row of the batch (``[T, H, W, 3]`` at the
bucket's size). Only the container formats listed in :data:`OPEN_FORMATS` are opened, whatever the file is named,
so a renamed file can never reach another demuxer. A video's rotation metadata (phone videos' display matrix) is
not applied: frames are taken as stored, and sized from the header that says so.

A truncated video is refused even when its sampled frames come before the damage: its packets must reach what its
header claims (:func:`check_complete`: the frame count of an MP4/MOV header, the duration of a Matroska/WebM
track). Matroska files are checked when planning (their frames are counted then anyway); MP4/MOV, whose header
holds the count, when the clip is decoded, which walks every packet (decoding only up to the last sampled frame).
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import SourceError

if TYPE_CHECKING:
    from .buckets import CropPlan

__all__ = [
    "VIDEO_EXTENSIONS",
    "FRAMES_SUFFIX",
    "SAMPLING_MODES",
    "MAX_CLIP_FRAMES",
    "MAX_CLIP_PIXEL_BYTES",
    "VIDEO_RULES",
    "OPEN_FORMATS",
    "MIN_FPS",
    "MAX_FPS",
    "FrameSettings",
    "VideoInfo",
    "clip_folder_of",
    "frame_order",
    "probe_video",
    "check_complete",
    "load_clip",
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

MAX_CLIP_PIXEL_BYTES = 2 << 30
"""Decoded float32 pixels of one clip at its bucket size (2 GiB: 81 frames at 1280×720 take 0.9 GiB). A clip
above it is left out as a failure naming it, before anything is decoded."""

MAX_VIDEO_PIXELS = 1 << 26
"""Width × height a video header may claim (8192×8192): a header claiming more is refused, never allocated."""

VIDEO_RULES = "av:rgb24,decode-order,resize-then-crop;v1"
"""Names the decode rules of :func:`load_clip` inside every clip's latent key (see ``PIXEL_RULES``)."""

OPEN_FORMATS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})
"""FFmpeg demuxer names a video may open with (MP4/MOV and Matroska/WebM)."""

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
    """

    frames: int = 17
    sampling: str = "first"
    every: int = 1
    fps: float = 0.0
    stride: int | None = 1

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
        length, step = self._resampled(total, rate)
        n = self.fit(min(self.frames, self.available(total, rate)))
        virtual: Sequence[int]
        if self.sampling == "first":
            virtual = range(n)
        elif self.sampling == "every_k":
            virtual = range(0, n * self.every, self.every)
        elif n == 1:
            virtual = range(length // 2, length // 2 + 1)
        else:  # evenly spread, exact integer rounding of i * (length - 1) / (n - 1)
            virtual = [(2 * i * (length - 1) + (n - 1)) // (2 * (n - 1)) for i in range(n)]
        return tuple(min(total - 1, math.floor(j * step)) for j in virtual)

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
        return {"frames": self.frames, "sampling": self.sampling, "every": self.every, "fps": float(self.fps)}


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


@dataclass(frozen=True)
class VideoInfo:
    """What a video's header says: size of its frames, their count and rate (``None`` when it has none)."""

    width: int
    height: int
    frames: int
    rate: Fraction | None


def _av(path: str) -> Any:
    try:
        import av
    except ImportError as exc:
        raise SourceError(path, "reading a video needs PyAV (the `av` package, which ComfyUI installs with its "
                                "requirements); install it in this Python (`pip install av`), or give the clip as "
                                "a folder of frames (<name>.frames/)") from exc
    return av


def _open(path: str | os.PathLike[str] | Any, name: str) -> Any:
    av = _av(name)
    try:
        container = av.open(path, mode="r", metadata_errors="ignore")
    except Exception as exc:  # PyAV raises many types for hostile input; all mean "not a usable video"
        raise SourceError(name, f"not a readable video ({type(exc).__name__}: {exc})") from exc
    try:
        if container.format.name not in OPEN_FORMATS:
            raise SourceError(name, f"is a {container.format.name!r} file, not an MP4/MOV/WebM/MKV video; "
                                    "convert it (e.g. ffmpeg -i in -c:v libx264 out.mp4)")
        if not container.streams.video:
            raise SourceError(name, "holds no video stream (is it an audio file, or truncated?)")
    except BaseException:
        container.close()
        raise
    return container


_probes: dict[tuple[str, int, int], VideoInfo] = {}
_probes_lock = threading.Lock()
_PROBES_KEPT = 4096


def probe_video(path: str) -> VideoInfo:
    """Return a video's frame size, frame count and rate from its header (packets are counted, not decoded,
    when the header gives no count).

    Results are remembered in this process by path, size and mtime, so the two or three plans of one ComfyUI run
    open an unchanged video once.

    Raises:
        SourceError: PyAV is missing, or the file is not a readable MP4/MOV/WebM/MKV video, claims an empty or
            oversized frame, or holds no frame.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SourceError(path, f"cannot stat video: {exc.strerror or exc}") from exc
    memo = (path, st.st_size, st.st_mtime_ns)
    with _probes_lock:
        hit = _probes.get(memo)
    if hit is not None:
        return hit
    with _open(path, path) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context
        if codec is None:  # a header cut short (seen on truncated MP4s)
            raise SourceError(path, "video header is incomplete (truncated?); re-download or re-encode it")
        width, height = int(codec.width or 0), int(codec.height or 0)
        if width <= 0 or height <= 0:
            raise SourceError(path, f"video header claims an empty frame size {width}x{height}")
        if width * height > MAX_VIDEO_PIXELS:
            raise SourceError(path, f"video frames are {width}x{height}, above the limit of {MAX_VIDEO_PIXELS} "
                                    "pixels; scale the video down first")
        count = int(stream.frames or 0)
        if count <= 0:  # no count in the header (Matroska/WebM): the packets are counted, and checked complete
            packets = _Packets(stream)
            try:
                for packet in container.demux(stream):
                    packets.add(packet)
            except Exception as exc:  # a truncated or corrupt stream
                raise SourceError(path, f"video stream is corrupt or truncated ({type(exc).__name__}: {exc})"
                                  ) from exc
            check_complete(container, stream, packets, path)
            count = packets.count
        rate = stream.average_rate or stream.guessed_rate
        rate = Fraction(rate) if rate else None
    if count <= 0:
        raise SourceError(path, "video holds no frame")
    info = VideoInfo(width, height, count, rate)
    with _probes_lock:
        if len(_probes) >= _PROBES_KEPT:
            _probes.clear()
        _probes[memo] = info
    return info


class _Packets:
    """The packets of one stream as they are demuxed: how many hold data, and when the last of them ends."""

    def __init__(self, stream: Any) -> None:
        self.count = 0
        self.timed = True  # every packet with data has a duration (else its end is its start)
        self._ticks: int | None = None
        self._base = stream.time_base

    def add(self, packet: Any) -> None:
        if not packet.size:  # the demuxer's final empty packet (it flushes the decoder)
            return
        self.count += 1
        if not packet.duration:
            self.timed = False
        if packet.pts is not None:
            ticks = packet.pts + (packet.duration or 0)
            self._ticks = ticks if self._ticks is None else max(self._ticks, ticks)

    @property
    def end(self) -> Fraction | None:
        """Seconds at which the last packet ends (``None``: no packet had a timestamp)."""
        return None if self._ticks is None or not self._base else self._ticks * Fraction(self._base)


def _tag_seconds(value: Any) -> Fraction | None:
    """A Matroska ``DURATION`` tag (``HH:MM:SS.nnnnnnnnn``, as FFmpeg and mkvmerge write it) in seconds."""
    match = re.fullmatch(r"(\d{1,6}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?", str(value).strip()[:32]) if value else None
    if match is None:
        return None
    hours, minutes, secs, frac = match.groups()
    return (int(hours) * 3600 + int(minutes) * 60 + int(secs)) + (Fraction(int(frac), 10 ** len(frac)) if frac
                                                                  else Fraction(0))


def _declared(container: Any, stream: Any) -> tuple[int | None, Fraction | None]:
    """What a video's header says its stream holds: a frame count (an MP4/MOV sample table; mkvmerge's
    ``NUMBER_OF_FRAMES`` tag) and, for Matroska/WebM, a duration in seconds (the track's ``DURATION`` tag, else the
    segment's when the track is its only stream: with audio it may run longer). ``None`` where it says nothing.
    No other duration is used: FFmpeg may estimate one from the bit rate, which proves nothing about the file."""
    frames = int(stream.frames or 0)
    if container.format.name != "matroska,webm":
        return (frames or None), None
    meta = {str(k).upper(): v for k, v in (stream.metadata or {}).items()}
    if frames <= 0:
        tag = str(meta.get("NUMBER_OF_FRAMES", "")).strip()[:20]
        frames = int(tag) if tag.isdecimal() and tag.isascii() else 0
    seconds = _tag_seconds(meta.get("DURATION"))
    if seconds is None and container.duration and len(container.streams) == 1:
        seconds = Fraction(container.duration, 1_000_000)
    return (frames or None), seconds


def check_complete(container: Any, stream: Any, packets: _Packets, name: str) -> None:
    """Refuse a video whose demuxed packets fall short of what its header claims: their count against the
    header's frame count, else the time the last of them ends at against the header's duration, with half a frame
    of slack for rounding (a frame and a half when a packet has no duration: its end is then its start).

    Raises:
        SourceError: naming the video, both figures and what to do.
    """
    frames, seconds = _declared(container, stream)
    fix = "the file is truncated (an interrupted copy or download?); re-download or re-encode it"
    if frames is not None:
        if packets.count < frames:
            raise SourceError(name, f"video holds {packets.count} of the {frames} frames its header claims: {fix}")
        return
    rate = stream.average_rate or stream.guessed_rate
    end = packets.end
    if seconds is None or end is None or not rate:
        return  # the header says nothing to compare with
    if end + Fraction(1 if packets.timed else 3, 2) / Fraction(rate) < seconds:
        raise SourceError(name, f"video's frames end at {float(end):.2f} s of the {float(seconds):.2f} s its header "
                                f"claims: {fix}")


def _put(out: torch.Tensor, rows: Sequence[int], img: Any, plan: CropPlan, name: str) -> None:
    from .imaging import apply_plan

    arr = np.asarray(apply_plan(img, plan, path=name), dtype=np.uint8)
    pixels = torch.from_numpy(arr.copy()).to(torch.float32).div_(255.0)
    for row in rows:
        out[row].copy_(pixels)


def load_clip(source: str | os.PathLike[str] | Any, indices: Sequence[int], plan: CropPlan, out: torch.Tensor, *,
              name: str, frames: Sequence[str] | None = None, frame_hashes: Sequence[str] | None = None) -> None:
    """Decode the frames ``indices`` of one clip into ``out`` (``[len(indices), H, W, 3]`` float32, 0..1).

    Args:
        source: the video (a path or a file object); ignored for a frame folder.
        indices: source frame indices, non-decreasing (a resampled clip may repeat one).
        plan: the spatial crop plan, made for the clip's frame size.
        out: where the frames go, row by row.
        name: the clip's path, named in errors.
        frames: for a frame folder, the frame files in order (``indices`` index them).
        frame_hashes: the content hash each frame's key was planned from; a frame edited since is refused.

    Raises:
        SourceError: the clip is unreadable, corrupt, truncated (fewer frames than it claimed), or changed.
    """
    wanted: dict[int, list[int]] = {}
    for row, index in enumerate(indices):
        wanted.setdefault(index, []).append(row)
    if frames is not None:
        _load_frames(frames, wanted, plan, out, frame_hashes)
        return
    last = max(wanted)
    found = 0
    index = 0
    with _open(source, name) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        packets = _Packets(stream)
        try:
            for packet in container.demux(stream):  # every packet: the file must hold what its header claims
                packets.add(packet)
                if index > last:
                    continue  # past the last sampled frame: counted, not decoded
                for frame in packet.decode():
                    rows = wanted.get(index)
                    if rows is not None:  # only sampled frames are converted: the rest are dropped as decoded
                        _put(out, rows, frame.to_image(), plan, name)
                        found += 1
                    index += 1
            check_complete(container, stream, packets, name)
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(name, f"video stream is corrupt or truncated ({type(exc).__name__}: {exc})") from exc
    if found < len(wanted):
        raise SourceError(name, f"video ends before frame {last + 1} (it decodes to fewer frames than its header "
                                "claims: truncated?); re-encode or re-download it")


def _load_frames(frames: Sequence[str], wanted: Mapping[int, list[int]], plan: CropPlan, out: torch.Tensor,
                 frame_hashes: Sequence[str] | None) -> None:
    import io

    from .imaging import decode_image
    from .keys import hash_bytes

    for index, rows in sorted(wanted.items()):
        path = frames[index]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise SourceError(path, f"cannot read frame: {exc.strerror or exc}") from exc
        if frame_hashes is not None and hash_bytes(data) != frame_hashes[index]:
            raise SourceError(path, "the frame changed after the folder was scanned; run the encode again")
        try:
            img = decode_image(io.BytesIO(data))  # type: ignore[arg-type]
        except SourceError as exc:
            raise SourceError(path, exc.reason) from exc
        _put(out, rows, img, plan, path)


@functools.lru_cache(maxsize=1)
def has_av() -> bool:
    """Whether PyAV can be imported (for tests and reports)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True
