"""Compaction: underfull shards rewritten into full ones, dropped entries left behind, unreferenced files swept,
and (on an explicit repair) damaged shards moved to ``damaged/``.

Compaction is where the cache's files are deleted, so the rules for what may go (docs/FORMAT.md, "Links, nesting
and what may be deleted") live in this one module, apart from the writer that adds entries. It runs as
:meth:`.writer.CacheWriter.compact`, which commits first and takes the new manifest's state as its own at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batching import batched
from ..errors import CacheCorruptError, CacheError, CacheUnreadableError
from .layout import (
    DAMAGED_DIR,
    DATASET_FILE_RE,
    DATASETS_DIR,
    MANIFEST,
    SHARD_FILE_RE,
    SHARDS_DIR,
    TEMP_FILE_RE,
    check_no_links,
)
from .durable import new_id
from .manifest import JOURNAL_RE, CacheState, ShardRecord, next_generation, write_manifest
from .reader import CacheReader, open_cache
from .shard import ShardBuilder

__all__ = ["CompactReport", "Compaction", "sweep_unreferenced", "unlink_unreferenced"]

log = logging.getLogger("dataset_cache.format.compaction")


@dataclass(frozen=True)
class CompactReport:
    """What :meth:`.writer.CacheWriter.compact` did.

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


@dataclass
class _CompactPlan:
    """The shards of one compaction: ``(record, index or None when unopened)`` pairs."""

    kept: list[tuple[ShardRecord, Any]] = field(default_factory=list)
    rewrite: list[tuple[ShardRecord, Any]] = field(default_factory=list)
    drop: list[tuple[ShardRecord, Any]] = field(default_factory=list)


class Compaction:
    """One compaction of the cache at ``root``, whose committed state is ``state`` (nothing pending).

    The steps, in the order :meth:`.writer.CacheWriter.compact` takes them: constructing one opens the cache and
    plans which shards are kept as they are, rewritten, or (repair only) dropped; :meth:`switch` rewrites and
    publishes the new manifest; :func:`sweep_unreferenced` deletes what that manifest no longer names;
    :meth:`report` says what happened.

    Args:
        root: the cache folder.
        state: its committed state (the writer's, after its commit).
        shard_bytes: the size new shards are filled to; shards under ``min_fill * shard_bytes`` are rewritten.
        keep: entries to keep (``None``: all). Entries referenced by a dataset are always kept.
        min_fill: see ``shard_bytes``.
        repair: verify every shard first; drop the entries whose bytes are damaged and move the shard files that
            held them (or that cannot be opened as shards at all) to ``damaged/``.
    """

    def __init__(self, root: Path, state: CacheState, shard_bytes: int, *, keep: set[str] | None = None,
                 min_fill: float = 0.5, repair: bool = False) -> None:
        check_no_links(root)
        self.root, self.before, self.shard_bytes, self.repair = root, state, shard_bytes, repair
        self.reader = open_cache(root, strict=False)
        problems: list[CacheError] = list(self.reader.verify() if repair else self.reader.problems)
        self.unreadable: list[CacheError] = [p for p in problems if isinstance(p, CacheUnreadableError)]
        self.damaged = [p for p in problems if not isinstance(p, CacheUnreadableError)]
        self.order = _dataset_order(self.reader)
        present = set(self.reader.keys())  # entries of shards that could not be opened are not copied: they stay there
        self.live = present if keep is None else (set(keep) | set(self.order)) & present
        self.plan = self._choose(problems, min_fill)
        self.new: list[ShardRecord] = []
        self.quarantined: list[str] = []

    def switch(self) -> CacheState:
        """Copy the live entries of the shards to rewrite into new shards, in dataset order (then the rest) so
        training reads them sequentially, and publish a manifest naming a fresh empty journal: the atomic switch.

        Returns the state after the switch (``state`` itself when there was nothing to rewrite, drop or fold in
        from the journal). A reader opened before the switch must be reopened.
        """
        plan, state = self.plan, self.before
        if not (plan.rewrite or plan.drop or state.journal_commits):
            return state
        kept_keys = {k for _, sh in plan.kept if sh is not None for k in sh.keys}
        wanted = [k for k in [*self.order, *(k for _, sh in plan.rewrite for k in sh.keys)]
                  if k in self.live and k not in kept_keys]
        self.new, failed = self._rewrite(wanted)
        held = self._hold_back(failed)
        self.quarantined = self._quarantine(held)
        kept = [rec for rec, _ in plan.kept] + held
        return write_manifest(self.root, next_generation(state.generation), kept + self.new, state.datasets)

    def report(self, after: CacheState, deleted: int, entries: int) -> CompactReport:
        """What this compaction did, given the state after it, the files swept and the entries the cache holds."""
        before = self.before
        gone = {r.file for r in before.shards} - {r.file for r in after.shards}
        return CompactReport(
            shards_before=len(before.shards), shards_after=len(after.shards), shards_rewritten=len(self.plan.rewrite),
            entries_kept=entries,
            entries_dropped=max(0, sum(r.entries for r in before.shards if r.file in gone)
                                - sum(r.entries for r in self.new)),
            bytes_before=sum(r.bytes for r in before.shards), bytes_after=sum(r.bytes for r in after.shards),
            files_deleted=deleted, damaged=tuple(dict.fromkeys(str(p) for p in self.damaged)),
            unreadable=tuple(dict.fromkeys(str(p) for p in self.unreadable)), quarantined=tuple(self.quarantined),
        )

    def _choose(self, problems: Sequence[CacheError], min_fill: float) -> _CompactPlan:
        """Sort the manifest's shards into kept as they are, rewritten, and (repair only) dropped as damaged."""
        by_file = {sh.file: sh for sh in self.reader.shards}
        hold = {p.path for p in problems if isinstance(p, CacheUnreadableError)}
        bad = {p.path for p in problems if isinstance(p, CacheCorruptError)} if self.repair else set()
        plan = _CompactPlan()
        seen: set[str] = set()
        for rec in self.before.shards:
            sh = by_file.get(rec.file)
            path = str(self.root / rec.file)
            if sh is None:  # could not be opened: damage is dropped on repair only; anything else stays
                (plan.drop if path in bad and path not in hold else plan.kept).append((rec, None))
                continue
            if path in hold:  # a read failed because of the environment: leave the file exactly as it is
                plan.kept.append((rec, sh))
                seen.update(sh.keys)
                continue
            dropped = any(k in seen or k not in self.live for k in sh.keys) or path in bad
            seen.update(sh.keys)
            (plan.rewrite if dropped or rec.bytes < min_fill * self.shard_bytes else plan.kept).append((rec, sh))
            if path in bad:
                plan.drop.append((rec, None))
        if (len(plan.rewrite) == 1 and all(k in self.live for k in plan.rewrite[0][1].keys)
                and str(plan.rewrite[0][1].path) not in bad):  # rewriting it alone gains nothing
            plan.kept, plan.rewrite = plan.kept + plan.rewrite, []
        return plan

    def _rewrite(self, keys: list[str]) -> tuple[list[ShardRecord], dict[str, CacheError]]:
        """Copy ``keys`` into new full shards; returns the records and the entries that could not be read."""
        pending = list(dict.fromkeys(keys))
        builder, records = ShardBuilder(), []
        failed: dict[str, CacheError] = {}
        for batch in batched(pending, 64):
            for k, v in _read_or_skip(self.reader, batch, failed):
                builder.add(k, self.reader.kind(k), v, "value")
                if builder.nbytes >= self.shard_bytes:
                    records.append(builder.write(self.root / SHARDS_DIR, new_id()))
                    builder = ShardBuilder()
        if len(builder):
            records.append(builder.write(self.root / SHARDS_DIR, new_id()))
        return records, failed

    def _hold_back(self, failed: dict[str, CacheError]) -> list[ShardRecord]:
        """The rewritten shards that must stay because an entry of theirs could not be copied.

        Without ``repair`` any failed read keeps its shard (nothing is dropped on a guess); with it, only a read
        that failed for its environment does, and damaged entries are dropped.
        """
        plan = self.plan
        held: list[ShardRecord] = []
        for rec, sh in plan.rewrite:
            errors = [failed[k] for k in sh.keys if k in failed]
            if not errors:
                continue
            for exc in errors:
                (self.unreadable if isinstance(exc, CacheUnreadableError) else self.damaged).append(exc)
            if not self.repair or any(isinstance(e, CacheUnreadableError) for e in errors):
                held.append(rec)
                plan.drop = [(r, s) for r, s in plan.drop if r.file != rec.file]
        return held

    def _quarantine(self, held: list[ShardRecord]) -> list[str]:
        """Move the shards a repair drops to ``damaged/`` (before the switch: a crash leaves them named, not lost).

        A shard that cannot be moved stays in the manifest (appended to ``held``).
        """
        moved: list[str] = []
        for rec, _ in self.plan.drop:
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


def sweep_unreferenced(root: Path, state: CacheState) -> int:
    """Delete the cache's own files ``state`` no longer names: only regular files of its name patterns.

    Returns how many files were deleted.
    """
    refs = {r.file for r in state.shards} | {d.file for d in state.datasets.values()}
    refs.add(state.journal)
    n = 0
    for sub, pattern in ((SHARDS_DIR, SHARD_FILE_RE), (DATASETS_DIR, DATASET_FILE_RE)):
        for name in _regular_files(root / sub):
            rel = f"{sub}/{name}"
            if rel not in refs and (pattern.fullmatch(rel) or TEMP_FILE_RE.fullmatch(name)):
                n += unlink_unreferenced(root / rel)
    for name in _regular_files(root):
        if name not in refs and name != MANIFEST and (JOURNAL_RE.fullmatch(name) or TEMP_FILE_RE.fullmatch(name)):
            n += unlink_unreferenced(root / name)
    return n


def unlink_unreferenced(p: Path) -> int:
    """Delete a file nothing published names any more: 1 when deleted, 0 when already gone or not deletable now
    (logged; being unreferenced, it is retried later)."""
    try:
        p.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:  # e.g. Windows: a file still open elsewhere; the next compaction retries
        log.warning("could not delete %s (%s); it is unreferenced and will be retried", p, exc)
        return 0


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
