"""``MultiCacheReader``: training from datasets of several caches through one reader.

Users keep a shared regularization cache across projects (kohya's reg folders), so the datasets a run trains
together may live in different caches. Keys are content addresses: a key found in several caches stands for the
same value, so each key is simply read from the first cache (in the order given) that holds it.

A batch whose entries all lie in one cache is read exactly as that cache's :class:`CacheReader` reads it (one
buffer, the caller's). A batch that spans caches is read in one group per cache: the first group into the caller's
buffer, every other group into a buffer of its own, kept with the caller's buffer and reused by the next read into
it. The cost: such a batch's latents are not one block of one buffer, so the loader stacks them (one copy), and on
CUDA each extra group holds a pinned buffer of its own per loader buffer. Training from one cache never uses this
class (Train LoRA passes the plain ``CacheReader`` then).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


from .format.read_plan import ReadPlan
from .format.reader import CacheReader, ReadBuffer

__all__ = ["MultiCacheReader", "MultiReadPlan", "PlanGroup"]

@dataclass(frozen=True)
class PlanGroup:
    """The part of a batch read that one cache serves.

    Attributes:
        reader: index of the cache in :attr:`MultiCacheReader.readers`.
        plan: that cache's own plan of its keys.
        positions: where each of its keys' values goes in the batch's result (``plan.keys[i]`` → ``positions[i]``).
    """

    reader: int
    plan: ReadPlan
    positions: tuple[int, ...]


@dataclass
class MultiReadPlan:
    """A planned batch read over several caches: one :class:`PlanGroup` per cache involved, in reader order.

    ``announced`` records which groups :meth:`MultiCacheReader.announce` announced, so each cache's read is told
    exactly what it was told before (a plan serves one batch's read).
    """

    keys: tuple[str, ...]
    groups: tuple[PlanGroup, ...]
    announced: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of every group's buffer together."""
        return sum(g.plan.nbytes for g in self.groups)


class MultiCacheReader:
    """Several open caches read as one: what training needs of a reader (headers, planned batch reads).

    Args:
        readers: open cache readers; a key is served by the first that holds it. :meth:`close` closes them all
            (idempotent, as ``CacheReader.close``), so closing them directly instead is just as good.

    Thread-safe as ``CacheReader`` is: give each thread its own ``out`` buffer.

    Raises:
        ValueError: no reader given.
    """

    def __init__(self, readers: Sequence[CacheReader]) -> None:
        if not readers:
            raise ValueError("MultiCacheReader needs at least one open cache reader")
        self.readers: tuple[CacheReader, ...] = tuple(readers)
        self._extras: weakref.WeakKeyDictionary[ReadBuffer, dict[int, ReadBuffer]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------- mapping
    @property
    def roots(self) -> tuple[str, ...]:
        """The caches' directories, in routing order."""
        return tuple(str(r.root) for r in self.readers)

    def __contains__(self, key: object) -> bool:
        return any(key in r for r in self.readers)

    def _route(self, key: str) -> int:
        """Index of the first reader holding ``key``.

        Raises:
            KeyError: no cache holds it, naming the key and every cache.
        """
        for i, r in enumerate(self.readers):
            if key in r:
                return i
        raise KeyError(f"entry {key!r} is not in any of the caches at {', '.join(self.roots)}")

    def reader_of(self, key: str) -> CacheReader:
        """The reader that serves ``key`` (the first holding it); ``KeyError`` naming the key when none does."""
        return self.readers[self._route(key)]

    def kind(self, key: str) -> str:
        """The entry's kind (``"latent"``, ``"conditioning"``, ...)."""
        return self.reader_of(key).kind(key)

    def get(self, key: str) -> Any:
        """The entry's structure with lazy tensor leaves (bound to the cache that serves it); no tensor I/O."""
        return self.reader_of(key).get(key)

    def tensor_shapes(self, key: str) -> Any:
        """The entry's structure with ``torch.Size`` leaves where tensors are (bucketing without I/O)."""
        return self.reader_of(key).tensor_shapes(key)

    # ----------------------------------------------------------------------------------------- reads
    def read(self, keys: Iterable[str], *, pin_memory: bool = False, out: ReadBuffer | None = None) -> list[Any]:
        """The values of ``keys`` in order: ``read_plan(plan(keys))``.

        Raises:
            KeyError: a key is in no cache (naming it).
            CacheCorruptError: as ``CacheReader.read``, from the cache that serves the damaged entry.
        """
        return self.read_plan(self.plan(keys), pin_memory=pin_memory, out=out)

    def plan(self, keys: Iterable[str]) -> MultiReadPlan:
        """Plan reading ``keys`` (duplicates allowed): each key's cache, and that cache's own plan of its keys.

        Raises:
            KeyError: a key is in no cache (naming it and the caches).
            CacheCorruptError: an entry's skeleton is malformed (from its cache's planning, naming the entry).
        """
        keys = tuple(keys)
        by_reader: dict[int, tuple[list[str], list[int]]] = {}
        for pos, key in enumerate(keys):
            mine, positions = by_reader.setdefault(self._route(key), ([], []))
            mine.append(key)
            positions.append(pos)
        groups = tuple(PlanGroup(i, self.readers[i].plan(mine), tuple(positions))
                       for i, (mine, positions) in sorted(by_reader.items()))
        return MultiReadPlan(keys, groups, [False] * len(groups))

    def announce(self, plan: MultiReadPlan) -> bool:
        """Announce every group to its cache (see ``CacheReader.announce``); ``True`` when any was. Never raises."""
        flags = [self.readers[g.reader].announce(g.plan) for g in plan.groups]
        plan.announced = flags
        return any(flags)

    def read_plan(self, plan: MultiReadPlan, *, pin_memory: bool = False, out: ReadBuffer | None = None,
                  announced: bool = False) -> list[Any]:
        """Read a plan made by :meth:`plan`: the values of ``plan.keys`` in order.

        The first group is read into ``out``; each further group into a buffer kept with ``out`` (reused by the
        next read into ``out`` once nothing refers to its memory any more, else replaced), or into new buffers when
        ``out`` is ``None``. Values are views of those buffers, as ``CacheReader``'s are of ``out``.
        """
        values: list[Any] = [None] * len(plan.keys)
        for n, group in enumerate(plan.groups):
            buf = out if n == 0 else self._extra_buffer(out, n, pin_memory)
            was_announced = announced and n < len(plan.announced) and plan.announced[n]
            got = self.readers[group.reader].read_plan(group.plan, pin_memory=pin_memory, out=buf,
                                                       announced=was_announced)
            for pos, value in zip(group.positions, got):
                values[pos] = value
        return values

    def _extra_buffer(self, out: ReadBuffer | None, n: int, pin_memory: bool) -> ReadBuffer:
        """The buffer of group ``n`` (``n >= 1``) of a read into ``out``.

        Kept with ``out`` so that a loader's reused (pinned) buffer brings its extra groups' buffers along: what
        a caller may assume of ``out`` (overwritten by its next read, not before) then holds for them too. One is
        reused only while no tensor refers to its memory (a CPU batch kept by the consumer never changes), else a
        new one replaces it.
        """
        if out is None:
            return ReadBuffer(pin_memory=pin_memory)
        with self._lock:
            extras = self._extras.setdefault(out, {})
            buf = extras.get(n)
            if buf is None or buf.pin_memory != out.pin_memory or buf.in_use():
                buf = extras[n] = ReadBuffer(pin_memory=out.pin_memory)
            return buf

    # ----------------------------------------------------------------------------------------- life
    def close(self) -> None:
        """Close every cache's files (idempotent; the readers stay usable, as ``CacheReader.close`` says)."""
        for r in self.readers:
            r.close()

    def __enter__(self) -> MultiCacheReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MultiCacheReader({', '.join(repr(r) for r in self.readers)})"
