"""``CacheReader``: opens headers only, batch reads with coalesced ``preadv``, checksum verification.

Opening a cache reads the manifest, the journal and each shard's header — never tensor data — and keeps each
entry's skeleton as unparsed JSON text until the entry is used, so opening 100k entries takes well under a
second and little memory. A batch read sorts the byte ranges of all requested rows, merges ranges closer than
``COALESCE_GAP_BYTES``, reads them with positional reads into one preallocated ``uint8`` buffer (pinned on
request) and returns tensors that are views into it. No memory map or file handle outlives a call: on Windows
a mapped file cannot be replaced, which would block compaction by another process.
"""

from __future__ import annotations

import logging
import os
from itertools import count, repeat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..constants import COALESCE_GAP_BYTES, FORMAT_NAME, FORMAT_VERSION
from ..dataset import DatasetInfo, Sample
from ..errors import CacheCorruptError, CacheError
from ..hashing import checksum64
from ..refs import LazyTensor
from . import skeleton
from .manifest import MANIFEST, CacheState, load_dataset, read_state
from .safetensors_io import open_regular
from .shard import Column, ShardIndex, open_shard

__all__ = ["open_cache", "CacheReader", "ReadBuffer"]

log = logging.getLogger("dataset_cache.format.reader")
_VERIFY_CHUNK = 64 << 20
_OPEN_RETRIES = 5


class ReadBuffer:
    """A reusable ``uint8`` host buffer for batch reads (pinned when asked and CUDA is available).

    Tensors returned by a read into this buffer are views of it: they are overwritten by the next read into the
    same buffer, so a loader keeps one buffer per batch in flight.
    """

    def __init__(self, nbytes: int = 0, *, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        self.tensor = self._alloc(nbytes)

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory)

    def ensure(self, nbytes: int) -> torch.Tensor:
        """Return a view of at least ``nbytes`` bytes, growing (with 25% headroom) when too small."""
        if self.tensor.numel() < nbytes:
            self.tensor = self._alloc(nbytes + nbytes // 4)
        return self.tensor[:nbytes]


class _Row:
    """A placeholder for one tensor row while a batch is planned (identity-hashed: cheap as a dict key)."""

    __slots__ = ("shard", "column", "row", "entry")

    def __init__(self, shard: int, column: int, row: int, entry: str) -> None:
        self.shard, self.column, self.row, self.entry = shard, column, row, entry


def open_cache(root: str | os.PathLike, *, verify: bool = True, strict: bool = True) -> CacheReader:
    """Open the cache at ``root`` (manifest, journal and shard headers only; no tensor data).

    Args:
        root: cache directory.
        verify: check each row's xxh3-64 checksum on every read (cheap: ~30 GB/s).
        strict: raise on the first damaged shard; ``False`` skips damaged shards (their entries are absent) and
            records the problems for :meth:`CacheReader.verify` — for the ``verify`` command, not for training.

    A compaction by another process that switches the manifest while we open is detected (the manifest file
    changed) and the open is retried.

    Raises:
        CacheNotFoundError, CacheFormatError, CacheCorruptError.
    """
    for attempt in range(_OPEN_RETRIES):
        before = _manifest_identity(root)
        try:
            return _open_once(root, verify, strict)
        except CacheCorruptError:
            # A compaction may have switched the manifest and deleted the old journal/shards while we read them.
            if attempt + 1 == _OPEN_RETRIES or _manifest_identity(root) == before:
                raise
    raise AssertionError("unreachable")


def _manifest_identity(root: str | os.PathLike) -> tuple[int, int, int] | None:
    try:
        st = os.stat(Path(root) / MANIFEST)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _open_once(root: str | os.PathLike, verify: bool, strict: bool) -> CacheReader:
    state = read_state(root)
    shards: list[ShardIndex] = []
    problems: list[CacheCorruptError] = []
    for rec in state.shards:
        try:
            shards.append(open_shard(state.root / rec.file, rec.file, rec))
        except CacheCorruptError as exc:
            if strict:
                raise
            problems.append(exc)
    return CacheReader(state, shards, verify=verify, problems=problems)


class CacheReader:
    """A read-only snapshot of a cache (the state when it was opened).

    Thread-safe: reads share no mutable state (give each thread its own ``ReadBuffer``), and positional reads
    release the GIL, so a loader may run several reads in parallel.

    Attributes:
        root: the cache directory.
        state: the manifest + journal state this reader was opened on.
    """

    def __init__(self, state: CacheState, shards: list[ShardIndex], *, verify: bool = True,
                 problems: list[CacheCorruptError] | None = None) -> None:
        self.root: Path = state.root
        self.state = state
        self._shards = shards
        self._verify = verify
        self._problems = list(problems or [])
        self._index: dict[str, tuple[int, int]] = {}
        for s, sh in enumerate(shards):
            self._index.update(zip(sh.keys, zip(repeat(s), count())))
        if len(self._index) < sum(len(sh.keys) for sh in shards):  # duplicated keys: the earliest shard wins
            self._index = {}
            for s, sh in enumerate(shards):
                for i, k in enumerate(sh.keys):
                    self._index.setdefault(k, (s, i))

    # ----------------------------------------------------------------------------------------- mapping
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> Iterator[str]:
        """Entry keys (shard order)."""
        return iter(self._index)

    def _loc(self, key: str) -> tuple[ShardIndex, int]:
        try:
            s, i = self._index[key]
        except KeyError:
            raise KeyError(f"entry {key!r} is not in the cache at {self.root}") from None
        return self._shards[s], i

    def kind(self, key: str) -> str:
        """The entry's kind (``"latent"``, ``"conditioning"``, ...)."""
        sh, i = self._loc(key)
        return sh.kinds[i]

    def get(self, key: str) -> Any:
        """The entry's structure with :class:`LazyTensor` leaves; no tensor I/O."""
        sh, i = self._loc(key)
        s = self._index[key][0]
        cols = sh.columns
        return sh.skeleton(i, lambda c, row: LazyTensor(self, _Row(s, c, row, key), cols[c].row_shape,
                                                         cols[c].dtype, key))

    def tensor_shapes(self, key: str) -> Any:
        """The entry's structure with ``torch.Size`` leaves where tensors are (bucketing without I/O)."""
        sh, i = self._loc(key)
        return sh.skeleton(i, lambda c, row: sh.columns[c].row_shape)

    # ----------------------------------------------------------------------------------------- reads
    def read(self, keys: Sequence[str], *, pin_memory: bool = False, out: ReadBuffer | None = None) -> list[Any]:
        """Materialize many entries with few large reads; returns their values in the order of ``keys``.

        Tensors are views into one buffer (``out`` when given, reused by the next read into it).

        Raises:
            KeyError: a key is not in the cache.
            CacheCorruptError: a shard is missing or truncated, or a checksum does not match (nothing is returned).
        """
        templates: list[Any] = []
        rows: list[tuple[int, int, int]] = []
        owners: list[str] = []
        index, shards = self._index, self._shards
        for key in keys:
            try:
                s, i = index[key]
            except KeyError:
                raise KeyError(f"entry {key!r} is not in the cache at {self.root}") from None
            template, refs = shards[s].parse(i)
            templates.append((template, len(refs)))
            rows.extend((s, c, r) for c, r in refs)
            owners.extend(repeat(key, len(refs)))
        tensors = self._read_rows(rows, owners, pin_memory, out)
        values, at = [], 0
        for template, n in templates:
            values.append(skeleton.fill(template, tensors[at:at + n]))
            at += n
        return values

    def materialize(self, value: Any) -> Any:
        """Replace the LazyTensor leaves of ``value`` (one batch read); see :func:`dataset_cache.refs.materialize`."""
        from ..refs import materialize

        return materialize(value)

    def _read_lazy(self, lazies: Sequence[LazyTensor]) -> list[torch.Tensor]:
        locs = [lz._loc for lz in lazies]
        return self._read_rows([(r.shard, r.column, r.row) for r in locs], [r.entry for r in locs], False, None)

    def _read_rows(self, rows: Sequence[tuple[int, int, int]], owners: Sequence[str], pin_memory: bool,
                   out: ReadBuffer | None) -> list[torch.Tensor]:
        """Read ``rows`` (``(shard, column, row)``, duplicates allowed) and return one tensor view per row."""
        unique = sorted(set(rows))
        plan, total = _plan(self._shards, unique)
        buf = (out or ReadBuffer(pin_memory=pin_memory)).ensure(total)
        mv = memoryview(buf.numpy()) if total else memoryview(bytearray(0))
        for s, ranges in plan.items():
            _read_ranges(self._shards[s], ranges, mv)
        where: dict[tuple[int, int, int], int] = {}
        bad: list[tuple[int, int, int]] = []
        verify = self._verify
        for s, ranges in plan.items():
            cols = self._shards[s].columns
            for begin, _end, pos, members in ranges:
                for c, row in members:
                    col = cols[c]
                    a = pos + col.offset + row * col.row_nbytes - begin
                    if verify and checksum64(mv[a:a + col.row_nbytes]) != col.checksum(row):
                        bad.append((s, c, row))
                    where[(s, c, row)] = a
        if bad:
            owner = dict(zip(rows, owners))
            errors = [CacheCorruptError(str(self._shards[s].path),
                                        f"checksum mismatch in {self._shards[s].columns[c].tensor} row {row}",
                                        entry=owner[(s, c, row)]) for s, c, row in bad]
            if len(errors) > 1:
                log.error("%d corrupt rows in one read; first: %s", len(errors), errors[0])
            raise errors[0]
        typed: dict[torch.dtype, torch.Tensor] = {}
        shards = self._shards
        return [_as_tensor(buf, typed, where[key], shards[key[0]].columns[key[1]]) for key in rows]

    # ----------------------------------------------------------------------------------------- datasets
    def datasets(self) -> dict[str, DatasetInfo]:
        """Name -> what the manifest says about each dataset (no dataset file is read)."""
        return dict(self.state.datasets)

    def dataset(self, name: str) -> list[Sample]:
        """Load a dataset's ordered sample list (its immutable file)."""
        try:
            info = self.state.datasets[name]
        except KeyError:
            raise KeyError(f"no dataset {name!r} in the cache at {self.root}; "
                           f"it has {sorted(self.state.datasets) or 'none'}") from None
        return load_dataset(self.root, info)

    # ----------------------------------------------------------------------------------------- reports
    def stats(self) -> dict[str, Any]:
        """Summary for ``info``: format version, entries, shards, bytes, kinds, datasets."""
        kinds: dict[str, int] = {}
        for sh in self._shards:
            for k in sh.kinds:
                kinds[k] = kinds.get(k, 0) + 1
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "root": str(self.root),
            "generation": self.state.generation,
            "journal_commits": self.state.journal_commits,
            "entries": len(self._index),
            "kinds": kinds,
            "shards": len(self._shards),
            "bytes": sum(sh.size for sh in self._shards),
            "datasets": {n: d.samples for n, d in self.state.datasets.items()},
        }

    def verify(self) -> list[CacheCorruptError]:
        """Read every row and check every checksum, skeleton and dataset; return every problem (empty: healthy)."""
        problems = list(self._problems)
        for sh in self._shards:
            problems.extend(_verify_shard(sh))
        for info in self.state.datasets.values():
            try:
                samples = load_dataset(self.root, info)
            except CacheError as exc:
                problems.append(exc if isinstance(exc, CacheCorruptError)
                                else CacheCorruptError(str(self.root / info.file), str(exc)))
                continue
            missing = [k for s in samples for k in (s.latent, *s.captions) if k not in self._index]
            if missing:
                problems.append(CacheCorruptError(str(self.root / info.file),
                                                  f"{len(missing)} sample entries are not in the cache",
                                                  entry=missing[0]))
        return problems

    @property
    def shards(self) -> tuple[ShardIndex, ...]:
        """The opened shards in state order (file, size, columns, keys, kinds, unparsed skeletons); read-only."""
        return tuple(self._shards)

    def entry_nbytes(self, key: str) -> int:
        """Tensor bytes of one entry (no tensor I/O)."""
        sh, i = self._loc(key)
        total = 0

        def add(c: int, row: int) -> None:
            nonlocal total
            total += sh.columns[c].row_nbytes

        sh.skeleton(i, add)
        return total

    @property
    def problems(self) -> list[CacheCorruptError]:
        """Shards skipped because they could not be opened (only with ``open_cache(strict=False)``)."""
        return list(self._problems)

    def close(self) -> None:
        """Nothing to release (no handles or maps are held between reads); kept for symmetry."""

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CacheReader({str(self.root)!r}, entries={len(self)}, shards={len(self._shards)})"


def _plan(shards: list[ShardIndex], rows: list[tuple[int, int, int]]) -> tuple[dict[int, list], int]:
    """Group unique rows per shard into coalesced ranges ``(begin, end, buffer_pos, [(col, row), ...])``.

    Each range is placed in the buffer at a position congruent to its file offset modulo 8, so every row keeps
    the alignment it has in the file (columns are item-aligned there) and can be viewed as its dtype.
    """
    per: dict[int, list[tuple[int, int, int, int]]] = {}
    for s, c, r in rows:
        b, e = shards[s].columns[c].row_range(r)
        per.setdefault(s, []).append((b, e, c, r))
    plan: dict[int, list] = {}
    total = 0
    for s, items in per.items():
        items.sort()
        ranges: list[list] = []
        for b, e, c, r in items:
            if ranges and b - ranges[-1][1] <= COALESCE_GAP_BYTES:
                ranges[-1][1] = max(ranges[-1][1], e)
                ranges[-1][3].append((c, r))
            else:
                ranges.append([b, e, 0, [(c, r)]])
        for rg in ranges:
            rg[2] = total + (rg[0] - total) % 8
            total = rg[2] + rg[1] - rg[0]
        plan[s] = [tuple(rg) for rg in ranges]
    return plan, total


def _read_ranges(sh: ShardIndex, ranges: list, mv: memoryview) -> None:
    p = str(sh.path)
    try:
        f = os.fdopen(open_regular(p), "rb", buffering=0)
    except FileNotFoundError:
        raise CacheCorruptError(p, "shard file is missing (deleted, or the cache was compacted since it was "
                                   "opened); reopen the cache, and run verify if it persists") from None
    except OSError as exc:
        raise CacheCorruptError(p, f"cannot open shard ({exc.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != sh.size:
            raise CacheCorruptError(p, f"shard is now {size} bytes, {sh.size} when opened (truncated or replaced); "
                                       "reopen the cache, and run verify if it persists")
        fd = f.fileno()
        for begin, end, pos, _members in ranges:
            _read_exact(f, fd, mv[pos:pos + end - begin], begin, p)


def _read_exact(f: Any, fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    n = len(view)
    while got < n:
        if hasattr(os, "preadv"):
            k = os.preadv(fd, [view[got:]], offset + got)
        else:  # Windows, macOS < 11
            f.seek(offset + got)
            k = f.readinto(view[got:])
        if not k:
            raise CacheCorruptError(path, f"file ends before byte {offset + n} (truncated)")
        got += k


def _as_tensor(buf: torch.Tensor, typed: dict[torch.dtype, torch.Tensor], a: int, col: Column) -> torch.Tensor:
    """A view of ``col.row_nbytes`` bytes at ``a`` in ``buf`` as the column's dtype and row shape."""
    if col.row_nbytes == 0:
        return torch.empty(col.row_shape, dtype=col.dtype)
    size = col.dtype.itemsize
    whole = typed.get(col.dtype)
    if whole is None:  # one dtype view of the whole buffer per batch; rows are item-aligned in it (see _plan)
        whole = typed[col.dtype] = buf[: buf.numel() - buf.numel() % size].view(col.dtype)
    return whole.as_strided(col.row_shape, col.strides, a // size)


def _verify_shard(sh: ShardIndex) -> list[CacheCorruptError]:
    p = str(sh.path)
    problems: list[CacheCorruptError] = []
    owner: dict[tuple[int, int], str] = {}
    for i, key in enumerate(sh.keys):
        try:
            sh.skeleton(i, lambda c, row, key=key: owner.setdefault((c, row), key))
        except CacheCorruptError as exc:
            problems.append(exc)
    try:
        f = os.fdopen(open_regular(p), "rb", buffering=0)
    except OSError as exc:
        return problems + [CacheCorruptError(p, f"cannot open shard ({exc})")]
    with f:
        if os.fstat(f.fileno()).st_size != sh.size:
            return problems + [CacheCorruptError(p, "shard size changed since the cache was opened")]
        for c, col in enumerate(sh.columns):
            per = max(1, _VERIFY_CHUNK // max(1, col.row_nbytes))
            for start in range(0, col.rows, per):
                n = min(per, col.rows - start)
                buf = bytearray(n * col.row_nbytes)
                mv = memoryview(buf)
                try:
                    _read_exact(f, f.fileno(), mv, col.row_range(start)[0], p)
                except CacheCorruptError as exc:
                    problems.append(exc)
                    break
                for j in range(n):
                    row = start + j
                    a = j * col.row_nbytes
                    if checksum64(mv[a:a + col.row_nbytes]) != col.checksum(row):
                        problems.append(CacheCorruptError(p, f"checksum mismatch in {col.tensor} row {row}",
                                                          entry=owner.get((c, row))))
    return problems
