"""The measurements of the library benchmarks' L1, L3 and L5 tables: one function per figure, no Markdown.

L1 opens each layout in a fresh interpreter (:func:`child_open`, run as ``python -m bench.library --child-open``),
L3 reads the same random batches in each way, L5 counts encoder inputs and times validation. The L4 prefetch
figures are :mod:`bench.library_prefetch`; :mod:`bench.library_run` calls these in order. Imports that only one
figure needs stay inside its function: the L1 child must import as little as the code it measures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import MIB, LazyReader, evict, keys_of, open_footprint, run_json_child
from .library_figures import IncrementalFigures, ValidationFigure

__all__ = ["child_open", "measure_open", "read_floor", "read_lazy", "read_raw", "incremental_bench",
           "validation_bench"]


# ------------------------------------------------------------------------------------------------ 1. open
def child_open(kind: str, root: str) -> dict[str, Any]:
    """Runs in a fresh interpreter: open, return time and RSS."""
    import torch  # noqa: F401  (imported before the baseline RSS: both designs need it)

    from dataset_cache.format.reader import open_cache

    def open_() -> tuple[Any, int]:
        if kind == "ours":
            reader = open_cache(root)
            samples = reader.dataset("bench")
            return (reader, samples), len(samples)
        lazy = LazyReader(Path(root))
        return lazy, len(lazy)

    return open_footprint(open_)


def measure_open(kind: str, root: Path, runs: int, cold: bool) -> dict[str, list[float]]:
    """``runs`` opens of one layout, each in a fresh ``python -m bench.library --child-open`` interpreter."""
    res: dict[str, list[float]] = {"open_s": [], "growth_mib": [], "rss_mib": []}
    for _ in range(runs):
        if cold:
            evict(root)
        r = run_json_child("bench.library", ["--child-open", kind, str(root)])
        for k in res:
            res[k].append(r[k])
    return res


# ------------------------------------------------------------------------------------------------ 3. reads
def read_floor(root: Path, plan: list[list[int]], checksums: bool = False) -> float:
    """The same rows as :func:`read_ours` with nothing but the positional reads: one ``preadv`` per row into one
    buffer, files already open, every offset computed before the clock starts (no parsing, planning, checksums or
    tensor views). What a reader of this layout could reach with zero Python work per batch; with ``checksums``,
    plus one xxh3-64 per row (the verification ours does)."""
    import xxhash

    from dataset_cache.format import open_cache

    with open_cache(root, verify=False) as r:
        shards = r.shards
        index = {k: (s, i) for s, sh in enumerate(shards) for i, k in enumerate(sh.keys)}
        fds = {s: os.open(str(sh.path), os.O_RDONLY) for s, sh in enumerate(shards)}
        try:
            batches, size = [], 0
            for b in plan:
                ops, at = [], 0
                for key in (k for i in b for k in keys_of(i)):
                    s, i = index[key]
                    for c, row in shards[s].parse(i)[1]:
                        col = shards[s].columns[c]
                        ops.append((fds[s], at, col.row_nbytes, col.offset + row * col.row_nbytes))
                        at += col.row_nbytes
                batches.append(sorted(ops, key=lambda o: (o[0], o[3])))
                size = max(size, at)
            mv = memoryview(bytearray(size))
            digest = xxhash.xxh3_64_intdigest
            t = time.perf_counter()
            for ops in batches:
                for fd, at, n, offset in ops:
                    os.preadv(fd, [mv[at:at + n]], offset)
                    if checksums:
                        digest(mv[at:at + n])
            return time.perf_counter() - t
        finally:
            for fd in fds.values():
                os.close(fd)


def read_lazy(root: Path, plan: list[list[int]]) -> float:
    """Seconds to realize every sample of ``plan`` from the lazy-branch files (one cached handle per shard)."""
    r = LazyReader(root)
    t = time.perf_counter()
    for b in plan:
        for i in b:
            r.realize(i)
    return time.perf_counter() - t


def read_raw(root: Path, nbytes: int) -> float:
    """Sequential readinto of ``nbytes`` of our shard files, 8 MiB at a time (no parsing, no checksum)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > MIB)
    buf = bytearray(8 * MIB)
    mv = memoryview(buf)
    left = nbytes
    t = time.perf_counter()
    while left > 0:
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while left > 0:
                    k = f.readinto(mv[: min(len(mv), left)])
                    if not k:
                        break
                    left -= k
            if left <= 0:
                break
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------------------ 5. incremental
def incremental_bench(work: Path, n: int, runs: int) -> IncrementalFigures | str:
    """Encoder inputs after a 1% edit of a folder of ``n`` images (no-op counting encoders), and how long
    re-planning the unchanged folder takes; a string saying why when it fails (the other tables still run)."""
    try:
        from dataset_cache.buckets import BucketConfig
        from dataset_cache.encode_settings import EncodeSettings
        from dataset_cache.encode_plan import plan_encode, sources_record_path
        from dataset_cache.encode_run import run_encode
        from dataset_cache.sources import validate_sources
        from dataset_cache.sources_record import load_record

        from . import bench_incremental as mod  # here, not at the top: the L1 child must not import it

        folder, cache = work / f"inc-data-{n}", work / f"inc-cache-{n}"
        mod.generate(folder, n)
        settings = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=8)
        enc = mod.NoopEncoders()
        b = mod.build(folder, cache, settings, enc, {})  # the defaults run_encode has
        record = sources_record_path(cache, "bench")
        vt, pt = [], []
        for _ in range(runs):
            t = time.perf_counter()
            validate_sources(folder, load_record(record))
            vt.append(time.perf_counter() - t)
            t = time.perf_counter()
            plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                        text_fingerprint="te")
            pt.append(time.perf_counter() - t)
        edited, added = mod.edit(folder, n)
        enc2 = mod.NoopEncoders()
        t = time.perf_counter()
        plan = plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                           text_fingerprint="te")
        run_encode(plan, encode_images=enc2.encode_images, encode_texts=enc2.encode_texts)
        wall = time.perf_counter() - t
        return IncrementalFigures(n=n, build_wall=b["wall"], build_images=enc.images, build_texts=enc.texts,
                                  edited=edited, added=added, images=enc2.images, texts=enc2.texts, wall=wall,
                                  validate=vt, plan=pt)
    except Exception as exc:  # report, do not fail the whole bench
        return f"incremental bench failed: {type(exc).__name__}: {exc}"


def validation_bench(work: Path, sizes: Sequence[int], runs: int) -> list[ValidationFigure]:
    """Wall and CPU time of ``validate_sources`` over unchanged generated folders of each size."""
    from dataset_cache.sources import build_record, validate_sources

    from . import bench_validate  # here, not at the top: the L1 child must not import it

    out = []
    for n in sizes:
        root = work / f"validate-{n}"
        bench_validate.generate(root, n, max(1, min(100, n // 1000)))
        record = build_record(root)
        wall, cpu = [], []
        for _ in range(runs):
            c, t = time.process_time(), time.perf_counter()
            v = validate_sources(root, record)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            assert v.hashed == 0, "unchanged folder re-hashed"
        out.append(ValidationFigure(len(record), wall, cpu))
    return out
