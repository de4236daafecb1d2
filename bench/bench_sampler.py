"""Benchmark: what training-time variety (#16) costs the sampler and the loader's batch assembly.

* Sampler: building one epoch's plan (``sampler_epoch.build_epoch``, once per epoch) and ``plan()`` per batch for
  ``--n`` samples (repeats 1-3, 5 buckets, batch 4, tail "wrap"): every setting off; mirrors + masks + caption
  dropout 0.1; the same plus a regularization set of ``n / 5`` samples at ratio 1.
* Loader: assembling a CPU batch of ``--batch`` 128×128 latents (SDXL 1024², float16) from an in-memory read,
  without masks and with a ``uint8`` mask per row (half of them mirrored), reads excluded.

Median (min-max) of ``--runs`` (>= 5, default 15) runs; the machine is shared, so the medians are what to read.

    .venv/bin/python -m bench.bench_sampler              # from the pack root
    .venv/bin/python -m bench.bench_sampler --n 1000000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dataset_cache.dataset import Sample
from dataset_cache.batch_assembly import assemble_cpu, latent_rows
from dataset_cache.dataset_mix import Regularization
from dataset_cache.sampler import BatchPlan, BucketSampler
from dataset_cache.sampler_epoch import build_epoch


def _timed(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _fmt(ts: list[float], unit: float, suffix: str) -> str:
    return f"{statistics.median(ts) * unit:.1f} ({min(ts) * unit:.1f}-{max(ts) * unit:.1f}) {suffix}"


def sampler_rows(n: int, runs: int) -> list[tuple[str, str, str, int]]:
    """(setting, epoch build, plan() per batch, occurrences per epoch) for each configuration."""
    plain = [Sample(f"l{i}", (f"c{i}a", f"c{i}b"), repeats=1 + i % 3) for i in range(n)]
    rich = [Sample(f"l{i}", (f"c{i}a", f"c{i}b"), repeats=1 + i % 3, mirror=f"m{i}", mask=f"k{i}",
                   empty_caption="e") for i in range(n)]
    buckets = [(4, 8 * (1 + i % 5), 8) for i in range(n)]
    reg = Regularization(rich[: n // 5], buckets[: n // 5], ratio=1.0, weight=0.5)
    rows = []
    for name, sampler in (
        ("every setting off", BucketSampler(plain, buckets, 4, 1, tail="wrap")),
        ("mirrors + masks + dropout 0.1", BucketSampler(rich, buckets, 4, 1, tail="wrap", caption_dropout=0.1)),
        ("... + regularization, ratio 1", BucketSampler(rich, buckets, 4, 1, tail="wrap", caption_dropout=0.1,
                                                        reg=reg)),
    ):
        epochs = iter(range(10**6))  # a new epoch each run: nothing cached
        build = _timed(lambda: build_epoch(sampler._layout, sampler.seed, next(epochs)), runs)
        sampler.epoch_plans(0)  # built once; plan() alone from here
        per = min(len(sampler), 2000)
        plan = _timed(lambda: [sampler.plan(0, i) for i in range(per)], runs)
        rows.append((name, _fmt(build, 1e3, "ms"), _fmt([t / per for t in plan], 1e6, "µs"),
                     sum(sampler.buckets.values())))
    return rows


def assembly_rows(batch: int, runs: int) -> list[tuple[str, str]]:
    """(masks, assembly time per batch) for a CPU batch of ``batch`` rows."""
    values: dict[str, Any] = {}
    for i in range(batch):
        values[f"l{i}"] = {"samples": torch.randn(1, 4, 128, 128).half()}
        values[f"k{i}"] = {"mask": torch.randint(0, 256, (1, 1, 128, 128), dtype=torch.uint8)}
        values[f"c{i}"] = [[torch.randn(1, 77, 2048).half(), {"pooled_output": torch.randn(1, 1280).half()}]]
    out = []
    for masked in (False, True):
        plan = BatchPlan(0, 0, tuple(range(batch)), tuple(f"l{i}" for i in range(batch)),
                         tuple(f"c{i}" for i in range(batch)), mirrored=tuple(i % 2 == 0 for i in range(batch)),
                         mask_keys=tuple(f"k{i}" for i in range(batch)) if masked else ())
        ts = _timed(lambda: assemble_cpu(plan, values, latent_rows(plan, values), {}), runs)
        out.append(("with masks (half mirrored)" if masked else "no masks", _fmt(ts, 1e3, "ms")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="main samples")
    ap.add_argument("--batch", type=int, default=16, help="rows of the assembled batch")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    runs = max(5, args.runs)
    print(f"sampler, {args.n} samples, batch 4, tail wrap; median (min-max) of {runs}")
    print("| setting | epoch build | plan() per batch | occurrences/epoch |\n|---|---|---|---|")
    for name, build, plan, occ in sampler_rows(args.n, runs):
        print(f"| {name} | {build} | {plan} | {occ} |")
    print(f"\nloader batch assembly (CPU, {args.batch} × [4, 128, 128] fp16, reads excluded)")
    print("| masks | assembly per batch |\n|---|---|")
    for name, t in assembly_rows(args.batch, runs):
        print(f"| {name} | {t} |")


if __name__ == "__main__":
    main()
