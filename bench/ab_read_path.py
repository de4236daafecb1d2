"""A/B of the read path: the L3 and L4 figures of two source trees, measured alternately in one run.

Refactors of the reader and the loader must not make them slower; on a shared, noisy machine only figures taken
side by side say that. Each measurement runs in a fresh subprocess that loads ``dataset_cache`` from one tree
(registered from ``TREE/dataset_cache`` with importlib before anything imports it; the measuring code is this
package's, the same for both), the trees alternate run by run, and both read the same caches (written once, by
the newer tree).

    .venv/bin/python -m bench.ab_read_path --old /tmp/old-checkout --new . [--runs 5]    # from the pack root

Prints a Markdown table of medians (min-max) per figure and tree, and the new/old ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import PROFILES, Entries, evict, random_batches, read_ours, run_json_child, serial_reads, write_ours

L3_N, L3_BATCHES, L3_BATCH = 5000, 150, 4
L4_N, L4_BATCHES, L4_BATCH = 2000, 20, 32


def _use_library_of(tree: Path) -> None:
    """Make ``import dataset_cache`` load ``tree``'s library in this (fresh) process."""
    if "dataset_cache" in sys.modules:
        raise RuntimeError("dataset_cache was imported before the tree under test was chosen")
    folder = tree.resolve() / "dataset_cache"
    spec = importlib.util.spec_from_file_location("dataset_cache", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"{tree}: no dataset_cache package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules["dataset_cache"] = module
    spec.loader.exec_module(module)


def _child(kind: str, cache: Path, seed: int) -> dict[str, Any]:
    """One measurement with the ``dataset_cache`` registered by :func:`_use_library_of`."""
    import torch

    from dataset_cache.format import ReadBuffer, open_cache
    from dataset_cache.loader import PrefetchLoader
    from dataset_cache.sampler import BucketSampler

    torch.set_num_threads(1)
    prof = PROFILES["sd15"]
    if kind == "write":
        write_ours(cache / "l3", L3_N, Entries(prof))
        write_ours(cache / "l4", L4_N, Entries(prof))
        return {}
    if kind in ("l3_warm", "l3_cold"):
        plan = random_batches(L3_N, L3_BATCH, L3_BATCHES, seed)
        if kind == "l3_warm":
            read_ours(cache / "l3", plan)  # the page cache now holds these rows
        else:
            evict(cache / "l3")
        seconds = read_ours(cache / "l3", plan)
        return {"MB/s": L3_BATCHES * L3_BATCH * prof.sample_bytes / seconds / 1e6}
    root = cache / "l4"
    with open_cache(root) as reader:
        samples = reader.dataset("bench")
        sampler = BucketSampler(samples, [0] * len(samples), L4_BATCH, seed=seed)
        evict(root)
        serial = statistics.median(serial_reads(reader, sampler.plans(epochs=None), L4_BATCHES, ReadBuffer()))
        out: dict[str, Any] = {"serial read ms": serial * 1e3}
        for threads in (1, 2):
            for step in (0.0, serial):
                evict(root)
                with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=threads, epochs=None) as loader:
                    it = iter(loader)
                    next(it)
                    wait, t0 = 0.0, time.perf_counter()
                    for _ in range(L4_BATCHES):
                        if step:
                            time.sleep(step)
                        tw = time.perf_counter()
                        next(it)
                        wait += time.perf_counter() - tw
                    per = (time.perf_counter() - t0) / L4_BATCHES
                if step:
                    out[f"{threads} thread(s), sleep 1x: wait / serial read %"] = 100 * wait / L4_BATCHES / serial
                else:
                    out[f"{threads} thread(s), standalone ms per batch"] = per * 1e3
        return out


def _run_child(tree: Path, kind: str, cache: Path, seed: int) -> dict[str, Any]:
    try:
        return run_json_child("bench.ab_read_path", ["--child", str(tree.resolve()), kind, str(cache), str(seed)])
    except RuntimeError as exc:
        raise SystemExit(f"child {kind} in {tree} failed:\n{exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, help="the tree before the change")
    p.add_argument("--new", type=Path, help="the tree after the change")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tree, kind, cache, seed = args.child
        _use_library_of(Path(tree))
        print(json.dumps(_child(kind, Path(cache), int(seed))))
        return 0
    if args.old is None or args.new is None:
        p.error("--old and --new are required")
    trees = {"old": args.old, "new": args.new}
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="streamcache-ab-") as tmp:
        cache = Path(tmp)
        _run_child(args.new, "write", cache, 0)
        for r in range(args.runs):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for kind in ("l3_warm", "l3_cold", "l4"):
                for side in order:
                    for name, value in _run_child(trees[side], kind, cache, r).items():
                        label = f"L3 {kind[3:]}: {name}" if kind.startswith("l3") else f"L4 {name}"
                        results.setdefault((label, side), []).append(value)
            sys.stderr.write(f"[ab] run {r + 1}/{args.runs} done\n")
    labels = list(dict.fromkeys(label for label, _ in results))
    print(f"| figure ({args.runs} runs, alternating) | old | new | new / old |")
    print("|---|---:|---:|---:|")
    for label in labels:
        old, new = results[(label, "old")], results[(label, "new")]
        mo, mn = statistics.median(old), statistics.median(new)
        print(f"| {label} | {mo:.2f} ({min(old):.2f}–{max(old):.2f}) | {mn:.2f} ({min(new):.2f}–{max(new):.2f}) "
              f"| {mn / mo:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
