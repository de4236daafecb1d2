"""Checks shared by the golden caches of dataset file versions (``tests/unit/format/data``): a golden opens, verifies
and reads as its generator wrote it, and today's writer makes the same files again."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dataset_cache.format import open_cache

__all__ = ["assert_golden_reads", "assert_writer_reproduces", "dataset_doc", "regenerate"]


def dataset_doc(root: Path) -> dict[str, Any]:
    """The JSON of the one dataset file of the cache at ``root``."""
    (file,) = (root / "datasets").iterdir()
    return json.loads(file.read_bytes())


def assert_golden_reads(golden: Path, entries: dict[str, Any], dataset: str, samples: Sequence[Any],
                        same: Callable[[Any, Any, str], None]) -> None:
    """The golden verifies clean, every entry reads back as ``entries`` holds it, and ``dataset`` is ``samples``."""
    with open_cache(golden) as reader:
        assert reader.verify() == []
        for key, got in zip(entries, reader.read(list(entries))):
            same(entries[key], got, key)
        assert reader.dataset(dataset) == list(samples)


def assert_writer_reproduces(build: Callable[[Path], None], tmp: Path, golden: Path) -> None:
    """``build`` into ``tmp`` writes the golden's dataset file and shard bytes again."""
    build(tmp)
    assert dataset_doc(tmp) == dataset_doc(golden)
    ours, gold = sorted((tmp / "shards").iterdir()), sorted((golden / "shards").iterdir())
    assert [p.read_bytes() for p in ours] == [p.read_bytes() for p in gold]


def regenerate(golden: Path, build: Callable[[Path], None], argv: Sequence[str]) -> None:
    """Write a golden that does not exist yet (``--force`` in ``argv``: anew); an existing one is never rewritten."""
    if golden.exists() and "--force" not in argv:
        raise SystemExit(f"{golden} exists; goldens are never rewritten")
    shutil.rmtree(golden, ignore_errors=True)
    build(golden)
    print("wrote", golden)
