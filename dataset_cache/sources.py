"""Exact, fast validation of a dataset folder against its sources record (:mod:`.sources_record`): what changed.

Planning an encode starts here, so an unchanged folder must cost no more than its listing, and a changed one no
more than reading the files that changed. Validation checks every file of the folder, none sampled:

* same ``(size, mtime_ns)`` as recorded → trusted without reading the file;
* different stat (or a new file) → the file is re-hashed; an unchanged hash only refreshes the stored stat, so a
  ``touch``, a copy that keeps contents or a ``git checkout`` costs no encode;
* recorded files no longer present → removed.

Counts are against the sources of the dataset as last stored: a plan saves the record before its encode (so a
crash never costs a re-hash), and the files it found new, changed or removed stay so in the record's ``pending``
map (path → the hash the stored dataset knew, ``None`` for a file it did not have) until the encode has stored
the dataset (:meth:`SourcesRecord.settled`). A second plan of the same run, or the run after a cancelled one,
therefore counts what the first one counted, not "unchanged".

Trust rule and its one blind spot: an edit that keeps both the size and the ``mtime_ns`` is trusted (documented,
tested). Tools that restore mtimes after editing (``touch -r``, some sync tools) must be followed by a rebuild of the
record. To close the usual way this happens by accident — a file edited within the filesystem's timestamp
granularity of the previous scan ("racy clean", as git calls it) — files whose mtime is within
:data:`RACY_WINDOW_NS` of the previous scan's start are always re-hashed (files dated in the future, e.g. copied
from a machine whose clock runs ahead, are therefore re-hashed on every run until that time has passed: slower,
never wrong).

Cost when nothing changed: one ``os.scandir`` per folder, one ``DirEntry.stat()`` per file and a dict lookup; no
file is opened. Changed files are hashed on a small thread pool (caption files are read whole, hashed and parsed
in one go; images are read whole, hashed, and their width and height read from the same bytes, so the scan does
not open them again). Trusted caption files recorded without variants (a version-1 record, or a caption that is not
UTF-8) are read once more to store them when their content still has the recorded hash.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .errors import SourceError, SourceFailure
from .frames import VIDEO_EXTENSIONS
from .gcpause import gc_paused
from .imaging import image_size_from_bytes
from .keys import hash_file
from .listing import CAPTION_EXTENSION, FolderListing, list_folder
from .scan import decode_captions
from .sources_record import SourceEntry, SourcesRecord
from .threads import resolve_threads

__all__ = [
    "RACY_WINDOW_NS",
    "Validation",
    "validate_sources",
    "build_record",
]

RACY_WINDOW_NS = 2_000_000_000
"""Files modified less than 2 s before the previous scan began are re-hashed even when their stat matches: 2 s
covers the coarsest common timestamp granularity (FAT/exFAT), so an edit in the same tick as the scan is caught."""


@dataclass(frozen=True)
class Validation:
    """The outcome of :func:`validate_sources`. Path lists are sorted relative paths. ``new``, ``changed``,
    ``unchanged`` and ``removed`` compare with the sources of the dataset as last stored (the previous record
    with its ``pending`` changes undone), ``refreshed`` and ``hashed`` with the previous record.

    Attributes:
        new: files the stored dataset's sources did not have.
        changed: files whose content hash differs from the stored dataset's sources.
        unchanged: files whose content is as there (trusted by stat, or re-hashed to the same hash).
        removed: files of the stored dataset's sources no longer in the folder (including captions whose image
            went away).
        refreshed: the subset of ``unchanged`` whose stat differed (touched, copied, checked out): stored anew.
        hashed: how many files were read and hashed.
        failures: files that could not be listed or hashed (left out of the record, so retried next time).
        record: the updated record, ready for :func:`save_record`.
        listing: the folder listing the validation used (reusable by :func:`.scan.scan_folder`).
        captions_added: trusted caption files whose variants were missing from the previous record (version 1)
            and were read and stored (the record then differs from the previous one and is worth saving).
        moved: a file was added, edited or removed since the previous record (not only since the stored
            dataset's sources).
    """

    new: tuple[str, ...]
    changed: tuple[str, ...]
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]
    refreshed: tuple[str, ...]
    hashed: int
    failures: tuple[SourceFailure, ...]
    record: SourcesRecord
    listing: FolderListing
    captions_added: int = 0
    moved: bool = False

    @property
    def clean(self) -> bool:
        """True when nothing was added, changed or removed."""
        return not (self.new or self.changed or self.removed)

    @property
    def record_changed(self) -> bool:
        """Whether :attr:`record` differs from the previous record (worth saving): a file hashed, a caption's
        variants added, or a file added, edited or removed since the previous record."""
        return bool(self.hashed or self.captions_added or self.moved)

    def counts(self) -> dict[str, int]:
        """Return the number of files in each category (for logs and reports)."""
        return {
            "new": len(self.new), "changed": len(self.changed), "unchanged": len(self.unchanged),
            "removed": len(self.removed), "refreshed": len(self.refreshed), "hashed": self.hashed,
            "failures": len(self.failures),
        }


_Read = Any  # (hash, caption variants or None[, image (width, height) or None]), or the OSError that stopped the read

_WHOLE_IMAGE_BYTES = 64 << 20
"""Images up to this size are read whole when hashed, and their header parsed from the same bytes, so the scan that
follows opens no file a second time (one open and read per new image instead of two; the size also comes from
exactly the content that was hashed). Larger files are hashed in chunks (flat memory) and scanned as before."""


def _read_whole(fd: int, size: int) -> bytes:
    """All bytes of an open regular file of ``size`` bytes (per ``fstat``), in one ``read`` as a rule.

    Asking for one byte more than the size tells the end of the file by a short read, so no second, empty
    ``read`` is needed to find it: that empty read allocated a buffer of the full request and cost more than
    reading a 3 MB image from the page cache (0.7 ms) on this machine. A file that grew since ``fstat`` is read
    on to its end.
    """
    want = size + 1
    part = os.read(fd, want)
    if len(part) < want:  # a regular file reads short only at its end
        return part
    parts = [part]
    while len(part) == want:
        want = 1 << 20
        part = os.read(fd, want)
        parts.append(part)
    return b"".join(parts)


def _read_caption(path: str) -> tuple[str, tuple[str, ...] | None]:
    """Read a caption file whole; return its hash and its variants (``None`` when not UTF-8)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        raw = _read_whole(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    try:
        captions: tuple[str, ...] | None = decode_captions(raw, path)
    except SourceError:  # reported by the scan, which reads it again
        captions = None
    return xxhash.xxh3_128_hexdigest(raw), captions


def _read_image(path: str) -> tuple[str, None, tuple[int, int] | None]:
    """Hash an image; for one up to :data:`_WHOLE_IMAGE_BYTES`, also read its size (as the scan would) from the
    same bytes (``None`` when the header is unreadable: the scan reads it again and reports the problem)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        if size > _WHOLE_IMAGE_BYTES or path[path.rfind("."):].lower() in VIDEO_EXTENSIONS:  # a video: no image size
            return hash_file(path), None, None
        raw = _read_whole(fd, size)
    finally:
        os.close(fd)
    return xxhash.xxh3_128_hexdigest(raw), None, image_size_from_bytes(raw)


def _hash_chunk(root: str, items: list[tuple[str, bool]]) -> list[_Read]:
    out: list[_Read] = []
    for relpath, caption in items:
        path = os.path.join(root, *relpath.split("/"))
        try:
            out.append(_read_caption(path) if caption else _read_image(path))
        except OSError as exc:
            out.append(exc)
    return out


_PROBE_FILES = 32
_POOL_MIN_SECONDS_PER_FILE = 150e-6
"""Files that hash faster than this on one thread (small files from the page cache) are hashed on the calling
thread, where a pool only hands the GIL around; slower ones (large images, a cold disk, a network share) go to the
pool, whose reads overlap (figures: docs/BENCHMARKS.md)."""


def _hash_all(root: str, items: list[tuple[str, bool]], threads: int | None) -> list[_Read]:
    """Hash files (``(relpath, is_caption)``), on a small pool when the files are slow enough for one to pay.

    The first files are hashed on the calling thread and timed; the rest follow them there when they were quick
    (see :data:`_POOL_MIN_SECONDS_PER_FILE`), else go to the pool in chunks (so per-task overhead stays small).
    """
    n = min(len(items), resolve_threads(threads, purpose="source hashing threads", per_cpu=2.0, maximum=16))
    if n <= 1 or len(items) <= _PROBE_FILES:
        return _hash_chunk(root, items)
    start = time.perf_counter()
    out = _hash_chunk(root, items[:_PROBE_FILES])
    rest = items[_PROBE_FILES:]
    if time.perf_counter() - start < _POOL_MIN_SECONDS_PER_FILE * _PROBE_FILES:
        return out + _hash_chunk(root, rest)
    size = max(1, min(256, len(rest) // (4 * n)))
    chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
    with ThreadPoolExecutor(n, thread_name_prefix="source-hash") as pool:
        return out + [h for part in pool.map(lambda c: _hash_chunk(root, c), chunks) for h in part]


def validate_sources(
    source: str | os.PathLike[str] | FolderListing,
    previous: SourcesRecord | None,
    *,
    threads: int | None = None,
    list_threads: int | None = 1,
    racy_window_ns: int = RACY_WINDOW_NS,
    caption_extension: str = CAPTION_EXTENSION,
) -> Validation:
    """Compare a folder with the record of a previous run (``None``: everything is new).

    Args:
        source: the dataset folder, or a listing of it made by :func:`.listing.list_folder` just before.
        previous: the record saved by the previous run.
        threads: hashing threads; ``None`` chooses from the CPUs this process may use.
        list_threads: folders listed concurrently (see :func:`.listing.list_folder`: 1 suits local disks).
        racy_window_ns: see :data:`RACY_WINDOW_NS`.
        caption_extension: the caption files' extension (see :func:`.listing.list_folder`), when ``source`` is a
            folder.

    Raises:
        DatasetFolderError: the folder is missing, not a folder, or holds no image.
    """
    prev = previous.entries if previous is not None else {}
    trust_before = previous.scanned_ns - racy_window_ns if previous is not None else 0
    with gc_paused():  # hundreds of thousands of acyclic objects: see .gcpause
        listing = source if isinstance(source, FolderListing) else list_folder(
            source, threads=list_threads, caption_extension=caption_extension)
        trusted = _trust(listing, prev, trust_before)
    entries, pending = trusted.entries, trusted.pending
    failures = list(listing.failures)
    hashes = _hash_all(listing.root, [(p, p in trusted.captions) for p in pending] + [(p, True) for p in trusted.fill],
                       threads)
    added = _fill_captions(entries, trusted.fill, hashes[len(pending):])
    new, changed, refreshed = _classify(pending, hashes, entries, failures, listing)
    failed = {f.relpath for f in failures}
    removed = sorted(prev.keys() - entries.keys() - failed)  # set algebra runs in C
    moved = bool(new or changed or removed)
    owed = previous.pending if previous is not None else {}
    if owed or moved:  # against the stored dataset's sources, not the previous record
        new, changed, removed, owed = _against_stored(prev, owed, entries, failed, (*new, *changed, *removed))
    unchanged = sorted(entries.keys() - set(new) - set(changed) if new or changed else entries)
    record = SourcesRecord(entries, listing.started_ns, listing.root, owed)
    return Validation(
        new=tuple(sorted(new)), changed=tuple(sorted(changed)), unchanged=tuple(unchanged),
        removed=tuple(sorted(removed)), refreshed=tuple(sorted(refreshed)), hashed=len(pending),
        failures=tuple(sorted(failures, key=lambda f: f.relpath)), record=record, listing=listing,
        captions_added=added, moved=moved,
    )


@dataclass
class _Trusted:
    """The first pass of :func:`validate_sources`: files whose stat the record vouches for, and those to hash."""

    entries: dict[str, SourceEntry] = field(default_factory=dict)
    pending: dict[str, tuple[int, int, SourceEntry | None]] = field(default_factory=dict)  # (size, mtime, old)
    captions: set[str] = field(default_factory=set)  # pending caption files
    fill: list[str] = field(default_factory=list)  # trusted caption files recorded without their variants


def _trust(listing: FolderListing, prev: Mapping[str, SourceEntry], trust_before: int) -> _Trusted:
    """Take each listed file's record entry where its size and mtime match and it was older than the previous
    scan by the racy window; every other file is pending (to hash)."""
    out = _Trusted()
    entries, pending, get = out.entries, out.pending, prev.get
    # hot loop (every file of the folder): a dict lookup and two int compares per file
    for relpath, size, mtime_ns, _, cap, cap_size, cap_mtime in listing.images:
        old = get(relpath)
        if old is not None and old[0] == size and old[1] == mtime_ns and mtime_ns < trust_before:
            entries[relpath] = old
        else:
            pending[relpath] = (size, mtime_ns, old)
        if cap is None or cap in entries or cap in pending:  # no caption, or one shared with a.jpg / a.png
            continue
        old = get(cap)
        if old is not None and old[0] == cap_size and old[1] == cap_mtime and cap_mtime < trust_before:
            entries[cap] = old
            if old.captions is None:
                out.fill.append(cap)
        else:
            pending[cap] = (cap_size, cap_mtime, old)
            out.captions.add(cap)
    for relpath, size, mtime_ns in listing.masks:  # mask files: hashed like images (their size is read too)
        old = get(relpath)
        if old is not None and old[0] == size and old[1] == mtime_ns and mtime_ns < trust_before:
            entries[relpath] = old
        else:
            pending[relpath] = (size, mtime_ns, old)
    return out


def _fill_captions(entries: dict[str, SourceEntry], fill: Sequence[str], reads: Sequence[Any]) -> int:
    """Store the caption lines of trusted caption files recorded without them; how many were stored."""
    added = 0
    for relpath, read in zip(fill, reads):
        # stored only when the content still has the recorded hash (else the stat-trusted file was edited in a
        # way the trust rule ignores: keep the entry as it was, the scan reads the caption as before)
        if not isinstance(read, OSError) and read[1] is not None and read[0] == entries[relpath].hash:
            entries[relpath] = entries[relpath]._replace(captions=read[1])
            added += 1
    return added


def _classify(pending: Mapping[str, tuple[int, int, SourceEntry | None]], hashes: Sequence[Any],
              entries: dict[str, SourceEntry], failures: list[SourceFailure], listing: FolderListing
              ) -> tuple[list[str], list[str], list[str]]:
    """Enter each hashed file in ``entries`` as new, changed or the same (its stat refreshed); one that could not
    be read goes to ``failures``. Returns (new, changed, refreshed)."""
    new: list[str] = []
    changed: list[str] = []
    refreshed: list[str] = []
    for (relpath, (size, mtime_ns, old)), read in zip(pending.items(), hashes):
        dims = None
        if isinstance(read, OSError):
            digest: str | OSError = read
        else:
            digest, lines = read[0], read[1]
            dims = read[2] if len(read) > 2 else None
        width, height = dims if dims is not None else (None, None)
        if isinstance(digest, OSError):
            failures.append(SourceFailure(relpath, listing.abspath(relpath),
                                          f"cannot read to hash: {digest.strerror or digest}"))
        elif old is None:
            new.append(relpath)
            entries[relpath] = SourceEntry(size, mtime_ns, digest, width, height, captions=lines)
        elif old.hash != digest:
            changed.append(relpath)
            entries[relpath] = SourceEntry(size, mtime_ns, digest, width, height, captions=lines)
        else:
            if (old.size, old.mtime_ns) != (size, mtime_ns):
                refreshed.append(relpath)
            entries[relpath] = old._replace(size=size, mtime_ns=mtime_ns, captions=lines)
    return new, changed, refreshed


def _against_stored(prev: Mapping[str, SourceEntry], owed: Mapping[str, str | None],
                    entries: Mapping[str, SourceEntry], failed: set[str], moved: Iterable[str]
                    ) -> tuple[list[str], list[str], list[str], dict[str, str | None]]:
    """New, changed and removed files against the stored dataset's sources — the previous record with its
    pending changes ``owed`` undone — and the pending changes to record now. Only the files that moved since the
    previous record and those already pending can differ from it; a file that cannot be read keeps its pending
    state and is not counted."""
    new: list[str] = []
    changed: list[str] = []
    removed: list[str] = []
    pending: dict[str, str | None] = {}
    for relpath in set(owed).union(moved):
        if relpath in failed:
            if relpath in owed:
                pending[relpath] = owed[relpath]
            continue
        if relpath in owed:
            before = owed[relpath]
        else:
            old = prev.get(relpath)
            before = old.hash if old is not None else None
        now = entries.get(relpath)
        if now is None:
            if before is not None:
                removed.append(relpath)
                pending[relpath] = before
        elif before is None:
            new.append(relpath)
            pending[relpath] = None
        elif before != now.hash:
            changed.append(relpath)
            pending[relpath] = before
    return new, changed, removed, pending


def build_record(source: str | os.PathLike[str] | FolderListing, *, threads: int | None = None) -> SourcesRecord:
    """Hash every source file of a folder and return a fresh record (nothing pending)."""
    return validate_sources(source, None, threads=threads).record.settled()
