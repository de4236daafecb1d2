"""Preview and removal of what no dataset references: unreferenced entries, underfull shards, orphan files.

Encodes never delete entries: a source removed from a folder (or a whole folder, for sourceless training)
leaves its entries in the cache, and a dataset rebuilt with other settings leaves the old entries behind. This
module is the one place that reclaims that space, under two rules:

* **Never remove what a dataset references.** The referenced set is read from every dataset file; if one cannot
  be read, nothing is deleted. Compaction itself also always keeps dataset-referenced entries, and the result is
  checked afterwards.
* **Never run under another process.** :func:`clean` takes the write lock (no encode running) and the read lock
  exclusively (no training reading), both without waiting, and raises :class:`.errors.CacheLockedError` when
  either is held.

Orphan files are files the cache's state does not name: shard and dataset files written by a run that was killed
before it committed, replaced dataset files, old journals, temp files (``*.tmp``) of interrupted writes, and
sources records (``sources/``) of datasets the cache no longer has (deleting one costs a re-hash, never a
re-encode). Only regular files whose names follow the cache's own patterns are ever orphans: a link, a folder or
a file of any other name is left alone, and so is ``damaged/`` (docs/FORMAT.md). Lock files are kept.

Damage is never removed silently: a shard that cannot be read is listed and kept, and damaged entries are dropped
only by ``clean(..., repair=True)``, which moves the damaged shard files to ``damaged/``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .encode_plan import SOURCES_DIR, reference_record_path, sources_record_path
from .errors import CacheCorruptError, CacheError, CacheUnreadableError
from .format.layout import DATASET_FILE_RE, MANIFEST, SHARD_FILE_RE, TEMP_FILE_RE
from .format.manifest import JOURNAL_RE
from .format.reader import CacheReader, open_cache
from .format.compaction import CompactReport
from .format.writer import CacheWriter
from .lock import READ_LOCK, WRITE_LOCK, CacheLock
from .units import format_bytes

__all__ = ["LOW_FILL", "ShardFill", "CleanPreview", "CleanReport", "preview_clean", "clean"]

log = logging.getLogger("dataset_cache.clean")

LOW_FILL = 0.5
"""Shards whose live bytes are below this fraction of their data are listed as worth compacting (the same
threshold compaction uses for shard size: rewriting a half-dead shard at most doubles its I/O once)."""

_KEEP_NAMES = frozenset({MANIFEST, WRITE_LOCK, READ_LOCK})
_SOURCES_RECORD_RE = re.compile(SOURCES_DIR + r"/[A-Za-z0-9._-]{1,48}-[0-9a-f]{16}\.json")


@dataclass(frozen=True)
class ShardFill:
    """How much of one shard is still referenced.

    Attributes:
        file: path relative to the cache root.
        bytes: file size.
        entries: entries stored in it.
        live_entries: entries a dataset references (first copy of a key only).
        live_bytes: tensor bytes of those entries.
        data_bytes: tensor bytes of all its entries.
    """

    file: str
    bytes: int
    entries: int
    live_entries: int
    live_bytes: int
    data_bytes: int

    @property
    def live_fraction(self) -> float:
        """Live share of the shard's tensor bytes (of its entries when it holds no tensor bytes)."""
        if self.data_bytes:
            return self.live_bytes / self.data_bytes
        return self.live_entries / self.entries if self.entries else 0.0


@dataclass(frozen=True)
class CleanPreview:
    """What :func:`clean` would remove (nothing is changed by computing it).

    Attributes:
        root: the cache directory.
        datasets: names of the datasets whose entries are kept.
        entries: distinct entries in the cache.
        referenced: distinct entries some dataset references.
        unreferenced: keys of the entries no dataset references.
        unreferenced_bytes: their tensor bytes (plus duplicate copies of keys).
        low_fill_shards: shards whose live fraction is below :data:`LOW_FILL`.
        shards: shard count.
        shard_bytes: total size of the shard files.
        orphan_files: files the cache does not name (relative paths).
        orphan_bytes: their total size.
        damaged: shards that are damaged (kept unless cleaned with ``repair``; ``verify`` tells more).
        unreadable: shards that cannot be read for now (permissions, I/O, a link): never dropped.
    """

    root: str
    datasets: tuple[str, ...]
    entries: int
    referenced: int
    unreferenced: tuple[str, ...]
    unreferenced_bytes: int
    low_fill_shards: tuple[ShardFill, ...]
    shards: int
    shard_bytes: int
    orphan_files: tuple[str, ...]
    orphan_bytes: int
    damaged: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()

    @property
    def reclaimable_bytes(self) -> int:
        """Bytes a clean frees (approximately: shard headers shrink too)."""
        return self.unreferenced_bytes + self.orphan_bytes

    def summary(self) -> str:
        """A few lines for the command line and the UI."""
        lines = [
            f"{self.root}: {self.entries} entries in {self.shards} shards ({format_bytes(self.shard_bytes)}), "
            f"{len(self.datasets)} dataset(s)",
            f"unreferenced: {len(self.unreferenced)} entries ({format_bytes(self.unreferenced_bytes)}); "
            f"{len(self.low_fill_shards)} shard(s) less than {LOW_FILL:.0%} live; "
            f"{len(self.orphan_files)} orphan file(s) ({format_bytes(self.orphan_bytes)})",
        ]
        if self.damaged:
            lines.append(f"{len(self.damaged)} damaged shard(s), kept as they are unless you clean with repair "
                         f"on; first: {self.damaged[0]}")
        if self.unreadable:
            lines.append(f"{len(self.unreadable)} shard(s) could not be read and are left untouched; first: "
                         f"{self.unreadable[0]}")
        return "\n".join(lines)


@dataclass(frozen=True)
class CleanReport:
    """What :func:`clean` did.

    Attributes:
        preview: the state before cleaning.
        dry_run: nothing was changed.
        entries_removed: entries dropped.
        files_deleted: files removed (replaced shards, orphans, old journals, stale records).
        bytes_freed: decrease of the cache folder's size.
        compaction: the compaction report (``None`` on a dry run).
        seconds: wall time.
        repaired_entries: entries a dataset references that a repair dropped as damaged (the next encode of that
            dataset re-creates them; a sourceless dataset has lost them).
    """

    preview: CleanPreview
    dry_run: bool
    entries_removed: int = 0
    files_deleted: int = 0
    bytes_freed: int = 0
    compaction: CompactReport | None = None
    seconds: float = 0.0
    repaired_entries: tuple[str, ...] = ()

    def summary(self) -> str:
        """The preview plus what was done."""
        if self.dry_run:
            return self.preview.summary() + "\ndry run: nothing was changed"
        text = (self.preview.summary() + f"\nremoved {self.entries_removed} entries and {self.files_deleted} "
                f"file(s), freed {format_bytes(self.bytes_freed)} ({self.seconds:.2f}s)")
        findings = self.compaction.findings() if self.compaction is not None else ""
        if self.repaired_entries:
            findings += (f"{'; ' if findings else ''}{len(self.repaired_entries)} of the dropped entries are used by "
                         f"a dataset (first: {self.repaired_entries[0]}): re-encode it to re-create them")
        return text + (f"\n{findings}" if findings else "")


class _Bytes(int):
    """A tensor's byte count inside a decoded skeleton (told apart from ints stored in the value)."""


def _sum_bytes(value: Any) -> int:
    if isinstance(value, _Bytes):
        return int(value)
    if isinstance(value, (list, tuple)):
        return sum(_sum_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_sum_bytes(v) for v in value.values())
    return 0


def _referenced(reader: CacheReader) -> set[str]:
    """Every key a dataset names; an unreadable dataset file stops the clean (its references are unknown)."""
    keys: set[str] = set()
    for name in reader.datasets():
        try:
            samples = reader.dataset(name)
        except CacheUnreadableError as exc:
            raise CacheUnreadableError(exc.path, f"{exc.reason}; what dataset {name!r} references is unknown, so "
                                       "nothing was cleaned", errno=exc.errno) from exc
        except CacheError as exc:
            raise CacheCorruptError(str(reader.root), f"dataset {name!r} cannot be read ({exc}), so what it "
                                    "references is unknown; nothing was cleaned. Re-encode or remove that dataset "
                                    "first") from exc
        for s in samples:
            keys.update(s.keys())
    return keys


def _shard_fills(reader: CacheReader, live: set[str]) -> tuple[list[ShardFill], dict[str, int]]:
    """Per shard: live and total tensor bytes; per key: its bytes. A key's later copies count as dead."""
    fills: list[ShardFill] = []
    entry_bytes: dict[str, int] = {}
    seen: set[str] = set()
    for sh in reader.shards:
        cols = sh.columns
        data = live_bytes = live_n = 0
        for i, key in enumerate(sh.keys):
            n = _sum_bytes(sh.skeleton(i, lambda c, r: _Bytes(cols[c].row_nbytes)))
            data += n
            first = key not in seen
            seen.add(key)
            if first:
                entry_bytes[key] = n
            if first and key in live:
                live_bytes += n
                live_n += 1
        fills.append(ShardFill(sh.file, sh.size, len(sh.keys), live_n, live_bytes, data))
    return fills, entry_bytes


def _orphans(root: Path, reader: CacheReader) -> list[Path]:
    state = reader.state
    named = {r.file for r in state.shards} | {d.file for d in state.datasets.values()} | {state.journal}
    records = {f"{SOURCES_DIR}/{path(root, name).name}" for name in state.datasets
               for path in (sources_record_path, reference_record_path)}
    out: list[Path] = []
    for p in _files(root):
        rel = p.relative_to(root).as_posix()
        if rel in _KEEP_NAMES or rel in named or rel in records:
            continue
        if (TEMP_FILE_RE.fullmatch(p.name) or SHARD_FILE_RE.fullmatch(rel) or DATASET_FILE_RE.fullmatch(rel)
                or _SOURCES_RECORD_RE.fullmatch(rel) or JOURNAL_RE.fullmatch(rel)):
            out.append(p)  # only files of the cache's own name patterns; anything else is not ours to delete
    return out


def _files(root: Path) -> Iterable[Path]:
    for top in (root, root / "shards", root / "datasets", root / SOURCES_DIR):
        try:
            with os.scandir(top) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        yield Path(e.path)
        except FileNotFoundError:
            continue


def _tree_bytes(root: Path) -> int:
    total = 0
    for p in _files(root):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def preview_clean(cache_root: str | os.PathLike[str]) -> CleanPreview:
    """Return what :func:`clean` would remove. Takes no lock and changes nothing.

    Raises:
        CacheNotFoundError: no cache at ``cache_root``.
        CacheCorruptError: the manifest, journal or a dataset file is damaged (references unknown).
    """
    root = Path(os.path.abspath(os.fspath(cache_root)))
    with open_cache(root, verify=False, strict=False) as reader:
        live = _referenced(reader)
        fills, entry_bytes = _shard_fills(reader, live)
        unref = sorted(k for k in reader.keys() if k not in live)
        dup_bytes = sum(f.data_bytes for f in fills) - sum(entry_bytes.values())
        orphans = _orphans(root, reader)
        orphan_bytes = 0
        for p in orphans:
            try:
                orphan_bytes += p.stat().st_size
            except FileNotFoundError:
                pass
        return CleanPreview(
            root=str(root), datasets=tuple(sorted(reader.datasets())), entries=len(reader),
            referenced=sum(1 for k in live if k in reader), unreferenced=tuple(unref),
            unreferenced_bytes=sum(entry_bytes[k] for k in unref) + dup_bytes,
            low_fill_shards=tuple(f for f in fills if f.live_fraction < LOW_FILL), shards=len(fills),
            shard_bytes=sum(f.bytes for f in fills),
            orphan_files=tuple(p.relative_to(root).as_posix() for p in orphans), orphan_bytes=orphan_bytes,
            damaged=tuple(str(p) for p in reader.problems if not isinstance(p, CacheUnreadableError)),
            unreadable=tuple(str(p) for p in reader.problems if isinstance(p, CacheUnreadableError)),
        )


def clean(cache_root: str | os.PathLike[str], *, dry_run: bool = True, repair: bool = False) -> CleanReport:
    """Remove unreferenced entries, compact underfull shards and delete orphan files.

    Args:
        cache_root: the cache directory.
        dry_run: only compute the preview (the default, so a bare call never deletes anything).
        repair: also verify every shard and drop damaged entries, moving their shard files to ``damaged/``
            (without it, damaged shards are kept as they are). Files that cannot be read are never dropped.

    Raises:
        CacheLockedError: another process encodes into or reads the cache; nothing was changed.
        CacheNotFoundError: no cache at ``cache_root``.
        CacheCorruptError: a dataset file cannot be read (nothing is deleted), or, after cleaning, a referenced
            entry is missing (a bug: report it).
    """
    start = time.perf_counter()
    root = Path(os.path.abspath(os.fspath(cache_root)))
    if dry_run:
        preview = preview_clean(root)
        return CleanReport(preview, True, seconds=time.perf_counter() - start)
    open_cache(root, verify=False, strict=False).close()  # CacheNotFoundError before any lock file is created
    with CacheLock(root, WRITE_LOCK, exclusive=True, timeout=0, purpose="clean"), \
            CacheLock(root, READ_LOCK, exclusive=True, timeout=0, purpose="clean"):
        preview = preview_clean(root)
        before = _tree_bytes(root)
        with open_cache(root, verify=False, strict=False) as reader:
            live = _referenced(reader)
            present = {k for k in live if k in reader}  # entries of unopenable shards were lost already
            shard_of = {k: Path(sh.file).name for sh in reader.shards for k in sh.keys if k in present}
            entries_before = len(reader)
        writer = CacheWriter(root, create=False)
        try:
            compaction = writer.compact(keep=live, repair=repair)
        finally:
            writer.close()
        deleted = compaction.files_deleted
        with open_cache(root, verify=False, strict=False) as reader:
            lost = [k for k in present if k not in reader]
            entries_after = len(reader)
            for p in _orphans(root, reader):  # sources records and temp files compaction does not look at
                try:
                    p.unlink()
                    deleted += 1
                except FileNotFoundError:
                    pass
        quarantined = {Path(q).name for q in compaction.quarantined}
        repaired = sorted(k for k in lost if shard_of.get(k) in quarantined)  # damaged: the next encode re-creates
        lost = [k for k in lost if shard_of.get(k) not in quarantined]
        if lost:
            raise CacheCorruptError(str(root), f"{len(lost)} entries referenced by a dataset are missing after "
                                    "clean; this is a bug, please report it", entry=lost[0])
        report = CleanReport(
            preview, False, entries_removed=entries_before - entries_after, files_deleted=deleted,
            bytes_freed=max(0, before - _tree_bytes(root)), compaction=compaction,
            seconds=time.perf_counter() - start, repaired_entries=tuple(repaired),
        )
    log.info("%s", report.summary())
    return report
