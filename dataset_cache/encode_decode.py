"""Reading and decoding sources for the encoder, on its worker threads: an image into its batch row, a clip's
sampled frames into its tensor, a mask reduced to latent resolution.

Every source's bytes are re-hashed against the hash its key was planned from, so a file edited after planning is
reported (a :class:`.SourceError` naming it), never stored under the old content's key. Kept apart from
:mod:`.encode_feed`, which decides what is decoded when, because this is all that touches the source files.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from .encode_jobs import LatentJob, MaskJob
from .errors import SourceError
from .imaging import load_image, load_mask
from .keys import hash_bytes, hash_file
from .video import load_clip

__all__ = ["WHOLE_VIDEO_BYTES", "decode_rows", "decode_clip", "make_mask"]

WHOLE_VIDEO_BYTES = 64 << 20
"""Videos up to this size are read once into memory, re-hashed and decoded from those very bytes; larger ones are
re-hashed from the file, then decoded from it in a stream (memory stays flat; an edit in between is the
source-record's ordinary trust window)."""


def _read_source(path: str, source_hash: str, what: str) -> bytes:
    """The bytes of a source file, checked against the hash its key was made from: a file edited after planning
    must never be stored under the old content's key.

    Raises:
        SourceError: naming the file: it cannot be read, or it changed since the plan.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SourceError(path, f"cannot read {what}: {exc.strerror or exc}") from exc
    if hash_bytes(data) != source_hash:
        raise SourceError(path, "the file changed after the folder was scanned; run the encode again")
    return data


def _decode(job: LatentJob, out: torch.Tensor, row: int) -> tuple[torch.Tensor | SourceError | None, float]:
    """Read, re-hash and decode one image (worker thread) into ``out[row]``.

    Returns ``None`` (the pixels are in ``out[row]``), the pixels when they do not fit there, or the error; and the
    seconds taken. Copying into the batch here, on the workers, spares the calling thread a ``torch.stack`` of
    the whole batch between encoder calls.
    """
    start = time.perf_counter()
    try:
        data = _read_source(job.path, job.source_hash, "image")
        try:
            pixels = load_image(io.BytesIO(data), job.plan)  # type: ignore[arg-type]  # Pillow opens file objects
        except SourceError as exc:  # the message named the BytesIO; name the file
            raise SourceError(job.path, exc.reason) from exc
        if pixels.shape == out.shape[1:] and pixels.dtype == out.dtype:
            out[row].copy_(pixels)
            return None, time.perf_counter() - start
        return pixels, time.perf_counter() - start
    except SourceError as exc:
        return exc, time.perf_counter() - start


def make_mask(job: MaskJob) -> Any:
    """Read, re-hash and reduce one mask (worker thread): its entry value ``{"mask": uint8 [1, 1, h, w]}``, or
    the :class:`.SourceError` naming the file."""
    try:
        data = _read_source(job.path, job.source_hash, "mask")
        return {"mask": load_mask(io.BytesIO(data), job.mode, job.plan, job.factor,  # type: ignore[arg-type]
                                  name=job.path)}
    except SourceError as exc:
        return exc


def decode_clip(job: LatentJob, out: torch.Tensor) -> tuple[SourceError | None, float]:
    """Read, re-hash and decode one clip's sampled frames into ``out`` (worker thread); the error, and the seconds."""
    start = time.perf_counter()
    clip = job.clip
    assert clip is not None
    try:
        with torch.inference_mode(out.is_inference()):  # see decode_rows
            if clip.frames:
                load_clip(None, clip.indices, job.plan, out, name=job.path, frames=clip.frames,
                          frame_hashes=clip.frame_hashes)
                return None, time.perf_counter() - start
            try:
                size = os.stat(job.path).st_size
                if size <= WHOLE_VIDEO_BYTES:
                    with open(job.path, "rb") as f:
                        data: bytes | None = f.read()
                    digest = hash_bytes(data)  # type: ignore[arg-type]
                else:
                    data, digest = None, hash_file(job.path)
            except OSError as exc:
                raise SourceError(job.path, f"cannot read video: {exc.strerror or exc}") from exc
            if digest != job.source_hash:
                raise SourceError(job.path, "the file changed after the folder was scanned; run the encode again")
            load_clip(io.BytesIO(data) if data is not None else job.path, clip.indices, job.plan, out, name=job.path)
        return None, time.perf_counter() - start
    except SourceError as exc:
        return exc, time.perf_counter() - start


def decode_rows(jobs: Sequence[LatentJob], out: torch.Tensor, first: int
                 ) -> list[tuple[torch.Tensor | SourceError | None, float]]:
    """Decode consecutive rows of a batch (one worker task: a task per image cost the calling thread a submit and
    a wake-up each).

    ``out`` was made by the calling thread, which may run under ``torch.inference_mode`` (ComfyUI executes nodes so);
    that mode is thread-local, so the worker enters the same one before writing into it.
    """
    with torch.inference_mode(out.is_inference()):
        return [_decode(job, out, first + i) for i, job in enumerate(jobs)]
