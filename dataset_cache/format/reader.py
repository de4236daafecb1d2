"""``CacheReader``: opens headers only, batch reads with positional reads into one buffer, checksum verification.

Opening a cache reads the manifest, the journal and each shard's header — never tensor data — and keeps each
entry's skeleton as unparsed JSON text until the entry is used, so opening 100k entries takes well under a
second and little memory. A batch read places all requested rows in one preallocated ``uint8`` buffer (pinned on
request; rows of one dtype and shape side by side, in the order asked), fills it with positional reads (rows
adjacent in the file and in the buffer share one) and returns tensors that are views into it. No memory map is ever held (on Windows a mapped file
cannot be replaced, which would block compaction by another process); on POSIX the shard files stay open
between reads until :meth:`CacheReader.close` (see ``_ShardFiles``), on Windows each read opens its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from itertools import count, repeat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..constants import FORMAT_NAME, FORMAT_VERSION
from ..dataset import DatasetInfo, Sample
from ..errors import CacheCorruptError, CacheError, CacheUnreadableError
from ..gcpause import gc_paused
from ..hashing import checksum64
from ..refs import LazyTensor
from . import skeleton
from .layout import check_no_links
from .manifest import MANIFEST, CacheState, load_dataset, read_state
from .safetensors_io import open_regular
from .shard import Column, ShardIndex, open_shard

__all__ = ["open_cache", "CacheReader", "ReadBuffer"]

log = logging.getLogger("dataset_cache.format.reader")
_VERIFY_CHUNK = 64 << 20
_OPEN_RETRIES = 5
_HAVE_PREADV = hasattr(os, "preadv")
_KEEP_FILES_OPEN = os.name == "posix" and _HAVE_PREADV
_CAN_ADVISE = _KEEP_FILES_OPEN and hasattr(os, "posix_fadvise")
_COLD_BYTES_PER_S = 2e9  # a batch slower than this came (partly) from the disk: announce the next one's ranges
_WARM_HINT_S_PER_RANGE = 4e-6  # a hint quicker than this per range plus per byte found its pages in the page cache:
_WARM_HINT_BYTES_PER_S = 10e9  # ~2 µs a range and ~20 GB/s measured warm here, 20-30 µs a range cold
_MAX_HINTED = 64  # hinted batches remembered at once (a loader has a few batches in flight)
_MAX_KEPT_FILES = 512  # beyond this many shards, the rest are opened per read (stays far below ulimit -n)


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
            A shard that cannot be opened because of its environment (permissions, open-file limit, I/O, a
            link) is recorded as a :class:`CacheUnreadableError`, which is never damage (see ``writer.compact``).

    A compaction by another process that switches the manifest while we open is detected (the manifest file
    changed) and the open is retried.

    Raises:
        CacheNotFoundError, CacheFormatError, CacheCorruptError; CacheUnreadableError (a file that cannot be
        read, or CacheLinkError: a part of the cache is a symbolic link).
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
    with gc_paused():  # headers and the key index: many small acyclic objects (see ..gcpause)
        check_no_links(root)
        state = read_state(root)
        shards: list[ShardIndex] = []
        problems: list[CacheError] = []
        for rec in state.shards:
            try:
                shards.append(open_shard(state.root / rec.file, rec.file, rec))
            except (CacheCorruptError, CacheUnreadableError) as exc:
                if strict:
                    raise
                problems.append(exc)
        return CacheReader(state, shards, verify=verify, problems=problems)


_Plan = tuple[list[tuple[int, int, int]], list[tuple[int, int, Column]],
              list[tuple[int, Column, list[tuple[int, int, int]]]], list[list[int]], int]
"""A planned batch read: ``(order, placed, groups, ranges, total)``, see ``CacheReader._plan``."""


class CacheReader:
    """A read-only snapshot of a cache (the state when it was opened).

    Thread-safe: reads share no mutable state (give each thread its own ``ReadBuffer``), and positional reads
    release the GIL, so a loader may run several reads in parallel.

    Attributes:
        root: the cache directory.
        state: the manifest + journal state this reader was opened on.
    """

    def __init__(self, state: CacheState, shards: list[ShardIndex], *, verify: bool = True,
                 problems: Sequence[CacheError] | None = None) -> None:
        self.root: Path = state.root
        self.state = state
        self._shards = shards
        self._verify = verify
        self._problems = list(problems or [])
        self._files = _ShardFiles(shards)
        self._hinted_plans: dict[tuple[str, ...], tuple[Any, Any, _Plan]] = {}  # will_read's, until read
        self._finalizer = weakref.finalize(self, self._files.close)  # a reader dropped without close()
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
        keys = tuple(keys)  # iterated more than once below (a generator would be spent by the first pass)
        hinted = self._hinted_plans.pop(keys, None) if self._hinted_plans else None
        if hinted is not None:  # planned by will_read: the snapshot has not changed since
            templates, rows, plan = hinted
        else:
            templates, rows = self._rows_of(keys)
            plan = None
        tensors = self._read_rows(rows, None, pin_memory, out, keys, plan)
        values, at = [], 0
        fill = skeleton.fill
        for template, n in templates:
            values.append(fill(template, tensors[at:at + n]))
            at += n
        return values

    def will_read(self, keys: Sequence[str]) -> None:
        """Hint that ``keys`` will be read soon, so that their bytes come off the disk while other work runs.

        When the recent reads came from the disk (the same test that makes a read announce its own ranges; see
        ``_ShardFiles``), every range of these entries is announced to the kernel with
        ``posix_fadvise(WILLNEED)``, which starts the reads and returns at once. A loader that hints batch N+1
        while it reads batch N keeps the disk busy with two batches instead of one: cold batches of 32 SD1.5
        samples came 36% faster on one thread here (9.8 → 6.3 ms). It does nothing while the page cache serves
        the reads (the hints would only add syscalls), after :meth:`close`, and where ``posix_fadvise`` does not
        exist (Windows, macOS). A hint never fails: an unknown key or a damaged entry is reported by the read.
        The read of exactly these keys reuses the hint's plan (~0.5 ms of Python for 32 SD1.5 samples here).
        """
        if not self._files.cold:
            return
        keys = tuple(keys)
        try:
            templates, rows = self._rows_of(keys)
            plan = self._plan(rows, keys)
        except (KeyError, CacheError, skeleton.SkeletonError):
            return
        if len(self._hinted_plans) >= _MAX_HINTED:  # hinted batches that were never read (an abandoned iteration)
            self._hinted_plans.clear()
        self._hinted_plans[keys] = (templates, rows, plan)  # the read reuses it: planning is ~0.5 ms a batch
        self._files.hint(plan[3])

    def _rows_of(self, keys: Sequence[str]) -> tuple[list[tuple[Any, int]], list[tuple[int, int, int]]]:
        """Each entry's template and reference count, and all their ``(shard, column, row)`` in key order."""
        templates: list[tuple[Any, int]] = []
        rows: list[tuple[int, int, int]] = []
        index, shards, split = self._index, self._shards, skeleton.split
        try:  # the loader's inner loop: references are range-checked where rows are planned (_plan)
            for key in keys:
                s, i = index[key]
                template, refs = split(shards[s].skeletons[i])
                templates.append((template, len(refs)))
                rows += [(s, c, r) for c, r in refs]
        except (KeyError, skeleton.SkeletonError):
            self._explain(keys)
            raise
        return templates, rows

    def _explain(self, keys: Sequence[str]) -> None:
        """Raise the precise error (unknown key, or which entry's skeleton is bad) for a read that failed."""
        for key in keys:
            sh, i = self._loc(key)
            sh.parse(i)

    def materialize(self, value: Any) -> Any:
        """Replace the LazyTensor leaves of ``value`` (one batch read); see :func:`dataset_cache.refs.materialize`."""
        from ..refs import materialize

        return materialize(value)

    def _read_lazy(self, lazies: Sequence[LazyTensor]) -> list[torch.Tensor]:
        locs = [lz._loc for lz in lazies]
        return self._read_rows([(r.shard, r.column, r.row) for r in locs], [r.entry for r in locs], False, None)

    def _read_rows(self, rows: Sequence[tuple[int, int, int]], owners: Sequence[str] | None, pin_memory: bool,
                   out: ReadBuffer | None, keys: Sequence[str] = (), plan: _Plan | None = None) -> list[torch.Tensor]:
        """Read ``rows`` (``(shard, column, row)``, duplicates allowed) and return one tensor view per row.

        ``owners`` names the entry of each row for error messages; when ``None``, they are looked up among
        ``keys`` only if a checksum fails (building the list costs more than the check on the fast path).

        Rows of the same dtype and shape are placed side by side in the buffer in the order asked for (see
        :meth:`_plan`), so the latents of a batch come out as consecutive views of one ``[B, ...]`` block that
        a loader can use without stacking them again. This path is the loader's inner loop, so it keeps Python
        work per row to a few operations.
        """
        order, placed, groups, ranges, total = plan or self._plan(rows, keys)
        buf = (out or ReadBuffer(pin_memory=pin_memory)).ensure(total)
        mv = memoryview(buf.numpy()) if total else memoryview(bytearray(0))
        self._files.read(ranges, mv, hinted=plan is not None)  # a plan given here came from will_read
        if self._verify:
            bad = [i for i, (a, r, col) in enumerate(placed)
                   if checksum64(mv[a:a + col.row_nbytes]) != col.checksums[16 * r:16 * r + 16]]
            if bad:
                self._raise_corrupt([order[i] for i in bad], rows, owners, keys)
        views: dict[tuple[int, int, int], torch.Tensor] = {}
        for start, col, members in groups:
            stacked = buf[start:start + len(members) * col.row_nbytes].view(col.dtype)
            views.update(zip(members, stacked.view(len(members), *col.row_shape).unbind(0)))
        return [views[key] for key in rows]

    def _plan(self, rows: Sequence[tuple[int, int, int]], keys: Sequence[str]) -> _Plan:
        """Where each unique row goes in the buffer and which positional reads fill it.

        Returns ``(order, placed, groups, ranges, total)``: the unique rows in buffer order, each one's ``(buffer
        position, row, column)``, the groups ``(buffer start, a column of the group, rows)`` (one per dtype and
        row shape, 64-byte aligned, rows in the order asked for), the reads ``[shard, file begin, file end,
        buffer position]`` (rows adjacent both in the file and in the buffer share one) and the buffer size.
        A reference outside its shard's columns is corrupt (the error names the entry).
        """
        shards = self._shards
        members: dict[int, list[tuple[int, int, int]]] = {}
        col_of: dict[tuple[int, int, int], Column] = {}  # each unique row's column (also: rows already seen)
        for key in rows:
            if key in col_of:
                continue
            s, c, r = key
            cols = shards[s].columns
            if not 0 <= c < len(cols) or not 0 <= r < cols[c].rows:
                self._explain(keys)  # a skeleton points outside its shard's columns: name the entry
                raise CacheCorruptError(str(shards[s].path), f"tensor reference [{c}, {r}] outside the columns")
            col = col_of[key] = cols[c]
            g = members.get(col.group)
            if g is None:
                g = members[col.group] = []
            g.append(key)
        order: list[tuple[int, int, int]] = []
        placed: list[tuple[int, int, Column]] = []
        groups: list[tuple[int, Column, list[tuple[int, int, int]]]] = []
        at: dict[tuple[int, int, int], int] = {}
        total = 0
        for keys_in in members.values():
            total = -(-total // 64) * 64  # each group 64-byte aligned: its rows are aligned for any dtype
            groups.append((total, col_of[keys_in[0]], keys_in))
            for key in keys_in:
                col = col_of[key]
                at[key] = total
                order.append(key)
                placed.append((total, key[2], col))
                total += col.row_nbytes
        ranges: list[list[int]] = []
        last: list[int] = [-1, 0, 0, 0]
        for key in sorted(at):  # file order: rows next to each other in the file and in the buffer share a read
            s, _c, r = key
            col = col_of[key]
            n = col.row_nbytes
            b = col.offset + r * n
            p = at[key]
            if s == last[0] and b == last[2] and p == last[3] + last[2] - last[1]:
                last[2] = b + n
            else:
                last = [s, b, b + n, p]
                ranges.append(last)
        return order, placed, groups, ranges, total

    def _raise_corrupt(self, bad: Sequence[tuple[int, int, int]], rows: Sequence[tuple[int, int, int]],
                       owners: Sequence[str] | None, keys: Sequence[str]) -> None:
        if owners is None:
            owners = [k for k in keys for _ in self._shards[self._index[k][0]].parse(self._index[k][1])[1]]
        owner = dict(zip(rows, owners))
        errors = [CacheCorruptError(str(self._shards[s].path),
                                    f"checksum mismatch in {self._shards[s].columns[c].tensor} row {row}",
                                    entry=owner[(s, c, row)]) for s, c, row in bad]
        if len(errors) > 1:
            log.error("%d corrupt rows in one read; first: %s", len(errors), errors[0])
        raise errors[0]

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

    def verify(self) -> list[CacheError]:
        """Read every row and check every checksum, skeleton and dataset; return every problem (empty: healthy).

        Each problem is a :class:`CacheCorruptError` (bytes that do not match: damage) or a
        :class:`CacheUnreadableError` (a file that could not be read: not damage).
        """
        problems = list(self._problems)
        for sh in self._shards:
            problems.extend(_verify_shard(sh))
        for info in self.state.datasets.values():
            try:
                samples = load_dataset(self.root, info)
            except CacheError as exc:
                problems.append(exc if isinstance(exc, (CacheCorruptError, CacheUnreadableError))
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
    def problems(self) -> list[CacheError]:
        """Shards skipped because they could not be opened (only with ``open_cache(strict=False)``): damaged
        (:class:`CacheCorruptError`) or unreadable for now (:class:`CacheUnreadableError`)."""
        return list(self._problems)

    def close(self) -> None:
        """Close the shard files kept open for reads (idempotent).

        The reader stays usable: later reads open and close their files each time.
        """
        self._finalizer()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CacheReader({str(self.root)!r}, entries={len(self)}, shards={len(self._shards)})"


class _ShardFiles:
    """Positional reads from a reader's shard files, each file opened once and kept open until the reader closes.

    Opening, checking and closing a shard file for every batch cost more than reading a random batch of small
    rows. A kept descriptor also pins the snapshot: a compaction by another process that deletes a shard we
    opened cannot change or remove the bytes we read (POSIX keeps an unlinked file alive while it is open).
    Windows cannot delete or replace a file that is open, and a cleaner there must not be blocked by an idle
    reader, so there (and after :meth:`close`, and beyond ``_MAX_KEPT_FILES``) each read opens and closes its
    files as before. Thread-safe: ``preadv`` is positional, and descriptors are closed only when no read is in
    flight.

    When the previous batch came slower than ``_COLD_BYTES_PER_S`` (its rows were not in the page cache: a dataset
    larger than RAM, or a first epoch), every range of the next batch is announced with
    ``posix_fadvise(WILLNEED)`` before it is read, so the kernel fetches them concurrently instead of one disk
    round trip per row: a cold batch of 32 SD1.5 samples took 12 ms instead of 23-28 ms here. From the page cache
    the hints would only add syscalls, so fast batches switch them off again.

    :meth:`hint` announces a batch that will be read later (``CacheReader.will_read``). Its read is then fast
    because of the hint, not because the page cache held it, so a fast hinted read does not switch the hints off
    (that made them alternate on and off, and lose the gain); the hint measures instead: the kernel accepts a
    hint for pages it already holds ~10× faster than one that must go to the disk.
    """

    def __init__(self, shards: list[ShardIndex]) -> None:
        self._shards = shards
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._keep = _KEEP_FILES_OPEN
        self._active = 0
        self._advise = _CAN_ADVISE  # start as if cold; the first fast batch turns the hints off

    @property
    def cold(self) -> bool:
        """Whether reads are announced: the last batch read came from the disk, and the files are kept open."""
        return self._advise and self._keep

    def read(self, ranges: Sequence[tuple[int, int, int, int]], mv: memoryview, *, hinted: bool = False) -> None:
        """Fill ``mv[pos:pos + end - begin]`` from shard ``s``'s bytes ``[begin, end)`` for each range.

        ``hinted``: these ranges were announced by :meth:`hint` already (not again, and a fast read proves nothing).
        """
        if not self._keep:
            self._read_transient(ranges, mv)
            return
        with self._lock:
            self._active += 1
        try:
            fds = self._fds
            if not hinted and self._advise and len(ranges) > 1:
                self.announce(ranges)
            t0 = time.perf_counter()
            for s, begin, end, pos in ranges:
                fd = fds.get(s)
                if fd is None:
                    fd = self._open_kept(s)
                    if fd is None:  # over the limit of kept files, or closed meanwhile
                        self._read_transient([(s, begin, end, pos)], mv)
                        continue
                view = mv[pos:pos + end - begin]
                try:
                    got = os.preadv(fd, [view], begin)
                except OSError as exc:
                    raise _unreadable(self._shards[s], exc) from None
                if got != len(view):
                    _read_exact(fd, view, begin, str(self._shards[s].path))  # short read: finish or raise
            if _CAN_ADVISE and len(ranges) > 1:
                seconds = time.perf_counter() - t0
                slow = sum(e - b for _, b, e, _ in ranges) < _COLD_BYTES_PER_S * seconds
                if slow or not hinted:  # a fast hinted read says nothing about the page cache
                    self._advise = slow
        finally:
            with self._lock:
                self._active -= 1
                if not self._keep and not self._active:
                    self._close_all()

    def hint(self, ranges: Sequence[tuple[int, int, int, int]]) -> None:
        """Announce the ranges of a read that will come later; a quick answer means the page cache holds them."""
        if not ranges:
            return
        t0 = time.perf_counter()
        self.announce(ranges)
        seconds = time.perf_counter() - t0
        nbytes = sum(e - b for _, b, e, _ in ranges)
        if len(ranges) > 1 and seconds < len(ranges) * _WARM_HINT_S_PER_RANGE + nbytes / _WARM_HINT_BYTES_PER_S:
            self._advise = False

    def announce(self, ranges: Sequence[tuple[int, int, int, int]]) -> None:
        """Ask the kernel to start reading every range now (asynchronously; a hint, never an error)."""
        fds = self._fds
        try:
            for s, begin, end, _pos in ranges:
                fd = fds.get(s)
                if fd is None:
                    fd = self._open_kept(s)  # a missing shard is reported by the read, not here
                if fd is not None:
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        except (OSError, CacheError):
            return

    def _open_kept(self, s: int) -> int | None:
        with self._lock:
            if not self._keep or len(self._fds) >= _MAX_KEPT_FILES:
                return None
            fd = self._fds.get(s)
            if fd is None:
                fd = self._fds[s] = _open_checked(self._shards[s])
            return fd

    def _read_transient(self, ranges: Sequence[tuple[int, int, int, int]], mv: memoryview) -> None:
        i = 0
        while i < len(ranges):
            s = ranges[i][0]
            sh = self._shards[s]
            fd = _open_checked(sh)
            try:
                while i < len(ranges) and ranges[i][0] == s:
                    _, begin, end, pos = ranges[i]
                    _read_exact(fd, mv[pos:pos + end - begin], begin, str(sh.path))
                    i += 1
            finally:
                os.close(fd)

    def close(self) -> None:
        """Stop keeping files open; descriptors close now, or when the last read in flight ends."""
        with self._lock:
            self._keep = False
            if not self._active:
                self._close_all()

    def _close_all(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _open_checked(sh: ShardIndex) -> int:
    """Open a shard file for reading and check it still has the size it had when the cache was opened."""
    p = str(sh.path)
    try:
        fd = open_regular(p)
    except FileNotFoundError:
        raise CacheCorruptError(p, "shard file is missing (deleted, or the cache was compacted since it was "
                                   "opened); reopen the cache, and run verify if it persists") from None
    except CacheUnreadableError:
        raise
    except OSError as exc:
        raise _unreadable(sh, exc) from None
    size = os.fstat(fd).st_size
    if size != sh.size:
        os.close(fd)
        raise CacheCorruptError(p, f"shard is now {size} bytes, {sh.size} when opened (truncated or replaced); "
                                   "reopen the cache, and run verify if it persists")
    return fd


def _unreadable(sh: ShardIndex, exc: OSError) -> CacheError:
    """The error for an ``OSError`` on a shard: not damage, unless it was no regular file (``errno`` None)."""
    if exc.errno is None:
        return CacheCorruptError(str(sh.path), f"cannot open shard ({exc.strerror})")
    return CacheUnreadableError(str(sh.path), f"cannot read the shard ({exc.strerror or exc})", errno=exc.errno)


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file that ends first is a truncated shard."""
    try:
        _read_exact_raw(fd, view, offset, path)
    except CacheError:
        raise
    except OSError as exc:
        raise CacheUnreadableError(path, f"cannot read the shard ({exc.strerror or exc})", errno=exc.errno) from None


def _read_exact_raw(fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    n = len(view)
    while got < n:
        if _HAVE_PREADV:
            k = os.preadv(fd, [view[got:]], offset + got)
        else:  # Windows, macOS < 11: the descriptor is private to this call, so seek + read is safe
            os.lseek(fd, offset + got, os.SEEK_SET)
            chunk = os.read(fd, min(n - got, 16 << 20))
            k = len(chunk)
            view[got:got + k] = chunk
        if not k:
            raise CacheCorruptError(path, f"file ends before byte {offset + n} (truncated)")
        got += k


def _verify_shard(sh: ShardIndex) -> list[CacheError]:
    p = str(sh.path)
    problems: list[CacheError] = []
    owner: dict[tuple[int, int], str] = {}
    for i, key in enumerate(sh.keys):
        try:
            sh.skeleton(i, lambda c, row, key=key: owner.setdefault((c, row), key))
        except CacheCorruptError as exc:
            problems.append(exc)
    try:
        f = os.fdopen(open_regular(p), "rb", buffering=0)
    except FileNotFoundError:
        return problems + [CacheCorruptError(p, "shard file is missing")]
    except CacheUnreadableError as exc:
        return problems + [exc]
    except OSError as exc:
        return problems + [_unreadable(sh, exc)]
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
                    _read_exact(f.fileno(), mv, col.row_range(start)[0], p)
                except (CacheCorruptError, CacheUnreadableError) as exc:
                    problems.append(exc)
                    break
                for j in range(n):
                    row = start + j
                    a = j * col.row_nbytes
                    if checksum64(mv[a:a + col.row_nbytes]) != col.checksum(row):
                        problems.append(CacheCorruptError(p, f"checksum mismatch in {col.tensor} row {row}",
                                                          entry=owner.get((c, row))))
    return problems
