"""Feeding the encoders of one encode run: texts in batches, masks on the decode threads, images batch by batch
and clips one by one, each decoded on a thread pool ahead of the encoder call that takes it; a source that fails
is left out (or raised, by the failure policy), a stop request is honoured before each batch.

Kept apart from :mod:`.encode_commit`, to which each encoded batch is handed: this module decides what is decoded
and encoded when (its look-ahead bounds the host memory of decoded pixels), that one what is durable; the source
files themselves are read by :mod:`.encode_decode`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .batching import batched
from .encode_commit import BatchCommitter
from .encode_decode import decode_clip, decode_rows, make_mask
from .encode_jobs import EncodePlan, LatentJob, MaskJob
from .encode_report import EncodeReport
from .errors import SourceError, SourceFailure

__all__ = [
    "LOOKAHEAD_BATCHES",
    "CLIP_LOOKAHEAD",
    "ImageEncoder",
    "ClipEncoder",
    "TextEncoder",
    "StopRequested",
    "EncoderFeed",
]

log = logging.getLogger("dataset_cache.encode")

LOOKAHEAD_BATCHES = 2
"""Image batches decoded ahead of the one being encoded: one ready while one decodes hides decode jitter, and host
memory stays bounded at ``(LOOKAHEAD_BATCHES + 1) * batch_size`` decoded images."""

CLIP_LOOKAHEAD = 1
"""Clips decoded ahead of the one being encoded: a clip is up to :data:`.frames.MAX_CLIP_PIXEL_BYTES` of pixels,
so host memory stays at two clips while the decode of the next one hides behind the encode of this one."""

ImageEncoder = Callable[[torch.Tensor], Sequence[Any]]
ClipEncoder = Callable[[torch.Tensor], Any]
TextEncoder = Callable[[list[str]], Sequence[Any]]


class StopRequested(Exception):
    """``should_stop()`` asked to end the run (:func:`.encode_run.run_encode` commits what is finished)."""


class EncoderFeed:
    """Runs the encoders of one :func:`.encode_run.run_encode` call over its work (all methods run on the calling
    thread) and hands each encoded batch to ``commits``.

    Args:
        plan: the run's plan (its settings: batch size, failure policy).
        report: the run's report: failures and the ``encoder`` / ``decode_*`` timings grow here.
        commits: where each encoded batch goes (and the progress of batches that encoded nothing).
        should_stop: polled before each batch; True raises :class:`StopRequested`.
    """

    def __init__(self, plan: EncodePlan, report: EncodeReport, commits: BatchCommitter,
                 should_stop: Callable[[], bool] | None) -> None:
        self.plan, self.report, self.commits = plan, report, commits
        self.should_stop = should_stop
        self.failed_keys: set[str] = set()  # latents, mirrors and masks that could not be made
        self.t = report.timings

    def check_stop(self) -> None:
        """Raise :class:`StopRequested` when ``should_stop()`` says so."""
        if self.should_stop is not None and self.should_stop():
            raise StopRequested

    def encode_texts(self, encode: TextEncoder, todo: list[tuple[str, str]]) -> None:
        for batch in batched(todo, self.plan.settings.batch_size):
            self.check_stop()
            texts = [text for _, text in batch]
            start = time.perf_counter()
            out = list(encode(texts))
            self.t["encoder"] += time.perf_counter() - start
            if len(out) != len(batch):
                raise ValueError(f"encode_texts returned {len(out)} values for {len(batch)} texts; "
                                 "it must return one conditioning per text")
            self.commits.hand_over([k for k, _ in batch], out, "conditioning", len(batch))

    def leave_out(self, job: LatentJob | MaskJob, error: SourceError) -> None:
        """A source that failed to decode: raise it under ``failure_policy="stop"``, else leave its sample out of
        the dataset and report it."""
        if self.plan.settings.failure_policy == "stop":
            raise error
        log.warning("skipping %s: %s", job.relpath, error.reason)
        self.report.failures.append(SourceFailure(job.relpath, job.path, error.reason))
        self.failed_keys.add(job.key)

    def make_masks(self, jobs: Sequence[MaskJob], threads: int) -> None:
        """Make loss masks on the decode threads (no encoder), committing them ``batch_size * 8`` at a time."""
        step = max(1, self.plan.settings.batch_size * 8)
        with ThreadPoolExecutor(threads, thread_name_prefix="encode-mask") as pool:
            for batch in batched(list(jobs), step):
                self.check_stop()
                start = time.perf_counter()
                values = list(pool.map(make_mask, batch))
                self.t["decode_cpu"] += time.perf_counter() - start
                good_keys, good_values = [], []
                for job, value in zip(batch, values):
                    if isinstance(value, SourceError):
                        self.leave_out(job, value)
                    else:
                        good_keys.append(job.key)
                        good_values.append(value)
                if good_keys:
                    self.commits.hand_over(good_keys, good_values, "mask", len(batch))
                else:
                    self.commits.tick(len(batch))

    def encode_images(self, encode: ImageEncoder, batches: list[Sequence[LatentJob]], threads: int) -> None:
        pending: deque[tuple[Sequence[LatentJob], torch.Tensor, list[Future]]] = deque()
        source = iter(batches)
        with ThreadPoolExecutor(threads, thread_name_prefix="encode-decode") as pool:
            def submit_next() -> None:
                batch = next(source, None)
                if batch is not None:
                    width, height = batch[0].bucket
                    out = torch.empty((len(batch), height, width, 3), dtype=torch.float32)  # filled by the workers
                    step = -(-len(batch) // threads)  # one task per worker
                    pending.append((batch, out, [pool.submit(decode_rows, batch[i:i + step], out, i)
                                                 for i in range(0, len(batch), step)]))

            try:
                for _ in range(LOOKAHEAD_BATCHES + 1):
                    submit_next()
                while pending:
                    self.check_stop()
                    batch, out, futures = pending.popleft()
                    start = time.perf_counter()
                    results = [r for f in futures for r in f.result()]
                    self.t["decode_wait"] += time.perf_counter() - start
                    submit_next()
                    self.t["decode_cpu"] += sum(sec for _, sec in results)
                    self.encode_batch(encode, batch, out, [r for r, _ in results])
                    del out
            finally:
                for _, _, futures in pending:  # an exception or a stop: drop the look-ahead, keep what is committed
                    for f in futures:
                        f.cancel()

    def encode_clips(self, encode: ClipEncoder, jobs: Sequence[LatentJob], threads: int) -> None:
        """Encode clips one per encoder call, the next :data:`CLIP_LOOKAHEAD` decoding meanwhile."""
        pending: deque[tuple[LatentJob, torch.Tensor, Future]] = deque()
        source = iter(jobs)
        with ThreadPoolExecutor(max(1, min(threads, CLIP_LOOKAHEAD + 1)), thread_name_prefix="encode-clip") as pool:
            def submit_next() -> None:
                job = next(source, None)
                if job is not None:
                    assert job.clip is not None
                    width, height = job.bucket
                    out = torch.empty((len(job.clip.indices), height, width, 3), dtype=torch.float32)
                    pending.append((job, out, pool.submit(decode_clip, job, out)))

            try:
                for _ in range(CLIP_LOOKAHEAD + 1):
                    submit_next()
                while pending:
                    self.check_stop()
                    job, out, future = pending.popleft()
                    start = time.perf_counter()
                    error, seconds = future.result()
                    self.t["decode_wait"] += time.perf_counter() - start
                    self.t["decode_cpu"] += seconds
                    submit_next()
                    if error is not None:
                        self.leave_out(job, error)
                        self.commits.tick(1)
                        continue
                    start = time.perf_counter()
                    value = encode(out)
                    self.t["encoder"] += time.perf_counter() - start
                    del out
                    self.commits.hand_over([job.key], [value], "latent", 1)
            finally:
                for _, _, future in pending:
                    future.cancel()

    def encode_batch(self, encode: ImageEncoder, batch: Sequence[LatentJob], out: torch.Tensor,
                     pixels: list[torch.Tensor | SourceError | None]) -> None:
        """Encode one decoded batch: ``pixels[i]`` is None when image ``i`` is in ``out[i]`` (see
        :func:`.encode_decode.decode_rows`)."""
        good: list[tuple[LatentJob, torch.Tensor | None]] = []
        for job, px in zip(batch, pixels):
            if isinstance(px, SourceError):
                self.leave_out(job, px)
            else:
                good.append((job, px))
        if good:
            if len(good) == len(batch) and all(px is None for px in pixels):
                images = out  # the usual case: the workers filled the batch
            else:  # a failure left a hole, or an image did not fit its row
                images = torch.stack([out[i] if px is None else px
                                      for i, px in enumerate(pixels) if not isinstance(px, SourceError)])
            start = time.perf_counter()
            latents = list(encode(images))
            self.t["encoder"] += time.perf_counter() - start
            del images
            if len(latents) != len(good):
                raise ValueError(f"encode_images returned {len(latents)} values for a batch of {len(good)} images; "
                                 "it must return one latent per image")
            self.commits.hand_over([job.key for job, _ in good], latents, "latent", len(batch))
        else:
            self.commits.tick(len(batch))
