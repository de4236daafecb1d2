"""``CacheWriter``: streams entries into shards, commits durably, checkpoints cheaply, compacts.

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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ..constants import DEFAULT_SHARD_BYTES
from ..dataset import DatasetInfo, Sample, check_epoch_size
from ..batching import batched
from ..errors import CacheCorruptError, CacheError, CacheNotFoundError, CacheUnreadableError
from .dataset_file import write_dataset
from .durable import new_id
from .layout import (
    DAMAGED_DIR,
    DATASET_FILE_RE,
    DATASETS_DIR,
    MANIFEST,
    SHARD_FILE_RE,
    SHARDS_DIR,
    TEMP_FILE_RE,
    check_new_cache_location,
    check_no_links,
)
from .manifest import (
    JOURNAL_RE,
    CacheState,
    ShardRecord,
    append_journal,
    next_generation,
    read_state,
    write_manifest,
)
from .reader import CacheReader, open_cache
from .shard import ShardBuilder
from .wal import LogBuffer, RecoveryLog, log_files, replay

__all__ = ["CacheWriter", "CompactReport", "LOG_SYNC_SECONDS", "LOG_SYNC_BYTES"]

log = logging.getLogger("dataset_cache.format.writer")
_MAX_KEY = 256

LOG_SYNC_SECONDS = 1.0
"""Default ``sync_seconds``: the recovery log is fsynced by the first checkpoint at least this long after the
previous fsync. A power loss takes at most the checkpoints since (about a second of encoding); a process death
takes none. One fsync a second costs well under 1% of an encode even where an fsync takes 10 ms."""

LOG_SYNC_BYTES = 64 << 20
"""...or once this many bytes were appended since the last fsync, so a fast encoder of large values does not
leave much more than this at the mercy of a power loss."""


@dataclass(frozen=True)
class CompactReport:
    """What :meth:`CacheWriter.compact` did.

    Attributes:
        shards_before / shards_after: committed shard files before and after.
        shards_rewritten: shards whose live entries were copied into new shards.
        entries_kept / entries_dropped: live entries after; entries removed (not kept, or duplicates).
        bytes_before / bytes_after: total shard bytes before and after.
        files_deleted: files removed (replaced shards, old journal, unreferenced dataset files, orphans).
        damaged: damage found (bytes that do not match the manifest or a checksum). Without ``repair`` the
            damaged shards stay in the cache as they are; with it, their unreadable entries were dropped (the next
            encode re-creates them) and the shard files moved to ``damaged/``.
        unreadable: files that could not be read (permissions, open-file limit, I/O error, a link): not damage,
            so they were left as they are, listed and untouched.
        quarantined: shard files an explicit repair took out of the cache, now in ``damaged/`` (never deleted).
    """

    shards_before: int
    shards_after: int
    shards_rewritten: int
    entries_kept: int
    entries_dropped: int
    bytes_before: int
    bytes_after: int
    files_deleted: int
    damaged: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()
    quarantined: tuple[str, ...] = ()

    def findings(self) -> str:
        """One paragraph for reports when compaction found damage or left files alone (empty when it did not)."""
        parts = []
        if self.unreadable:
            parts.append(f"{len(self.unreadable)} cache file(s) could not be read and were left untouched "
                         f"(first: {self.unreadable[0]}); their entries are re-encoded when needed")
        if self.damaged and not self.quarantined:
            parts.append(f"{len(self.damaged)} damaged part(s) found and kept as they are (first: "
                         f"{self.damaged[0]}); run `python -m dataset_cache verify <cache>`, then a repair to "
                         "drop them")
        if self.quarantined:
            parts.append(f"repair dropped the damaged entries and moved {len(self.quarantined)} shard file(s) to "
                         f"{DAMAGED_DIR}/ (first: {self.quarantined[0]}); delete them when you no longer need them")
        elif self.damaged and self.entries_dropped:
            parts.append(f"repair dropped {self.entries_dropped} damaged entr(y/ies)")
        return "; ".join(parts)


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
            _unlink(self.root / rec.file)
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
            _unlink(path)
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
        the switch must be reopened.
        """
        self._check_open()
        self._commit({})
        check_no_links(self.root)
        reader = open_cache(self.root, strict=False)
        problems: list[CacheError] = list(reader.verify() if repair else reader.problems)
        unreadable: list[CacheError] = [p for p in problems if isinstance(p, CacheUnreadableError)]
        damaged = [p for p in problems if not isinstance(p, CacheUnreadableError)]
        order = _dataset_order(reader)
        present = set(reader.keys())  # entries of shards that could not be opened are not copied: they stay there
        live = present if keep is None else (set(keep) | set(order)) & present
        state = self._state
        plan = self._choose(reader, live, problems, min_fill, repair)
        kept_keys = {k for _, sh in plan.kept if sh is not None for k in sh.keys}
        new: list[ShardRecord] = []
        if plan.rewrite or plan.drop or state.journal_commits:
            wanted = [k for k in [*order, *(k for _, sh in plan.rewrite for k in sh.keys)]
                      if k in live and k not in kept_keys]
            new, failed = self._rewrite(reader, wanted)
            held = self._hold_back(plan, failed, repair, damaged, unreadable)
            quarantined = self._quarantine(plan, held)
            kept = [rec for rec, _ in plan.kept] + held
            self._state = write_manifest(self.root, next_generation(state.generation), kept + new, state.datasets)
        else:
            quarantined = []
        deleted = self._delete_unreferenced()
        self._committed = set(open_cache(self.root, strict=False).keys())
        shards = self._state.shards
        gone = {r.file for r in state.shards} - {r.file for r in shards}
        return CompactReport(
            shards_before=len(state.shards), shards_after=len(shards), shards_rewritten=len(plan.rewrite),
            entries_kept=len(self._committed),
            entries_dropped=max(0, sum(r.entries for r in state.shards if r.file in gone)
                                - sum(r.entries for r in new)),
            bytes_before=sum(r.bytes for r in state.shards), bytes_after=sum(r.bytes for r in shards),
            files_deleted=deleted, damaged=tuple(dict.fromkeys(str(p) for p in damaged)),
            unreadable=tuple(dict.fromkeys(str(p) for p in unreadable)), quarantined=tuple(quarantined),
        )

    def _choose(self, reader: CacheReader, live: set[str], problems: Sequence[CacheError], min_fill: float,
                repair: bool) -> _CompactPlan:
        """Sort the manifest's shards into kept as they are, rewritten, and (repair only) dropped as damaged."""
        by_file = {sh.file: sh for sh in reader.shards}
        hold = {p.path for p in problems if isinstance(p, CacheUnreadableError)}
        bad = {p.path for p in problems if isinstance(p, CacheCorruptError)} if repair else set()
        plan = _CompactPlan()
        seen: set[str] = set()
        for rec in self._state.shards:
            sh = by_file.get(rec.file)
            path = str(self.root / rec.file)
            if sh is None:  # could not be opened: damage is dropped on repair only; anything else stays
                (plan.drop if path in bad and path not in hold else plan.kept).append((rec, None))
                continue
            if path in hold:  # a read failed because of the environment: leave the file exactly as it is
                plan.kept.append((rec, sh))
                seen.update(sh.keys)
                continue
            dropped = any(k in seen or k not in live for k in sh.keys) or path in bad
            seen.update(sh.keys)
            (plan.rewrite if dropped or rec.bytes < min_fill * self.shard_bytes else plan.kept).append((rec, sh))
            if path in bad:
                plan.drop.append((rec, None))
        if (len(plan.rewrite) == 1 and all(k in live for k in plan.rewrite[0][1].keys)
                and str(plan.rewrite[0][1].path) not in bad):  # rewriting it alone gains nothing
            plan.kept, plan.rewrite = plan.kept + plan.rewrite, []
        return plan

    def _rewrite(self, reader: CacheReader, keys: list[str]) -> tuple[list[ShardRecord], dict[str, CacheError]]:
        """Copy ``keys`` into new full shards; returns the records and the entries that could not be read."""
        pending = list(dict.fromkeys(keys))
        builder, records = ShardBuilder(), []
        failed: dict[str, CacheError] = {}
        for batch in batched(pending, 64):
            for k, v in _read_or_skip(reader, batch, failed):
                builder.add(k, reader.kind(k), v, "value")
                if builder.nbytes >= self.shard_bytes:
                    records.append(builder.write(self.root / SHARDS_DIR, new_id()))
                    builder = ShardBuilder()
        if len(builder):
            records.append(builder.write(self.root / SHARDS_DIR, new_id()))
        return records, failed

    def _hold_back(self, plan: _CompactPlan, failed: dict[str, CacheError], repair: bool,
                   damaged: list[CacheError], unreadable: list[CacheError]) -> list[ShardRecord]:
        """The rewritten shards that must stay because an entry of theirs could not be copied.

        Without ``repair`` any failed read keeps its shard (nothing is dropped on a guess); with it, only a read
        that failed for its environment does, and damaged entries are dropped.
        """
        held: list[ShardRecord] = []
        for rec, sh in plan.rewrite:
            errors = [failed[k] for k in sh.keys if k in failed]
            if not errors:
                continue
            for exc in errors:
                (unreadable if isinstance(exc, CacheUnreadableError) else damaged).append(exc)
            if not repair or any(isinstance(e, CacheUnreadableError) for e in errors):
                held.append(rec)
                plan.drop = [(r, s) for r, s in plan.drop if r.file != rec.file]
        return held

    def _quarantine(self, plan: _CompactPlan, held: list[ShardRecord]) -> list[str]:
        """Move the shards a repair drops to ``damaged/`` (before the switch: a crash leaves them named, not lost).

        A shard that cannot be moved stays in the manifest (appended to ``held``).
        """
        moved: list[str] = []
        for rec, _ in plan.drop:
            src = self.root / rec.file
            dst = self.root / DAMAGED_DIR / Path(rec.file).name
            try:
                dst.parent.mkdir(exist_ok=True)
                if os.path.lexists(dst):
                    dst = dst.with_name(f"{dst.stem}-{new_id()}{dst.suffix}")
                os.rename(src, dst)
                moved.append(f"{DAMAGED_DIR}/{dst.name}")
            except FileNotFoundError:  # already gone: dropping its record loses nothing more
                moved.append(rec.file)
            except OSError as exc:
                log.warning("could not move damaged shard %s to %s/ (%s); it stays in the cache", src,
                            DAMAGED_DIR, exc)
                held.append(rec)
        return moved

    def _delete_unreferenced(self) -> int:
        """Delete the cache's own files the manifest no longer names: only regular files of its name patterns."""
        refs = {r.file for r in self._state.shards} | {d.file for d in self._state.datasets.values()}
        refs.add(self._state.journal)
        n = 0
        for sub, pattern in ((SHARDS_DIR, SHARD_FILE_RE), (DATASETS_DIR, DATASET_FILE_RE)):
            for name in _regular_files(self.root / sub):
                rel = f"{sub}/{name}"
                if rel not in refs and (pattern.fullmatch(rel) or TEMP_FILE_RE.fullmatch(name)):
                    n += _unlink(self.root / rel)
        for name in _regular_files(self.root):
            if name not in refs and name != MANIFEST and (JOURNAL_RE.fullmatch(name) or TEMP_FILE_RE.fullmatch(name)):
                n += _unlink(self.root / name)
        return n

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


@dataclass
class _CompactPlan:
    """The shards of one compaction: ``(record, index or None when unopened)`` pairs."""

    kept: list[tuple[ShardRecord, Any]] = field(default_factory=list)
    rewrite: list[tuple[ShardRecord, Any]] = field(default_factory=list)
    drop: list[tuple[ShardRecord, Any]] = field(default_factory=list)


def _regular_files(folder: Path) -> list[str]:
    """Names of the regular files directly in ``folder`` (links and folders are never listed)."""
    try:
        with os.scandir(folder) as it:
            return [e.name for e in it if e.is_file(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _dataset_order(reader: CacheReader) -> list[str]:
    order: dict[str, None] = {}
    for name in reader.datasets():
        for s in reader.dataset(name):
            for key in s.keys():
                order.setdefault(key, None)
    return list(order)


def _read_or_skip(reader: CacheReader, keys: Sequence[str], failed: dict[str, CacheError]) -> list[tuple[str, Any]]:
    """Read ``keys``; when the batch fails, read one by one, recording each entry that cannot be read."""
    try:
        return list(zip(keys, reader.read(keys)))
    except (CacheError, OSError):
        pass
    out = []
    for k in keys:
        try:
            out.append((k, reader.read([k])[0]))
        except CacheError as exc:
            log.warning("compaction could not copy an entry: %s", exc)
            failed[k] = exc
        except OSError as exc:
            log.warning("compaction could not copy entry %s: %s", k, exc)
            failed[k] = CacheUnreadableError(str(reader.root), f"cannot read entry {k} ({exc})", errno=exc.errno)
    return out


def _unlink(p: Path) -> int:
    try:
        p.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:  # e.g. Windows: a file still open elsewhere; the next compaction retries
        log.warning("could not delete %s (%s); it is unreferenced and will be retried", p, exc)
        return 0
