"""Pausing Python's cyclic garbage collector while bulk bookkeeping builds many small objects.

Validating a 100k-file folder or opening a cache of 100k entries allocates a few hundred thousand small tuples,
stat results and directory entries. Every 700 allocations start a collection of the young generation, and a
fast-growing heap soon starts full ones, which walk every object of the process — in ComfyUI, models and graphs,
millions of objects — to find nothing: what is built here holds no reference cycles, so reference counting frees
it, so pausing the collector around those phases saves that walk (figures: docs/BENCHMARKS.md).

The pause is process-wide (the collector has one switch) and covers bookkeeping: planning an encode (validating
the folder, hashing new files, keys), and opening a cache. Pauses nest and may overlap across threads; the
collector is switched back on when the last one ends, and only if it was on when the first began.

A training loop is the other place the collector costs time for nothing (:class:`StepCollector`): a step of a
checkpointed model allocates tens of thousands of tensors and autograd objects, so the collector runs a few dozen
young passes and, every few steps, a full pass over ComfyUI's several hundred thousand objects, on the training
thread, while a launch-bound GPU waits for it. There the collector is paused too, but not for good: a step's
reference cycles are collected when the step ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StepCollector", "gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_frozen = 0


def _pause() -> None:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1


def _resume() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module docstring for when that is right)."""
    _pause()
    try:
        yield
    finally:
        _resume()


class StepCollector:
    """The collector's work in a training loop, moved to the step boundaries (see the module docstring).

    On entry: one full collection (garbage made before the loop is freed, not kept), then every object alive is
    frozen (``gc.freeze``: no later pass walks the models and ComfyUI's own objects) and the collector paused.
    :meth:`step` after each optimizer step collects the young generations, and every ``full_every`` steps all of
    them, which after the freeze walks only what the loop made. On exit the collector is back as it was and the
    frozen objects are collectable again. A reference cycle thus lives until the end of the step that made it at
    most (``full_every`` steps if it outlived that step), where the collector would have freed it at any allocation.
    Loops may overlap (threads): the objects stay frozen until the last one ends.
    """

    def __init__(self, full_every: int = 50) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {full_every}")
        self.full_every = full_every
        self.steps = 0

    def __enter__(self) -> StepCollector:
        global _frozen
        gc.collect()
        with _lock:
            if _frozen == 0:
                gc.freeze()
            _frozen += 1
        _pause()
        return self

    def step(self) -> None:
        """One optimizer step ended: collect what it left in reference cycles."""
        self.steps += 1
        gc.collect(2 if self.steps % self.full_every == 0 else 1)

    def __exit__(self, *exc: object) -> None:
        global _frozen
        _resume()
        with _lock:
            _frozen -= 1
            if _frozen == 0:
                gc.unfreeze()
