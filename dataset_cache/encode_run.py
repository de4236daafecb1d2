"""The second half of encoding: encode only what is missing, in bucket batches, committing each batch durably.

The first half, :func:`.encode_plan.plan_encode`, says what a folder needs; :func:`run_encode` encodes exactly that:

* conditionings first (each distinct caption text once, shuffled variants and the empty caption among them),
  then loss masks (no encoder: decoded and averaged down to latent resolution on the decode threads,
  :func:`.imaging.load_mask`), then latents bucket by bucket (mirrors among them), ``batch_size`` per encoder
  call, so each model is needed in one stretch;
* images are decoded, resized and cropped on a small thread pool up to :data:`LOOKAHEAD_BATCHES` batches ahead
  of the encoder, so the GPU does not wait on Pillow. Each image's bytes are re-hashed against the hash its key
  was planned from: a file edited after planning is reported, never stored under the old content's key;
* every finished batch is added and checkpointed (:meth:`.format.writer.CacheWriter.checkpoint`: one append to
  the writer's recovery log, no fsync, no small shard) on a background thread while the encoder runs the next
  batch, so an exception or a stop request loses at most the batch in flight, a ``kill -9`` at most that one and,
  while its checkpoint is still being written (about a millisecond), the one before (``background_commits=False``:
  only the batch in flight), and the next run encodes exactly the rest; the log is fsynced about once a second
  (``sync_seconds``), so a power loss or an OS crash loses at most the last second or so of batches, and the
  cache stays readable whatever happens. Entries are published in full-size shards as they fill and at the end;
* the cache's write lock serialises writers: a second process encoding into the same cache waits (saying so),
  then reuses whatever the first one stored;
* at the end the rest is committed (fsync), the dataset's sample list is stored and the cache is compacted, which
  merges the run's last, partly filled shard with earlier small ones (skipped, with a log line, while a reader
  holds the cache's read lock).

Callbacks (``progress``, ``should_stop``) are only ever called from the calling thread: ComfyUI's progress bar
and interrupt check do not work from other threads. Unreadable images follow ``settings.failure_policy``:
``"skip"`` leaves the sample out (counted and listed in the report), ``"stop"`` raises :class:`.SourceError`
naming the file. A zero tensor never stands in for data.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .batching import batched
from .dataset import Sample
from .encode_decode import decode_clip, decode_rows, make_mask
from .encode_plan import EncodePlan, LatentJob, MaskJob, samples_digest, settle_sources, variant_counts
from .encode_report import EncodeReport
from .errors import CacheLockedError, SourceError
from .format.writer import LOG_SYNC_SECONDS, CacheWriter, CompactReport
from .lock import READ_LOCK, WRITE_LOCK, CacheLock
from .scan import DatasetFolderError, SourceFailure
from .threads import resolve_threads
from .units import format_bytes

__all__ = [
    "LOOKAHEAD_BATCHES",
    "run_encode",
    "compact_if_unread",
    "images_per_call",
    "MAX_PIXEL_BATCH_BYTES",
]

log = logging.getLogger("dataset_cache.encode")

MAX_PIXEL_BATCH_BYTES = 1 << 30
"""Decoded float32 pixels of one VAE call (1 GiB: eight 4096² images, one 8192² image). A bucket whose images are
larger gets fewer per call, so a large ``resolution`` can never turn ``batch_size`` into tens of GB of host memory;
the VAE's own memory is ComfyUI's (it splits or tiles an encode by the device's free memory)."""


def images_per_call(bucket: tuple[int, int], batch_size: int) -> int:
    """How many images of ``bucket`` (width, height) one encoder call takes: ``batch_size``, or fewer when their
    pixels would pass :data:`MAX_PIXEL_BATCH_BYTES` (never less than one)."""
    per_image = bucket[0] * bucket[1] * 3 * 4
    return max(1, min(int(batch_size), MAX_PIXEL_BATCH_BYTES // per_image))


LOOKAHEAD_BATCHES = 2
"""Image batches decoded ahead of the one being encoded: one ready while one decodes hides decode jitter, and host
memory stays bounded at ``(LOOKAHEAD_BATCHES + 1) * batch_size`` decoded images."""

_LOCK_POLL_S = 0.2

CLIP_LOOKAHEAD = 1
"""Clips decoded ahead of the one being encoded: a clip is up to :data:`.video.MAX_CLIP_PIXEL_BYTES` of pixels,
so host memory stays at two clips while the decode of the next one hides behind the encode of this one."""

ImageEncoder = Callable[[torch.Tensor], Sequence[Any]]
ClipEncoder = Callable[[torch.Tensor], Any]
TextEncoder = Callable[[list[str]], Sequence[Any]]


def _shard_sizes(root: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with os.scandir(os.path.join(root, "shards")) as it:
            for e in it:
                if e.name.endswith(".safetensors") and not e.name.startswith("."):
                    out[e.name] = e.stat().st_size
    except FileNotFoundError:
        pass
    return out


class _Stopped(Exception):
    """Internal: should_stop() asked to end the run."""


class _Run:
    """The state of one :func:`run_encode` call (all methods run on the calling thread)."""

    def __init__(self, plan: EncodePlan, writer: CacheWriter, report: EncodeReport,
                 progress: Callable[[int, int], None] | None, should_stop: Callable[[], bool] | None) -> None:
        self.plan, self.writer, self.report = plan, writer, report
        self.progress, self.should_stop = progress, should_stop
        self.done = 0
        self.total = 0
        self.failed_keys: set[str] = set()  # latents, mirrors and masks that could not be made
        self.t = report.timings
        self.min_commit_seconds = 0.0
        self.last_commit = float("-inf")
        self._committer: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[None], str, int, int] | None = None  # (checkpoint, kind, entries, items)

    def tick(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise _Stopped

    def commit(self, keys: Sequence[str], values: Sequence[Any], kind: str) -> None:
        """Add and checkpoint one encoded batch (on the committer thread when commits run in the background)."""
        start = time.perf_counter()
        for key, value in zip(keys, values):
            self.writer.add(key, value, kind=kind, name=kind)
        if start - self.last_commit >= self.min_commit_seconds:
            self.writer.checkpoint()
            self.last_commit = time.perf_counter()
        self.t["commit"] += time.perf_counter() - start

    def start_background_commits(self) -> None:
        """Checkpoint each batch on one background thread while the encoder runs the next one (see run_encode)."""
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="encode-commit")

    def hand_over(self, keys: Sequence[str], values: Sequence[Any], kind: str, items: int) -> None:
        """Commit one encoded batch (``items`` work items, ``keys`` of them encoded); report it once checkpointed.

        In the background, the previous batch's checkpoint is awaited first (one batch pending at most: bounded
        memory, and its error surfaces here with its traceback); progress is reported per checkpointed batch.
        """
        if self._committer is None:
            self.commit(keys, values, kind)
            self._checkpointed(kind, len(keys), items)
            return
        self.wait_for_commit()
        self._pending = (self._committer.submit(self.commit, keys, values, kind), kind, len(keys), items)

    def wait_for_commit(self) -> None:
        """Wait until the batch handed over last is checkpointed (raising its error); the writer is ours again."""
        if self._pending is None:
            return
        future, kind, entries, items = self._pending
        self._pending = None
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.t["commit_wait"] += time.perf_counter() - start
        self._checkpointed(kind, entries, items)

    def _checkpointed(self, kind: str, entries: int, items: int) -> None:
        if kind == "latent":
            self.report.encoded_latents += entries
        elif kind == "mask":
            self.report.encoded_masks += entries
        else:
            self.report.encoded_conditionings += entries
        self.tick(items)

    def stop_background_commits(self, *, failing: bool) -> None:
        """Checkpoint the batch still pending and end the committer thread.

        With ``failing`` (the encode is ending by an exception or a stop), an error of that last checkpoint is
        logged rather than raised, so the original exception is the one the caller sees.
        """
        if self._committer is None:
            return
        try:
            self.wait_for_commit()
        except Exception as exc:
            if not failing:
                raise
            log.warning("%s: the last encoded batch could not be checkpointed (%s)", self.plan.cache_root, exc)
        finally:
            self._committer.shutdown(wait=True)
            self._committer = None

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
            self.hand_over([k for k, _ in batch], out, "conditioning", len(batch))

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
                    self.hand_over(good_keys, good_values, "mask", len(batch))
                else:
                    self.tick(len(batch))

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
                        self.tick(1)
                        continue
                    start = time.perf_counter()
                    value = encode(out)
                    self.t["encoder"] += time.perf_counter() - start
                    del out
                    self.hand_over([job.key], [value], "latent", 1)
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
            self.hand_over([job.key for job, _ in good], latents, "latent", len(batch))
        else:
            self.tick(len(batch))


def _acquire(lock: CacheLock, root: str, should_stop: Callable[[], bool] | None) -> bool:
    """Take the write lock, polling ``should_stop`` while another process holds it. False when stopped."""
    told = False
    while True:
        try:
            lock.acquire()
            return True
        except CacheLockedError:
            if not told:
                log.warning("%s: another process is encoding into this cache; waiting for it to finish "
                            "(whatever it stores is reused, not encoded again)", root)
                told = True
            if should_stop is not None and should_stop():
                return False
            time.sleep(_LOCK_POLL_S)


def compact_if_unread(writer: CacheWriter, root: str | os.PathLike[str], *,
                      purpose: str = "compaction after encode") -> CompactReport | None:
    """Compact unless a reader holds the cache (compaction deletes replaced shards under its feet).

    Returns None, with a log line, when a reader (a training) holds the read lock: the next encode, save or
    ``clean`` compacts instead.
    """
    try:
        with CacheLock(root, READ_LOCK, exclusive=True, timeout=0, purpose=purpose):
            return writer.compact()
    except CacheLockedError:
        log.info("%s: a reader holds the cache; compaction skipped (the next encode or `clean` does it)", root)
        return None


def _finish(run: _Run, plan: EncodePlan) -> tuple[Sample, ...]:
    """Return the dataset's samples after encode-time failures, checking failures against the policy."""
    samples = tuple(s for s in plan.samples if run.failed_keys.isdisjoint((s.latent, s.mirror, s.mask)))
    run.report.skipped += len(plan.samples) - len(samples)
    if not samples:
        first = run.report.failures[0] if run.report.failures else None
        raise DatasetFolderError(plan.folder, "no image or clip could be encoded" + (
            f"; first problem: {first.relpath}: {first.reason}" if first else ""))
    return samples


def run_encode(
    plan: EncodePlan,
    *,
    encode_images: ImageEncoder | None,
    encode_texts: TextEncoder | None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    min_commit_seconds: float = 0.0,
    sync_seconds: float = LOG_SYNC_SECONDS,
    background_commits: bool = True,
    encode_clips: ClipEncoder | None = None,
) -> EncodeReport:
    """Encode what ``plan`` lists as missing, checkpoint it batch by batch, store the dataset and compact.

    Args:
        plan: from :func:`plan_encode`.
        encode_images: takes a float32 ``[B, H, W, 3]`` batch (0..1, one bucket) and returns ``B`` latent values
            (ComfyUI latent dicts ``{"samples": Tensor[1, C, h, w]}``); may be ``None`` when
            ``plan.needs_vae`` is false.
        encode_clips: takes one clip's frames, float32 ``[T, H, W, 3]``, and returns its latent value (ComfyUI
            ``{"samples": Tensor[1, C, T', h, w]}`` from a video VAE); needed only when ``plan.missing_clips``.
        encode_texts: takes a list of texts and returns one conditioning per text (ComfyUI
            ``[[Tensor[1, T, D], {"pooled_output": ...}]]``); may be ``None`` when ``plan.needs_text_encoder`` is
            false.
        progress: ``progress(done, total)`` after each checkpointed batch (entries, not batches).
        should_stop: polled before each batch (and while waiting for another writer); returning True ends the
            run with ``report.stopped`` set after committing everything already encoded.
        min_commit_seconds: ``0`` (default) checkpoints every batch, so an exception or ``kill -9`` loses at
            most the batch in flight. A positive value checkpoints a finished batch only when this long has passed
            since the last checkpoint, losing up to that much finished work on a ``kill -9``; a stop request or an
            exception still commits everything finished. (A checkpoint is one append to a log, so this is rarely
            worth it.)
        sync_seconds: the recovery log is fsynced by the first checkpoint at least this long after the previous
            fsync (default :data:`.format.writer.LOG_SYNC_SECONDS`, 1 s); ``0`` fsyncs every checkpoint, so a power
            loss too loses at most the batch in flight. Process death (Cancel, exception, ``kill -9``) never needs
            the fsync.
        background_commits: ``True`` (default) adds and checkpoints each encoded batch on one background thread
            while the encoder runs the next batch, so the encoder does not wait for the bookkeeping (figures:
            docs/BENCHMARKS.md). One batch is pending at most; a stop request or an
            exception waits for it, so they still lose only the batch in flight. A ``kill -9`` during the first
            moments of an encoder call (a batch's checkpoint takes about a millisecond) can also lose the batch
            before it; ``False`` checkpoints on the calling thread before the next encoder call, so a ``kill -9``
            loses at most the batch in flight at any instant.

    Raises:
        SourceError: with ``failure_policy="stop"``, the first unusable source file (nothing after it is encoded;
            batches already committed stay).
        ValueError: an encoder is needed but missing, or returned the wrong number of values.
        UnstorableValueError: an encoder returned a value the cache cannot store (the message names its path).
        CacheError: the cache cannot be written.
    """
    start = time.perf_counter()
    report = _new_report(plan)
    if plan.failures and plan.settings.failure_policy == "stop":
        raise plan.failures[0].error()
    if plan.sourceless or plan.up_to_date:
        return _nothing_to_encode(plan, report, start)
    lock = CacheLock(plan.cache_root, WRITE_LOCK, timeout=0, purpose="encode")  # polled: see _acquire
    t_lock = time.perf_counter()
    if not _acquire(lock, plan.cache_root, should_stop):
        report.stopped = True
        report.seconds = time.perf_counter() - start
        return report
    report.timings["lock_wait"] = time.perf_counter() - t_lock
    try:
        before = _shard_sizes(plan.cache_root)
        writer = CacheWriter(plan.cache_root, shard_bytes=plan.settings.shard_bytes, checkpoints=True,
                             sync_seconds=sync_seconds)
        try:
            work = _pending_work(plan, writer, report)
            _check_encoders(plan, work, encode_images, encode_texts, encode_clips)
            run = _Run(plan, writer, report, progress, should_stop)
            run.min_commit_seconds = max(0.0, float(min_commit_seconds))
            run.total = work.total
            if progress is not None:
                progress(0, run.total)
            _encode_all(run, work, encode_images, encode_texts, encode_clips, background_commits)
            _commit_and_count(run, work, before)
            if not report.stopped:
                _store_dataset(run)
        except BaseException:
            # Entries already added are finished encodes (the failing batch never reached add), so keep them.
            try:
                writer.commit()
            except Exception as exc:
                log.warning("%s: could not commit finished entries after an error (%s)", plan.cache_root, exc)
                writer.abort()
            raise
        finally:
            writer.close()
    finally:
        lock.release()
    report.failed = len(report.failures)
    report.seconds = time.perf_counter() - start
    log.info("%s", report.summary())
    return report


def _new_report(plan: EncodePlan) -> EncodeReport:
    report = EncodeReport(plan.dataset, new=plan.new, changed=plan.changed, unchanged=plan.unchanged,
                          removed=plan.removed, failures=list(plan.failures), sourceless=plan.sourceless,
                          notes=list(plan.notes), short_clips=plan.short_clips)
    report.timings.update(encoder=0.0, decode_wait=0.0, decode_cpu=0.0, commit=0.0, commit_wait=0.0, finish=0.0,
                          lock_wait=0.0)
    report.skipped = plan.skipped
    return report


def _nothing_to_encode(plan: EncodePlan, report: EncodeReport, start: float) -> EncodeReport:
    """The report of a plan with nothing to encode (every entry stored, or a cache without its sources): no lock,
    no writer; the sources' record still settles."""
    report.samples, report.reused = len(plan.samples), plan.reused
    report.variants = variant_counts(plan.samples, None if plan.sourceless else plan.settings)
    report.skipped = 0 if plan.sourceless else plan.skipped
    report.failed = len(report.failures)
    settle_sources(plan)
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class _Work:
    """What is still absent from the cache once the write lock is held (another process may have stored some of
    the plan's entries since it was made)."""

    texts: list[tuple[str, str]]
    batches: list[Sequence[LatentJob]]
    clips: list[LatentJob]
    masks: list[MaskJob]

    @property
    def total(self) -> int:
        return len(self.texts) + sum(map(len, self.batches)) + len(self.clips) + len(self.masks)


def _pending_work(plan: EncodePlan, writer: CacheWriter, report: EncodeReport) -> _Work:
    settings = plan.settings
    needed = {k for s in plan.samples for k in s.keys()}
    report.reused = sum(1 for k in needed if writer.has(k))
    texts = [(k, t) for k, t in plan.missing_conditionings.items() if not writer.has(k)]
    batches = [b for bucket, jobs in plan.missing_latents.items()
               for b in batched([j for j in jobs if not writer.has(j.key)],
                                 images_per_call(bucket, settings.batch_size))]
    smaller = [b for b in plan.missing_latents if images_per_call(b, settings.batch_size) < settings.batch_size]
    if smaller:
        w, h = max(smaller, key=lambda b: (b[0] * b[1], b))
        report.notes.append(f"images of {len(smaller)} bucket(s) are encoded fewer per VAE call than "
                            f"batch_size {settings.batch_size} (the {w}x{h} ones "
                            f"{images_per_call((w, h), settings.batch_size)} per call): more would pass "
                            f"{format_bytes(MAX_PIXEL_BATCH_BYTES)} of pixels per call")
    clips = [j for j in plan.missing_clips if not writer.has(j.key)]
    masks = [j for j in plan.missing_masks if not writer.has(j.key)]
    return _Work(texts, batches, clips, masks)


def _check_encoders(plan: EncodePlan, work: _Work, encode_images: ImageEncoder | None,
                    encode_texts: TextEncoder | None, encode_clips: ClipEncoder | None) -> None:
    """Refuse, before anything is encoded, a run that lacks an encoder (or a compression factor) it needs."""
    settings, name = plan.settings, plan.dataset
    if work.masks and settings.mask_factor is None:
        raise ValueError(f"dataset {name!r}: {len(work.masks)} masks must be made but the VAE's spatial "
                         "compression (EncodeSettings.mask_factor) is unknown; plan with the loaded VAE")
    if work.clips and settings.video.stride is None:
        raise ValueError(f"dataset {name!r}: {len(work.clips)} clips must be encoded but the VAE's "
                         "temporal compression (FrameSettings.stride) is unknown; plan with the loaded VAE")
    if work.clips and encode_clips is None:
        raise ValueError(f"dataset {name!r}: {len(work.clips)} clips must be encoded but encode_clips "
                         "is None (connect a video VAE)")
    if work.batches and encode_images is None:
        raise ValueError(f"dataset {name!r}: {sum(map(len, work.batches))} latents must be encoded but "
                         "encode_images is None (connect a VAE)")
    if work.texts and encode_texts is None:
        raise ValueError(f"dataset {name!r}: {len(work.texts)} conditionings must be encoded but "
                         "encode_texts is None (connect a text encoder)")


def _encode_all(run: _Run, work: _Work, encode_images: ImageEncoder | None, encode_texts: TextEncoder | None,
                encode_clips: ClipEncoder | None, background_commits: bool) -> None:
    """Texts first (their encoder is released before the VAE loads), then masks, images and clips; a stop request
    ends it with ``report.stopped``, an error after the finished batches' checkpoints."""
    if background_commits:
        run.start_background_commits()
    try:
        if work.texts:
            run.encode_texts(encode_texts, work.texts)  # type: ignore[arg-type]
            run.wait_for_commit()
            run.writer.sync_log()  # the VAE may take a while to load: no checkpoint should wait unsynced
        threads = resolve_threads(run.plan.settings.encode_threads, purpose="encode threads", maximum=16)
        if work.masks:
            run.make_masks(work.masks, threads)
        if work.batches:
            run.encode_images(encode_images, work.batches, threads)  # type: ignore[arg-type]
        if work.clips:
            run.encode_clips(encode_clips, work.clips, threads)  # type: ignore[arg-type]
    except _Stopped:
        run.report.stopped = True
    except BaseException:
        run.stop_background_commits(failing=True)  # what is finished is kept (committed by the caller)
        raise
    run.stop_background_commits(failing=False)  # the last batch's checkpoint (its error is raised)


def _commit_and_count(run: _Run, work: _Work, before: dict[str, int]) -> None:
    """Publish what was encoded (the recovery log is deleted) and count it into the report."""
    report, writer, plan = run.report, run.writer, run.plan
    t_commit = time.perf_counter()
    writer.commit()
    report.timings["commit"] += time.perf_counter() - t_commit
    report.log_syncs = writer.log_syncs
    # jobs were planned for keys the writer lacked: one it has now was encoded by this run
    report.encoded_mirrors = sum(1 for j in (*(j for b in work.batches for j in b), *work.clips)
                                 if j.mirror and writer.has(j.key))
    report.encoded_empty_caption = plan.empty_caption is not None and any(
        k == plan.empty_caption for k, _ in work.texts) and writer.has(plan.empty_caption)
    written = _shard_sizes(plan.cache_root)
    report.bytes_written = sum(size for name, size in written.items() if name not in before)


def _store_dataset(run: _Run) -> None:
    """Store the dataset's samples (when they changed), compact the run's small shards, settle the sources."""
    report, writer, plan = run.report, run.writer, run.plan
    t_finish = time.perf_counter()
    samples = _finish(run, plan)
    if not (plan.dataset_current and samples == plan.samples):
        writer.set_dataset(plan.dataset, samples, info=_info(plan, report, samples))
    if report.encoded:  # the run's last shard is partly filled: merge it with earlier small ones
        report.compaction = compact_if_unread(writer, plan.cache_root)
    report.samples = len(samples)
    report.variants = variant_counts(samples, plan.settings)
    settle_sources(plan)
    report.timings["finish"] = time.perf_counter() - t_finish


def _info(plan: EncodePlan, report: EncodeReport, samples: Sequence[Sample]) -> dict[str, Any]:
    return {
        "samples_digest": samples_digest(samples),
        "vae_fingerprint": plan.vae_fingerprint,
        "text_fingerprint": plan.text_fingerprint,
        "settings": plan.settings.describe(),
        "folder": plan.folder,
        "counts": {
            "samples": len(samples), "new": plan.new, "changed": plan.changed, "unchanged": plan.unchanged,
            "removed": plan.removed, "failed": len(report.failures), "skipped": report.skipped,
        },
    }
