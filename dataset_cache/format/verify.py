"""Checking a shard against its checksums: what :meth:`.reader.CacheReader.verify` and a remote reader's verify run.

Verification reads every row, so it reads in chunks of :data:`VERIFY_CHUNK` into one buffer per chunk rather than
through the batch read path (which plans reads of a few rows); each mismatch names the entry that owns the row.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import CacheCorruptError, CacheError, CacheUnreadableError
from ..hashing import checksum64
from .safetensors_io import open_regular
from .shard import ShardIndex
from .shard_files import read_exact, unreadable

__all__ = ["VERIFY_CHUNK", "RowsReader", "check_rows", "entry_owners", "verify_local_shard"]

VERIFY_CHUNK = 64 << 20
"""Bytes of one column read at once while verifying: large reads, and a bounded buffer however large the shard."""


def entry_owners(sh: ShardIndex) -> tuple[dict[tuple[int, int], str], list[CacheError]]:
    """Which entry owns each ``(column, row)`` of a shard (to name it in an error), and the entries whose
    skeletons do not parse."""
    problems: list[CacheError] = []
    owner: dict[tuple[int, int], str] = {}
    for i, key in enumerate(sh.keys):
        try:
            for c, row in sh.parse(i)[1]:
                owner.setdefault((c, row), key)
        except CacheCorruptError as exc:
            problems.append(exc)
    return owner, problems


RowsReader = Callable[[int, int, memoryview], None]
"""Reads rows ``[start, start + n)`` of a shard's column (``(column index, start, buffer of n rows)``)."""


def check_rows(sh: ShardIndex, owner: dict[tuple[int, int], str], read: RowsReader,
               errors: tuple[type[CacheError], ...]) -> list[CacheError]:
    """Every row of every column of ``sh`` read in chunks through ``read`` and checked against its checksum; a
    chunk that fails to read with one of ``errors`` ends that column's check (the error is listed)."""
    problems: list[CacheError] = []
    for c, col in enumerate(sh.columns):
        per = max(1, VERIFY_CHUNK // max(1, col.row_nbytes))
        for start in range(0, col.rows, per):
            n = min(per, col.rows - start)
            buf = memoryview(bytearray(n * col.row_nbytes))
            try:
                read(c, start, buf)
            except errors as exc:
                problems.append(exc)
                break
            for j in range(n):
                a = j * col.row_nbytes
                if checksum64(buf[a:a + col.row_nbytes]) != col.checksum(start + j):
                    problems.append(CacheCorruptError(str(sh.path), f"checksum mismatch in {col.tensor} row "
                                                      f"{start + j}", entry=owner.get((c, start + j))))
    return problems


def verify_local_shard(sh: ShardIndex) -> list[CacheError]:
    """Every problem of one local shard: its skeletons, its file (missing, unreadable, resized since the cache was
    opened) and every row against its checksum."""
    p = str(sh.path)
    owner, problems = entry_owners(sh)
    try:
        f = os.fdopen(open_regular(p), "rb", buffering=0)
    except FileNotFoundError:
        return problems + [CacheCorruptError(p, "shard file is missing")]
    except CacheUnreadableError as exc:
        return problems + [exc]
    except OSError as exc:
        return problems + [unreadable(sh, exc)]
    with f:
        if os.fstat(f.fileno()).st_size != sh.size:
            return problems + [CacheCorruptError(p, "shard size changed since the cache was opened")]

        def read(c: int, start: int, buf: memoryview) -> None:
            read_exact(f.fileno(), buf, sh.columns[c].row_range(start)[0], p)

        return problems + check_rows(sh, owner, read, (CacheCorruptError, CacheUnreadableError))
