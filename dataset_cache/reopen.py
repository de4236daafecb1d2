"""Opening again, in another process, the caches a reader reads, as that reader reads them.

A run on several devices opens its caches in every worker process. A folder is opened by its path (Train LoRA's
shared read lock keeps it as rank 0 opened it). A cache in object storage is opened with rank 0's fetch settings,
so every rank keeps its blocks in the same fetch cache (blocks are content-addressed and written by rename: a block
one rank fetched is read from the disk by the others), and at rank 0's version of the manifest: a cache published
again between rank 0's open and a worker's is refused by name, never read as another version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .format.reader import CacheReader, open_cache
from .multi_reader import MultiCacheReader
from .remote.client import RemoteOptions
from .remote.remote_files import ManifestVersion
from .remote.remote_reader import RemoteCacheReader, open_remote_cache

__all__ = ["CacheAddress", "addresses_of", "parts_of", "reopen"]


@dataclass(frozen=True)
class CacheAddress:
    """What another process needs to open one cache as a reader of it reads it (picklable).

    Attributes:
        root: the cache folder, or a remote cache's URL.
        remote: a remote cache's fetch settings (``None`` for a folder).
        version: the manifest a remote cache must still be (``None`` for a folder).
    """

    root: str
    remote: RemoteOptions | None = None
    version: ManifestVersion | None = None


def parts_of(reader: Any) -> tuple[Any, ...]:
    """The reader of each cache ``reader`` reads: itself, or each of a :class:`MultiCacheReader`'s, in its order (the
    order of :func:`addresses_of`)."""
    return tuple(reader.readers) if isinstance(reader, MultiCacheReader) else (reader,)


def addresses_of(reader: Any) -> tuple[CacheAddress, ...]:
    """The address of each cache ``reader`` reads (one, or each of a :class:`MultiCacheReader`'s, in its order).

    Raises:
        ValueError: a reader of another kind, which another process could not open again.
    """
    out = []
    for r in parts_of(reader):
        if isinstance(r, RemoteCacheReader):
            out.append(CacheAddress(str(r.root), r.options, r.version))
        elif isinstance(r, CacheReader):
            out.append(CacheAddress(str(r.root)))
        else:
            raise ValueError(f"this dataset is read through a {type(r).__name__}, which another process cannot "
                             "open again: only caches opened by Load Lazy Cache (a folder or a remote cache) can")
    return tuple(out)


def reopen(address: CacheAddress) -> CacheReader:
    """Open the cache at ``address`` (see the module docstring).

    Raises: what :func:`~dataset_cache.format.reader.open_cache` raises; for a remote cache also
    ``CacheReplacedError`` when its manifest is no longer ``address.version``.
    """
    if address.version is not None:
        return open_remote_cache(address.root, options=address.remote, version=address.version)
    return open_cache(address.root, remote=address.remote)
