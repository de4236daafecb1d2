"""Benchmark: what the encode-side variants (issue #16) cost when nothing changed, and what a mask costs to make.

1. **Warm plan.** A folder of ``--n`` tiny 64×64 PNGs with a six-tag caption each and a ``-masklabel`` file for
   every second image is planned once (sources record written), then ``plan_encode`` of the unchanged folder is
   timed ``--runs`` times (median) at the default settings and with every variant on (``shuffle_variants`` 4,
   ``keep_tokens`` 1, ``empty_caption``, ``flip`` random, ``masks`` masklabel). The defaults run on a copy of the
   folder without mask files (hard links), so both plan the same images.
2. **One mask against one image.** At a ``--side``² bucket: :func:`dataset_cache.imaging.load_mask` (decode, crop
   plan, area average to latent resolution) against :func:`dataset_cache.imaging.load_image` (decode, crop plan,
   float pixels for the VAE), median of ``--runs`` each, from PNG files in the page cache. A mask needs no VAE
   call at all, so this is all it costs.

Prints markdown tables.

    .venv/bin/python -m bench.bench_variants                    # from the pack root
    .venv/bin/python -m bench.bench_variants --n 10000 --side 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_jobs import EncodePlan
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.imaging import load_image, load_mask

OLD = 1_600_000_000  # dated long before the scan: trusted by stat


def make_folder(root: Path, n: int) -> tuple[Path, Path]:
    """The folder with masks and a copy of it without (hard links)."""
    from PIL import Image

    full, bare = root / "masked", root / "bare"
    full.mkdir()
    bare.mkdir()
    for i in range(n):
        stem = f"img{i:06d}"
        Image.new("RGB", (64, 64), (i % 256, (i // 256) % 256, 7)).save(full / f"{stem}.png")
        (full / f"{stem}.txt").write_text(f"tag{i}, red, round, shiny, big, small", encoding="utf-8")
        if i % 2 == 0:
            Image.new("L", (64, 64), i % 251).save(full / f"{stem}-masklabel.png")
    for p in full.iterdir():
        os.utime(p, (OLD, OLD))
        if not p.stem.endswith("-masklabel"):
            os.link(p, bare / p.name)
    return full, bare


def warm_plan(folder: Path, cache: Path, settings: EncodeSettings, runs: int) -> tuple[float, int, int]:
    """Median seconds of planning the unchanged folder; texts and latents the dataset names."""

    def plan() -> EncodePlan:
        return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae",
                           text_fingerprint="te", threads=1)

    plan()  # the sources record
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = plan()
        times.append(time.perf_counter() - start)
    texts = len({k for s in done.samples for k in s.captions})
    latents = len({k for s in done.samples for k in (s.latent, s.mirror) if k})
    return statistics.median(times), texts, latents


def one_mask(root: Path, side: int, runs: int) -> tuple[float, float]:
    import numpy as np
    from PIL import Image

    gen = np.random.default_rng(0)
    image, mask = root / "big.png", root / "big-masklabel.png"
    Image.fromarray(gen.integers(0, 256, (side + side // 4, side, 3), dtype=np.uint8), "RGB").save(image)
    Image.fromarray(gen.integers(0, 256, (side + side // 4, side), dtype=np.uint8), "L").save(mask)
    plan = BucketConfig(resolution=side, step=64, min_side=side // 2).plan(side, side + side // 4)
    out = []
    for fn in (lambda: load_mask(mask, "masklabel", plan, 8), lambda: load_image(image, plan)):
        fn()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000, help="images (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs, median shown (default: %(default)s)")
    ap.add_argument("--side", type=int, default=1024, help="bucket side of the one-mask test (default: %(default)s)")
    args = ap.parse_args()
    base = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32))
    every = replace(base, bucket=replace(base.bucket, flip="random"), shuffle_variants=4, keep_tokens=1,
                    empty_caption=True, masks="masklabel", mask_factor=8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full, bare = make_folder(root, args.n)
        rows = [("defaults (no mask files)", *warm_plan(bare, root / "c1", base, args.runs)),
                ("every variant on", *warm_plan(full, root / "c2", every, args.runs))]
        print(f"| {args.n} images, unchanged folder | plan seconds | caption texts | latents |\n|---|---|---|---|")
        for name, sec, texts, latents in rows:
            print(f"| {name} | {sec:.3f} | {texts} | {latents} |")
        mask_s, image_s = one_mask(root, args.side, args.runs)
        print(f"\n| {args.side}-side bucket | ms |\n|---|---|")
        print(f"| load_mask (to latent resolution, factor 8) | {mask_s * 1000:.1f} |")
        print(f"| load_image (pixels for the VAE) | {image_s * 1000:.1f} |")


if __name__ == "__main__":
    main()
