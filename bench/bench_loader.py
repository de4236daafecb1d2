"""Benchmark: does the PrefetchLoader hide reads, keep up with the disk, and hold flat memory?

Three measurements, printed as markdown tables:

1. **Overlap** (step >= read): a reader with a simulated read cost (``--read-ms`` of sleep + a real memcpy into the
   reusable buffer) and a consumer step of ``--step-ms`` (sleep, standing for GPU work that releases the GIL).
   Goal: total consumer data-wait < 5% of the serial read time (batches × read time).
2. **Throughput** (read > step): the same reader with a step of ``--fast-step-ms``. Goal: batches/s >= 90% of the
   standalone read rate (the same reads back to back in one thread, no loader).
3. **Memory**: loader RSS growth while iterating ``--rss-batches`` batches over datasets of 1k .. 100k samples,
   each in a fresh process, with a synthetic reader that stores nothing (values are made from the key at read
   time), so only the loader's and sampler's own memory is measured. Goal: flat in the dataset size.
4. With ``--real``: the same overlap measurement over a real on-disk cache (``dataset_cache.format``).

    .venv/bin/python -m bench.bench_loader              # from the pack root
    .venv/bin/python -m bench.bench_loader --read-ms 20 --step-ms 25 --batches 100 --real
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dataset_cache.dataset import Sample
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler

from .common import run_json_child

LATENT = (4, 64, 64)  # SD1.5 at 512 px: 64 KiB fp32
COND = (1, 77, 768)  # CLIP-L: 231 KiB fp32
SMALL_LATENT, SMALL_COND = (4, 16, 16), (1, 8, 64)  # real-cache memory runs: 100k samples fit in ~0.3 GB of disk


class SyntheticReader:
    """Makes each value from its key at read time (nothing stored), with a simulated per-read cost."""

    def __init__(self, read_s: float = 0.0) -> None:
        self.read_s = read_s
        self.reads = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        return {"samples": torch.empty((1, *LATENT), device="meta")}

    def read(self, keys, *, pin_memory: bool = False, out: Any = None) -> list[Any]:
        with self._lock:
            self.reads += 1
        t_end = time.perf_counter() + self.read_s
        sizes = [(1, *LATENT) if k.startswith("l") else COND for k in keys]
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        flat = out.ensure(nbytes) if out is not None else torch.empty(nbytes, dtype=torch.uint8)
        values: list[Any] = []
        at = 0
        for k, s in zip(keys, sizes):
            n = 4 * torch.Size(s).numel()
            flat[at : at + n].numpy().fill(int(k[1:9], 16) % 251)  # write every byte, as a read would (numpy:
            t = flat[at : at + n].view(torch.float32).view(s)  # single-threaded, no OpenMP wake-up noise)
            at += n
            values.append({"samples": t} if k.startswith("l") else [[t, {}]])
        left = t_end - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the rest of the simulated I/O (a preadv releases the GIL just like sleep)
        return values


def make_samples(n: int) -> list[Sample]:
    return [Sample(f"l{i:031x}", (f"c{i:031x}",)) for i in range(n)]


def make_sampler(n: int, batch_size: int) -> BucketSampler:
    return BucketSampler(make_samples(n), [0] * n, batch_size, seed=0)


def run_loader(reader: Any, sampler: BucketSampler, batches: int, step_s: float, **kw: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    with PrefetchLoader(reader, sampler, epochs=None, **kw) as loader:
        for i, _batch in enumerate(loader):
            if step_s:
                time.sleep(step_s)
            if i + 1 == batches:
                break
        stats = loader.stats
    wall = time.perf_counter() - t0
    return {"wall": wall, "wait": stats.wait_s, "first_wait": stats.recent_wait_s[0], "rate": batches / wall}


def standalone_read_rate(reader: Any, sampler: BucketSampler, batches: int) -> tuple[float, float]:
    """Batches/s and mean seconds of the same reads back to back, in one thread, without a loader."""
    from dataset_cache.format.reader import ReadBuffer

    buf = ReadBuffer()
    plans = sampler.plans(epochs=None)
    for _ in range(3):  # warm-up: first-touch page faults of the buffer are not the steady read rate
        p = next(plans)
        reader.read(list(dict.fromkeys(p.latent_keys + p.caption_keys)), out=buf)
    t0 = time.perf_counter()
    for _ in range(batches):
        p = next(plans)
        values = reader.read(list(dict.fromkeys(p.latent_keys + p.caption_keys)), out=buf)
        torch.cat([values[i]["samples"] for i in range(len(p.latent_keys))])
    wall = time.perf_counter() - t0
    return batches / wall, wall / batches


def bench_overlap(args: argparse.Namespace, reader: Any, sampler: BucketSampler, label: str) -> list[str]:
    rate, read_s = standalone_read_rate(reader, sampler, args.batches)
    serial_read = args.batches * read_s
    kw = {"prefetch_batches": args.prefetch, "threads": args.threads}
    slow = run_loader(reader, sampler, args.batches, args.step_ms / 1e3, **kw)
    fast = run_loader(reader, sampler, args.batches, args.fast_step_ms / 1e3, **kw)
    wait_pct = 100 * slow["wait"] / serial_read
    thr_pct = 100 * fast["rate"] / rate
    return [
        f"| {label} | step {args.step_ms:g} ms >= read {1e3 * read_s:.1f} ms | data-wait {slow['wait']:.3f} s = "
        f"{wait_pct:.2f}% of serial read {serial_read:.2f} s (first batch {1e3 * slow['first_wait']:.1f} ms) "
        f"| < 5% | {'PASS' if wait_pct < 5 else 'FAIL'} |",
        f"| {label} | step {args.fast_step_ms:g} ms < read {1e3 * read_s:.1f} ms | {fast['rate']:.1f} batches/s = "
        f"{thr_pct:.1f}% of standalone {rate:.1f}/s | >= 90% | {'PASS' if thr_pct >= 90 else 'FAIL'} |",
    ]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def rss_child(n: int, batches: int, batch_size: int, prefetch: int, real_dir: str | None) -> dict[str, int]:
    """Runs in a fresh process: RSS before the loader, and the peak while it iterates."""
    samples_rss0 = _rss_bytes()
    if real_dir:
        from dataset_cache.format.reader import open_cache

        reader: Any = open_cache(real_dir)
    else:
        reader = SyntheticReader()
    sampler = make_sampler(n, batch_size)
    sampler.plan(0, 0)  # build epoch 0 up front: the sampler's O(dataset) part is measured apart
    gc.collect()
    base = _rss_bytes()
    peak = base
    held = 0
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, epochs=None) as loader:
        for i, batch in enumerate(loader):
            del batch  # measure the loader, not a consumer that keeps its batch while asking for the next
            held = max(held, loader.held_bytes())
            if i % 10 == 0:
                peak = max(peak, _rss_bytes())
            if i + 1 == batches:
                break
    peak = max(peak, _rss_bytes())
    return {"sampler": base - samples_rss0, "loader": peak - base, "held": held}


def bench_rss(args: argparse.Namespace, real: bool = False) -> list[str]:
    rows = []
    latent, cond = (SMALL_LATENT, SMALL_COND) if real else (LATENT, COND)
    batch_bytes = args.batch_size * 4 * (torch.Size(latent).numel() + torch.Size(cond).numel())
    for n in (1_000, 10_000, 100_000):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ["--rss-child", str(n), "--rss-batches", str(args.rss_batches),
                   "--batch-size", str(args.batch_size), "--prefetch", str(args.prefetch)]
            if real:
                make_real_cache(Path(tmp) / "cache", n, latent, cond)
                cmd += ["--rss-real-dir", str(Path(tmp) / "cache")]
            r = run_json_child("bench.bench_loader", cmd)
        rows.append(
            f"| {'real' if real else 'synthetic'} | {n:,} | {r['sampler'] / 2**20:.1f} MiB | "
            f"{r['loader'] / 2**20:.1f} MiB "
            f"({r['loader'] / batch_bytes:.2f} batches) | {r['held'] / 2**20:.1f} MiB "
            f"({r['held'] / batch_bytes:.2f} batches) |"
        )
    return rows


def make_real_cache(
    root: Path, n: int, latent: tuple[int, ...] = LATENT, cond: tuple[int, ...] = COND
) -> tuple[Any, list[Sample]]:
    from dataset_cache.format.reader import open_cache
    from dataset_cache.format.writer import CacheWriter

    samples = make_samples(n)
    g = torch.Generator().manual_seed(0)
    with CacheWriter(root) as w:
        for s in samples:
            w.add(s.latent, {"samples": torch.randn((1, *latent), generator=g)}, kind="latent")
            w.add(s.captions[0], [[torch.randn(cond, generator=g), {}]], kind="conditioning")
    return open_cache(root), samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--read-ms", type=float, default=20.0)
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--fast-step-ms", type=float, default=5.0)
    ap.add_argument("--rss-batches", type=int, default=300)
    ap.add_argument("--real", action="store_true", help="also measure over a real on-disk cache")
    ap.add_argument("--real-samples", type=int, default=2_000)
    ap.add_argument("--real-batch-size", type=int, default=32)
    ap.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rss-real-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.rss_batches, args.batch_size, args.prefetch,
                                   args.rss_real_dir)))
        return 0

    print(f"torch {torch.__version__}; batch {args.batch_size} × latent {list(LATENT)} + cond {list(COND)} fp32; "
          f"prefetch {args.prefetch}, {args.threads} loader thread(s)\n")
    print("| reader | regime | measured | goal | result |\n| --- | --- | --- | --- | --- |")
    reader = SyntheticReader(args.read_ms / 1e3)
    for line in bench_overlap(args, reader, make_sampler(10_000, args.batch_size), "simulated"):
        print(line)
    if args.real:
        with tempfile.TemporaryDirectory() as tmp:
            real, samples = make_real_cache(Path(tmp) / "cache", args.real_samples)
            sampler = BucketSampler(samples, [0] * len(samples), args.real_batch_size, seed=0)
            rate, read_s = standalone_read_rate(real, sampler, args.batches)
            step = round(max(2.0, 1.2e3 * read_s), 2)
            real_args = argparse.Namespace(**{**vars(args), "step_ms": step, "batches": args.batches,
                                              "fast_step_ms": round(0.3e3 * read_s, 2)})
            label = f"real cache, batch {args.real_batch_size} (page cache warm)"
            for line in bench_overlap(real_args, real, sampler, label):
                print(line)
            real.close()
    print(f"\nLoader memory while iterating {args.rss_batches} batches, a fresh process each (baseline = reader + "
          f"sampler with epoch 0 built; synthetic batch = latents {list(LATENT)} + conds {list(COND)}, real batch = "
          f"{list(SMALL_LATENT)} + {list(SMALL_COND)}, fp32 × {args.batch_size})\n")
    print("| reader | samples | baseline (reader + sampler) | RSS growth while iterating | max held_bytes() |\n"
          "| --- | --- | --- | --- | --- |")
    for line in bench_rss(args) + (bench_rss(args, real=True) if args.real else []):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
