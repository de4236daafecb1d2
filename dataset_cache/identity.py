"""What tells two machines' copies of a cache or of a model file apart, cheaply: a rank that joins a run from
another machine finds both by name there and must train the same rows on the same weights as rank 0.

:func:`cache_fingerprint` hashes what a cache trains: its datasets' samples and every shard's entries with their
rows' stored checksums (keys alone would not do: a cache written by other tools need not derive its keys from the
content). It reads no tensor: the checksums are in the headers a reader already holds. :func:`file_edges` hashes a
file's first and last MiB: a whole hash of a 24 GB model file would read all of it at every start, over 20 s from
an ordinary disk (docs/BENCHMARKS.md, "Joining a run from another machine"), and a copy that differs only in
between is not what a wrong download or another version of a model looks like (their headers or sizes differ).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from .gcpause import gc_paused

__all__ = ["EDGE_BYTES", "cache_fingerprint", "file_edges"]

EDGE_BYTES = 1 << 20
"""How much of each end of a file :func:`file_edges` reads."""


def cache_fingerprint(reader: Any) -> str:
    """What ``reader``'s cache trains, as 32 hex digits (see the module docstring): equal for two copies of a cache,
    different when a sample, an entry or a stored tensor differs.

    Args:
        reader: a :class:`~.format.reader.CacheReader` (its ``datasets()``, ``dataset(name)`` and ``shards``).
    """
    h = xxhash.xxh3_128()
    with gc_paused():  # a list per sample, no cycles: the collector would walk the process for nothing
        for name in sorted(reader.datasets()):
            rows = [[s.latent, list(s.captions), s.repeats, s.mirror, s.mask, s.empty_caption]
                    + ([s.reference, s.reference_mirror] if s.reference is not None else [])
                    for s in reader.dataset(name)]
            h.update(json.dumps([name, rows]).encode())
        for shard in sorted(reader.shards, key=lambda s: s.keys):
            h.update(json.dumps([shard.keys, shard.skeletons]).encode())
            for column in shard.columns:
                h.update(column.checksums.encode())
    return h.hexdigest()


def file_edges(path: Path, size: int | None = None) -> str:
    """xxh3-128 of the first and last :data:`EDGE_BYTES` of ``path`` (the whole file when it is smaller than
    both), as 32 hex digits; ``size``: the file's size when the caller knows it."""
    size = path.stat().st_size if size is None else size
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        h.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    return h.hexdigest()
