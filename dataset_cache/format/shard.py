"""One immutable shard: columns of stacked rows, an entry table, and a checksum per row.

All tensors of the same (dtype, row shape) among a shard's entries are stacked into one safetensors tensor, a
*column* of shape ``[rows, *row_shape]``. The safetensors tensor table therefore stays a handful of items even
for thousands of entries (one tensor per sample tensor made a 100k-entry cache 50 MB of header JSON, 1.4 s to
parse). Rows follow entry insertion order, so entries added in bucket order lie next to each other on disk and a
batch reads as few long ranges. Columns are laid out by decreasing item size so every row is aligned for a
zero-copy tensor view. The entry table and checksums live in ``__metadata__["streamcache"]`` (docs/FORMAT.md).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..constants import FORMAT_NAME, FORMAT_VERSION
from ..errors import CacheCorruptError, CacheFormatError, CacheUnreadableError
from ..hashing import checksum64, is_lower_hex, tensor_bytes
from . import skeleton
from .durable import atomic_write
from .manifest import ShardRecord
from .safetensors_io import (
    DTYPE_TO_ST,
    ST_ITEMSIZE,
    ST_TO_DTYPE,
    SafetensorsHeader,
    build_header,
    open_regular,
    read_header,
    write_safetensors,
)

if TYPE_CHECKING:
    from ..remote.urls import CacheURL

__all__ = ["Column", "ShardIndex", "ShardBuilder", "StoredTensor", "private_bytes", "open_shard", "index_shard",
           "METADATA_KEY"]

METADATA_KEY = "streamcache"
_GROUPS: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}  # (dtype, row shape) -> Column.group (a few kinds)
_GROUPS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Column:
    """A stacked tensor of a shard; ``offset`` is the absolute file offset of row 0."""

    tensor: str
    dtype: torch.dtype
    row_shape: torch.Size
    rows: int
    row_nbytes: int
    offset: int
    checksums: str
    strides: tuple[int, ...] = ()
    group: int = 0  # the same small int for every column of this dtype and row shape, in any shard

    def __post_init__(self) -> None:
        key = (self.dtype, tuple(self.row_shape))
        with _GROUPS_LOCK:  # readers may be opened by several threads at once
            group = _GROUPS.setdefault(key, len(_GROUPS))
        object.__setattr__(self, "group", group)

    def checksum(self, row: int) -> str:
        """The stored xxh3-64 (16 hex digits) of one row."""
        return self.checksums[16 * row:16 * row + 16]

    def row_range(self, row: int) -> tuple[int, int]:
        """Absolute ``(begin, end)`` file offsets of one row."""
        b = self.offset + row * self.row_nbytes
        return b, b + self.row_nbytes


@dataclass(slots=True)
class ShardIndex:
    """What a reader keeps of one shard: its columns and entry table (skeletons as unparsed JSON text).

    ``path`` is the file, or its URL for a remote cache (messages name it either way).
    """

    path: Path | CacheURL
    file: str
    size: int
    columns: list[Column]
    keys: list[str]
    kinds: list[str]
    skeletons: list[str]

    def skeleton(self, i: int, on_ref: Callable[[int, int], Any]) -> Any:
        """Decode entry ``i``'s skeleton, calling ``on_ref(column_index, row)`` for each tensor reference.

        Raises:
            CacheCorruptError: malformed skeleton or a reference outside the shard's columns.
        """
        template, refs = self.parse(i)
        return skeleton.fill(template, [on_ref(c, r) for c, r in refs])

    def parse(self, i: int) -> tuple[Any, list[tuple[int, int]]]:
        """Entry ``i``'s skeleton as a shared template plus its checked ``(column, row)`` references.

        Raises:
            CacheCorruptError: malformed skeleton or a reference outside the shard's columns.
        """
        try:
            template, refs = skeleton.split(self.skeletons[i])
        except skeleton.SkeletonError as exc:
            raise CacheCorruptError(str(self.path), f"bad skeleton: {exc}", entry=self.keys[i]) from None
        cols = self.columns
        for c, r in refs:
            if not (0 <= c < len(cols) and 0 <= r < cols[c].rows):
                raise CacheCorruptError(str(self.path), f"bad skeleton: tensor reference [{c}, {r}] outside "
                                        "the shard's columns", entry=self.keys[i])
        return template, refs


def open_shard(path: Path, file: str, record: ShardRecord | None = None) -> ShardIndex:
    """Read and check one shard's header (no tensor data).

    Args:
        path: the shard file.
        file: its name relative to the cache root, as the manifest lists it.
        record: the manifest's record; when given, the file size and header checksum must match it.

    Raises:
        CacheCorruptError: missing, truncated or damaged shard, or an impossible header claim.
        CacheFormatError: a shard of another format or an unknown version.
    """
    p = str(path)
    try:
        fd = open_regular(p)
    except FileNotFoundError:
        raise CacheCorruptError(p, "shard file is missing; rebuild the cache or restore the file") from None
    except CacheUnreadableError:
        raise
    except OSError as exc:  # permissions, open-file limit, I/O: not damage (see CacheUnreadableError)
        if exc.errno is None:  # open_regular: a FIFO, device or folder where the shard should be
            raise CacheCorruptError(p, f"cannot open shard ({exc.strerror})") from None
        raise CacheUnreadableError(p, f"cannot open shard ({exc.strerror or exc})", errno=exc.errno) from None
    try:
        size = os.fstat(fd).st_size
        if record is not None and size != record.bytes:
            raise CacheCorruptError(p, f"shard is {size} bytes but the manifest says {record.bytes} (truncated?)")
        head = read_header(p, fd, size)
    except OSError as exc:
        raise CacheUnreadableError(p, f"cannot read the shard header ({exc.strerror or exc})",
                                   errno=exc.errno) from None
    finally:
        os.close(fd)
    return index_shard(path, file, size, head, record)


def index_shard(path: Path | CacheURL, file: str, size: int, head: SafetensorsHeader,
                record: ShardRecord | None = None) -> ShardIndex:
    """Check a shard's parsed header ``head`` (of a file of ``size`` bytes, at ``path``) and index it: what
    :func:`open_shard` does once the header is read (a remote reader reads it over the network).

    Raises:
        CacheCorruptError, CacheFormatError: as :func:`open_shard`.
    """
    p = str(path)
    if record is not None and record.header_xxh3 and checksum64(head.raw) != record.header_xxh3:
        raise CacheCorruptError(p, "shard header checksum does not match the manifest")
    if METADATA_KEY not in head.metadata:
        raise CacheFormatError(f"{p}: not a {FORMAT_NAME} shard (no __metadata__[{METADATA_KEY!r}])")
    try:
        meta = skeleton.loads(head.metadata[METADATA_KEY])
    except skeleton.SkeletonError as exc:
        raise CacheCorruptError(p, f"shard metadata: {exc}") from None
    if type(meta) is not dict:
        raise CacheCorruptError(p, "shard metadata is not a JSON object")
    _check_version(p, meta)
    columns = _parse_columns(p, meta.get("columns"), head)
    keys, kinds, skels = _parse_entries(p, meta.get("entries"))
    if record is not None and record.entries != len(keys):
        raise CacheCorruptError(p, f"shard has {len(keys)} entries but the manifest says {record.entries}")
    return ShardIndex(path, file, size, columns, keys, kinds, skels)


def _check_version(p: str, meta: dict) -> None:
    if meta.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{p}: format {meta.get('format')!r:.40}, expected {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION:
        raise CacheFormatError(
            f"{p}: shard format version {meta.get('version')!r:.20}, this library reads version {FORMAT_VERSION}; "
            "upgrade ComfyUI-StreamCache or rebuild the cache"
        )


def _parse_columns(p: str, cols: Any, head: Any) -> list[Column]:
    if type(cols) is not list:
        raise CacheCorruptError(p, "shard metadata 'columns' is not a list")
    out: list[Column] = []
    seen: set[str] = set()
    for i, c in enumerate(cols):
        if type(c) is not dict:
            raise CacheCorruptError(p, f"column {i} is not an object")
        name, rows, cks = c.get("tensor"), c.get("rows"), c.get("checksums")
        span = head.tensors.get(name) if isinstance(name, str) else None
        if not isinstance(name, str) or span is None or name in seen:
            raise CacheCorruptError(p, f"column {i} names no (or an already used) safetensors tensor")
        seen.add(name)
        row_shape = list(span.shape[1:])
        if (c.get("dtype") != span.dtype or type(rows) is not int or not span.shape or span.shape[0] != rows
                or c.get("row_shape") != row_shape):
            raise CacheCorruptError(p, f"column {i} disagrees with tensor {name!r:.40} of the safetensors table")
        if type(cks) is not str or len(cks) != 16 * rows or not is_lower_hex(cks):
            raise CacheCorruptError(p, f"column {i} needs {rows} checksums: a string of {16 * rows} hex digits")
        offset = head.data_start + span.begin
        itemsize = ST_ITEMSIZE[span.dtype]
        if offset % itemsize:
            raise CacheCorruptError(p, f"column {i} starts at {offset}, not aligned to its {itemsize}-byte items")
        out.append(Column(name, ST_TO_DTYPE[span.dtype], torch.Size(row_shape), rows,
                          math.prod(row_shape) * itemsize, offset, cks, _contiguous_strides(row_shape)))
    if len(seen) != len(head.tensors):
        raise CacheCorruptError(p, "the safetensors table has tensors that no column describes")
    return out


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _parse_entries(p: str, ent: Any) -> tuple[list[str], list[str], list[str]]:
    if type(ent) is not dict:
        raise CacheCorruptError(p, "shard metadata 'entries' is not an object")
    keys, kinds, skels = ent.get("key"), ent.get("kind"), ent.get("skeleton")
    if not (type(keys) is list and type(kinds) is list and type(skels) is list):
        raise CacheCorruptError(p, "entries.key, entries.kind and entries.skeleton must be lists")
    if not len(keys) == len(kinds) == len(skels):
        raise CacheCorruptError(p, "entries.key, entries.kind and entries.skeleton differ in length")
    for lst, what in ((keys, "key"), (kinds, "kind"), (skels, "skeleton")):
        if not _all_str(lst):
            raise CacheCorruptError(p, f"every entries.{what} must be a string")
    return keys, list(map(sys.intern, kinds)), skels  # a few distinct kinds: share one str object each


def _all_str(items: list) -> bool:
    """Whether every item is a str (C-speed set/map: this runs over every entry at open)."""
    return not items or set(map(type, items)) == {str}


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})

StoredTensor = tuple[list[int], str, list[int], bytes]
"""One tensor of an added entry: its reference in the entry's skeleton (a list the builder fills in at
:meth:`ShardBuilder.write`; until then another serializer, the recovery log, may use it), safetensors dtype, shape
and C-order bytes (a private copy)."""


def private_bytes(t: torch.Tensor) -> bytes:
    """A private C-order copy of a tensor's bytes, on the CPU (one copy, in as few torch calls as possible: each
    costs microseconds per entry in an encode, and may hand the GIL to another thread)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype in _NUMPY_DTYPES:
        try:
            return t.numpy().tobytes()  # C order whatever the strides
        except RuntimeError:  # a lazily negated view (the negative bit): numpy() refuses it
            return t.resolve_neg().numpy().tobytes()
    return bytes(tensor_bytes(t.resolve_neg()))  # bfloat16, float8, uint16..64: via a uint8 view


@dataclass
class _Group:
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    rows: list[bytes] = field(default_factory=list)


class ShardBuilder:
    """Collects entries in memory (already validated, their tensors as private bytes) until :meth:`write` streams
    them to a shard."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._keyset: set[str] = set()
        self.kinds: list[str] = []
        self._skels: list[Any] = []
        self._groups: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
        self._group_list: list[_Group] = []
        self._refs: list[tuple[list[int], int, int]] = []  # (skeleton reference, group, row)
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keyset

    def add(self, key: str, kind: str, value: Any, name: str) -> tuple[Any, list[StoredTensor]]:
        """Validate ``value`` (raising ``UnstorableValueError`` with its path) and take a private copy of it.

        Returns the entry's skeleton and its tensors, for a recovery log to record the same entry without
        serializing it again (the references in the skeleton are filled in by :meth:`write`).
        """
        pending: list[tuple[list[int], torch.Tensor]] = []

        def on_tensor(t: torch.Tensor, where: str = "") -> list[int]:
            ref = [0, 0]
            pending.append((ref, t))
            return ref

        try:
            skel = skeleton.encode_lean(value, on_tensor)
        except skeleton.NotLean:  # an error to name by its path, or an unusual value: the checked encoder
            pending.clear()
            skel = skeleton.encode(value, name, on_tensor)  # raises before anything is recorded
        stored = [(ref, DTYPE_TO_ST[t.dtype], list(t.shape), private_bytes(t)) for ref, t in pending]
        groups, group_list, refs = self._groups, self._group_list, self._refs
        for (ref, _st, shape, raw), (_, t) in zip(stored, pending):
            gk = (t.dtype, tuple(shape))
            gi = groups.get(gk)
            if gi is None:
                gi = groups[gk] = len(group_list)
                group_list.append(_Group(t.dtype, gk[1]))
            rows = group_list[gi].rows
            refs.append((ref, gi, len(rows)))
            rows.append(raw)
            self.nbytes += len(raw)
        self.keys.append(key)
        self._keyset.add(key)
        self.kinds.append(kind)
        self._skels.append(skel)
        self.nbytes += 64 + len(key)
        return skel, stored

    def write(self, directory: Path, file_id: str) -> ShardRecord:
        """Write the shard atomically as ``directory/<file_id>.safetensors`` and return its manifest record."""
        order = sorted(range(len(self._group_list)),
                       key=lambda g: -self._group_list[g].dtype.itemsize)  # stable: keeps first-seen order
        remap = {g: i for i, g in enumerate(order)}
        for ref, g, row in self._refs:
            ref[0], ref[1] = remap[g], row
        columns, tensors, chunks = [], [], []
        for i, g in enumerate(order):
            grp = self._group_list[g]
            st = DTYPE_TO_ST[grp.dtype]
            rows = grp.rows
            columns.append({"tensor": f"c{i}", "dtype": st, "row_shape": list(grp.row_shape),
                            "rows": len(rows), "checksums": "".join(map(checksum64, rows))})
            tensors.append((f"c{i}", st, [len(rows), *grp.row_shape]))
            chunks.extend(rows)
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "columns": columns,
                "entries": {"key": self.keys, "kind": self.kinds,
                            "skeleton": [skeleton.dumps(s) for s in self._skels]}}
        header = build_header(tensors, {METADATA_KEY: skeleton.dumps(meta)})
        name = f"{file_id}.safetensors"
        size = atomic_write(directory / name, lambda f: write_safetensors(f, header, chunks))
        return ShardRecord(f"shards/{name}", size, len(self.keys), checksum64(header))

