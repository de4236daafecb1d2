"""An in-memory stand-in for a cache reader (``get`` and ``read`` of entries by key) that records every read, for
loader tests that look at what a batch reads."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["MemoryReader"]


class MemoryReader:
    """Entries in memory; records the keys of every read."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self.entries = entries
        self.reads: list[tuple[str, ...]] = []
        self.lock = threading.Lock()

    def get(self, key: str) -> Any:
        return self.entries[key]

    def read(self, keys: Sequence[str], *, pin_memory: bool = False, out: Any = None) -> list[Any]:
        with self.lock:
            self.reads.append(tuple(keys))
        return [self.entries[k] for k in keys]
