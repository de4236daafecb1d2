"""The on-disk cache format (docs/FORMAT.md): shards, manifest + journal, writer and reader."""

from .reader import CacheReader, ReadBuffer, open_cache
from .compaction import CompactReport
from .writer import CacheWriter

__all__ = ["CacheReader", "CacheWriter", "CompactReport", "ReadBuffer", "open_cache"]
