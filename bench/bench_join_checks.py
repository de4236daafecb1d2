"""Benchmark: what a rank joining from another machine spends checking that it has rank 0's cache and model file.

Before it meets the other ranks, a join command fingerprints each cache it found by name
(:func:`dataset_cache.identity.cache_fingerprint`: the samples and the stored checksums, no tensor read) and hashes
the ends of each model file (:func:`dataset_cache.identity.file_edges`); rank 0 computes the same once per run.
Measured here, median of ``--runs`` with a warm page cache: opening a cache of N samples (the reader the run opens
anyway) and its fingerprint, for each N of ``--sizes``; and for a ``--file-gb`` file, the ends' hash against a
whole-file xxh3-128 (the alternative), whose rate gives what a whole hash of a full-size model file would cost. The
fingerprint is also timed with Python's garbage collector left running, as it was before it paused it.

    .venv/bin/python -m bench.bench_join_checks                 # from the pack root; caches and a file in /tmp
    .venv/bin/python -m bench.bench_join_checks --sizes 1000,10000 --file-gb 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import xxhash

from dataset_cache import identity
from dataset_cache.dataset import Sample
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.identity import cache_fingerprint, file_edges

__all__ = ["main"]

FLUX_GB = 23.8
"""The size of Flux-dev's diffusion model file (bf16), the largest a run commonly loads."""


def _write_cache(root: Path, n: int) -> None:
    """``n`` samples of one tiny latent and one conditioning each (the fingerprint reads headers, not tensors)."""
    g = torch.Generator().manual_seed(0)
    with CacheWriter(root) as w:
        for i in range(n):
            w.add(f"lat{i:08d}", {"samples": torch.randn(1, 4, 2, 2, generator=g)}, kind="latent")
            w.add(f"cap{i:08d}", [[torch.randn(1, 2, 8, generator=g), {}]], kind="conditioning")
        w.set_dataset("train", [Sample(f"lat{i:08d}", (f"cap{i:08d}",), 1, f"{i}.png") for i in range(n)])


def _median_s(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextlib.contextmanager
def _collector_not_paused() -> Iterator[None]:
    """The fingerprint as it was before it paused Python's garbage collector (the comparison arm)."""
    saved = identity.gc_paused
    identity.gc_paused = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        identity.gc_paused = saved


def _whole(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _disk_rate(path: Path) -> float | None:
    """Bytes/s of reading ``path`` past the page cache (``O_DIRECT``, Linux), or ``None`` where that is refused."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    buffer = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT needs
    total, start = 0, time.perf_counter()
    try:
        while n := os.readv(fd, [buffer]):
            total += n
    except OSError:
        return None
    finally:
        os.close(fd)
        buffer.close()
    return total / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,50000", help="cache sizes in samples")
    parser.add_argument("--file-gb", type=float, default=1.0, help="size of the model-like file")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-join-"))
    try:
        print(f"cpu: {os.cpu_count()} cores; median of {args.runs} runs, warm page cache")
        print("| samples | open | fingerprint | fingerprint per 1k samples | fingerprint, the collector not paused |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for n in (int(s) for s in args.sizes.split(",")):
            root = folder / f"cache{n}"
            _write_cache(root, n)

            def opened() -> None:
                with open_cache(root):
                    pass

            with open_cache(root) as reader:
                fingerprint = _median_s(partial(cache_fingerprint, reader), args.runs)
                with _collector_not_paused():
                    unpaused = _median_s(partial(cache_fingerprint, reader), args.runs)
            open_s = _median_s(opened, args.runs)
            print(f"| {n:,} | {open_s * 1e3:.0f} ms | {fingerprint * 1e3:.0f} ms | "
                  f"{fingerprint * 1e3 / n * 1000:.1f} ms | {unpaused * 1e3:.0f} ms |")
            shutil.rmtree(root)
        path = folder / "model.safetensors"
        block = os.urandom(16 << 20)
        with path.open("wb") as f:
            for _ in range(max(1, int(args.file_gb * 1024 / 16))):
                f.write(block)
        size = path.stat().st_size
        _whole(path)  # into the page cache
        edges = _median_s(lambda: file_edges(path, size), args.runs)
        whole = _median_s(lambda: _whole(path), max(3, args.runs // 2))
        rate = size / whole / 1e9
        disk = _disk_rate(path)
        print(f"\nfile of {size / 1e9:.2f} GB: its ends {edges * 1e3:.2f} ms; the whole file {whole:.2f} s "
              f"({rate:.1f} GB/s, from the page cache)")
        print(f"a {FLUX_GB} GB Flux-dev file hashed whole: {FLUX_GB / rate:.0f} s from the page cache", end="")
        if disk is not None:
            print(f", {FLUX_GB / min(rate, disk / 1e9):.0f} s from this disk (read past the page cache at "
                  f"{disk / 1e9:.2f} GB/s)", end="")
        print(f"; its ends: {edges * 1e3:.2f} ms")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
