"""Committing an encode's batches: each encoded batch is added to the writer and checkpointed, on the calling
thread or on one background thread while the encoder runs the next batch; the report's encoded counts and the
progress callback follow each checkpoint.

Kept apart from :mod:`.encode_feed` (what is encoded when) because what a stop, an exception or a ``kill -9`` can
lose is decided here alone (see :func:`.encode_run.run_encode`), and the committer thread is this module's only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .encode_report import EncodeReport
from .format.writer import CacheWriter

__all__ = ["BatchCommitter"]

log = logging.getLogger("dataset_cache.encode")


class BatchCommitter:
    """Adds and checkpoints the encoded batches of one :func:`.encode_run.run_encode` call into its writer, and
    counts them (all methods run on the calling thread; :meth:`commit` also on the committer thread).

    Args:
        writer: the run's writer, opened with checkpoints.
        report: the run's report: its ``encoded_*`` counts and ``commit`` / ``commit_wait`` timings grow here.
        progress: ``progress(done, total)`` after each checkpointed batch (work items, not batches).
        total: the run's work items, for ``progress``.
        min_commit_seconds: a finished batch is checkpointed only this long after the last checkpoint (``0``:
            every batch).
        root: the cache's directory, for log lines.
    """

    def __init__(self, writer: CacheWriter, report: EncodeReport, progress: Callable[[int, int], None] | None, *,
                 total: int, min_commit_seconds: float, root: str) -> None:
        self.writer, self.report, self.root = writer, report, root
        self.progress = progress
        self.done = 0
        self.total = total
        self.t = report.timings
        self.min_commit_seconds = min_commit_seconds
        self.last_commit = float("-inf")
        self._committer: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[None], str, int, int] | None = None  # (checkpoint, kind, entries, items)

    def tick(self, n: int) -> None:
        """Count ``n`` more work items done and report the progress."""
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)

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
        """Checkpoint each batch on one background thread while the encoder runs the next one (see
        ``background_commits`` of :func:`.encode_run.run_encode`)."""
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
            log.warning("%s: the last encoded batch could not be checkpointed (%s)", self.root, exc)
        finally:
            self._committer.shutdown(wait=True)
            self._committer = None
