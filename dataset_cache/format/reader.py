"""``CacheReader``: opens headers only, batch reads with positional reads into one buffer, checksum verification.

Opening a cache reads the manifest, the journal and each shard's header — never tensor data — and keeps each
entry's skeleton as unparsed JSON text until the entry is used, so opening 100k entries takes well under a
second and little memory. A batch read places all requested rows in one preallocated ``uint8`` buffer (pinned on
request; rows of one dtype and shape side by side, in the order asked), fills it with positional reads (rows
adjacent in the file and in the buffer share one) and returns tensors that are views into it. No memory map is
ever held (on Windows a mapped file cannot be replaced, which would block compaction by another process).

A read is three steps, each its own method: :meth:`CacheReader.plan` (a :class:`~.read_plan.ReadPlan`, from the
headers alone), :meth:`CacheReader.announce` (ask the kernel for its bytes ahead of time) and
:meth:`CacheReader.read_plan`; :meth:`CacheReader.read` does all three. The files themselves and the read-ahead
policy live in :mod:`.shard_files`.
"""

from __future__ import annotations

import logging
import os
import weakref
from itertools import count, repeat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..constants import FORMAT_NAME, FORMAT_VERSION
from ..dataset import DatasetInfo, Sample
from ..errors import CacheCorruptError, CacheError, CacheUnreadableError
from ..gcpause import gc_paused
from ..hashing import checksum64
from ..refs import LazyTensor
from . import skeleton
from .dataset_file import load_dataset
from .layout import check_no_links
from .manifest import MANIFEST, CacheState, read_state
from .read_plan import ReadPlan, RowRef, plan_read, plan_rows
from .shard import ShardIndex, open_shard
from .shard_files import ShardFiles, ShardSource
from .verify import verify_local_shard
from ..remote.urls import is_remote_url

if TYPE_CHECKING:
    from ..remote.client import RemoteOptions
    from ..remote.urls import CacheURL

__all__ = ["open_cache", "CacheReader", "ReadBuffer"]

log = logging.getLogger("dataset_cache.format.reader")
_OPEN_RETRIES = 5


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # what torch's own weak storage refs use


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors, views and arrays (each holds one) refer to ``t``'s memory, plus one for the query."""
    return _storage_use_count(t.untyped_storage()._cdata)  # type: ignore[misc]


class ReadBuffer:
    """A reusable ``uint8`` host buffer for batch reads (pinned when asked and CUDA is available).

    Tensors returned by a read into this buffer are views of it: they are overwritten by the next read into the
    same buffer, so a loader keeps one buffer per batch in flight, and reuses one only once :meth:`in_use` says
    no view of an earlier read is alive.
    """

    TRACKS_USE: bool = _storage_use_count is not None
    """Whether :meth:`in_use` can tell (torch's private storage use count; there is no public equivalent)."""

    _IDLE_USERS = _storage_users(torch.empty(1)) if TRACKS_USE else -1  # a buffer's own tensor and the query

    def __init__(self, nbytes: int = 0, *, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        self.tensor = self._alloc(nbytes)

    def in_use(self) -> bool:
        """Whether any tensor, view or numpy array besides the buffer's own refers to its memory (a batch read into
        it is still alive); ``True`` when :attr:`TRACKS_USE` is false, so such a buffer is never reused."""
        return not self.TRACKS_USE or _storage_users(self.tensor) != self._IDLE_USERS

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


def open_cache(root: str | os.PathLike, *, verify: bool = True, strict: bool = True,
               remote: RemoteOptions | None = None) -> CacheReader:
    """Open the cache at ``root`` (manifest, journal and shard headers only; no tensor data).

    Args:
        root: cache directory, or a remote cache's URL (``s3://``, ``gs://``, ``az://``, ``https://``: read with
            ranged GETs through a local fetch cache, see :func:`dataset_cache.remote.open_remote_cache`; needs the
            remote extra).
        verify: check each row's xxh3-64 checksum on every read (cheap: ~30 GB/s).
        strict: raise on the first damaged shard; ``False`` skips damaged shards (their entries are absent) and
            records the problems for :meth:`CacheReader.verify` — for the ``verify`` command, not for training.
            A shard that cannot be opened because of its environment (permissions, open-file limit, I/O, a
            link) is recorded as a :class:`CacheUnreadableError`, which is never damage (see ``compaction.py``).
        remote: how a remote cache is fetched (``None``: the defaults); ignored for a directory.

    A compaction by another process that switches the manifest while we open is detected (the manifest file
    changed) and the open is retried.

    Raises:
        CacheNotFoundError, CacheFormatError, CacheCorruptError; CacheUnreadableError (a file that cannot be
        read, or CacheLinkError: a part of the cache is a symbolic link). For a URL also ValueError (a bad URL),
        RemoteUnreachableError, CacheReplacedError and RemoteExtraMissingError.
    """
    if is_remote_url(root):
        from ..remote.remote_reader import open_remote_cache

        return open_remote_cache(str(root), verify=verify, strict=strict, options=remote)
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
        folder = Path(root)
        shards: list[ShardIndex] = []
        problems: list[CacheError] = []
        for rec in state.shards:
            try:
                shards.append(open_shard(folder / rec.file, rec.file, rec))
            except (CacheCorruptError, CacheUnreadableError) as exc:
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
                 problems: Sequence[CacheError] | None = None, files: ShardSource | None = None) -> None:
        self.root: Path | CacheURL = state.root
        self.state = state
        self._shards = shards
        self._verify = verify
        self._problems = list(problems or [])
        self._files: ShardSource = files if files is not None else ShardFiles(shards)
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
    def read(self, keys: Iterable[str], *, pin_memory: bool = False, out: ReadBuffer | None = None) -> list[Any]:
        """Materialize many entries with few large reads; returns their values in the order of ``keys``.

        The same as ``read_plan(plan(keys))``. Tensors are views into one buffer (``out`` when given, reused by
        the next read into it).

        Raises:
            KeyError: a key is not in the cache.
            CacheCorruptError: a shard is missing or truncated, or a checksum does not match (nothing is returned).
        """
        return self.read_plan(self.plan(keys), pin_memory=pin_memory, out=out)

    def plan(self, keys: Iterable[str]) -> ReadPlan:
        """Plan reading ``keys`` (duplicates allowed): buffer layout and positional reads, from the headers only.

        Raises:
            KeyError: a key is not in the cache.
            CacheCorruptError: an entry's skeleton is malformed or points outside its shard (naming the entry).
        """
        keys = tuple(keys)  # iterated again by _explain (a generator would be spent by the first pass)
        try:
            return plan_read(self._shards, self._index, keys)
        except (KeyError, skeleton.SkeletonError, CacheCorruptError):
            self._explain(keys)  # the precise error: the unknown key, or the entry whose skeleton is bad
            raise

    def announce(self, plan: ReadPlan) -> bool:
        """Tell the kernel that ``plan`` will be read soon, so its bytes come off the disk while other work runs.

        Only while reads come from the disk (see :class:`~dataset_cache.format.shard_files.ReadAhead`), and only
        while the files are kept open (not after :meth:`close`, not on Windows); never raises: a damaged or
        missing shard is reported by the read. Returns whether the ranges were announced; pass that to
        :meth:`read_plan` as ``announced``.
        """
        return self._files.announce_ahead(plan.ranges)

    def read_plan(self, plan: ReadPlan, *, pin_memory: bool = False, out: ReadBuffer | None = None,
                  announced: bool = False) -> list[Any]:
        """Read a plan of this reader's: the values of ``plan.keys`` in order (see :meth:`read`).

        ``announced``: :meth:`announce` returned ``True`` for this plan (its ranges are not announced again).
        """
        tensors = self._read_rows(plan, None, pin_memory, out, announced)
        values, at = [], 0
        fill = skeleton.fill
        for template, n in plan.templates:
            values.append(fill(template, tensors[at:at + n]))
            at += n
        return values

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
        plan = plan_rows(self._shards, [(r.shard, r.column, r.row) for r in locs])
        return self._read_rows(plan, [r.entry for r in locs], False, None, False)

    def _read_rows(self, plan: ReadPlan, owners: Sequence[str] | None, pin_memory: bool, out: ReadBuffer | None,
                   announced: bool) -> list[torch.Tensor]:
        """Read ``plan`` and return one tensor view per reference in ``plan.rows``.

        ``owners`` names the entry of each row for error messages; when ``None``, they are looked up among
        ``plan.keys`` only if a checksum fails (building the list costs more than the check on the fast path).
        Rows of one dtype and shape are side by side in the buffer in the order asked for, so a batch's latents
        come out as consecutive views of one ``[B, ...]`` block that a loader uses without stacking them again.
        This is the loader's inner loop: Python work per row is kept to a few operations.
        """
        total = plan.nbytes
        buf = (out or ReadBuffer(pin_memory=pin_memory)).ensure(total)
        mv = buf.numpy().data if total else memoryview(bytearray(0))
        self._files.read(plan.ranges, mv, announced=announced)
        if self._verify:
            bad = [ref for ref, a, col in plan.placed
                   if checksum64(mv[a:a + col.row_nbytes]) != col.checksums[16 * ref[2]:16 * ref[2] + 16]]
            if bad:
                self._raise_corrupt(bad, plan, owners)
        views: dict[RowRef, torch.Tensor] = {}
        for group in plan.groups:
            col, members = group.column, group.rows
            stacked = buf[group.start:group.start + len(members) * col.row_nbytes].view(col.dtype)
            views.update(zip(members, stacked.view(len(members), *col.row_shape).unbind(0)))
        return [views[ref] for ref in plan.rows]

    def _raise_corrupt(self, bad: Sequence[RowRef], plan: ReadPlan, owners: Sequence[str] | None) -> None:
        if owners is None:
            owners = [k for k in plan.keys for _ in self._shards[self._index[k][0]].parse(self._index[k][1])[1]]
        owner = dict(zip(plan.rows, owners))
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
        return self._load_dataset(info)

    def _load_dataset(self, info: DatasetInfo) -> list[Sample]:
        """Read a dataset file of this cache (a remote reader fetches it)."""
        return load_dataset(Path(self.root), info)

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
            problems.extend(self._verify_shard(sh))
        for info in self.state.datasets.values():
            try:
                samples = self._load_dataset(info)
            except CacheError as exc:
                problems.append(exc if isinstance(exc, (CacheCorruptError, CacheUnreadableError))
                                else CacheCorruptError(str(self.root / info.file), str(exc)))
                continue
            missing = [k for s in samples for k in s.keys() if k not in self._index]
            if missing:
                problems.append(CacheCorruptError(str(self.root / info.file),
                                                  f"{len(missing)} sample entries are not in the cache",
                                                  entry=missing[0]))
        return problems

    def _verify_shard(self, sh: ShardIndex) -> list[CacheError]:
        """Every problem of one shard's rows (a remote reader reads them through its fetches)."""
        return verify_local_shard(sh)

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
