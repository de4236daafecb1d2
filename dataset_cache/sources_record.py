"""The sources record: the stat and content hash of each source file of a dataset folder, and its file format.

Kept apart from :mod:`.sources`, which validates a folder against a record, because the record is a stored format
(docs/FORMAT.md §10.1): its layout and checks change only with that document, and older records keep loading.

The record maps each source file (images, their caption files and mask files, by path relative to the folder) to
its size, ``mtime_ns``, xxh3-128 content hash and, for images and masks, the scanned width and height, for caption
files their caption variants (:func:`.scan.decode_captions`, parsed from the very bytes that were hashed), so that
planning an unchanged folder opens no file at all. Its ``pending`` map holds the files that differ from the sources
of the dataset as last stored (path → the hash the stored dataset knew, ``None`` for a file it did not have) until
the encode has stored the dataset (:meth:`SourcesRecord.settled`).

Storage: JSON with one list per field (columnar: compact, fast to load; ``captions`` holds a list of variants
for caption files and ``null`` otherwise; version-1 records, which lack it, still load), written atomically (temp
file, fsync, ``os.replace``, directory fsync) at a path the caller chooses (the cache keeps them under
``<cache>/sources/``).
A record that fails validation on load raises :class:`SourcesRecordError`; callers that prefer to carry on can
catch it and validate against an empty record, which re-hashes every file but re-encodes nothing (keys are
content addressed).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import CacheError
from .format.durable import atomic_write
from .format.safetensors_io import read_regular
from .hashing import is_lower_hex
from .keys import is_key

if TYPE_CHECKING:
    from .scan import SourceImage

__all__ = [
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "SourcesRecordError",
    "SourceEntry",
    "SourcesRecord",
    "save_record",
    "load_record",
    "load_record_or_empty",
]

log = logging.getLogger("dataset_cache.encode")

RECORD_FORMAT = "streamcache-sources"
"""Value of the ``format`` field of every record file."""

RECORD_VERSION = 2
"""Version of the record file layout written; version 1 (no ``captions`` column) is still read, others are refused
with an explicit message."""

_READABLE_VERSIONS = (1, 2)

_COLUMNS = ("paths", "size", "mtime_ns", "hash", "width", "height")
_CAPTIONS = "captions"  # version 2 on
_PENDING = "pending"  # optional: {relpath: hash in the stored dataset's sources, or null}


class SourcesRecordError(CacheError, ValueError):
    """A sources record file is unreadable, of an unknown version, or inconsistent.

    Attributes:
        path: the record file.
        reason: what is wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(
            f"{self.path}: {reason}. Delete this file to rebuild it: every source is then re-hashed once, "
            "nothing is re-encoded."
        )


class SourceEntry(NamedTuple):
    """The recorded state of one source file (``width``/``height`` only for images whose size was scanned,
    ``captions`` only for caption files: their variants, parsed from the content that has ``hash``)."""

    size: int
    mtime_ns: int
    hash: str
    width: int | None = None
    height: int | None = None
    captions: tuple[str, ...] | None = None


@dataclass
class SourcesRecord:
    """Stat and content hash of every source file of one folder.

    Attributes:
        entries: ``relpath -> SourceEntry``.
        scanned_ns: wall-clock time (``time.time_ns()``) when the listing this record reflects began
            (``FolderListing.started_ns``; 0 when unknown, which makes every file re-hashed next time).
        root: the folder the record was made from (informational; paths are relative, so a moved folder matches).
        pending: files that differ from the sources of the dataset as last stored: ``relpath -> the hash it had
            there`` (``None``: it had no such file). Emptied by :meth:`settled` once the dataset is stored.
    """

    entries: dict[str, SourceEntry] = field(default_factory=dict)
    scanned_ns: int = 0
    root: str | None = None
    pending: dict[str, str | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, relpath: object) -> bool:
        return relpath in self.entries

    def get(self, relpath: str) -> SourceEntry | None:
        """Return the entry of ``relpath``, or ``None``."""
        return self.entries.get(relpath)

    def image_sizes(self) -> dict[str, tuple[int, int, int, int]]:
        """Return ``relpath -> (size, mtime_ns, width, height)`` for :func:`.scan.scan_folder`'s ``known_sizes``."""
        return {
            p: (e.size, e.mtime_ns, e.width, e.height)
            for p, e in self.entries.items()
            if e.width is not None and e.height is not None
        }

    def caption_lines(self) -> dict[str, tuple[int, int, tuple[str, ...]]]:
        """Return ``relpath -> (size, mtime_ns, variants)`` for :func:`.scan.scan_folder`'s ``known_captions``."""
        return {p: (e.size, e.mtime_ns, e.captions) for p, e in self.entries.items() if e.captions is not None}

    def with_image_sizes(self, images: Iterable[SourceImage]) -> SourcesRecord:
        """Return a copy with the scanned sizes of ``images`` stored (entries whose stat matches only)."""
        entries = dict(self.entries)
        for img in images:
            e = entries.get(img.relpath)
            if e is not None and e.size == img.size and e.mtime_ns == img.mtime_ns:
                entries[img.relpath] = e._replace(width=img.width, height=img.height)
        return SourcesRecord(entries, self.scanned_ns, self.root, dict(self.pending))

    def settled(self) -> SourcesRecord:
        """A copy with no pending change: the sources as recorded are now those of the stored dataset."""
        return SourcesRecord(dict(self.entries), self.scanned_ns, self.root)

    def same_sources(self, other: SourcesRecord) -> bool:
        """Whether ``other`` records the same files with the same contents and the same pending changes."""
        return (self.pending == other.pending and self.entries.keys() == other.entries.keys()
                and all(e.hash == other.entries[p].hash for p, e in self.entries.items()))


def save_record(record: SourcesRecord, path: str | os.PathLike[str]) -> None:
    """Write ``record`` to ``path`` atomically (temp file in the same folder, fsync, ``os.replace``)."""
    path = os.fspath(path)
    paths = sorted(record.entries)
    rows = [record.entries[p] for p in paths]
    doc = {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "root": record.root,
        "scanned_ns": record.scanned_ns,
        "paths": paths,
        "size": [r.size for r in rows],
        "mtime_ns": [r.mtime_ns for r in rows],
        "hash": [r.hash for r in rows],
        "width": [r.width for r in rows],
        "height": [r.height for r in rows],
        _CAPTIONS: [r.captions for r in rows],
    }
    if record.pending:  # absent when nothing is pending, as in records written before it existed
        doc[_PENDING] = dict(sorted(record.pending.items()))
    data = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    target = Path(os.path.abspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda f: f.write(data))


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_side(v: Any) -> bool:
    return v is None or (type(v) is int and v > 0)


def _column_ok(name: str, col: list[Any]) -> bool:
    """Check a whole column with C-speed primitives (a 100k-row record loads in tens of ms)."""
    types = set(map(type, col))
    if name == "paths":
        return types <= {str} and "" not in col
    if name == "hash":
        return types <= {str} and set(map(len, col)) <= {32} and is_lower_hex("".join(col))
    if name == _CAPTIONS:
        lists = [v for v in col if v is not None]
        return (types <= {list, type(None)} and all(lists)
                and set(map(type, (line for v in lists for line in v))) <= {str})
    if name in ("width", "height"):
        ints = [v for v in col if v is not None]
        return types <= {int, type(None)} and (not ints or min(ints) > 0)
    return types <= {int} and (not col or min(col) >= 0)


def _check_doc(doc: Any, path: str) -> int:
    """Validate a parsed record document; return its row count."""
    if not isinstance(doc, Mapping) or doc.get("format") != RECORD_FORMAT:
        raise SourcesRecordError(path, f"not a sources record (expected \"format\": \"{RECORD_FORMAT}\")")
    if doc.get("version") not in _READABLE_VERSIONS or type(doc.get("version")) is not int:
        raise SourcesRecordError(
            path, f"sources record version {doc.get('version')!r} is not supported (expected "
                  f"{' or '.join(map(str, _READABLE_VERSIONS))})"
        )
    if not _is_count(doc.get("scanned_ns")) or not (doc.get("root") is None or isinstance(doc.get("root"), str)):
        raise SourcesRecordError(path, "field scanned_ns must be an int >= 0 and root a str or null")
    names = _COLUMNS + ((_CAPTIONS,) if doc["version"] >= 2 else ())
    values = [doc.get(c) for c in names]
    bad = [c for c, v in zip(names, values) if not isinstance(v, list)]
    if bad:
        raise SourcesRecordError(path, f"column(s) {', '.join(bad)} missing or not lists")
    cols: list[list[Any]] = [v for v in values if isinstance(v, list)]
    n = len(cols[0])
    if any(len(v) != n for v in cols):
        lengths = ", ".join(f"{c}={len(v)}" for c, v in zip(names, cols))
        raise SourcesRecordError(path, f"columns differ in length ({lengths})")
    checks = (("paths", lambda v: isinstance(v, str) and v != ""), ("size", _is_count), ("mtime_ns", _is_count),
              ("hash", is_key), ("width", _is_side), ("height", _is_side),
              (_CAPTIONS, lambda v: v is None or (isinstance(v, list) and bool(v)
                                                   and all(isinstance(x, str) for x in v))))
    for (name, ok), col in zip(checks, cols):
        if not _column_ok(name, col):  # fast whole-column check; find the bad row only on failure
            i, v = next((i, v) for i, v in enumerate(col) if not ok(v))
            raise SourcesRecordError(path, f"row {i} of column {name} holds an invalid value {v!r}")
    if len(set(cols[0])) != n:
        raise SourcesRecordError(path, "column paths lists a file twice")
    owed = doc.get(_PENDING, {})
    if not isinstance(owed, Mapping) or not all(
            isinstance(k, str) and k and (v is None or is_key(v)) for k, v in owed.items()):
        raise SourcesRecordError(path, "field pending must map paths to a content hash or null")
    return n


def load_record(path: str | os.PathLike[str], *, missing_ok: bool = False) -> SourcesRecord:
    """Read a record written by :func:`save_record`.

    Args:
        path: the record file.
        missing_ok: return an empty record (everything will count as new) when the file does not exist.

    Raises:
        FileNotFoundError: the file does not exist and ``missing_ok`` is false.
        CacheLinkError: the file is a symbolic link.
        SourcesRecordError: the file is not valid JSON, not a record, of another version, or inconsistent.
    """
    path = os.fspath(path)
    try:
        raw = read_regular(path)  # a record that is a link is refused (CacheLinkError), never followed
    except FileNotFoundError:
        if missing_ok:
            return SourcesRecord()
        raise
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourcesRecordError(path, f"not valid JSON ({exc})") from exc
    _check_doc(doc, path)
    cols = [doc[c] for c in _COLUMNS]
    # version 1 has no variants: its trusted captions are read (once) by the next validation
    cols.append([None if v is None else tuple(v) for v in doc[_CAPTIONS]] if doc["version"] >= 2
                else [None] * len(cols[0]))
    make = functools.partial(tuple.__new__, SourceEntry)  # SourceEntry._make without its per-row length check
    entries = dict(zip(cols[0], map(make, zip(*cols[1:]))))
    return SourcesRecord(entries, doc["scanned_ns"], doc["root"], dict(doc.get(_PENDING, {})))


def load_record_or_empty(path: str | os.PathLike[str]) -> SourcesRecord:
    """:func:`load_record`, an empty record for one that is missing or unreadable (logged): a lost record costs one
    re-hash of every file of its folder, never a re-encode."""
    try:
        return load_record(path, missing_ok=True)
    except SourcesRecordError as exc:
        log.warning("%s; validating against an empty record instead", exc)
        return SourcesRecord()
