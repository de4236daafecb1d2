"""The small handle objects that travel along the pack's custom sockets (``STREAM_DATASET``).

A handle names data; it never holds tensors, open files or threads, so ComfyUI can cache it, compare it and
pass it between nodes for free, and a node that consumes it opens what it needs for the length of its own
``execute`` and closes it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ..dataset_cache.dataset import Sample
from ..dataset_cache.errors import CacheNotFoundError
from ..dataset_cache.format.reader import CacheReader, open_cache

__all__ = ["StreamDataset", "StreamDatasetHandle"]

StreamDataset = io.Custom("STREAM_DATASET")
"""The socket type that carries a :class:`StreamDatasetHandle` between the pack's nodes."""


@dataclass(frozen=True)
class StreamDatasetHandle:
    """One dataset of one cache: the value of a ``STREAM_DATASET`` socket.

    Attributes:
        cache_root: the cache directory (absolute path).
        name: the dataset's name inside the cache.
    """

    cache_root: str
    name: str

    def open(self) -> tuple[CacheReader, list[Sample]]:
        """Open the cache (headers only) and load the dataset's sample list.

        The caller owns the reader and closes it when done (``reader.close()``).

        Raises:
            ValueError: the cache does not exist or the dataset is not in it; the message names the cache and the
                dataset and says what to do. An empty dataset opens (consumers that cannot use one say so).
        """
        try:
            reader = open_cache(self.cache_root)
        except CacheNotFoundError as exc:
            raise ValueError(
                f"dataset {self.name!r}: no StreamCache cache at {self.cache_root} ({exc}); encode the dataset "
                "first or pick an existing cache"
            ) from exc
        try:
            samples = reader.dataset(self.name)
        except KeyError as exc:
            there = sorted(reader.datasets()) or "no datasets"
            reader.close()
            raise ValueError(
                f"dataset {self.name!r} is not in the cache at {self.cache_root}: it holds {there}; pick one of "
                "those or encode it"
            ) from exc
        except BaseException:
            reader.close()
            raise
        return reader, samples
