"""``CacheWriter``: streams entries into shards, commits durably, checkpoints cheaply.

At most one shard's tensors are held in memory: ``add()`` validates and clones a value (a row view of a batch
would otherwise drag the whole batch storage along), and once the pending bytes reach ``shard_bytes`` they are
written as an immutable shard. Nothing is visible to readers until :meth:`CacheWriter.commit` appends a journal
line naming the new shards — data file first (temp + fsync + rename + folder fsync), journal line second
(append + fsync) — so a crash at any instant leaves the previous or the new state, both readable. Entries are
content-addressed: adding a key the cache already has is a no-op. One writer per cache at a time (the
inter-process lock lives in ``lock.py``); all writer state is in this one object.

A commit per encoder batch would cost three fsyncs and one small shard per batch (which the final compaction must
rewrite). A writer made with ``checkpoints=True`` offers :meth:`CacheWriter.checkpoint` instead: the entries
added since the last checkpoint are appended to the writer's recovery log (``wal.py``) with one ``write()``, which
survives the death of the process; the log is fsynced every ``sync_seconds``, which bounds what a power loss can
take; entries are published in full shards as they fill, and the next writer publishes whatever a dead one left in
its log. Readers never read the log, so the published state keeps every guarantee above.

Compaction lives in ``compaction.py``; :meth:`CacheWriter.compact` runs it under the writer (the one writer per
cache is the one that may compact it), committing first and taking the new manifest's state as its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ..constants import DEFAULT_SHARD_BYTES
from ..dataset import DatasetInfo, Sample, check_epoch_size
from ..errors import CacheNotFoundError, CacheUnreadableError
from .compaction import Compaction, CompactReport, sweep_unreferenced, unlink_unreferenced
from .dataset_file import write_dataset
from .durable import new_id
from .layout import DATASETS_DIR, MANIFEST, SHARDS_DIR, check_new_cache_location, check_no_links
from .manifest import CacheState, ShardRecord, append_journal, read_state, write_manifest
from .reader import open_cache
from .shard import ShardBuilder
from .wal import LogBuffer, RecoveryLog, log_files, replay

__all__ = ["CacheWriter", "LOG_SYNC_SECONDS", "LOG_SYNC_BYTES"]

log = logging.getLogger("dataset_cache.format.writer")
_MAX_KEY = 256

LOG_SYNC_SECONDS = 1.0
"""Default ``sync_seconds``: the recovery log is fsynced by the first checkpoint at least this long after the
previous fsync. A power loss takes at most the checkpoints since (about a second of encoding); a process death
takes none. One fsync a second costs well under 1% of an encode even where an fsync takes 10 ms."""

LOG_SYNC_BYTES = 64 << 20
"""...or once this many bytes were appended since the last fsync, so a fast encoder of large values does not
leave much more than this at the mercy of a power loss."""


class CacheWriter:
    """Adds entries and datasets to the cache at ``root``.

    Args:
        root: cache directory (created with ``create=True`` when it holds no cache yet).
        shard_bytes: pending tensor bytes at which a shard is written.
        create: create an empty cache when ``root`` has none; otherwise raise ``CacheNotFoundError``.
        checkpoints: keep a recovery log so that :meth:`checkpoint` can make added entries survive the death of
            this process without publishing a shard per call (each added value is serialized once more for it).
        sync_seconds: with ``checkpoints``, fsync the log by the first checkpoint at least this long after the
            previous fsync (``0``: every checkpoint; see :data:`LOG_SYNC_SECONDS`).

    Opening a writer first publishes the entries a dead writer left in its recovery log (one commit), then
    deletes that log. Use as a context manager: leaving the block normally commits; leaving it by an exception
    discards the entries added since the last commit or checkpoint (committed ones stay, checkpointed ones are
    published by the next writer). :meth:`close` commits.
    """

    def __init__(self, root: str | os.PathLike, *, shard_bytes: int = DEFAULT_SHARD_BYTES, create: bool = True,
                 checkpoints: bool = False, sync_seconds: float = LOG_SYNC_SECONDS) -> None:
        self.root = Path(root)
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if not sync_seconds >= 0:
            raise ValueError(f"sync_seconds must be >= 0, got {sync_seconds}")
        self.shard_bytes = int(shard_bytes)
        check_no_links(self.root)
        if not os.path.lexists(self.root / MANIFEST):
            if not create:
                raise CacheNotFoundError(f"{self.root}: no cache here ({MANIFEST} is missing); pass create=True")
            _init_cache(self.root)
        self._state: CacheState = read_state(self.root)
        reader = open_cache(self.root, strict=False)
        for problem in reader.problems:  # their entries count as absent: the next encode re-creates them
            log.warning("shard left as it is (its entries count as absent): %s", problem)
        self._unreadable = [p for p in reader.problems if isinstance(p, CacheUnreadableError)]
        self._committed: set[str] = set(reader.keys())
        self._builder = ShardBuilder()
        self._written: list[ShardRecord] = []
        self._written_keys: set[str] = set()
        self._closed = False
        self._sync_seconds = float(sync_seconds)
        self._log: RecoveryLog | None = self._new_log() if checkpoints else None
        self._log_buf = LogBuffer()  # entries added since the last checkpoint, serialized (checkpoints only)
        self._retired: list[RecoveryLog] = []  # logs whose entries all went into shards written but unpublished
        self.log_syncs = 0
        """fsyncs of the recovery log by :meth:`checkpoint` so far (for reports and benchmarks)."""
        self._recover()

    # ----------------------------------------------------------------------------------------- entries
    def has(self, key: str) -> bool:
        """Whether ``key`` is committed, or added in this writer and not yet committed."""
        return key in self._committed or key in self._written_keys or key in self._builder

    def add(self, key: str, value: Any, *, kind: str = "value", name: str = "value") -> None:
        """Add one entry (ignored when the key exists: same key, same content).

        The value is validated and its tensors cloned now, so the caller may reuse or free them at once.

        Raises:
            UnstorableValueError: ``value`` holds something not storable; the message names its path, e.g.
                ``conditioning[0][1]['hooks']: HookGroup is not storable``.
            ValueError: bad key or kind, or the writer is closed.
        """
        self._check_open()
        _check_entry(key, kind)
        if self.has(key):
            return
        skel, stored = self._builder.add(key, kind, value, name)
        if self._log is not None:
            self._log_buf.add(key, kind, skel, stored)
        if self._builder.nbytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not len(self._builder):
            return
        rec = self._builder.write(self.root / "shards", new_id())
        self._written.append(rec)
        self._written_keys.update(self._builder.keys)
        self._builder = ShardBuilder()
        if self._log is not None:
            # Every logged entry is in a written shard now. Entries not yet logged need no log (they were never
            # checkpointed); the logged ones stay recoverable from the retired log until the shard is published.
            self._log_buf = LogBuffer()
            if self._log.path is not None:
                self._retired.append(self._log)
                self._log = self._new_log()

    def commit(self) -> None:
        """Write pending entries as a shard and durably publish every shard written since the last commit."""
        self._check_open()
        self._commit({})

    def checkpoint(self) -> None:
        """Make the entries added so far survive the death of this process (Cancel, an exception, ``kill -9``).

        With ``checkpoints=True`` this appends the entries added since the last checkpoint to the recovery log
        (one ``write()``; an fsync only when ``sync_seconds`` have passed since the last one) and publishes the
        full shards written since, if any; it writes no small shard. Entries are published (visible to readers)
        when their shard fills, at :meth:`commit` / :meth:`close`, or by the next writer after a crash. After a
        power loss, the checkpoints since the log's last fsync may be lost; the cache stays readable.
        Without ``checkpoints`` this is :meth:`commit`.
        """
        self._check_open()
        if self._log is None:
            self._commit({})
            return
        if self._written:
            self._publish({})
        if len(self._log_buf):
            self.log_syncs += self._log.append(self._log_buf)  # on failure the entries stay for the next try
            self._log_buf = LogBuffer()

    def sync_log(self) -> None:
        """fsync the recovery log now (before a pause, e.g. while the next model loads); a no-op without one."""
        for lg in (*self._retired, self._log):
            if lg is not None and lg.path is not None and lg.unsynced:
                lg.sync()
                self.log_syncs += 1

    def _commit(self, datasets: dict[str, Any]) -> None:
        self._flush()
        if self._written or datasets:
            self._publish(datasets)
        if self._log is not None and self._log.path is not None:  # everything it holds is published now
            self._log.discard()

    def _publish(self, datasets: dict[str, Any]) -> None:
        """Durably append one journal line naming the written shards (and ``datasets``); retire their logs."""
        append_journal(self._state, {"shards": [r.to_json() for r in self._written], "datasets": datasets})
        self._committed |= self._written_keys
        self._written, self._written_keys = [], set()
        for lg in self._retired:
            lg.discard()
        self._retired = []

    def abort(self) -> None:
        """Discard entries added since the last commit (their shard files are deleted).

        Checkpointed entries stay in the recovery log, which the next writer publishes.
        """
        self._builder = ShardBuilder()
        for rec in self._written:
            unlink_unreferenced(self.root / rec.file)
        self._written, self._written_keys = [], set()
        if self._log is not None:
            for lg in (*self._retired, self._log):
                lg.close()
            self._retired, self._log, self._log_buf = [], self._new_log(), LogBuffer()

    def _new_log(self) -> RecoveryLog:
        return RecoveryLog(self.root, sync_seconds=self._sync_seconds, sync_bytes=LOG_SYNC_BYTES)

    def _recover(self) -> None:
        """Publish the entries of recovery logs left by writers that died, then delete those logs."""
        paths = log_files(self.root)
        if not paths:
            return
        done, entries = [], 0
        for path in paths:
            usable, n = replay(path, self._add_recovered)
            entries += n
            if usable:
                done.append(path)
        added = len(self._builder) + len(self._written_keys)
        self._commit({})  # durable before the logs go
        for path in done:
            unlink_unreferenced(path)
        log.info("%s: published %d entries checkpointed by an earlier writer (%d already present)", self.root,
                 added, entries - added)

    def _add_recovered(self, key: str, kind: str, value: Any) -> None:
        _check_entry(key, kind)
        if not self.has(key):
            self._builder.add(key, kind, value, kind)
            if self._builder.nbytes >= self.shard_bytes:
                self._flush()

    # ----------------------------------------------------------------------------------------- datasets
    def set_dataset(self, name: str, samples: Sequence[Sample], *, info: dict | None = None) -> None:
        """Write the dataset's sample list (immutable file) and commit it, with any pending entries.

        A dataset of the same name is replaced (its old file is deleted by the next compaction).

        Raises:
            ValueError: a sample names an entry the cache does not have, or the name/info is unusable.
            CacheUnreadableError: such entries may be in a shard this writer could not read when it opened.
        """
        self._check_open()
        check_epoch_size(samples, f"dataset {name!r:.80}")
        missing = [k for s in samples for k in s.keys() if not self.has(k)]
        if missing and self._unreadable:  # they may well be in the shard that could not be read
            first = self._unreadable[0]
            raise CacheUnreadableError(first.path, f"{first.reason}, so {len(missing)} entries of dataset "
                                       f"{name!r:.80} could not be confirmed; nothing was lost", errno=first.errno)
        if missing:
            raise ValueError(f"dataset {name!r:.80}: {len(missing)} sample entries are not in the cache "
                             f"(first: {missing[0]}); add them before set_dataset()")
        rec = write_dataset(self.root, name, samples, info)
        self._commit({name: {"file": rec.file, "samples": rec.samples, "info": rec.info}})

    def remove_dataset(self, name: str) -> None:
        """Remove a dataset from the cache (its entries stay until a compaction drops unreferenced ones)."""
        self._check_open()
        if name not in self._state.datasets:
            raise KeyError(f"no dataset {name!r} in the cache at {self.root}")
        self._commit({name: None})

    def datasets(self) -> dict[str, DatasetInfo]:
        """The committed datasets (name -> record)."""
        return dict(self._state.datasets)

    # ----------------------------------------------------------------------------------------- compaction
    def compact(self, *, keep: set[str] | None = None, min_fill: float = 0.5, repair: bool = False) -> CompactReport:
        """Rewrite underfull shards (and shards with dropped entries) into full ones; publish a new manifest.

        Args:
            keep: entries to keep (``None``: all). Entries referenced by a dataset are always kept.
            min_fill: shards smaller than ``min_fill * shard_bytes`` are rewritten.
            repair: verify every shard first; drop the entries whose bytes are damaged and move the shard files
                that held them (or that cannot be opened as shards at all) to ``damaged/``.

        What compaction may delete (docs/FORMAT.md): only files it made itself (names of the cache's own
        patterns, regular files, never a link) that the new manifest no longer names. A shard that cannot be
        read because of its environment (permissions, open-file limit, I/O error, a link) is kept exactly as it
        is, and so is a damaged one unless ``repair`` is asked for; the report lists both. Rewritten entries are
        written in dataset order (then the rest) so training reads them sequentially. The new manifest (naming a
        fresh empty journal) is the atomic switch; replaced files are deleted after it. A reader opened before
        the switch must be reopened. The steps are :class:`.compaction.Compaction`'s.
        """
        self._check_open()
        self._commit({})
        run = Compaction(self.root, self._state, self.shard_bytes, keep=keep, min_fill=min_fill, repair=repair)
        self._state = run.switch()  # the writer follows the new manifest at once (a later commit appends there)
        deleted = sweep_unreferenced(self.root, self._state)
        self._committed = set(open_cache(self.root, strict=False).keys())
        return run.report(self._state, deleted, len(self._committed))

    # ----------------------------------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the CacheWriter of {self.root} is closed")

    def close(self) -> None:
        """Commit pending entries and close the writer (idempotent)."""
        if not self._closed:
            self._commit({})
            self._closed = True

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        else:
            self.abort()
            self._closed = True

    def __repr__(self) -> str:
        return f"CacheWriter({str(self.root)!r}, committed={len(self._committed)}, pending={len(self._builder)})"


def _check_entry(key: Any, kind: Any) -> None:
    if type(key) is not str or not key or len(key) > _MAX_KEY or not key.isprintable():
        raise ValueError(f"entry key {key!r:.80}: use 1-{_MAX_KEY} printable characters (a content hash)")
    if type(kind) is not str or not kind or len(kind) > 64:
        raise ValueError(f"entry {key}: kind must be a short non-empty str, got {kind!r:.40}")


def _init_cache(root: Path) -> None:
    check_new_cache_location(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / SHARDS_DIR).mkdir(exist_ok=True)
    (root / DATASETS_DIR).mkdir(exist_ok=True)
    write_manifest(root, 1, [], {})
