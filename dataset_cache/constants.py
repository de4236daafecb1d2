"""Defaults of the library, each with the reason for its value."""

from __future__ import annotations

FORMAT_NAME = "streamcache"
"""Written into every manifest and shard so a reader can tell our files from other safetensors files."""

FORMAT_VERSION = 1
"""Bumped on any incompatible change of docs/FORMAT.md; readers refuse versions they do not know."""

DEFAULT_SHARD_BYTES = 128 << 20
"""128 MiB: large enough that a 100k-entry SD1.5 cache (~15 GB) is ~120 files (cheap to open), small enough
that the writer's one-shard buffer stays modest and a compaction rewrites little at a time."""

MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on the JSON header (100 MB); a larger claim is refused before any allocation."""

MAX_SKELETON_DEPTH = 64
"""Nesting limit of a stored value. ComfyUI conditionings nest 4–5 levels; 64 leaves room while stopping a
hostile header from driving the decoder into deep recursion."""

DEFAULT_PREFETCH_BATCHES = 2
"""Batches read ahead by the loader: one in flight while one waits, enough to hide read jitter; host memory
held is bounded by (depth + 1) × batch bytes."""

