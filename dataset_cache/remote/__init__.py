"""Caches in object storage: read a cache at ``s3://``, ``gs://``, ``az://`` or ``https://`` like a local one, and
publish a local cache to a bucket.

* :func:`~dataset_cache.format.reader.open_cache` opens a URL as it opens a folder (through
  :func:`~.remote_reader.open_remote_cache`): ranged GETs of the cache's own read plans, a local fetch cache so a
  second epoch reads locally, the manifest pinned by its ETag.
* :func:`~.publish.push` / :func:`~.publish.pull` (``python -m dataset_cache push CACHE URL`` / ``pull URL CACHE``):
  shards and dataset files under content-addressed names, never overwritten, the manifest last.

The object-store client (obstore) is an optional extra, imported on first use (:mod:`.client`). Importing this
package imports nothing optional: :func:`is_remote_url` and :func:`parse_cache_url` work without it.
"""

from __future__ import annotations

from typing import Any

from .client import RemoteOptions
from .urls import CacheURL, is_remote_url, parse_cache_url

__all__ = ["CacheURL", "RemoteOptions", "is_remote_url", "parse_cache_url", "open_remote_cache", "push", "pull"]


def __getattr__(name: str) -> Any:
    """The functions that need the reader or the writer, imported when first used (they import the format
    package, which imports this one)."""
    if name == "open_remote_cache":
        from .remote_reader import open_remote_cache

        return open_remote_cache
    if name in ("push", "pull"):
        from . import publish

        return getattr(publish, name)
    raise AttributeError(name)
