"""Benchmark: validating an unchanged dataset folder against its sources record.

Generates ``--n`` small source files (half images, half same-stem ``.txt`` captions, spread over ``--dirs``
kohya folders; image bytes are not decodable pictures, validation never opens them), builds the record, then
times :func:`dataset_cache.sources.validate_sources` on the unchanged folder with a warm page cache. Reports the
median of ``--runs`` runs (>= 5) and the per-file cost, plus the costs around it (listing only, record load/save,
full re-hash). Goal: < 1 s for 100k files.

    .venv/bin/python -m bench.bench_validate            # from the pack root; 100k files in /tmp
    .venv/bin/python -m bench.bench_validate --n 20000 --runs 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dataset_cache.listing import list_folder
from dataset_cache.sources import build_record, validate_sources
from dataset_cache.sources_record import SourcesRecord, load_record, save_record

__all__ = ["generate", "main"]

MARKER = ".bench-validate"


def generate(root: Path, n: int, dirs: int) -> None:
    """Write ``n`` files (n/2 images + n/2 captions) under ``root``, all with an mtime one hour in the past."""
    if (root / MARKER).is_file() and (root / MARKER).read_text() == f"{n} {dirs}":
        return
    shutil.rmtree(root, ignore_errors=True)
    images = n // 2
    old = time.time_ns() - 3600 * 10**9
    per_dir = -(-images // dirs)
    for i in range(images):
        folder = i // per_dir
        d = root / f"{1 + folder % 5}_concept{folder:04d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        img, cap = d / f"img{i:07d}.png", d / f"img{i:07d}.txt"
        img.write_bytes(b"\x89PNG\r\n\x1a\n" + i.to_bytes(8, "little") * 16)
        cap.write_text(f"a photo of thing {i % 1000}, tag{i % 37}\nshared caption line\n")
        os.utime(img, ns=(old, old))
        os.utime(cap, ns=(old, old))
    (root / MARKER).write_text(f"{n} {dirs}")


CPU: dict[int, list[float]] = {}
T = TypeVar("T")


def timed(fn: Callable[[], T], runs: int) -> tuple[list[float], T]:
    """Run ``fn`` ``runs`` (≥ 1) times; return wall times (CPU times, user+sys of all threads, go to ``CPU``) and
    the last run's result."""
    times: list[float] = []
    cpu: list[float] = []
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if not times:
        raise ValueError("runs must be at least 1")
    CPU[id(times)] = cpu
    return times, out


def fmt(times: list[float], files: int) -> str:
    med = statistics.median(times)
    cpu = CPU.get(id(times))
    cpu_s = f", cpu median {statistics.median(cpu) * 1e3:.1f} ms" if cpu else ""
    return (f"median {med * 1e3:8.1f} ms  min {min(times) * 1e3:8.1f}  max {max(times) * 1e3:8.1f}  "
            f"({med / files * 1e6:.2f} us/file, {len(times)} runs{cpu_s})")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="source files to generate (half images, half captions)")
    ap.add_argument("--dirs", type=int, default=100, help="kohya folders to spread them over")
    ap.add_argument("--runs", type=int, default=7, help="timed runs per measurement (>= 5)")
    ap.add_argument("--threads", type=int, default=None, help="hashing threads (default: from available CPUs)")
    ap.add_argument("--dir", type=Path, default=None, help="where to generate (default: a folder in /tmp, kept)")
    ap.add_argument("--clean", action="store_true", help="delete the generated folder afterwards")
    return ap


def _record_costs(root: Path, rec_path: Path, threads: int | None,
                  runs: int) -> tuple[SourcesRecord, list[float], int]:
    """Print the costs around validation (hash every file, save, load, list only); return the loaded record, its
    load times and the number of files."""
    t0 = time.perf_counter()
    record = build_record(root, threads=threads)
    build_s = time.perf_counter() - t0
    files = len(record)
    print(f"build record (hash every file):    {build_s * 1e3:8.1f} ms  ({build_s / files * 1e6:.2f} us/file)")

    save_times, _ = timed(lambda: save_record(record, rec_path), runs)
    print(f"save record ({rec_path.stat().st_size / 1e6:.1f} MB, fsync):  {fmt(save_times, files)}")
    load_times, loaded = timed(lambda: load_record(rec_path), runs)
    print(f"load record (parse + check):       {fmt(load_times, files)}")
    assert loaded == record

    list_times, _ = timed(lambda: list_folder(root), runs)
    print(f"list folder only (scandir+stat):   {fmt(list_times, files)}")
    return loaded, load_times, files


def _validate_costs(root: Path, loaded: SourcesRecord, threads: int | None, runs: int, load_times: list[float],
                    files: int) -> list[float]:
    """Print validation of the unchanged folder (folders listed on the calling thread, then on threads, then with
    the record's load); return the first one's wall times."""
    val_times, v = timed(lambda: validate_sources(root, loaded, threads=threads), runs)
    assert v.clean and v.hashed == 0 and len(v.unchanged) == files, v.counts()
    print(f"validate unchanged folder:         {fmt(val_times, files)}")
    pooled_times, v = timed(lambda: validate_sources(root, loaded, list_threads=None), runs)
    assert v.clean and v.hashed == 0 and len(v.unchanged) == files, v.counts()
    print(f"  same, folders listed on threads: {fmt(pooled_times, files)}")
    total = [a + b for a, b in zip(sorted(load_times), sorted(val_times))]
    print(f"load record + validate:            {fmt(total, files)}")
    return val_times


def _touched_cost(root: Path, loaded: SourcesRecord, threads: int | None, files: int) -> None:
    """Print validation after touching every file (every file re-hashed, none changed)."""
    newer = time.time_ns() - 1800 * 10**9
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name != MARKER:
                os.utime(os.path.join(dirpath, name), ns=(newer, newer))
    t0 = time.perf_counter()
    touched = validate_sources(root, loaded, threads=threads)
    touch_s = time.perf_counter() - t0
    assert touched.clean and len(touched.refreshed) == files, touched.counts()
    print(f"validate after touching every file: {touch_s * 1e3:7.1f} ms  (re-hash {files}, 0 changed)")


def main(argv: list[str] | None = None) -> int:
    """Generate (or reuse) the folder, print each cost, then the goal's verdict for wall and CPU time."""
    args = _parser().parse_args(argv)
    runs = max(5, args.runs)
    root = args.dir or Path(tempfile.gettempdir()) / f"streamcache-bench-validate-{args.n}"

    print(f"cpus usable: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()[0]:.2f} "
          "(wall times include waiting for a CPU on a busy machine; cpu times do not)")
    t0 = time.perf_counter()
    generate(root, args.n, args.dirs)
    gen_s = time.perf_counter() - t0
    print(f"folder: {root}  ({args.n} files in {args.dirs} folders; generated/reused in {gen_s:.1f} s)")

    rec_path = root.parent / f"{root.name}.sources.json"
    loaded, load_times, files = _record_costs(root, rec_path, args.threads, runs)
    val_times = _validate_costs(root, loaded, args.threads, runs, load_times, files)
    _touched_cost(root, loaded, args.threads, files)

    scale = files / 100_000
    wall_ok = statistics.median(val_times) < scale
    cpu_ok = statistics.median(CPU[id(val_times)]) < scale
    print(f"goal (< 1 s per 100k files): wall {'met' if wall_ok else 'NOT met'}, cpu {'met' if cpu_ok else 'NOT met'}"
          f"  (load average now {os.getloadavg()[0]:.2f})")
    if args.clean:
        shutil.rmtree(root, ignore_errors=True)
        rec_path.unlink(missing_ok=True)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
