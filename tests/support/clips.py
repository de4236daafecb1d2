"""Tiny clips generated at test time: videos written with PyAV and ``.frames`` folders of PNG frames.

Frame ``i`` is filled with the grey level :func:`level` ``(i)`` (plus a small gradient so codecs have something
to code), so a test can tell from decoded pixels which source frames a clip gave.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["level", "frame_array", "make_video", "make_frames_folder", "truncate"]


def level(i: int) -> int:
    """The grey level of frame ``i`` (0..250, steps of 10, repeating after 26 frames)."""
    return (i * 10) % 260


def frame_array(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i`` as ``uint8 [H, W, 3]``."""
    arr = np.full((height, width, 3), level(i), np.uint8)
    return arr


def make_video(path: Path, frames: int, *, width: int = 64, height: int = 48, fps: int = 8,
               codec: str = "mpeg4", faststart: bool = False) -> Path:
    """Write a video of ``frames`` frames (``.mp4``/``.mov`` with MPEG-4 part 2, ``.webm`` with VP8).

    ``faststart`` writes an MP4's index (with its frame count) before the frames, as web videos are laid out, so
    a truncated copy still opens and its first frames still decode.
    """
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".webm":
        codec = "libvpx"
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "1"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_array(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def make_frames_folder(path: Path, frames: int, *, width: int = 64, height: int = 48, pad: int = 0) -> Path:
    """Write ``frames`` PNG frames ``0.png``, ``1.png``... (zero-padded to ``pad`` digits) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(frames):
        Image.fromarray(frame_array(i, width, height)).save(path / f"{i:0{pad}d}.png")
    return path


def truncate(path: Path, fraction: float = 2 / 3) -> Path:
    """Cut a file to ``fraction`` of its bytes, as an interrupted copy or download leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path
