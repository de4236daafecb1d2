"""A committed version-1 cache: it must stay readable, and today's writer must still produce its exact bytes.

A failure here means the on-disk format changed. If that is intended, bump ``FORMAT_VERSION``, document the
change in docs/FORMAT.md and add a new golden next to this one (``python tests/unit/format/test_format_golden.py``
writes ``data/v<version>``); never edit an old golden.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import torch

from dataset_cache.constants import FORMAT_VERSION
from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter, open_cache

GOLDEN = Path(__file__).parent / "data" / "v1"


def golden_entries() -> dict:
    ar = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    return {
        "latent-0": {"samples": ar.half(), "noise_mask": torch.ones(1, 1, 3, 4), "batch_index": [0]},
        "latent-1": {"samples": (ar + 1).half()},
        "cond-0": [[ar.reshape(1, 6, 4).bfloat16(), {"pooled_output": torch.arange(4).float().reshape(1, 4),
                                                     "guidance": 3.5, "area": (8, 8, 0, 0), "$odd": math.inf}]],
        "misc": {"bool": torch.tensor([True, False]), "i8": torch.tensor(-3, dtype=torch.int8),
                 "f8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 3),
                 "i64": torch.tensor([2**40]), "nan": math.nan, "one": 1, "one_f": 1.0, "none": None},
    }


def golden_samples() -> list[Sample]:
    return [Sample("latent-0", ("cond-0",), 2, "2_x/a.png"), Sample("latent-1", ("cond-0", "misc"))]


def build(root: Path) -> None:
    with CacheWriter(root) as w:
        for k, v in golden_entries().items():
            w.add(k, v, kind=k.split("-")[0], name=k)
        w.set_dataset("golden", golden_samples(), info={"note": "format golden"})


def test_golden_cache_is_readable(same):
    r = open_cache(GOLDEN)
    assert r.verify() == []
    want = golden_entries()
    for k, got in zip(want, r.read(list(want))):
        same(want[k], got, k)
    assert r.dataset("golden") == golden_samples()
    assert r.datasets()["golden"].info == {"note": "format golden"}


def test_writer_still_produces_the_golden_shard_bytes(tmp_path):
    build(tmp_path)
    ours = sorted((tmp_path / "shards").iterdir())
    gold = sorted((GOLDEN / "shards").iterdir())
    assert len(ours) == len(gold) == 1
    assert ours[0].read_bytes() == gold[0].read_bytes()


if __name__ == "__main__":  # regenerate: only for a new format version
    target = GOLDEN.parent / f"v{FORMAT_VERSION}"
    if target.exists() and "--force" not in sys.argv:
        sys.exit(f"{target} exists; goldens are never rewritten")
    shutil.rmtree(target, ignore_errors=True)
    build(target)
    print("wrote", target)
