"""The on-disk cache format (docs/FORMAT.md): shards, manifest + journal, writer and reader."""

from .reader import CacheReader, ReadBuffer, open_cache
from .writer import CacheWriter, CompactReport

__all__ = ["CacheReader", "CacheWriter", "CompactReport", "ReadBuffer", "open_cache"]
