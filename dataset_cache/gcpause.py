"""Pausing Python's cyclic garbage collector while bulk bookkeeping builds many small objects.

Validating a 100k-file folder or opening a cache of 100k entries allocates a few hundred thousand small tuples,
stat results and directory entries. Every 700 allocations start a collection of the young generation, and a
fast-growing heap soon starts full ones, which walk every object of the process — in ComfyUI, models and graphs,
millions of objects — to find nothing: what is built here holds no reference cycles, so reference counting frees
it, so pausing the collector around those phases saves that walk (figures: docs/BENCHMARKS.md).

The pause is process-wide (the collector has one switch) and covers bookkeeping only: planning an encode
(validating the folder, hashing new files, keys), and opening a cache; never encoding or training. Pauses nest and
may overlap across threads; the collector is switched back on when the last one ends, and only if it was on when
the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module docstring for when that is right)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
