"""``manifest.json`` + the append-only journal: which shards and datasets make up the cache.

The manifest is rewritten only by compaction (temp + fsync + rename: the atomic switch); every ordinary commit
appends one checksummed line to the live journal, so committing a batch costs one small append + fsync however
large the cache is (a single monolithic index becomes the bottleneck at ~100k entries). A reader's state is the
manifest followed by the journal's valid lines; a torn last line (a crash mid-append) is ignored, while a bad
line followed by good ones means damage and is reported. Layout and rules: docs/FORMAT.md.

A dataset's record here only names its file; the file itself (its samples) is ``dataset_file.py``'s, and every
write goes through ``durable.py`` (temp + fsync + rename, no link followed).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import FORMAT_NAME, FORMAT_VERSION
from ..dataset import DatasetInfo
from ..errors import CacheCorruptError, CacheFormatError, CacheNotFoundError
from ..hashing import checksum64
from .durable import atomic_write, fsync_dir, named_os_error, open_nofollow, read_error
from .layout import DATASET_FILE_RE, MANIFEST, SHARD_FILE_RE
from .safetensors_io import load_json_object, read_regular

if TYPE_CHECKING:
    from ..remote.urls import CacheURL

__all__ = [
    "MANIFEST",
    "ShardRecord",
    "CacheState",
    "read_state",
    "parse_manifest",
    "replay_journal",
    "append_journal",
    "write_manifest",
    "manifest_bytes",
    "journal_name",
    "next_generation",
    "MAX_GENERATION",
    "JOURNAL_RE",
    "local_root",
    "encode_line",
]

MAX_GENERATION = 10**18 - 1
"""The largest manifest generation: its journal name still has the 18 digits ``JOURNAL_RE`` accepts. The
generation after it is 1 (:func:`next_generation`), so a writer never names a journal its reader refuses."""
JOURNAL_RE = re.compile(r"journal-[0-9]{6,18}\.jsonl")
_LINE_HEAD = b'{"xxh3_64":"'
_LINE_MID = b'","record":'
_LINE_TAIL = b"}\n"


@dataclass(frozen=True)
class ShardRecord:
    """The manifest's record of one shard: relative file name, size, entry count, header checksum."""

    file: str
    bytes: int
    entries: int
    header_xxh3: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "bytes": self.bytes, "entries": self.entries}
        if self.header_xxh3:
            d["header_xxh3"] = self.header_xxh3
        return d

    @classmethod
    def from_json(cls, where: str, obj: Any) -> ShardRecord:
        """Check and convert one shard record (``where`` names the file in errors)."""
        if type(obj) is not dict:
            raise CacheCorruptError(where, "a shard record is not an object")
        f, b, n, h = obj.get("file"), obj.get("bytes"), obj.get("entries"), obj.get("header_xxh3")
        if type(f) is not str or not SHARD_FILE_RE.fullmatch(f):
            raise CacheCorruptError(where, f"bad shard file name {f!r:.80}")
        if type(b) is not int or b < 8 or type(n) is not int or n < 0:
            raise CacheCorruptError(where, f"shard {f}: bytes and entries must be non-negative ints")
        if h is not None and (type(h) is not str or len(h) != 16):
            raise CacheCorruptError(where, f"shard {f}: header_xxh3 must be 16 hex digits")
        return cls(f, b, n, h)


@dataclass
class CacheState:
    """The committed state of a cache: the manifest plus the journal's valid lines.

    Attributes:
        root: cache directory (a remote cache's URL for a state read over the network, which no writer takes).
        generation: manifest generation (incremented by each compaction).
        journal: file name of the live journal.
        shards: committed shards in commit order.
        datasets: name -> dataset record.
        journal_bytes: length of the journal's valid prefix (a writer truncates anything after it).
        journal_commits: number of valid journal lines.
        journal_torn: whether an invalid last line was ignored.
        files: the file names of ``shards`` (a set, so a commit checks its new shards in O(1), not O(shards)).
    """

    root: Path | CacheURL
    generation: int
    journal: str
    shards: list[ShardRecord] = field(default_factory=list)
    datasets: dict[str, DatasetInfo] = field(default_factory=dict)
    journal_bytes: int = 0
    journal_commits: int = 0
    journal_torn: bool = False
    files: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if not self.files:
            self.files = {s.file for s in self.shards}


def journal_name(generation: int) -> str:
    """File name of the journal of a manifest generation (0..MAX_GENERATION)."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"manifest generation {generation} is outside 0..{MAX_GENERATION}")
    return f"journal-{generation:06d}.jsonl"


def next_generation(generation: int) -> int:
    """The generation a compaction publishes after ``generation``; wraps to 1 after :data:`MAX_GENERATION`.

    Generations only name journals (readers never compare them), and the journal of generation 1 is long gone
    by then, so wrapping keeps every name the writer makes one the reader accepts.
    """
    return generation + 1 if generation < MAX_GENERATION else 1


def read_state(root: str | os.PathLike) -> CacheState:
    """Read the manifest and replay the journal of the cache at ``root``.

    Raises:
        CacheNotFoundError: no ``manifest.json`` at ``root``.
        CacheFormatError: not a streamcache manifest, or a version this library does not read.
        CacheCorruptError: damaged manifest or journal.
    """
    root = Path(root)
    mpath = root / MANIFEST
    try:
        raw = read_regular(mpath)
    except FileNotFoundError:
        raise CacheNotFoundError(
            f"{root}: no cache here ({MANIFEST} is missing); create one by encoding a dataset into this folder"
        ) from None
    except OSError as exc:
        raise read_error(str(mpath), "the manifest", exc) from None
    state = parse_manifest(root, str(mpath), raw)
    jpath = root / state.journal
    try:
        data = read_regular(jpath)
    except FileNotFoundError:
        raise CacheCorruptError(str(jpath), "the journal named by the manifest is missing") from None
    except OSError as exc:
        raise read_error(str(jpath), "the journal", exc) from None
    replay_journal(state, str(jpath), data)
    return state


def parse_manifest(root: Path | CacheURL, where: str, raw: bytes) -> CacheState:
    """Check the manifest bytes ``raw`` (read from ``where``, named in errors) and return its state, before the
    journal is replayed (:func:`replay_journal`). ``root`` becomes ``CacheState.root``: a folder, or a remote
    cache's URL (``dataset_cache.remote``), which reads the same files over the network.

    Raises:
        CacheFormatError: not a streamcache manifest, or a version this library does not read.
        CacheCorruptError: a damaged manifest.
    """
    m = load_json_object(where, raw)
    if m.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{where}: format {m.get('format')!r:.40}, expected {FORMAT_NAME!r}")
    if m.get("version") != FORMAT_VERSION:
        raise CacheFormatError(
            f"{where}: cache format version {m.get('version')!r:.20}, this library reads version {FORMAT_VERSION}; "
            "upgrade ComfyUI-StreamCache or rebuild the cache"
        )
    gen, journal, shards = m.get("generation"), m.get("journal"), m.get("shards")
    if (type(gen) is not int or not 0 <= gen <= MAX_GENERATION or type(journal) is not str
            or not JOURNAL_RE.fullmatch(journal)):
        raise CacheCorruptError(where, "bad generation or journal name")
    if type(shards) is not list:
        raise CacheCorruptError(where, "'shards' is not a list")
    state = CacheState(root, gen, journal, [ShardRecord.from_json(where, s) for s in shards])
    _apply_datasets(where, state, m.get("datasets", {}), allow_delete=False)
    return state


def _apply_datasets(where: str, state: CacheState, ds: Any, *, allow_delete: bool) -> None:
    if type(ds) is not dict:
        raise CacheCorruptError(where, "'datasets' is not an object")
    for name, rec in ds.items():
        if rec is None and allow_delete:
            state.datasets.pop(name, None)
            continue
        if type(rec) is not dict:
            raise CacheCorruptError(where, f"dataset {name!r:.80}: record is not an object")
        f, n, info = rec.get("file"), rec.get("samples"), rec.get("info", {})
        if type(f) is not str or not DATASET_FILE_RE.fullmatch(f) or type(n) is not int or n < 0:
            raise CacheCorruptError(where, f"dataset {name!r:.80}: bad file name or sample count")
        if type(info) is not dict:
            raise CacheCorruptError(where, f"dataset {name!r:.80}: info is not an object")
        state.datasets[name] = DatasetInfo(name, f, n, info)


def replay_journal(state: CacheState, where: str, data: bytes) -> None:
    """Apply the journal bytes ``data`` (the file ``where``) to ``state``: every valid line in order, a torn last
    line ignored (``state.journal_torn``).

    Raises:
        CacheCorruptError: an invalid line followed by more lines, or a valid line that breaks the rules.
    """
    pos = 0
    known = state.files
    while pos < len(data):
        nl = data.find(b"\n", pos)
        line = data[pos:] if nl < 0 else data[pos:nl + 1]
        rec = _parse_line(line)
        if rec is None:
            if nl < 0 or nl + 1 == len(data):  # torn or zero-filled last line: a crash mid-append
                state.journal_torn = True
                break
            raise CacheCorruptError(where, f"invalid journal line at byte {pos} followed by more lines")
        _apply_record(where, state, rec, known)
        pos += len(line)
        state.journal_bytes = pos
        state.journal_commits += 1


def _parse_line(line: bytes) -> dict[str, Any] | None:
    n = len(_LINE_HEAD) + 16 + len(_LINE_MID)
    if len(line) < n + len(_LINE_TAIL) or not line.endswith(_LINE_TAIL) or not line.startswith(_LINE_HEAD):
        return None
    if line[len(_LINE_HEAD) + 16:n] != _LINE_MID:
        return None
    body = line[n:-len(_LINE_TAIL)]
    if checksum64(body).encode("ascii") != line[len(_LINE_HEAD):len(_LINE_HEAD) + 16]:
        return None
    try:
        obj = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return obj if type(obj) is dict else None


def _apply_record(where: str, state: CacheState, rec: dict[str, Any], known: set[str]) -> None:
    shards = rec.get("shards", [])
    if type(shards) is not list:
        raise CacheCorruptError(where, "journal record: 'shards' is not a list")
    for s in shards:
        r = ShardRecord.from_json(where, s)
        if r.file not in known:
            known.add(r.file)
            state.shards.append(r)
    _apply_datasets(where, state, rec.get("datasets", {}), allow_delete=True)


def local_root(state: CacheState) -> Path:
    """The folder of a state a writer changes.

    Raises:
        TypeError: the state is a remote cache's, which is read only (``python -m dataset_cache push`` publishes
            a local cache to a URL).
    """
    if not isinstance(state.root, Path):
        raise TypeError(f"{state.root}: a remote cache is read only; write a local cache, then publish it with "
                        "`python -m dataset_cache push CACHE URL`")
    return state.root


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One journal line: ``{"xxh3_64":"<hex of R>","record":R}\\n`` where R is the record's JSON bytes."""
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    return _LINE_HEAD + checksum64(body).encode("ascii") + _LINE_MID + body + _LINE_TAIL


def append_journal(state: CacheState, record: Mapping[str, Any]) -> None:
    """Durably append one record to the live journal (truncating an ignored torn tail first) and apply it."""
    jpath = local_root(state) / state.journal
    line = encode_line(record)
    fd = open_nofollow(jpath, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != state.journal_bytes:
            os.ftruncate(fd, state.journal_bytes)
        os.lseek(fd, state.journal_bytes, os.SEEK_SET)
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        raise named_os_error(exc, jpath, "appending a commit to the journal") from exc
    finally:
        os.close(fd)
    _apply_record(str(jpath), state, json.loads(line[len(_LINE_HEAD) + 16 + len(_LINE_MID):-2]), state.files)
    state.journal_bytes += len(line)
    state.journal_commits += 1
    state.journal_torn = False


def write_manifest(root: Path, generation: int, shards: list[ShardRecord],
                   datasets: Mapping[str, DatasetInfo]) -> CacheState:
    """Create an empty journal for ``generation``, then atomically publish a manifest naming it.

    The manifest rename is the switch: before it readers see the old state, after it the new one.
    """
    journal = journal_name(generation)
    jpath = root / journal
    fd = open_nofollow(jpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise named_os_error(exc, jpath, "creating the journal") from exc
    finally:
        os.close(fd)
    fsync_dir(root)
    raw = manifest_bytes(generation, journal, shards, datasets)
    atomic_write(root / MANIFEST, lambda f: f.write(raw))
    return CacheState(root, generation, journal, list(shards), dict(datasets))


def manifest_bytes(generation: int, journal: str, shards: Sequence[ShardRecord],
                   datasets: Mapping[str, DatasetInfo]) -> bytes:
    """The bytes of a manifest (what :func:`write_manifest` writes, and what a publisher uploads)."""
    m = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "generation": generation,
        "journal": journal,
        "shards": [s.to_json() for s in shards],
        "datasets": {d.name: {"file": d.file, "samples": d.samples, "info": d.info} for d in datasets.values()},
    }
    return json.dumps(m, indent=1, ensure_ascii=True, allow_nan=False).encode("ascii") + b"\n"
