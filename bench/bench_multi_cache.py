"""Benchmark: what reading a run's datasets from two caches (``MultiCacheReader``) costs against one cache.

Two datasets, "main" and "reg", of ``--n`` samples each (SD1.5 at 512 px: a ``[1, 4, 64, 64]`` float16 latent and a
``[1, 77, 768]`` float16 conditioning per sample), written once into one cache holding both and once into two
caches (main in one, reg in the other). The loader (CPU target, ``--prefetch`` 0: the read and the batch assembly
on the timed thread, nothing hidden) iterates one epoch of batches of ``--batch`` rows with the regularization
set mixed in at ratio 1, warm page cache, in two layouts:

* **own buckets**: reg latents are ``[4, 64, 48]``, so no batch mixes the datasets: a batch reads from one cache.
* **shared bucket**: reg latents are ``[4, 64, 64]`` too, so batches mix rows of both caches: two groups per
  read, and the latents are stacked (one copy) instead of being one block of the read buffer.

Median (min-max) ms per batch of ``--runs`` epochs, the two readers alternating run by run.

    .venv/bin/python -m bench.bench_multi_cache            # from the pack root
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dataset_cache import MultiCacheReader
from dataset_cache.dataset import Sample
from dataset_cache.dataset_mix import Regularization
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler


def _entries(prefix: str, n: int, width: int) -> tuple[list[Sample], dict[str, Any]]:
    g = torch.Generator().manual_seed(len(prefix) + width)
    entries: dict[str, Any] = {}
    samples = []
    for i in range(n):
        entries[f"{prefix}l{i}"] = {"samples": torch.randn(1, 4, 64, width, generator=g).half()}
        entries[f"{prefix}c{i}"] = [[torch.randn(1, 77, 768, generator=g).half(), {}]]
        samples.append(Sample(f"{prefix}l{i}", (f"{prefix}c{i}",)))
    return samples, entries


def _write(root: Path, *parts: dict[str, Any]) -> None:
    with CacheWriter(root) as w:
        for entries in parts:
            for key, value in entries.items():
                w.add(key, value, kind="conditioning" if isinstance(value, list) else "latent")


def _epoch_ms(reader: Any, main: list[Sample], reg: list[Sample], batch: int, prefetch: int) -> tuple[float, int]:
    sampler = BucketSampler(main, buckets_from_reader(reader, main), batch, seed=1, tail="wrap",
                            reg=Regularization(reg, buckets_from_reader(reader, reg), 1.0, 1.0))
    t = time.perf_counter()
    n = 0
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, epochs=1) as loader:
        for _ in loader:
            n += 1
    return (time.perf_counter() - t) * 1000 / max(n, 1), n


def measure(work: Path, n: int, batch: int, runs: int, prefetch: int) -> list[tuple[str, str, str, int]]:
    """(layout, one cache, two caches, batches per epoch) rows."""
    rows = []
    for layout, reg_width in (("own buckets (a batch reads one cache)", 48),
                              ("shared bucket (batches span both caches)", 64)):
        main, main_entries = _entries("p", n, 64)
        reg, reg_entries = _entries("r", n, reg_width)
        base = work / f"w{reg_width}"
        _write(base / "one", main_entries, reg_entries)
        _write(base / "a", main_entries)
        _write(base / "b", reg_entries)
        del main_entries, reg_entries
        one = open_cache(base / "one")
        two = MultiCacheReader([open_cache(base / "a"), open_cache(base / "b")])
        try:
            _epoch_ms(one, main, reg, batch, prefetch)  # warm the page cache and the kept descriptors
            _epoch_ms(two, main, reg, batch, prefetch)
            t_one, t_two = [], []
            batches = 0
            for _ in range(runs):
                ms, batches = _epoch_ms(one, main, reg, batch, prefetch)
                t_one.append(ms)
                t_two.append(_epoch_ms(two, main, reg, batch, prefetch)[0])
        finally:
            one.close()
            two.close()
        rows.append((layout, _fmt(t_one), _fmt(t_two), batches))
    return rows


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256, help="samples per dataset")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--prefetch", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_multi_") as tmp:
        rows = measure(Path(tmp), args.n, args.batch, args.runs, args.prefetch)
    print(f"n={args.n} per dataset, batch {args.batch}, prefetch {args.prefetch}, {args.runs} runs; ms per batch")
    print("| layout | one cache | two caches | batches/epoch |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
