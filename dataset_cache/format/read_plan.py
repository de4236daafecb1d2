"""``ReadPlan``: where each tensor of a batch read goes in one buffer, and which positional reads fill it.

A plan is a value computed from the shard headers alone (no file is touched), so it can be made on one thread,
announced to the kernel on another and read on a third, and tested without any file. The reader makes plans
(:meth:`CacheReader.plan`), announces them (:meth:`CacheReader.announce`) and reads them
(:meth:`CacheReader.read_plan`); a loader job carries its plan through all three.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CacheCorruptError
from . import skeleton
from .shard import Column, ShardIndex

__all__ = ["RowRef", "FileRange", "RowGroup", "ReadPlan", "plan_read", "plan_rows"]

RowRef = tuple[int, int, int]
"""One tensor row of a cache: ``(shard number, column number, row number)``."""

FileRange = tuple[int, int, int, int]
"""One positional read: ``(shard number, first byte, end byte, position in the buffer)``."""

_ALIGN = 64  # each group starts 64-byte aligned: its rows are then aligned for any dtype


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Rows of one dtype and row shape, side by side in the buffer in the order asked for (one ``[n, ...]`` view)."""

    start: int
    column: Column  # any column of the group: its dtype, row shape and row size are the group's
    rows: tuple[RowRef, ...]


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """A planned batch read.

    Attributes:
        keys: the entries read, in the order their values are returned (empty for a read of loose rows).
        templates: each entry's skeleton template and how many tensor references it holds.
        rows: every tensor reference in key order (a row referenced twice appears twice).
        placed: each unique row once, in buffer order: ``(row, buffer position, column)`` (for checksums).
        groups: the buffer's groups, one per dtype and row shape.
        ranges: the positional reads that fill the buffer; rows adjacent in the file and in the buffer share one.
        nbytes: the buffer size the read needs.
    """

    keys: tuple[str, ...]
    templates: tuple[tuple[Any, int], ...]
    rows: tuple[RowRef, ...]
    placed: tuple[tuple[RowRef, int, Column], ...]
    groups: tuple[RowGroup, ...]
    ranges: tuple[FileRange, ...]
    nbytes: int

    @property
    def range_bytes(self) -> int:
        """Bytes the positional reads move (less than ``nbytes`` by the alignment padding)."""
        return sum(end - begin for _, begin, end, _ in self.ranges)


def plan_read(shards: Sequence[ShardIndex], index: Mapping[str, tuple[int, int]], keys: Sequence[str]) -> ReadPlan:
    """Plan reading the entries ``keys`` (duplicates allowed) of a cache whose key index is ``index``.

    Raises:
        KeyError: a key is not in ``index``.
        skeleton.SkeletonError: an entry's skeleton cannot be parsed.
        CacheCorruptError: a tensor reference lies outside its shard's columns.
    The caller turns these into errors that name the entry (``CacheReader.plan``).
    """
    keys = tuple(keys)
    templates: list[tuple[Any, int]] = []
    rows: list[RowRef] = []
    split = skeleton.split
    for key in keys:  # the loader's inner loop: a few operations per reference
        s, i = index[key]
        template, refs = split(shards[s].skeletons[i])
        templates.append((template, len(refs)))
        rows += [(s, c, r) for c, r in refs]
    return plan_rows(shards, rows, keys=keys, templates=tuple(templates))


def plan_rows(shards: Sequence[ShardIndex], rows: Sequence[RowRef], *, keys: tuple[str, ...] = (),
              templates: tuple[tuple[Any, int], ...] = ()) -> ReadPlan:
    """Plan reading loose ``rows`` (``LazyTensor`` leaves), or the rows of ``keys`` (see :func:`plan_read`)."""
    members: dict[int, list[RowRef]] = {}
    col_of: dict[RowRef, Column] = {}  # each unique row's column (also: rows already seen)
    for ref in rows:
        if ref in col_of:
            continue
        s, c, r = ref
        cols = shards[s].columns
        if not 0 <= c < len(cols) or not 0 <= r < cols[c].rows:
            raise CacheCorruptError(str(shards[s].path), f"tensor reference [{c}, {r}] outside the columns")
        col = col_of[ref] = cols[c]
        group = members.get(col.group)
        if group is None:
            group = members[col.group] = []
        group.append(ref)
    placed: list[tuple[RowRef, int, Column]] = []
    groups: list[RowGroup] = []
    at: dict[RowRef, int] = {}
    total = 0
    for refs in members.values():
        total = -(-total // _ALIGN) * _ALIGN
        groups.append(RowGroup(total, col_of[refs[0]], tuple(refs)))
        for ref in refs:
            col = col_of[ref]
            at[ref] = total
            placed.append((ref, total, col))
            total += col.row_nbytes
    ranges: list[list[int]] = []
    last: list[int] = [-1, 0, 0, 0]
    for ref in sorted(at):  # file order: rows next to each other in the file and in the buffer share a read
        s, _c, r = ref
        n = col_of[ref].row_nbytes
        begin = col_of[ref].offset + r * n
        pos = at[ref]
        if s == last[0] and begin == last[2] and pos == last[3] + last[2] - last[1]:
            last[2] = begin + n
        else:
            last = [s, begin, begin + n, pos]
            ranges.append(last)
    return ReadPlan(keys, templates, tuple(rows), tuple(placed), tuple(groups),
                    tuple((s, b, e, p) for s, b, e, p in ranges), total)
