"""Benchmark: what an edit model's reference images cost when nothing changed, and per batch.

1. **Warm plan.** A folder of ``--n`` tiny 64×64 PNGs with captions, and a reference folder with an image of the
   same name for each, is planned once (both sources records written); then ``plan_encode`` of the unchanged
   folder is timed ``--runs`` times (median) without and with ``reference_folder``, interleaved, in one run.
2. **Batch assembly.** ``assemble_cpu`` of a batch of ``--rows`` rows of ``[C, h, w]`` fp16 latents (an SDXL or
   Flux latent at ``--side`` pixels) from values already read, without references and with one per row (each row's
   conditioning copied with the reference appended), median of ``--runs`` × 200 calls. Reads are excluded: a
   reference is one more entry of the batch's one read, as large as its latent.

Prints markdown tables.

    .venv/bin/python -m bench.bench_references                  # from the pack root
    .venv/bin/python -m bench.bench_references --n 10000 --rows 16 --side 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dataset_cache.batch_assembly import assemble_cpu, latent_rows
from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.sampler import BatchPlan

OLD = 1_600_000_000  # dated long before the scan: trusted by stat


def make_folders(root: Path, n: int) -> tuple[Path, Path]:
    """The dataset folder and its reference folder (an image of the same name for every image)."""
    from PIL import Image

    data, refs = root / "data", root / "refs"
    data.mkdir()
    refs.mkdir()
    for i in range(n):
        stem = f"img{i:06d}"
        Image.new("RGB", (64, 64), (i % 256, (i // 256) % 256, 7)).save(data / f"{stem}.png")
        (data / f"{stem}.txt").write_text(f"make it tag{i}, red, round", encoding="utf-8")
        Image.new("RGB", (64, 64), (7, i % 256, (i // 256) % 256)).save(refs / f"{stem}.png")
    for folder in (data, refs):
        for p in folder.iterdir():
            os.utime(p, (OLD, OLD))
    return data, refs


def warm_plans(data: Path, root: Path, settings: dict[str, EncodeSettings], runs: int) -> dict[str, list[float]]:
    """Seconds of each warm plan, the settings interleaved run by run (a shared machine's load hits both)."""
    def plan(name: str) -> Any:
        return plan_encode(data, root / f"cache-{name}", dataset="ds", settings=settings[name], vae_fingerprint="v",
                           text_fingerprint="t", threads=1)

    for name in settings:
        plan(name)  # the sources records
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(runs):
        for name in settings:
            start = time.perf_counter()
            plan(name)
            times[name].append(time.perf_counter() - start)
    return times


def batch_inputs(rows: int, shape: tuple[int, ...], references: bool) -> tuple[BatchPlan, dict[str, Any]]:
    """A batch's plan and read values: ``rows`` latents, a shared caption (T5-sized) and, with ``references``,
    one reference latent per row."""
    values: dict[str, Any] = {"cap": [[torch.zeros(1, 512, 4096, dtype=torch.bfloat16), {"guidance": 3.5}]]}
    for i in range(rows):
        values[f"l{i}"] = {"samples": torch.zeros(1, *shape, dtype=torch.float16)}
        if references:
            values[f"r{i}"] = {"samples": torch.zeros(1, *shape, dtype=torch.float16)}
    plan = BatchPlan(0, 0, tuple(range(rows)), tuple(f"l{i}" for i in range(rows)), ("cap",) * rows,
                     reference_keys=tuple(f"r{i}" for i in range(rows)) if references else ())
    return plan, values


def assembly_seconds(rows: int, shape: tuple[int, ...], runs: int) -> dict[str, list[float]]:
    """Seconds per ``assemble_cpu`` call (median of 200 per run), without and with references, interleaved."""
    cases = {name: batch_inputs(rows, shape, name == "with a reference per row")
             for name in ("no references", "with a reference per row")}
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (plan, values) in cases.items():
            lat = latent_rows(plan, values)
            start = time.perf_counter()
            for _ in range(200):
                assemble_cpu(plan, values, lat, {})
            out[name].append((time.perf_counter() - start) / 200)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000, help="images (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs, median shown (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=16, help="rows of the assembled batch (default: %(default)s)")
    ap.add_argument("--side", type=int, default=1024, help="pixels of a latent's side (default: %(default)s)")
    args = ap.parse_args(argv)
    base = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, refs = make_folders(root, args.n)
        times = warm_plans(data, root, {"without reference_folder": base,
                                        "with reference_folder": replace(base, reference_folder=str(refs))},
                           args.runs)
    print(f"| {args.n} images, unchanged folders | plan seconds, median (min–max) |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} ({min(t):.3f}–{max(t):.3f}) |")
    shape = (16, args.side // 8, args.side // 8)
    spent = assembly_seconds(args.rows, shape, args.runs)
    print(f"\n| assemble_cpu, {args.rows} rows of {list(shape)} fp16 | ms per batch, median (min–max) |\n|---|---|")
    for name, t in spent.items():
        print(f"| {name} | {statistics.median(t) * 1000:.3f} ({min(t) * 1000:.3f}–{max(t) * 1000:.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
