"""Benchmark: incremental encode bookkeeping, encoder calls after small edits, and validation of an unchanged folder.

For each size in ``--sizes`` a folder of tiny 64×64 PNGs (distinct pixels, one distinct caption each; decode is
cheap so bookkeeping shows) is generated, then:

1. **Build overhead.** ``plan_encode`` + ``run_encode`` into an empty cache with no-op encoders returning small
   fixed tensors, at the default settings (``run_encode``'s defaults, which the ComfyUI node uses: a checkpoint per
   batch on a background thread beside the encoder, the recovery log fsynced at most once a second), with
   ``sync_seconds=0`` (the log fsynced at every batch, so a power loss too loses only the batch in flight) and with
   ``background_commits=False`` (each batch checkpointed on the calling thread before the next encoder call);
   ``--build-runs`` builds each, median shown. Wall time is split into encoder calls, main-thread waits for
   decoding (decode runs on worker threads ahead of the encoder; its total CPU time is shown too) and bookkeeping
   (everything else the calling thread waits for: validation, hashing, scanning, keys, adding entries,
   checkpoints — or, in the background, waits for them —, shard writes, commits with fsync, dataset file,
   compaction). Since the
   encoders do nothing, the fraction of a real build spent outside the encoder is projected from the measured
   bookkeeping and an assumed encoder cost per image/caption (``--vae-ms``, ``--text-ms``; defaults are rough
   SD1.5-512 figures on a fast GPU: real VAEs at 1024² are slower, which lowers the fraction).
2. **Encoder calls after a 1% caption edit + 1% new images**, counted by a counting encoder, next to ComfyUI's
   built-in MakeTrainingDataset flow, which re-encodes every image and caption of the folder on every run.
   ``--sleep-encoder`` makes the encoders sleep the assumed cost instead (decode then overlaps the "encoder" as it
   does on a GPU, and the first share column is measured: bookkeeping over the build's wall time).
3. **Validation of an unchanged folder**: ``validate_sources`` alone and the whole ``plan_encode`` (validation,
   caption reading, keys, cache lookup), median of ``--runs``.

Prints markdown tables.

    .venv/bin/python -m bench.bench_incremental                       # from the pack root; 1k and 10k
    .venv/bin/python -m bench.bench_incremental --sizes 1000,10000,100000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode, sources_record_path
from dataset_cache.encode_run import run_encode
from dataset_cache.sources import validate_sources
from dataset_cache.sources_record import load_record

__all__ = ["NoopEncoders", "generate", "build", "edit", "main"]

MARKER = ".bench-incremental"
_LATENT = torch.zeros(1, 4, 8, 8)
_COND = torch.zeros(1, 4, 32)


class NoopEncoders:
    """Returns small fixed tensors; counts items. With ``sleep_ms`` (per image, per text) each call also sleeps
    that long, standing in for a GPU encoder: the calling thread waits without the GIL, as on a real GPU."""

    def __init__(self, sleep_ms: tuple[float, float] | None = None) -> None:
        self.images = 0
        self.texts = 0
        self.sleep_ms = sleep_ms

    def encode_images(self, batch: torch.Tensor) -> list[Any]:
        self.images += batch.shape[0]
        if self.sleep_ms:
            time.sleep(self.sleep_ms[0] * batch.shape[0] / 1000)
        return [{"samples": _LATENT} for _ in range(batch.shape[0])]

    def encode_texts(self, texts: list[str]) -> list[Any]:
        self.texts += len(texts)
        if self.sleep_ms:
            time.sleep(self.sleep_ms[1] * len(texts) / 1000)
        return [[[_COND, {"pooled_output": _COND[:, 0]}]] for _ in texts]


def _png(i: int, path: Path) -> None:
    img = Image.new("RGB", (64, 64), (i % 251, (i // 251) % 251, (i // 63001) % 251))
    img.putpixel((i % 64, (i // 64) % 64), (255, 255, 255))
    img.save(path, compress_level=1)


def generate(root: Path, n: int) -> None:
    """``n`` images in 100-image kohya folders, each with a one-line distinct caption, dated an hour ago."""
    if (root / MARKER).is_file() and (root / MARKER).read_text() == str(n):
        return
    shutil.rmtree(root, ignore_errors=True)
    old = time.time_ns() - 3600 * 10**9
    for i in range(n):
        d = root / f"{1 + (i // 100) % 3}_c{i // 100:05d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        _png(i, d / f"{i:07d}.png")
        (d / f"{i:07d}.txt").write_text(f"a photo of item {i}, tag{i % 37}\n")
        for p in (d / f"{i:07d}.png", d / f"{i:07d}.txt"):
            os.utime(p, ns=(old, old))
    (root / MARKER).write_text(str(n))


def build(folder: Path, cache: Path, settings: EncodeSettings, enc: NoopEncoders,
          options: dict[str, Any]) -> dict[str, float]:
    shutil.rmtree(cache, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.thread_time()
    plan = plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                       text_fingerprint="te")
    t_plan = time.perf_counter() - t0
    report = run_encode(plan, encode_images=enc.encode_images, encode_texts=enc.encode_texts, **options)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    t = report.timings
    b = {"wall": wall, "cpu": cpu, "plan": t_plan, "encoder": t["encoder"], "decode_wait": t["decode_wait"],
         "decode_cpu": t["decode_cpu"], "commit": t["commit"], "commit_wait": t.get("commit_wait", 0.0),
         "finish": t["finish"],
         "latents": report.encoded_latents, "texts": report.encoded_conditionings,
         "syncs": getattr(report, "log_syncs", 0), "shards": len(list((cache / "shards").glob("*.safetensors")))}
    b["book"] = b["wall"] - b["encoder"] - b["decode_wait"]
    return b


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "log fsync every batch": {"sync_seconds": 0.0},
    "commits on the calling thread": {"background_commits": False},
    "checkpoint every >= 1 s": {"min_commit_seconds": 1.0},  # not run by default; also runs on older versions
}
DEFAULT_CONFIGS = "default,log fsync every batch,commits on the calling thread"


def edit(folder: Path, n: int) -> tuple[int, int]:
    """Edit the caption of 1% of the images and add 1% new images; return (edited, added)."""
    k = max(1, n // 100)
    step = n // k
    for j in range(k):
        i = j * step
        cap = next(folder.glob(f"*_c{i // 100:05d}")) / f"{i:07d}.txt"
        cap.write_text(f"an edited caption {i}\n")
    d = folder / "1_new"
    d.mkdir(exist_ok=True)
    for j in range(k):
        _png(n + j, d / f"new{j:07d}.png")
        (d / f"new{j:07d}.txt").write_text(f"a new image {j}\n")
    (folder / MARKER).write_text("edited")  # regenerate next time
    return k, k


def median_time(fn: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


BuildRow = tuple[int, str, dict[str, float], float, list[float], list[float]]
"""(images, config, the median build's figures, its bookkeeping s, share per assumed encoder cost, each run's
bookkeeping s): one row of table 1."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000", help="comma-separated image counts (default: %(default)s)")
    ap.add_argument("--n", type=int, default=None, help="shortcut for one size, e.g. --n 100000")
    ap.add_argument("--batch-size", type=int, default=8, help="encoder batch (one commit each; default: 8)")
    ap.add_argument("--vae-ms", type=float, nargs="+", default=[5.0, 40.0],
                    help="assumed real VAE cost per image in ms, one projection each (default: 5 = SD1.5 at 512², "
                         "40 = SDXL at 1024², rough fast-GPU figures)")
    ap.add_argument("--text-ms", type=float, nargs="+", default=[1.0, 4.0],
                    help="assumed real text encoder cost per caption in ms, paired with --vae-ms")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="builds to run, comma-separated from: " + ", ".join(CONFIGS) + " (default: %(default)s)")
    ap.add_argument("--build-runs", type=int, default=1,
                    help="builds per size and config; the run of median bookkeeping is shown (default: 1)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of the unchanged-folder validation")
    ap.add_argument("--build-only", action="store_true", help="section 1 only (the folder is left unedited)")
    ap.add_argument("--sleep-encoder", action="store_true",
                    help="the build's encoders sleep the first --vae-ms / --text-ms per item (a GPU stand-in: decode "
                         "overlaps it as in a real run); the share is then measured, not projected")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: /tmp/bench-incremental, kept)")
    ap.add_argument("--clean", action="store_true", help="delete the work folder afterwards")
    return ap


def _build_rows(args: argparse.Namespace, n: int, folder: Path, cache: Path,
                settings: EncodeSettings) -> list[BuildRow]:
    """Section 1 at one size: every asked-for config built ``--build-runs`` times, the median run kept."""
    rows = []
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in sorted(configs, key=lambda c: c == "default"):  # the default build last: its cache is reused
        sleep = (args.vae_ms[0], args.text_ms[0]) if args.sleep_encoder else None
        runs = sorted((build(folder, cache, settings, NoopEncoders(sleep), CONFIGS[name])
                       for _ in range(max(1, args.build_runs))), key=lambda b: b["book"])
        b = runs[len(runs) // 2]
        book = b["book"]
        shares = [book / (book + n * (v + t) / 1000) for v, t in zip(args.vae_ms, args.text_ms)]
        if sleep:  # measured: bookkeeping over the whole build's wall time
            shares = [book / b["wall"]] + shares[1:]
        rows.append((n, name, b, book, shares, [r["book"] for r in runs]))
    return rows


def _unchanged_row(args: argparse.Namespace, n: int, folder: Path, cache: Path,
                   settings: EncodeSettings) -> tuple[int, float, float]:
    """Section 3 at one size: median seconds of ``validate_sources`` and of the whole ``plan_encode``."""
    record = sources_record_path(cache, "bench")
    t_validate = median_time(lambda: validate_sources(folder, load_record(record)), args.runs)
    t_plan = median_time(lambda: plan_encode(folder, cache, dataset="bench", settings=settings,
                                             vae_fingerprint="vae", text_fingerprint="te"), args.runs)
    return n, t_validate, t_plan


def _edit_row(n: int, folder: Path, cache: Path, settings: EncodeSettings) -> tuple[int, int, int, int, int, float]:
    """Section 2 at one size: edit the folder, re-encode, count what the encoders were given."""
    edited, added = edit(folder, n)
    enc2 = NoopEncoders()
    t0 = time.perf_counter()
    plan = plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                       text_fingerprint="te")
    run_encode(plan, encode_images=enc2.encode_images, encode_texts=enc2.encode_texts)
    return n, edited, added, enc2.images, enc2.texts, time.perf_counter() - t0


def _print_builds(args: argparse.Namespace, rows1: list[BuildRow]) -> None:
    """Table 1, the default settings' summary line per size, and the footnote on the projected share."""
    print(f"\n### 1. Build with no-op encoders (batch {args.batch_size}, median of {max(1, args.build_runs)})\n")
    print("| images | entries | settings | wall s | main-thread CPU s | plan s | encoder s | decode wait s "
          "| decode CPU s | add+checkpoint+commit s | waits for a checkpoint s | dataset+compact s | log fsyncs "
          "| shards | bookkeeping s "
          "| per entry µs | per image µs | "
          + " | ".join(f"share @{v:g}+{t:g} ms*" for v, t in zip(args.vae_ms, args.text_ms)) + " |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
          + "---:|" * len(args.vae_ms))
    for n, name, b, book, shares, books in rows1:
        entries = b["latents"] + b["texts"]
        print(f"| {n} | {entries} | {name} | {b['wall']:.2f} | {b['cpu']:.2f} | {b['plan']:.2f} | {b['encoder']:.3f} "
              f"| {b['decode_wait']:.2f} | {b['decode_cpu']:.2f} | {b['commit']:.2f} | {b['commit_wait']:.2f} "
              f"| {b['finish']:.2f} "
              f"| {b['syncs']} | {b['shards']} | {book:.2f} | {book / entries * 1e6:.0f} | {book / n * 1e6:.0f} | "
              + " | ".join(f"{x:.1%}" for x in shares) + " |")
        if len(books) > 1:
            print(f"|  |  | (bookkeeping of each run, s: {', '.join(f'{x:.2f}' for x in books)}) |"
                  + " |" * (13 + len(args.vae_ms)))
    for n, name, b, book, shares, _ in rows1:
        if name == "default":
            how = ["measured (encoders sleeping)" if args.sleep_encoder and i == 0 else "projected"
                   for i in range(len(shares))]
            print(f"\n**Default settings, {n} images: bookkeeping {book / n * 1e6:.0f} µs per image "
                  f"({book / (b['latents'] + b['texts']) * 1e6:.0f} µs per entry): "
                  + ", ".join(f"{x:.1%} of a build at {v:g}+{t:g} ms per image, {h}"
                              for x, v, t, h in zip(shares, args.vae_ms, args.text_ms, how)) + ".**")
    print("\n\\* projected share of a real build spent outside the encoders: bookkeeping / (bookkeeping + "
          "N × VAE ms + N × text encoder ms); "
          "decode runs ahead of the encoder on worker threads and is hidden when it is faster than the encoder. "
          "Main-thread CPU is the calling thread's own CPU time (the plan's hashing threads and the decode threads "
          "not included): on a shared machine it moves less than wall time.")


def _print_edits_and_unchanged(args: argparse.Namespace, rows2: list[tuple[int, int, int, int, int, float]],
                               rows3: list[tuple[int, float, float]]) -> None:
    """Tables 2 (encoder work after the edit, next to the built-in flow) and 3 (the unchanged folder)."""
    print("\n### 2. Encoder work after editing 1% of captions and adding 1% new images\n")
    print("| images | edited captions | new images | ours: latents | ours: conditionings | built-in: latents "
          "| built-in: conditionings | ours / built-in | ours wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, edited, added, lat, txt, wall in rows2:
        total = n + added
        print(f"| {n} | {edited} | {added} | {lat} | {txt} | {total} | {total} | {(lat + txt) / (2 * total):.2%} "
              f"| {wall:.2f} |")
    print(f"\n### 3. Unchanged folder (median of {args.runs} runs)\n")
    print("| images | files | validate_sources s | plan_encode s (validate + captions + keys + cache lookup) |")
    print("|---:|---:|---:|---:|")
    for n, tv, tp in rows3:
        print(f"| {n} | {2 * n} | {tv:.3f} | {tp:.3f} |")


def main(argv: list[str] | None = None) -> int:
    """Measure every size (builds, then unless ``--build-only`` the unchanged folder and the edit), then print."""
    args = _parser().parse_args(argv)
    sizes = [args.n] if args.n else [int(s) for s in args.sizes.split(",")]
    work = args.dir or Path(tempfile.gettempdir()) / "bench-incremental"
    settings = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=args.batch_size)
    rows1: list[BuildRow] = []
    rows2: list[tuple[int, int, int, int, int, float]] = []
    rows3: list[tuple[int, float, float]] = []
    try:
        for n in sizes:
            folder, cache = work / f"data-{n}", work / f"cache-{n}"
            t0 = time.perf_counter()
            generate(folder, n)
            print(f"[{n}] folder ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            rows1 += _build_rows(args, n, folder, cache, settings)
            if args.build_only:
                continue
            rows3.append(_unchanged_row(args, n, folder, cache, settings))
            rows2.append(_edit_row(n, folder, cache, settings))
    finally:
        if args.clean:
            shutil.rmtree(work, ignore_errors=True)
    _print_builds(args, rows1)
    if args.build_only:
        return 0
    _print_edits_and_unchanged(args, rows2, rows3)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
