"""Benchmark of the cache format against the "lazy-branch" design it replaces, side by side in one run.

Entries are SD1.5-sized: a latent ``{"samples": 1x4x64x64 fp16}`` and a conditioning
``[[1x77x768 fp16, {"pooled_output": 1x768 fp16}]]`` per sample (~150 KB a sample, ~15 GB at 100k).

Measured:
* open: time and RSS growth to open the cache (ours: manifest + journal + shard headers; baseline: pickled
  skeleton per shard + safetensors header per shard, as in KohakuBlueleaf/ComfyUI@streamabledataset), each in a
  fresh subprocess, with the files in the page cache (warm) and evicted first (cold, ``posix_fadvise``).
* random batches of 4 samples (latent + conditioning each): ours ``CacheReader.read`` (checksums verified, and
  not), per-tensor ``safe_open().get_tensor()`` on the baseline files, and raw ``preadv`` of exactly the same
  byte ranges of our shard files (no parsing, no checksums: the limit), warm and cold.

Usage, from the pack root: ``python -m bench.bench_format --quick`` (N=2000) or
``python -m bench.bench_format --n 100000`` (needs ~2 x 15 GB free under --dir). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from dataset_cache.format import ReadBuffer, open_cache
from dataset_cache.hashing import tensor_checksum

from .common import PROFILES, LazyReader, evict, keys_of, run_json_child, write_ours
from .common import Entries as _ProfileEntries
from .common import write_lazy as write_baseline

__all__ = ["BaselineReader", "main"]

SAMPLE_BYTES = 2 * (4 * 64 * 64 + 77 * 768 + 768)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class BaselineReader(LazyReader):
    """Opens like ``_ShardReader`` (skeleton pickle + own header parse); realizes as the lazy branch did, with a
    fresh ``safe_open`` per tensor (``bench.common.LazyReader`` keeps one handle per shard instead)."""

    def realize_per_tensor(self, i: int, hashed: bool):
        """``get_tensor`` may return a lazily mapped tensor; hashing (= our verification work) or cloning it
        makes sure the bytes are really read."""
        from safetensors import safe_open

        path = self.shards[i // self.shard_size][0]

        def tensor(name: str):
            with safe_open(path, "pt") as f:
                t = f.get_tensor(name)
            if hashed:
                tensor_checksum(t)
                return t
            return t.clone()

        return self.realize_with(i, tensor)


# ------------------------------------------------------------------------------------------------ measures
def measure_open_child(kind: str, root: str) -> None:
    gc.collect()
    r0 = rss_bytes()
    t = time.perf_counter()
    ours = open_cache(root) if kind == "ours" else None
    baseline = BaselineReader(Path(root)) if ours is None else None  # noqa: F841 - kept alive for the RSS figure
    dt = time.perf_counter() - t
    gc.collect()
    extra: dict[str, float] = {}
    if ours is not None:
        t2 = time.perf_counter()
        n = sum(1 for k in ours.keys() if ours.kind(k) == "latent" and ours.get(k)["samples"].shape)
        extra = {"shapes_s": time.perf_counter() - t2, "latents": n}
    print(json.dumps({"open_s": dt, "rss_mb": (rss_bytes() - r0) / 2**20, **extra}))


def measure_open(kind: str, root: Path, cold: bool) -> dict:
    if cold:
        evict(root)
    return run_json_child("bench.bench_format", ["--_open", kind, str(root)])


def batches(n: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(n), 4) for _ in range(count)]


def time_ours(root: Path, plan: list[list[int]], verify: bool) -> float:
    r = open_cache(root, verify=verify)
    buf = ReadBuffer()
    t = time.perf_counter()
    for b in plan:
        r.read([k for i in b for k in keys_of(i)], out=buf)
    return time.perf_counter() - t


def time_baseline(root: Path, plan: list[list[int]], hashed: bool) -> float:
    r = BaselineReader(root)
    t = time.perf_counter()
    for b in plan:
        for i in b:
            r.realize_per_tensor(i, hashed)
    return time.perf_counter() - t


def time_raw(root: Path, plan: list[list[int]]) -> float:
    """preadv of exactly the rows' byte ranges (per-row, sorted) into one buffer: no parsing, no checksums."""
    r = open_cache(root)
    ranges = []
    for b in plan:
        per: dict[str, list] = {}
        for i in b:
            for k in keys_of(i):
                s, e = r._index[k]
                sh = r._shards[s]
                sh.skeleton(e, lambda c, row: per.setdefault(str(sh.path), []).append(sh.columns[c].row_range(row)))
        ranges.append({p: sorted(v) for p, v in per.items()})
    buf = bytearray(SAMPLE_BYTES * 4 + 4096)
    mv = memoryview(buf)
    t = time.perf_counter()
    for batch in ranges:
        pos = 0
        for path, rr in batch.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                for a, z in rr:
                    os.preadv(fd, [mv[pos:pos + z - a]], a)
                    pos += z - a
            finally:
                os.close(fd)
    return time.perf_counter() - t


Row = tuple[str, str, str, str]
"""(measure, ours, lazy-branch baseline, raw limit): one row of the printed table."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N=2000, 200 batches")
    ap.add_argument("--n", type=int, default=None, help="samples (default 5000; --quick 2000)")
    ap.add_argument("--batches", type=int, default=None, help="random batches of 4 per method")
    ap.add_argument("--dir", default="/tmp/streamcache-bench", help="scratch folder (deleted unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the written caches")
    ap.add_argument("--_open", nargs=2, help=argparse.SUPPRESS)
    return ap


def _write_rows(n: int, base: Path, ours: Path, lazy: Path) -> list[Row]:
    """Write both caches unless ours is already there (``--keep``): the write speed row, or none."""
    entries = _ProfileEntries(PROFILES["sd15"])
    torch.set_num_threads(1)
    if (ours / "manifest.json").exists():
        return []
    shutil.rmtree(base, ignore_errors=True)
    w_ours = write_ours(ours, n, entries)
    w_base = write_baseline(lazy, n, entries)
    gb = n * SAMPLE_BYTES / 1e9
    return [("write", f"{gb / w_ours:.2f} GB/s ({w_ours:.1f} s)", f"{gb / w_base:.2f} GB/s ({w_base:.1f} s)", "")]


def _open_rows(ours: Path, lazy: Path) -> list[Row]:
    """Open time and RSS growth of both, warm then cold; the latents' shapes once warm."""
    rows = []
    for cold in (False, True):
        o, b = measure_open("ours", ours, cold), measure_open("baseline", lazy, cold)
        tag = "cold" if cold else "warm"
        rows.append((f"open ({tag})", f"{o['open_s'] * 1000:.0f} ms, +{o['rss_mb']:.0f} MB RSS",
                     f"{b['open_s'] * 1000:.0f} ms, +{b['rss_mb']:.0f} MB RSS", ""))
        if not cold:
            rows.append(("shapes of all latents (get().shape)", f"{o['shapes_s'] * 1000:.0f} ms", "", ""))
    return rows


def _read_rows(n: int, nb: int, ours: Path, lazy: Path) -> list[Row]:
    """Random batches of 4 read every way, warm (after a warm-up pass) then cold."""
    rows = []
    plan = batches(n, nb)
    plan_b = plan[: max(1, min(nb, 50))]  # the baseline parses a big header per tensor: ~50 ms a batch
    payload = nb * 4 * SAMPLE_BYTES / 1e9
    payload_b = len(plan_b) * 4 * SAMPLE_BYTES / 1e9
    for cold in (False, True):
        tag = "cold" if cold else "warm"
        res = {}
        for name, fn, root in (("ours", lambda: time_ours(ours, plan, True), ours),
                               ("ours_noverify", lambda: time_ours(ours, plan, False), ours),
                               ("baseline", lambda: time_baseline(lazy, plan_b, True), lazy),
                               ("baseline_clone", lambda: time_baseline(lazy, plan_b, False), lazy),
                               ("raw", lambda: time_raw(ours, plan), ours)):
            if cold:
                evict(root)
            else:
                fn()  # warm-up pass: pages in cache
            res[name] = fn()
        rows.append((f"random batches of 4 ({tag}), GB/s [batches/s]",
                     f"{payload / res['ours']:.2f} [{nb / res['ours']:.0f}] verified; "
                     f"{payload / res['ours_noverify']:.2f} unverified",
                     f"{payload_b / res['baseline']:.3f} [{len(plan_b) / res['baseline']:.0f}] hashed; "
                     f"{payload_b / res['baseline_clone']:.3f} copied",
                     f"{payload / res['raw']:.2f} [{nb / res['raw']:.0f}]"))
    return rows


def _print_table(n: int, nb: int, rows: list[Row]) -> None:
    print(f"\nN = {n} samples ({n * SAMPLE_BYTES / 1e9:.1f} GB of tensors per cache), {nb} random batches of 4, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| measure | ours (streamcache v1) | lazy-branch baseline (per-tensor safe_open) "
          "| raw preadv of our rows (limit) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main() -> None:
    """Write both caches (unless kept), measure opens and batch reads side by side, print the table."""
    a = _parser().parse_args()
    if a._open:
        return measure_open_child(*a._open)
    n = a.n or (2000 if a.quick else 5000)
    nb = a.batches or (200 if a.quick else 1000)
    base = Path(a.dir) / f"n{n}"
    ours, lazy = base / "ours", base / "baseline"
    need = 2 * n * SAMPLE_BYTES * 1.05
    free = shutil.disk_usage(Path(a.dir).parent if not Path(a.dir).exists() else a.dir).free
    if not (ours / "manifest.json").exists() and need > free:
        sys.exit(f"need {need / 2**30:.1f} GiB free under {a.dir}, have {free / 2**30:.1f}; use --n to scale")
    rows = _write_rows(n, base, ours, lazy) + _open_rows(ours, lazy) + _read_rows(n, nb, ours, lazy)
    _print_table(n, nb, rows)
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)

if __name__ == "__main__":
    main()
