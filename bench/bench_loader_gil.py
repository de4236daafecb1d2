"""A/B of the loader's per-batch cost to the training thread: Python work on the workers, and the step it slows.

A training thread on a GPU launches thousands of small kernels a step; each launch releases and re-takes the GIL,
so every stretch of Python a loader worker runs meanwhile delays it. Per realistic batch (SDXL batch 4: latents
``[4, 4, 128, 128]`` fp32 + conditioning ``[1, 77, 2048]`` and pooled ``[1, 1280]``; Flux batch 2: ``[2, 16, 128,
128]`` + T5 ``[1, 512, 4096]`` + pooled ``[1, 768]`` + guidance), read through the real ``CacheReader`` (page cache
warm), each tree measures in a fresh process:

* **Python calls / batch** on the worker thread, and in ``next(loader)`` on the training thread (``setprofile``:
  Python and C calls made by Python; a count, the same on every machine): the Python work a batch costs.
* **worker CPU µs / batch**: the loader thread's CPU time (``/proc/self/task/<tid>/schedstat``), GIL-held Python and
  GIL-free reads and copies together.
* **step overhead µs**: the consumer runs a launch-like step (``--ops`` tiny in-place torch ops, each releasing the
  GIL as a kernel launch does) per batch; the mean step with the loader minus the mean step over the same batches
  already in memory (the in-memory bound), in one process.
* with ``--py-spy PATH``: **GIL-held ms / batch** of the loader thread, sampled by ``py-spy record --gil``.

``--device cuda`` measures the CUDA target instead (pinned buffers, side-stream copies) where a GPU is.
Trees alternate run by run (``bench.ab_read_path`` registers each tree's ``dataset_cache``); medians (min-max).

    .venv/bin/python -m bench.bench_loader_gil --old /tmp/old-checkout --new . [--runs 5] [--py-spy PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ab_read_path import _use_library_of
from .common import PACK_ROOT, run_json_child

__all__ = ["main", "child", "write_caches", "WORKLOADS"]

WORKLOADS: dict[str, dict[str, Any]] = {
    "SDXL b4": {"batch": 4, "latent": (1, 4, 128, 128), "cond": (1, 77, 2048), "pooled": (1, 1280),
                "guidance": False},
    "Flux b2": {"batch": 2, "latent": (1, 16, 128, 128), "cond": (1, 512, 4096), "pooled": (1, 768),
                "guidance": True},
}
SAMPLES = 48


def write_caches(root: Path) -> None:
    """One real cache per workload (the format is the same for both trees)."""
    import torch

    from dataset_cache.format import CacheWriter

    g = torch.Generator().manual_seed(0)
    for name, w in WORKLOADS.items():
        with CacheWriter(root / name.replace(" ", "_")) as writer:
            for i in range(SAMPLES):
                writer.add(f"l{i}", {"samples": torch.randn(w["latent"], generator=g)}, kind="latent")
                extra: dict[str, Any] = {"pooled_output": torch.randn(w["pooled"], generator=g).half()}
                if w["guidance"]:
                    extra["guidance"] = 3.5
                writer.add(f"c{i}", [[torch.randn(w["cond"], generator=g).half(), extra]], kind="conditioning")


def _thread_cpu_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0])


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dataset_cache-loader")]


def child(cache: Path, workload: str, batches: int, ops: int, device: str, count_calls: bool) -> dict[str, float]:
    """One measurement in this process, with the ``dataset_cache`` registered by ``_use_library_of``."""
    import torch

    from dataset_cache.dataset import Sample
    from dataset_cache.format import open_cache
    from dataset_cache.loader import PrefetchLoader
    from dataset_cache.sampler import BucketSampler

    torch.set_num_threads(1)
    w = WORKLOADS[workload]
    reader = open_cache(cache / workload.replace(" ", "_"))
    samples = [Sample(f"l{i}", (f"c{i}",)) for i in range(SAMPLES)]
    x = torch.zeros(1, device=device)

    def step() -> None:  # a launch-bound training step: each op releases and re-takes the GIL
        for _ in range(ops):
            x.add_(1)

    def loader(**kw: Any) -> Any:
        return PrefetchLoader(reader, BucketSampler(samples, [0] * SAMPLES, w["batch"], seed=0), epochs=None,
                              device=device, prefetch_batches=2, threads=1, **kw)

    if count_calls:
        return _count_calls(loader, batches)
    return _time_steps(loader, step, batches, device)


def _count_calls(loader: Callable[[], Any], batches: int) -> dict[str, float]:
    """Python calls per batch on the loader's worker thread and inside ``next()`` on the training thread."""
    out: dict[str, float] = {}
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    mine = [0]

    def profile_mine(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            mine[0] += 1

    threading.setprofile(profile)  # threads started from now on: the loader's worker
    with loader() as ld:
        it = iter(ld)
        for _ in range(5):
            next(it)
        start = calls[0]
        n = batches // 4
        for _ in range(n):
            sys.setprofile(profile_mine)  # the training thread: only inside next()
            batch = next(it)
            sys.setprofile(None)
            del batch
        out["worker Python calls / batch"] = (calls[0] - start) / n
        out["training-thread Python calls / next()"] = mine[0] / n
    threading.setprofile(None)
    return out


def _time_steps(loader: Callable[[], Any], step: Callable[[], None], batches: int, device: str) -> dict[str, float]:
    """The worker's CPU time per batch, and the step with the loader vs over batches already in memory."""
    import torch

    out: dict[str, float] = {}
    with loader() as ld:
        it = iter(ld)
        kept = [next(it) for _ in range(8)]  # the in-memory bound steps over these
        if device == "cuda":
            torch.cuda.synchronize()
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for i in range(batches):
            _ = kept[i % len(kept)]
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        bound = (time.perf_counter() - t0) / batches
        (worker,) = _loader_threads()
        cpu0 = _thread_cpu_ns(worker.native_id)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for _ in range(batches):
            batch = next(it)
            step()
            del batch
        if device == "cuda":
            torch.cuda.synchronize()
        ours = (time.perf_counter() - t0) / batches
        cpu = _thread_cpu_ns(worker.native_id) - cpu0  # type: ignore[arg-type]
    out["worker CPU µs / batch"] = cpu / 1e3 / batches
    out["bound step µs"] = bound * 1e6
    out["step overhead µs"] = (ours - bound) * 1e6
    return out


def _py_spy(py_spy: str, tree: Path, cache: Path, workload: str, batches: int, ops: int, device: str) -> float:
    """GIL-held ms per batch of the loader thread, from ``py-spy record --gil --threads`` of a child run."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        rate = 1000
        cmd = [py_spy, "record", "--gil", "--threads", "--nonblocking", "--format", "raw", "--rate", str(rate),
               "-o", str(raw), "--", sys.executable, "-m", "bench.bench_loader_gil", "--child", str(tree), str(cache),
               workload, str(batches), str(ops), device, "0"]
        subprocess.run(cmd, cwd=str(PACK_ROOT), capture_output=True, check=True)
        samples = 0
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if "dataset_cache-loader" in stack.split(";")[0]:
                samples += int(n)
    # the child draws 8 + `batches` batches from the loader (plus up to 2 read ahead)
    return samples / rate * 1e3 / (batches + 10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=False, help="the tree before the change")
    p.add_argument("--new", type=Path, default=Path("."), help="the tree after the change (default: this one)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--ops", type=int, default=2000, help="tiny torch ops per consumer step")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--py-spy", dest="py_spy", help="py-spy executable: also sample the loader thread's GIL time")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tree, cache, workload, batches, ops, device, count = args.child
        _use_library_of(Path(tree))
        print(json.dumps(child(Path(cache), workload, int(batches), int(ops), device, count == "1")))
        return 0
    if args.old is None:
        p.error("--old is required")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    results = _measure(trees, args)
    print(f"{args.runs} runs, alternating; {args.batches} batches, {args.ops} ops a step, device {args.device}, "
          f"{os.cpu_count()} CPUs\n")
    _print_table(results)
    return 0


def _measure(trees: dict[str, Path], args: argparse.Namespace) -> dict[tuple[str, str, str], list[float]]:
    """Every figure, (workload, figure, "old" / "new") → one value per run; the trees alternate run by run."""
    results: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="streamcache-gil-") as tmp:
        cache = Path(tmp)
        _use_library_of(trees["new"])
        write_caches(cache)
        for r in range(args.runs):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for workload in WORKLOADS:
                for side in order:
                    for count in ("0", "1"):
                        got = run_json_child("bench.bench_loader_gil", [
                            "--child", str(trees[side]), str(cache), workload, str(args.batches), str(args.ops),
                            args.device, count])
                        for name, value in got.items():
                            results.setdefault((workload, name, side), []).append(value)
                    if args.py_spy:
                        ms = _py_spy(args.py_spy, trees[side], cache, workload, args.batches, args.ops, args.device)
                        results.setdefault((workload, "GIL-held ms / batch (py-spy)", side), []).append(ms)
            sys.stderr.write(f"[gil] run {r + 1}/{args.runs} done\n")
    return results


def _print_table(results: dict[tuple[str, str, str], list[float]]) -> None:
    """One row per (workload, figure): old and new as median (min–max), and new / old."""
    print("| workload | figure | old | new | new / old |\n|---|---|---:|---:|---:|")
    for workload, name in dict.fromkeys((w, n) for w, n, _ in results):
        old, new = results[(workload, name, "old")], results[(workload, name, "new")]
        mo, mn = statistics.median(old), statistics.median(new)
        ratio = f"{mn / mo:.2f}" if mo else "—"
        print(f"| {workload} | {name} | {mo:.1f} ({min(old):.1f}–{max(old):.1f}) | {mn:.1f} ({min(new):.1f}–"
              f"{max(new):.1f}) | {ratio} |")

if __name__ == "__main__":
    raise SystemExit(main())
