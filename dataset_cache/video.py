"""Reading video clips with PyAV: a video's header, whether it holds what the header claims, and its frames.

Kept apart from :mod:`.frames` (which frames a clip gives, and its key) because this is the only part of clips that
opens files and needs PyAV (``av``), which ComfyUI itself requires: the library imports it only when a video is met
and names the file when it is missing. A ``.frames`` folder's frames are decoded here too, as images.

Decoding never holds a whole clip: frames are decoded in order up to the last one sampled, and only sampled
frames are converted, resized and cropped, straight into the clip's row of the batch (``[T, H, W, 3]`` at the
bucket's size). Only the container formats listed in :data:`OPEN_FORMATS` are opened, whatever the file is named,
so a renamed file can never reach another demuxer. A video's rotation metadata (phone videos' display matrix) is
not applied: frames are taken as stored, and sized from the header that says so. What :func:`load_clip` gives is
named in every clip's key by :data:`.frames.VIDEO_RULES`.

A truncated video is refused even when its sampled frames come before the damage: its packets must reach what its
header claims (:func:`check_complete`: the frame count of an MP4/MOV header, the duration of a Matroska/WebM
track). Matroska files are checked when planning (their frames are counted then anyway); MP4/MOV, whose header
holds the count, when the clip is decoded, which walks every packet (decoding only up to the last sampled frame).
"""

from __future__ import annotations

import functools
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
    "OPEN_FORMATS",
    "VideoInfo",
    "probe_video",
    "check_complete",
    "load_clip",
]

MAX_VIDEO_PIXELS = 1 << 26
"""Width × height a video header may claim (8192×8192): a header claiming more is refused, never allocated."""

OPEN_FORMATS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"})
"""FFmpeg demuxer names a video may open with (MP4/MOV and Matroska/WebM)."""


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
