"""``python -m dataset_cache bench``: library benchmarks (no ComfyUI), written into ``docs/BENCHMARKS.md``.

Everything is measured side by side in one run on synthetic datasets that the bench writes itself:

* **SD1.5 profile**: latent ``{"samples": 1x4x64x64 fp16}``, conditioning ``[[1x77x768 fp16,
  {"pooled_output": 1x768 fp16}]]`` (~150 KB a sample).
* **Flux profile**: latent ``1x16x128x128 bf16``, conditioning ``[[1x512x4096 bf16, {"pooled_output": 1x768
  bf16}]]`` (~4.5 MB a sample).

Tables (numbers match docs/BENCHMARKS.md and the issue):

1. **Open a dataset**: ``open_cache`` + the dataset's sample list vs the lazy-branch design (pickled skeleton per
   shard + safetensors header, as in KohakuBlueleaf/ComfyUI@streamabledataset; same as :mod:`bench.bench_format`),
   wall time and RSS, each run in a fresh subprocess, page cache warm and dropped (``posix_fadvise DONTNEED``).
   ComfyUI's built-in ``LoadTrainingDataset`` is measured by ``scripts/bench-comfy`` (needs ComfyUI).
3. **Batch read throughput**: random batches read by ``CacheReader.read`` (checksums verified) vs per-tensor
   ``safe_open().get_tensor()`` on the lazy-branch files (one cached handle per shard, as the lazy branch does)
   vs raw sequential ``readinto`` of the same number of bytes of our shard files (the limit), warm and cold.
4. **Prefetch overlap**: data-wait fraction of the consumer's wall time with ``PrefetchLoader`` prefetch off / 1 / 2
   over the real reader, for simulated steps of 0.5x, 1x and 2x the measured batch read time, the step being a
   GIL-releasing torch matmul loop or a sleep.
5. **Incremental encode** (:mod:`bench.bench_incremental`'s generator) and validation of an unchanged folder
   of 1k/10k/100k files (:mod:`bench.bench_validate`'s generator).
6. **Scaling**: open time and RSS vs N, stated as flat/linear, with ``docs/bench_open_library.png``.

Every timing is the median of ``--runs`` (>= 5) runs, shown as ``median (min-max)``.

:func:`measure` runs everything and returns a :class:`LibraryRun` (plain figures); :func:`render` turns it into
the Markdown section and :func:`plot_panels` into the chart; :func:`main` is the command. ``python -m dataset_cache
bench`` hands its arguments to :func:`main` (run from the pack root, where this package is importable);
``python -m bench.library --child-open`` is the fresh interpreter of one L1 open.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import (
    DOC, MIB, PACK_ROOT, PROFILES, Entries, LazyReader, Machine, evict, keys_of, machine_info, med, random_batches,
    read_ours, rss_mib, run_json_child, serial_reads, write_lazy, write_ours,
)
from .report import growth, line_plot, machine_lines, stat, update_doc

__all__ = ["main", "add_arguments", "measure", "render", "plot_panels", "LibraryRun"]

PROG = "python -m dataset_cache bench"


# ------------------------------------------------------------------------------------------------ figures
@dataclass
class WriteFigure:
    """Seconds to write one synthetic dataset in each layout."""

    profile: str
    n: int
    gb: float
    ours_s: float
    lazy_s: float


@dataclass
class OpenFigure:
    """L1: per-run open seconds and RSS growth (MiB) of ours and the lazy design, page cache warm or dropped."""

    profile: str
    n: int
    cold: bool
    ours: dict[str, list[float]]
    lazy: dict[str, list[float]]


@dataclass
class ReadFigure:
    """L3: MB/s of tensor payload per run for each way of reading the same random batches."""

    profile: str
    n: int
    cold: bool
    batch: int
    ours: list[float]
    floor: list[float]
    floor_xxh3: list[float]
    safe_open: list[float]
    raw: list[float]


@dataclass
class PrefetchRow:
    """L4: one loader setting under one simulated step (``kind == "none"``: the loader alone, no step)."""

    kind: str
    factor: float
    step_s: float
    depth: int
    threads: int
    hints: bool
    per_batch_s: list[float]
    wait_s: list[float]
    standalone_s: float


@dataclass
class PrefetchFigures:
    """L4: the cache it ran over, the serial read time (the reference of the wait goal) and the rows."""

    samples: int
    batch: int
    batches: int
    serial_read_s: float
    rows: list[PrefetchRow]


@dataclass
class IncrementalFigures:
    """L5: encoder inputs after a 1% edit of a folder of ``n`` images, and the re-planning times."""

    n: int
    build_wall: float
    build_images: int
    build_texts: int
    edited: int
    added: int
    images: int
    texts: int
    wall: float
    validate: list[float]
    plan: list[float]


@dataclass
class ValidationFigure:
    """L5: wall and CPU seconds per run to validate an unchanged folder of ``files`` files."""

    files: int
    wall: list[float]
    cpu: list[float]


@dataclass
class LibraryRun:
    """Everything one run measured, plus what the report says about the run itself."""

    mode: str
    runs: int
    sd15: list[int]
    flux: list[int]
    machine: Machine
    writes: list[WriteFigure] = field(default_factory=list)
    opens: list[OpenFigure] = field(default_factory=list)
    reads: list[ReadFigure] = field(default_factory=list)
    prefetch: PrefetchFigures | None = None
    incremental: IncrementalFigures | str | None = None  # str: why it was not measured
    validation: list[ValidationFigure] = field(default_factory=list)
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ 1. open
def _child_open(kind: str, root: str) -> dict[str, Any]:
    """Runs in a fresh interpreter: open, return time and RSS."""
    import torch  # noqa: F401  (imported before the baseline RSS: both designs need it)

    from dataset_cache.format.reader import open_cache

    gc.collect()
    r0, _ = rss_mib()
    t = time.perf_counter()
    if kind == "ours":
        reader = open_cache(root)
        samples = reader.dataset("bench")
        n = len(samples)
    else:
        reader = LazyReader(Path(root))
        n = len(reader)
    dt = time.perf_counter() - t
    gc.collect()
    r1, peak = rss_mib()
    return {"open_s": dt, "rss_mib": r1, "growth_mib": r1 - r0, "peak_mib": peak, "samples": n}


def measure_open(kind: str, root: Path, runs: int, cold: bool) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {"open_s": [], "growth_mib": [], "rss_mib": []}
    for _ in range(runs):
        if cold:
            evict(root)
        r = run_json_child("bench.library", ["--child-open", kind, str(root)])
        for k in res:
            res[k].append(r[k])
    return res


# ------------------------------------------------------------------------------------------------ 3. reads
def read_floor(root: Path, plan: list[list[int]], checksums: bool = False) -> float:
    """The same rows as :func:`read_ours` with nothing but the positional reads: one ``preadv`` per row into one
    buffer, files already open, every offset computed before the clock starts (no parsing, planning, checksums or
    tensor views). What a reader of this layout could reach with zero Python work per batch; with ``checksums``,
    plus one xxh3-64 per row (the verification ours does)."""
    import xxhash

    from dataset_cache.format import open_cache

    with open_cache(root, verify=False) as r:
        shards = r.shards
        index = {k: (s, i) for s, sh in enumerate(shards) for i, k in enumerate(sh.keys)}
        fds = {s: os.open(str(sh.path), os.O_RDONLY) for s, sh in enumerate(shards)}
        try:
            batches, size = [], 0
            for b in plan:
                ops, at = [], 0
                for key in (k for i in b for k in keys_of(i)):
                    s, i = index[key]
                    for c, row in shards[s].parse(i)[1]:
                        col = shards[s].columns[c]
                        ops.append((fds[s], at, col.row_nbytes, col.offset + row * col.row_nbytes))
                        at += col.row_nbytes
                batches.append(sorted(ops, key=lambda o: (o[0], o[3])))
                size = max(size, at)
            mv = memoryview(bytearray(size))
            digest = xxhash.xxh3_64_intdigest
            t = time.perf_counter()
            for ops in batches:
                for fd, at, n, offset in ops:
                    os.preadv(fd, [mv[at:at + n]], offset)
                    if checksums:
                        digest(mv[at:at + n])
            return time.perf_counter() - t
        finally:
            for fd in fds.values():
                os.close(fd)


def read_lazy(root: Path, plan: list[list[int]]) -> float:
    r = LazyReader(root)
    t = time.perf_counter()
    for b in plan:
        for i in b:
            r.realize(i)
    return time.perf_counter() - t


def read_raw(root: Path, nbytes: int) -> float:
    """Sequential readinto of ``nbytes`` of our shard files, 8 MiB at a time (no parsing, no checksum)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > MIB)
    buf = bytearray(8 * MIB)
    mv = memoryview(buf)
    left = nbytes
    t = time.perf_counter()
    while left > 0:
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while left > 0:
                    k = f.readinto(mv[: min(len(mv), left)])
                    if not k:
                        break
                    left -= k
            if left <= 0:
                break
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------------------ 4. prefetch
def _calibrate_matmul(target_s: float) -> Callable[[], None]:
    """A torch matmul loop (releases the GIL) that takes about ``target_s`` on one thread."""
    import torch

    a = torch.randn(128, 128)
    b = torch.randn(128, 128)

    def once(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)

    once(20)
    t = time.perf_counter()
    once(200)
    per = (time.perf_counter() - t) / 200
    k = max(1, round(target_s / per))
    return lambda: once(k)


LOADER_CONFIGS = ((0, 0, False), (2, 1, True), (2, 1, False), (2, 2, True))
"""(prefetch batches, loader threads, read hints); (0, 0, _): reads inside next(); hints off: the A/B of the
worker announcing the next batch's read plan (``CacheReader.announce``)."""


class _WithoutHints:
    """The reader as a plain ``BatchReader`` (no ``plan``/``announce``): what the loader does with a reader that
    cannot announce a batch ahead."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def read(self, keys: Any, **kwargs: Any) -> Any:
        return self._reader.read(keys, **kwargs)


def prefetch_bench(root: Path, runs: int, batches: int, batch_size: int) -> PrefetchFigures:
    """Issue #5's two overlap figures for a few loader settings, page cache dropped before every run.

    * serial read time: one thread reads a batch (``CacheReader.read`` + ``torch.cat`` of the latents), no loader;
    * standalone loader rate: the loader iterated with no step (its own best throughput in that setting);
    * with a simulated step of 0.5×/1×/2× the serial read time: the consumer's wait in ``next()`` per batch
      (goal at ≥ 1×: < 5% of the serial read time) and its throughput against the standalone rate of the same
      setting (goal at 0.5×, reads slower than steps: ≥ 90%).

    ``kind`` ``"none"`` rows are the standalone runs.
    """
    import torch

    from dataset_cache.format import ReadBuffer, open_cache
    from dataset_cache.loader import PrefetchLoader
    from dataset_cache.sampler import BucketSampler

    torch.set_num_threads(1)  # the step uses one core
    rows: list[PrefetchRow] = []
    with open_cache(root) as reader:
        samples = reader.dataset("bench")
        sampler = BucketSampler(samples, [0] * len(samples), batch_size, seed=0)
        buf = ReadBuffer()
        reads = []
        for _ in range(runs):
            evict(root)
            reads += serial_reads(reader, sampler.plans(epochs=None), batches, buf)
        read_s = med(reads)

        def measure(depth: int, threads: int, hints: bool,
                    step: Callable[[], None] | None) -> tuple[list[float], list[float]]:
            per, waits = [], []
            for _ in range(runs):
                evict(root)
                with PrefetchLoader(reader if hints else _WithoutHints(reader), sampler, prefetch_batches=depth,
                                    threads=threads or None, epochs=None) as loader:
                    it = iter(loader)
                    next(it)  # the first batch is never hidden: leave it out of the steady figure
                    wait = 0.0
                    t0 = time.perf_counter()
                    for _ in range(batches):
                        if step is not None:
                            step()
                        tw = time.perf_counter()
                        next(it)
                        wait += time.perf_counter() - tw
                    per.append((time.perf_counter() - t0) / batches)
                    waits.append(wait / batches)
            return per, waits

        def make_step(kind: str, step_s: float) -> Callable[[], None]:
            return _calibrate_matmul(step_s) if kind == "matmul" else (lambda: time.sleep(step_s))

        for depth, threads, hints in LOADER_CONFIGS:
            alone, _ = measure(depth, threads, hints, None)
            rows.append(PrefetchRow("none", 0.0, 0.0, depth, threads, hints, alone, [0.0] * len(alone),
                                    med(alone)))
            for kind in ("matmul", "sleep"):
                for factor in (0.5, 1.0, 2.0):
                    # Reads slower than steps: half the loader's own standalone time in this setting (a loader
                    # faster than the serial read would otherwise face a step as long as its reads). Steps at
                    # least as long as a read: multiples of the serial read.
                    step_s = factor * (med(alone) if factor < 1 else read_s)
                    per, waits = measure(depth, threads, hints, make_step(kind, step_s))
                    rows.append(PrefetchRow(kind, factor, step_s, depth, threads, hints, per, waits, med(alone)))
    return PrefetchFigures(len(samples), batch_size, batches, read_s, rows)


# ------------------------------------------------------------------------------------------------ 5. incremental
def incremental_bench(work: Path, n: int, runs: int) -> IncrementalFigures | str:
    """Encoder inputs after a 1% edit of a folder of ``n`` images (no-op counting encoders), and how long
    re-planning the unchanged folder takes; a string saying why when it fails (the other tables still run)."""
    try:
        from dataset_cache.buckets import BucketConfig
        from dataset_cache.encode_jobs import EncodeSettings
        from dataset_cache.encode_plan import plan_encode, sources_record_path
        from dataset_cache.encode_run import run_encode
        from dataset_cache.sources import validate_sources
        from dataset_cache.sources_record import load_record

        from . import bench_incremental as mod  # here, not at the top: the L1 child must not import it

        folder, cache = work / f"inc-data-{n}", work / f"inc-cache-{n}"
        mod.generate(folder, n)
        settings = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=8)
        enc = mod.NoopEncoders()
        b = mod.build(folder, cache, settings, enc, {})  # the defaults run_encode has
        record = sources_record_path(cache, "bench")
        vt, pt = [], []
        for _ in range(runs):
            t = time.perf_counter()
            validate_sources(folder, load_record(record))
            vt.append(time.perf_counter() - t)
            t = time.perf_counter()
            plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                        text_fingerprint="te")
            pt.append(time.perf_counter() - t)
        edited, added = mod.edit(folder, n)
        enc2 = mod.NoopEncoders()
        t = time.perf_counter()
        plan = plan_encode(folder, cache, dataset="bench", settings=settings, vae_fingerprint="vae",
                           text_fingerprint="te")
        run_encode(plan, encode_images=enc2.encode_images, encode_texts=enc2.encode_texts)
        wall = time.perf_counter() - t
        return IncrementalFigures(n=n, build_wall=b["wall"], build_images=enc.images, build_texts=enc.texts,
                                  edited=edited, added=added, images=enc2.images, texts=enc2.texts, wall=wall,
                                  validate=vt, plan=pt)
    except Exception as exc:  # report, do not fail the whole bench
        return f"incremental bench failed: {type(exc).__name__}: {exc}"


def validation_bench(work: Path, sizes: Sequence[int], runs: int) -> list[ValidationFigure]:
    """Wall and CPU time of ``validate_sources`` over unchanged generated folders of each size."""
    from dataset_cache.sources import build_record, validate_sources

    from . import bench_validate  # here, not at the top: the L1 child must not import it

    out = []
    for n in sizes:
        root = work / f"validate-{n}"
        bench_validate.generate(root, n, max(1, min(100, n // 1000)))
        record = build_record(root)
        wall, cpu = [], []
        for _ in range(runs):
            c, t = time.process_time(), time.perf_counter()
            v = validate_sources(root, record)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            assert v.hashed == 0, "unchanged folder re-hashed"
        out.append(ValidationFigure(len(record), wall, cpu))
    return out


# ------------------------------------------------------------------------------------------------ measure
@dataclass(frozen=True)
class Settings:
    """What one run measures: the mode, runs per figure and the sizes, resolved from the options."""

    mode: str
    smoke: bool
    runs: int
    sd15: list[int]
    flux: list[int]
    validate: list[int]
    incremental_n: int

    def scratch_bytes(self) -> float:
        """Free disk the largest datasets need under the scratch folder (both layouts, with a margin)."""
        return 2.1 * (max(self.sd15) * PROFILES["sd15"].sample_bytes
                      + max(self.flux or [0]) * PROFILES["flux"].sample_bytes)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def settings_from(args: argparse.Namespace) -> Settings:
    if args.smoke:  # a functional check of every table, not figures
        sd, fx, vs, inc_n = [40], [4], [200], 20
    elif args.quick:
        sd, fx, vs, inc_n = [1000, 5000], [100], [1000, 10000], 200
    else:
        sd, fx, vs, inc_n = [1000, 5000], [50, 200], [1000, 10000, 100000], 1000
    return Settings(
        mode="--smoke" if args.smoke else "--quick" if args.quick else "default",
        smoke=args.smoke,
        runs=1 if args.smoke else max(5, args.runs),
        sd15=_ints(args.sd15) if args.sd15 else sd,
        flux=_ints(args.flux) if args.flux is not None else fx,
        validate=_ints(args.validate_sizes) if args.validate_sizes else vs,
        incremental_n=args.incremental_n if args.incremental_n is not None else inc_n,
    )


def measure(s: Settings, work: Path, machine: Machine, say: Callable[[str], None]) -> LibraryRun:
    """Run every library benchmark in the scratch folder ``work`` and return the figures (no Markdown here)."""
    runs = s.runs
    run = LibraryRun(mode=s.mode, runs=runs, sd15=list(s.sd15), flux=list(s.flux), machine=machine)
    # ---------------------------------------------------------------- 1 + 3: write, open, read
    for pkey, sizes in (("sd15", s.sd15), ("flux", s.flux)):
        prof = PROFILES[pkey]
        entries = Entries(prof)
        for n in sizes:
            ours, lazy = work / f"{pkey}-{n}" / "ours", work / f"{pkey}-{n}" / "lazy"
            say(f"{prof.name} N={n}: writing")
            w_o = write_ours(ours, n, entries)
            w_l = write_lazy(lazy, n, entries)
            run.writes.append(WriteFigure(prof.name, n, n * prof.sample_bytes / 1e9, w_o, w_l))
            say(f"{prof.name} N={n}: open x{runs} warm and cold")
            res = {}
            for cold in (False, True):
                for kind, root in (("ours", ours), ("lazy", lazy)):
                    res[(kind, cold)] = measure_open(kind, root, runs, cold)
            for cold in (False, True):
                run.opens.append(OpenFigure(prof.name, n, cold, res[("ours", cold)], res[("lazy", cold)]))
            if n == max(sizes):
                say(f"{prof.name} N={n}: batch reads x{runs} warm and cold")
                nb = {"sd15": 150, "flux": 15}[pkey] if not s.smoke else 5
                payload = nb * prof.batch * prof.sample_bytes
                for cold in (False, True):
                    t_o, t_f, t_h, t_l, t_r = [], [], [], [], []
                    for r in range(runs):
                        plan = random_batches(n, prof.batch, nb, seed=r)
                        for lst, fn, root in ((t_o, lambda: read_ours(ours, plan), ours),
                                              (t_f, lambda: read_floor(ours, plan), ours),
                                              (t_h, lambda: read_floor(ours, plan, checksums=True), ours),
                                              (t_l, lambda: read_lazy(lazy, plan), lazy),
                                              (t_r, lambda: read_raw(ours, payload), ours)):
                            if cold:
                                evict(root)
                            else:
                                fn()  # warm-up: the pages are in the page cache
                            lst.append(fn())
                    mbs = lambda ts: [payload / t / 1e6 for t in ts]  # noqa: E731
                    run.reads.append(ReadFigure(prof.name, n, cold, prof.batch, mbs(t_o), mbs(t_f), mbs(t_h),
                                                mbs(t_l), mbs(t_r)))
            shutil.rmtree(work / f"{pkey}-{n}", ignore_errors=True)

    # ---------------------------------------------------------------- 4: prefetch
    say("prefetch overlap")
    pn, pb, pbatch = (40, 4, 4) if s.smoke else (2000, 20, 32)
    proot = work / "prefetch" / "ours"
    write_ours(proot, pn, Entries(PROFILES["sd15"]))
    run.prefetch = prefetch_bench(proot, runs, pb, pbatch)
    shutil.rmtree(work / "prefetch", ignore_errors=True)

    # ---------------------------------------------------------------- 5: incremental + validation
    if s.incremental_n:
        say(f"incremental encode N={s.incremental_n}")
        run.incremental = incremental_bench(work, s.incremental_n, runs)
    say(f"validation of unchanged folders {s.validate}")
    run.validation = validation_bench(work, s.validate, runs)
    return run


# ------------------------------------------------------------------------------------------------ render
def _open_series(run: LibraryRun, profile: str) -> dict[str, list[tuple[int, float]]]:
    """The warm L1 figures of one profile as plot/growth series over N."""
    series: dict[str, list[tuple[int, float]]] = {}
    for f in run.opens:
        if f.profile == profile and not f.cold:
            series.setdefault("ours open ms", []).append((f.n, med(f.ours["open_s"]) * 1e3))
            series.setdefault("lazy open ms", []).append((f.n, med(f.lazy["open_s"]) * 1e3))
            series.setdefault("ours RSS MiB", []).append((f.n, max(med(f.ours["growth_mib"]), 0.1)))
            series.setdefault("lazy RSS MiB", []).append((f.n, max(med(f.lazy["growth_mib"]), 0.1)))
    return series


def _profiles(run: LibraryRun) -> list[tuple[str, list[int]]]:
    return [(PROFILES["sd15"].name, run.sd15), (PROFILES["flux"].name, run.flux)]


def plot_panels(run: LibraryRun) -> list[dict[str, Any]]:
    """The panels of ``bench_open_library.png`` (open time and RSS growth vs N per profile with > 1 size)."""
    panels = []
    for pname, _ in _profiles(run):
        series = _open_series(run, pname)
        if series and len(next(iter(series.values()))) > 1:
            panels.append({"title": f"{pname}: open time (warm), ms", "xlabel": "N samples", "ylabel": "ms",
                           "series": {k: v for k, v in series.items() if k.endswith("ms")}})
            panels.append({"title": f"{pname}: RSS growth after open, MiB", "xlabel": "N samples",
                           "ylabel": "MiB", "series": {k: v for k, v in series.items() if k.endswith("MiB")}})
    return panels


def render(run: LibraryRun, cmd: str, plot_name: str | None = None) -> str:
    """The library section of docs/BENCHMARKS.md for ``run``; ``cmd`` is the command shown to regenerate it and
    ``plot_name`` the chart (beside the doc) to link, if one was drawn."""
    pf = run.prefetch
    assert pf is not None, "the prefetch figures are part of every run"
    sd, fx = run.sd15, run.flux
    open_rows, write_rows, read_rows, scale_rows = [], [], [], []
    for w in run.writes:
        write_rows.append(f"| {w.profile} | {w.n} | {w.gb:.2f} | {w.gb / w.ours_s:.2f} ({w.ours_s:.1f} s) "
                          f"| {w.gb / w.lazy_s:.2f} ({w.lazy_s:.1f} s) |")
    for f in run.opens:
        o, l_ = f.ours, f.lazy
        ratio = med(l_["open_s"]) / med(o["open_s"])
        ok = med(o["open_s"]) <= med(l_["open_s"]) * 1.0
        open_rows.append(
            f"| {f.profile} | {f.n} | {'dropped' if f.cold else 'warm'} "
            f"| {stat(o['open_s'], 1e3)} | {stat(o['growth_mib'])} "
            f"| {stat(l_['open_s'], 1e3)} | {stat(l_['growth_mib'])} "
            f"| {ratio:.1f}× | {'met' if ok else 'NOT met'} |")
    for r in run.reads:
        o, f_, h_, l_, r_ = r.ours, r.floor, r.floor_xxh3, r.safe_open, r.raw
        read_rows.append(
            f"| {r.profile} | {r.n} | {'dropped' if r.cold else 'warm'} | {r.batch} "
            f"| {stat(o, fmt='.0f')} | {stat(f_, fmt='.0f')} | {stat(h_, fmt='.0f')} "
            f"| {stat(l_, fmt='.0f')} | {stat(r_, fmt='.0f')} | {med(o) / med(r_):.0%} "
            f"| {med(f_) / med(r_):.0%} | {med(h_) / med(r_):.0%} | {med(o) / med(h_):.0%} "
            f"| {med(o) / med(l_):.1f}× |")
    for pname, sizes in _profiles(run):
        series = _open_series(run, pname)
        if len(sizes) > 1:
            xs = [x for x, _ in series["ours open ms"]]
            for name, pts in series.items():
                scale_rows.append(f"| {pname} | {name} | {growth(xs, [y for _, y in pts])} |")
    read_s = pf.serial_read_s
    out = [
        "## Library benchmarks (`python -m dataset_cache bench`)",
        "",
        f"Regenerate: `{cmd}` (this run: mode {run.mode}, {run.runs} runs per figure, "
        f"took {run.seconds / 60:.1f} min). "
        f"SD1.5 N = {', '.join(map(str, sd))}; Flux N = {', '.join(map(str, fx)) or 'none'}. "
        "Figures are `median (min–max)` over the runs.",
        "",
        *machine_lines(run.machine),
        "",
        "### L1. Open a dataset: ours vs the lazy-branch design",
        "",
        "Each open runs in a fresh interpreter (torch already imported before the baseline RSS is taken). "
        "*Ours*: `open_cache(root)` (manifest, journal, shard headers) + `reader.dataset(name)` (the sample list). "
        "*Lazy branch*: unpickle every shard's skeleton + parse every shard's safetensors header "
        "(KohakuBlueleaf/ComfyUI@streamabledataset, 1000 samples a shard). *Dropped*: the files' page cache was "
        "dropped with `posix_fadvise(DONTNEED)` before each run. The built-in `LoadTrainingDataset` is in the "
        "ComfyUI section below (Goal: no slower than the lazy design).",
        "",
        "| profile | N | page cache | ours open ms | ours RSS growth MiB | lazy open ms | lazy RSS growth MiB "
        "| lazy / ours time | goal: ours ≤ lazy |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
        *open_rows,
        "",
        "Writing the synthetic caches (single thread, includes the xxh3 checksums of ours):",
        "",
        "| profile | N | GB | ours GB/s | lazy-branch GB/s |",
        "|---|---:|---:|---:|---:|",
        *write_rows,
        "",
        "### L3. Batch read throughput (MB/s of tensor payload)",
        "",
        "Random batches (150 of 4 for SD1.5, 15 of 2 for Flux) at the largest N. *Ours*: `CacheReader.read` with "
        "a reused `ReadBuffer`, checksums verified. *Floor*: the same rows with nothing but one `preadv` per row "
        "into one buffer, files open and every offset computed before the clock starts (what this layout allows "
        "with zero Python work); *floor + xxh3*: the same plus the per-row checksum ours verifies. *safe_open*: "
        "the lazy-branch files, one `safe_open` handle per shard kept open "
        "(as that branch does), `get_tensor(...).clone()` per tensor (`get_tensor` returns a view of a memory "
        "map: the clone is what reads the bytes). *Raw*: sequential `readinto` (8 MiB) of the same number of "
        "bytes of our shard files, no parsing or checksums: the limit of the disk/page cache. Goals (issue #3): "
        "ours ≥ 70% of raw and ≥ 5× safe_open.",
        "",
        "| profile | N | page cache | batch | ours MB/s | floor MB/s | floor + xxh3 MB/s | safe_open MB/s "
        "| raw sequential MB/s | ours / raw | floor / raw | floor + xxh3 / raw | ours / (floor + xxh3) "
        "| ours / safe_open |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *read_rows,
        "",
        "### L4. Prefetch overlap (the consumer's wait for data)",
        "",
        f"`PrefetchLoader` over a real SD1.5 cache of {pf.samples} samples, batches of {pf.batch}, "
        f"{pf.batches} batches a run, the "
        "cache's page cache dropped before every run (each read waits for the disk, as with a dataset larger than "
        f"RAM). *Serial read*: one thread reads a batch (`CacheReader.read` + `torch.cat` of the latents), no "
        f"loader: {read_s * 1e3:.2f} ms (median). *Standalone*: the loader with the same setting iterated with no "
        "step (its own best rate). The consumer then runs a simulated step of 1×/2× the serial read time, or of "
        "0.5× the standalone time of the same setting (reads slower than steps): a torch matmul loop on one thread "
        "(releases the GIL, competes for the CPU like a CPU training step) or a "
        "`time.sleep` (like a GPU step: the CPU is free). *Wait* = the consumer's time in `next()` per batch, "
        "first batch excluded. Goals (issue #5): with a step at least as long as a read (≥ 1×), the wait is under "
        "5% of the serial read time; with reads slower than steps (0.5× standalone), the throughput is at least "
        "90% of the "
        "loader's standalone rate. Prefetch off = the read runs inside `next()` (the reference). *Hints*: a "
        "worker starting a batch first asks the kernel for the next batch's rows (`CacheReader.announce`, "
        "`posix_fadvise(WILLNEED)` while reads come from the disk), so two batches are in flight on the disk; "
        "*off* = the same loader over a reader that cannot announce (the A/B). This machine has 2 CPUs, so a "
        "second loader thread competes with a matmul step for a core.",
        "",
        "| step | step length | step ms | prefetch | threads | hints | ms per batch | wait ms per batch "
        "| wait / serial read | throughput / standalone | goal |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in pf.rows:
        kind, factor, step_s, depth, threads, hints = (row.kind, row.factor, row.step_s, row.depth, row.threads,
                                                       row.hints)
        per, waits, alone = row.per_batch_s, row.wait_s, row.standalone_s
        goal = ""
        wait_frac = [w / read_s for w in waits]
        rate = [alone / x for x in per]
        if depth >= 1 and factor >= 1.0:
            goal = "met" if med(wait_frac) < 0.05 else "NOT met"
        elif depth >= 1 and kind != "none":
            goal = "met" if med(rate) >= 0.90 else "NOT met"
        alone_row = kind == "none"
        length = "—" if alone_row else f"{factor:g}× " + ("standalone" if factor < 1 else "serial read")
        out.append(f"| {'none (standalone)' if alone_row else kind} | {length} "
                   f"| {'—' if alone_row else f'{step_s * 1e3:.2f}'} | {depth if depth else 'off'} "
                   f"| {threads if depth else '—'} | {('on' if hints else 'off') if depth else '—'} "
                   f"| {stat(per, 1e3, '.2f')} "
                   f"| {'—' if alone_row else stat(waits, 1e3, '.2f')} "
                   f"| {'—' if alone_row else stat(wait_frac, 100) + '%'} "
                   f"| {stat(rate, 100, '.0f') + '%' if factor == 0.5 else '—'} | {goal} |")
    out += ["", "### L5. Incremental encode and validation", ""]
    inc = run.incremental
    if isinstance(inc, IncrementalFigures):
        total_after = inc.n + inc.added
        ours_calls = inc.images + inc.texts
        out += [
            f"A folder of {inc.n} tiny PNGs with one caption each, encoded with no-op encoders that count their "
            f"inputs (`bench/bench_incremental.py`'s generator), then {inc.edited} captions edited (1%) and "
            f"{inc.added} images added (1%). The built-in `MakeTrainingDataset` + `SaveTrainingDataset` path "
            "re-encodes every image and every caption on every run (its `execute` loops `vae.encode` over all "
            "images and `clip.encode_from_tokens_scheduled` over all texts; see `scripts/bench-comfy` for a run "
            "with the real node).",
            "",
            "| images | edit | ours: VAE inputs | ours: text inputs | built-in: VAE | built-in: text "
            "| ours / built-in | ours wall s after the edit | first build wall s | goal: only changed items |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {inc.n} | {inc.edited} captions + {inc.added} images | {inc.images} | {inc.texts} "
            f"| {total_after} | {total_after} | {ours_calls / (2 * total_after):.1%} | {inc.wall:.2f} "
            f"| {inc.build_wall:.2f} | "
            f"{'met' if inc.images == inc.added and inc.texts == inc.edited + inc.added else 'NOT met'} |",
            "",
            f"Re-planning the unchanged folder ({2 * inc.n} files): `validate_sources` {stat(inc.validate, 1e3)} ms, "
            f"whole `plan_encode` {stat(inc.plan, 1e3)} ms.",
            "",
        ]
    elif inc is not None:
        out += [f"Incremental encode: not measured ({inc}).", ""]
    out += [
        "Validation of an unchanged folder (stat every file, compare with the stored record, hash nothing): "
        "`validate_sources` with the record already loaded. Goal: < 1 s per 100k files.",
        "",
        "| files | wall ms | CPU ms | µs per file | goal |",
        "|---:|---:|---:|---:|---|",
    ]
    for v in run.validation:
        # the goal is stated for 100k files; smaller folders carry fixed costs
        files, wall, cpu = v.files, v.wall, v.cpu
        goal = ("met" if med(wall) < 1.0 else "NOT met") + " (wall)" if files >= 100_000 else "— (stated at 100k)"
        out.append(f"| {files} | {stat(wall, 1e3)} | {stat(cpu, 1e3)} | {med(wall) / files * 1e6:.1f} | {goal} |")
    if len(run.validation) > 1:
        scale_rows.append(f"| files | validate unchanged folder | "
                          f"{growth([v.files for v in run.validation], [med(v.wall) for v in run.validation])} |")
    out += [
        "",
        "### L6. Scaling with N",
        "",
        "Growth between the smallest and largest N (log-log slope < 0.25: flat; > 0.75: linear).",
        "",
        "| profile | figure | growth |",
        "|---|---|---|",
        *scale_rows,
    ]
    if plot_name:
        out += ["", f"![open time and RSS vs N]({plot_name})"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the command (also those of ``python -m dataset_cache bench``, which hands them over)."""
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes for iteration (SD1.5 1k,5k; Flux 100; validation 1k,10k; incremental 200)")
    p.add_argument("--smoke", action="store_true",
                   help="functional check (tests): tiny sizes, one run each, no doc unless --doc; not figures")
    p.add_argument("--sd15", default=None, metavar="N,N",
                   help="SD1.5 dataset sizes (default: 1000,5000; --quick 1000,5000; 20000 needs ~6.5 GB and minutes)")
    p.add_argument("--flux", default=None, metavar="N,N",
                   help="Flux dataset sizes (default: 50,200; --quick 100; 1000 needs ~9.5 GB)")
    p.add_argument("--runs", type=int, default=5, help="runs per figure (>= 5; the median and min-max are shown)")
    p.add_argument("--validate-sizes", default=None, metavar="N,N",
                   help="files in the unchanged folders to validate (default: 1000,10000,100000)")
    p.add_argument("--incremental-n", type=int, default=None, help="images in the incremental bench (default 1000)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary folder, deleted)")
    p.add_argument("--doc", type=Path, default=None,
                   help=f"markdown file to update (default: {DOC.relative_to(PACK_ROOT)}; --smoke: none)")
    p.add_argument("--no-doc", action="store_true", help="only print the tables")


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the Markdown section, and rewrite it (and its chart) in the doc unless told not to."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--child-open", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_open:
        print(json.dumps(_child_open(*args.child_open)))
        return 0

    import torch  # noqa: F401  (before the clock: the run's time is the benchmarks')

    t_start = time.perf_counter()
    s = settings_from(args)
    own_dir = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="streamcache-bench-")) if own_dir else args.dir
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if s.scratch_bytes() > free:
        sys.stderr.write(f"error: need {s.scratch_bytes() / 2**30:.1f} GiB free under {work}, "
                         f"have {free / 2**30:.1f}\n")
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        return 2
    say = (lambda m: None) if args.smoke else (lambda m: sys.stderr.write(
        f"[bench {time.perf_counter() - t_start:6.1f}s] {m}\n"))
    machine = machine_info(root=work.parent if own_dir else work)
    try:
        run = measure(s, work, machine, say)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    run.seconds = time.perf_counter() - t_start

    cmd = " ".join([PROG, *(x for x in argv if x != "--no-doc")])  # as typed (sizes, runs), to regenerate
    write_doc = not args.no_doc and not (args.smoke and args.doc is None)
    doc = args.doc or DOC
    plot_name = None
    if write_doc:
        panels = plot_panels(run)
        if panels:
            plot = doc.parent / "bench_open_library.png"
            line_plot(plot, panels, "Open a dataset: ours vs lazy branch (log-log)")
            plot_name = plot.name
    text = render(run, cmd, plot_name)
    sys.stdout.write(text)
    if write_doc:
        update_doc(doc, "library", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
