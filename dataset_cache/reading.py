"""What the loader, the sampler and the trainer need of a reader, as ``Protocol`` classes.

:class:`~dataset_cache.format.reader.CacheReader` is all of them, and so is
:class:`~dataset_cache.multi_reader.MultiCacheReader` (several caches as one); tests and other sources (an in-memory
dataset) implement only what they are used for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["EntryHeaders", "BatchReader", "PlannedReader", "DatasetReader"]


class EntryHeaders(Protocol):
    """Entries' structure without their bytes: what bucketing and the trainability checks read."""

    def get(self, key: str) -> Any:
        """The entry's structure with lazy tensor leaves (shape and dtype known, no data)."""
        ...


class BatchReader(Protocol):
    """A source of batches: many entries in one call, into a reusable buffer."""

    def read(self, keys: Iterable[str], *, pin_memory: bool = False, out: Any = None) -> list[Any]:
        """The values of ``keys`` in order; tensors may be views into ``out`` (a ``ReadBuffer``)."""
        ...


@runtime_checkable
class PlannedReader(BatchReader, Protocol):
    """A batch reader whose reads are planned first, so a loader can announce a batch before it reads it.

    A plan is opaque to the caller: it is made by :meth:`plan`, passed to :meth:`announce` and :meth:`read_plan`.
    """

    def plan(self, keys: Iterable[str]) -> Any:
        """Plan reading ``keys`` without touching their bytes."""
        ...

    def announce(self, plan: Any) -> bool:
        """Ask for the plan's bytes ahead of its read; ``True`` when something was announced. Never raises."""
        ...

    def read_plan(self, plan: Any, *, pin_memory: bool = False, out: Any = None,
                  announced: bool = False) -> list[Any]:
        """Read a plan made by :meth:`plan`: the values of its keys in order."""
        ...


class DatasetReader(EntryHeaders, BatchReader, Protocol):
    """What training from a dataset needs: headers for buckets and checks, batch reads for the loader."""
