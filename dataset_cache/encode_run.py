"""The second half of encoding: encode only what is missing, in bucket batches, committing each batch durably.

The first half, :func:`.encode_plan.plan_encode`, says what a folder needs; :func:`run_encode` encodes exactly that:

* conditionings first (each distinct caption text once, shuffled variants and the empty caption among them),
  then loss masks (no encoder: decoded and averaged down to latent resolution on the decode threads,
  :func:`.imaging.load_mask`), then latents bucket by bucket (mirrors among them), ``batch_size`` per encoder
  call, so each model is needed in one stretch;
* images are decoded, resized and cropped on a small thread pool up to :data:`.encode_feed.LOOKAHEAD_BATCHES`
  batches ahead of the encoder, so the GPU does not wait on Pillow. Each image's bytes are re-hashed against the
  hash its key was planned from: a file edited after planning is reported, never stored under the old content's key;
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

This module holds the run and its steps (the write lock, what is still missing once it is held, the final commit,
storing the dataset, compacting); the encoders are fed by :mod:`.encode_feed` (the sources read and decoded by
:mod:`.encode_decode`), each encoded batch is added and checkpointed by :mod:`.encode_commit`, and what the run did
is an :class:`.encode_report.EncodeReport`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .batching import batched
from .dataset import Sample
from .encode_commit import BatchCommitter
from .encode_feed import ClipEncoder, EncoderFeed, ImageEncoder, StopRequested, TextEncoder
from .encode_jobs import EncodePlan, LatentJob, MaskJob, variant_counts
from .encode_plan import samples_digest, settle_sources
from .encode_report import EncodeReport
from .errors import CacheLockedError, DatasetFolderError
from .format.compaction import CompactReport
from .format.writer import LOG_SYNC_SECONDS, CacheWriter
from .lock import READ_LOCK, WRITE_LOCK, CacheLock
from .threads import resolve_threads
from .units import format_bytes

__all__ = [
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


_LOCK_POLL_S = 0.2


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


def _finish(plan: EncodePlan, report: EncodeReport, failed_keys: set[str]) -> tuple[Sample, ...]:
    """Return the dataset's samples after encode-time failures, checking failures against the policy."""
    samples = tuple(s for s in plan.samples
                    if failed_keys.isdisjoint((s.latent, s.mirror, s.mask, s.reference, s.reference_mirror)))
    report.skipped += len(plan.samples) - len(samples)
    if not samples:
        first = report.failures[0] if report.failures else None
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
    lock = _write_lock(plan, report, should_stop)
    if lock is None:
        report.stopped = True
        report.seconds = time.perf_counter() - start
        return report
    try:
        _encode_locked(plan, report, _Options(encode_images, encode_texts, encode_clips, progress, should_stop,
                                              min_commit_seconds, sync_seconds, background_commits))
    finally:
        lock.release()
    report.failed = len(report.failures)
    report.seconds = time.perf_counter() - start
    log.info("%s", report.summary())
    return report


@dataclass(frozen=True)
class _Options:
    """:func:`run_encode`'s arguments besides its plan: the encoders, and how the run reports, stops and commits."""

    encode_images: ImageEncoder | None
    encode_texts: TextEncoder | None
    encode_clips: ClipEncoder | None
    progress: Callable[[int, int], None] | None
    should_stop: Callable[[], bool] | None
    min_commit_seconds: float
    sync_seconds: float
    background_commits: bool


def _write_lock(plan: EncodePlan, report: EncodeReport, should_stop: Callable[[], bool] | None) -> CacheLock | None:
    """The cache's write lock, held (the wait for another writer timed in the report), or ``None`` when
    ``should_stop`` ended the wait."""
    lock = CacheLock(plan.cache_root, WRITE_LOCK, timeout=0, purpose="encode")  # polled: see _acquire
    t_lock = time.perf_counter()
    if not _acquire(lock, plan.cache_root, should_stop):
        return None
    report.timings["lock_wait"] = time.perf_counter() - t_lock
    return lock


def _encode_locked(plan: EncodePlan, report: EncodeReport, options: _Options) -> None:
    """With the write lock held: open the writer and encode what is still missing; on an error the entries already
    added (finished encodes) are committed before it leaves, and the writer is closed whatever happens."""
    before = _shard_sizes(plan.cache_root)
    writer = CacheWriter(plan.cache_root, shard_bytes=plan.settings.shard_bytes, checkpoints=True,
                         sync_seconds=options.sync_seconds)
    try:
        _encode_missing(plan, writer, report, before, options)
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


def _encode_missing(plan: EncodePlan, writer: CacheWriter, report: EncodeReport, before: dict[str, int],
                    options: _Options) -> None:
    """The run's work once the writer is open: what is still missing, its encoders checked, encoded batch by batch,
    committed and counted, then (unless stopped) the dataset stored. ``before``: the shard files' sizes before."""
    work = _pending_work(plan, writer, report)
    _check_encoders(plan, work, options.encode_images, options.encode_texts, options.encode_clips)
    commits = BatchCommitter(writer, report, options.progress, total=work.total,
                             min_commit_seconds=max(0.0, float(options.min_commit_seconds)), root=plan.cache_root)
    feed = EncoderFeed(plan, report, commits, options.should_stop)
    if options.progress is not None:
        options.progress(0, commits.total)
    _encode_all(feed, work, options.encode_images, options.encode_texts, options.encode_clips,
                options.background_commits)
    _commit_and_count(plan, writer, report, work, before)
    if not report.stopped:
        _store_dataset(plan, writer, report, feed.failed_keys)


def _new_report(plan: EncodePlan) -> EncodeReport:
    report = EncodeReport(plan.dataset, new=plan.new, changed=plan.changed, unchanged=plan.unchanged,
                          removed=plan.removed, failures=list(plan.failures), sourceless=plan.sourceless,
                          notes=list(plan.notes), short_clips=plan.short_clips,
                          caption_example=plan.caption_example)
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


def _encode_all(feed: EncoderFeed, work: _Work, encode_images: ImageEncoder | None,
                encode_texts: TextEncoder | None, encode_clips: ClipEncoder | None, background_commits: bool) -> None:
    """Texts first (their encoder is released before the VAE loads), then masks, images and clips; a stop request
    ends it with ``report.stopped``, an error after the finished batches' checkpoints."""
    commits = feed.commits
    if background_commits:
        commits.start_background_commits()
    try:
        if work.texts:
            feed.encode_texts(encode_texts, work.texts)  # type: ignore[arg-type]
            commits.wait_for_commit()
            commits.writer.sync_log()  # the VAE may take a while to load: no checkpoint should wait unsynced
        threads = resolve_threads(feed.plan.settings.encode_threads, purpose="encode threads", maximum=16)
        if work.masks:
            feed.make_masks(work.masks, threads)
        if work.batches:
            feed.encode_images(encode_images, work.batches, threads)  # type: ignore[arg-type]
        if work.clips:
            feed.encode_clips(encode_clips, work.clips, threads)  # type: ignore[arg-type]
    except StopRequested:
        feed.report.stopped = True
    except BaseException:
        commits.stop_background_commits(failing=True)  # what is finished is kept (committed by the caller)
        raise
    commits.stop_background_commits(failing=False)  # the last batch's checkpoint (its error is raised)


def _commit_and_count(plan: EncodePlan, writer: CacheWriter, report: EncodeReport, work: _Work,
                      before: dict[str, int]) -> None:
    """Publish what was encoded (the recovery log is deleted) and count it into the report."""
    t_commit = time.perf_counter()
    writer.commit()
    report.timings["commit"] += time.perf_counter() - t_commit
    report.log_syncs = writer.log_syncs
    # jobs were planned for keys the writer lacked: one it has now was encoded by this run
    jobs = (*(j for b in work.batches for j in b), *work.clips)
    report.encoded_mirrors = sum(1 for j in jobs if j.mirror and writer.has(j.key))
    report.encoded_references = sum(1 for j in jobs if j.reference and writer.has(j.key))
    report.encoded_empty_caption = plan.empty_caption is not None and any(
        k == plan.empty_caption for k, _ in work.texts) and writer.has(plan.empty_caption)
    written = _shard_sizes(plan.cache_root)
    report.bytes_written = sum(size for name, size in written.items() if name not in before)


def _store_dataset(plan: EncodePlan, writer: CacheWriter, report: EncodeReport, failed_keys: set[str]) -> None:
    """Store the dataset's samples (when they changed), compact the run's small shards, settle the sources."""
    t_finish = time.perf_counter()
    samples = _finish(plan, report, failed_keys)
    if not (plan.dataset_current and samples == plan.samples and plan.tags_current):
        writer.set_dataset(plan.dataset, samples, info=_info(plan, report, samples))
    if report.encoded:  # the run's last shard is partly filled: merge it with earlier small ones
        report.compaction = compact_if_unread(writer, plan.cache_root)
    report.samples = len(samples)
    report.variants = variant_counts(samples, plan.settings)
    settle_sources(plan)
    report.timings["finish"] = time.perf_counter() - t_finish


def _info(plan: EncodePlan, report: EncodeReport, samples: Sequence[Sample]) -> dict[str, Any]:
    info: dict[str, Any] = {
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
    if plan.tag_frequency:  # none for a folder without captions: its info stays as before
        info["tag_frequency"] = plan.tag_frequency
    return info
