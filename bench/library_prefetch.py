"""The L4 figures of the library benchmarks: ``PrefetchLoader``'s overlap of reads with a simulated step.

Apart from :mod:`bench.library_measure` because it needs the most machinery of its own: a calibrated matmul step,
a reader that cannot announce a batch ahead (the A/B of read hints) and one timed loader run per setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import evict, med, serial_reads
from .library_figures import PrefetchFigures, PrefetchRow

__all__ = ["LOADER_CONFIGS", "prefetch_bench"]


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


@dataclass(frozen=True)
class _Setup:
    """What every timed loader run of one :func:`prefetch_bench` shares: the open reader over ``root``, its
    sampler, how many runs and how many batches a run."""

    root: Path
    reader: Any
    sampler: Any
    runs: int
    batches: int


def _serial_read_s(s: _Setup) -> float:
    """Median seconds for one thread to read a batch, no loader (the reference of the wait goal)."""
    from dataset_cache.format import ReadBuffer

    buf = ReadBuffer()
    reads = []
    for _ in range(s.runs):
        evict(s.root)
        reads += serial_reads(s.reader, s.sampler.plans(epochs=None), s.batches, buf)
    return med(reads)


def _loader_runs(s: _Setup, depth: int, threads: int, hints: bool,
                 step: Callable[[], None] | None) -> tuple[list[float], list[float]]:
    """Seconds per batch and seconds waited in ``next()`` per batch, one of each per run, page cache dropped."""
    from dataset_cache.loader import PrefetchLoader

    per, waits = [], []
    for _ in range(s.runs):
        evict(s.root)
        with PrefetchLoader(s.reader if hints else _WithoutHints(s.reader), s.sampler, prefetch_batches=depth,
                            threads=threads or None, epochs=None) as loader:
            it = iter(loader)
            next(it)  # the first batch is never hidden: leave it out of the steady figure
            wait = 0.0
            t0 = time.perf_counter()
            for _ in range(s.batches):
                if step is not None:
                    step()
                tw = time.perf_counter()
                next(it)
                wait += time.perf_counter() - tw
            per.append((time.perf_counter() - t0) / s.batches)
            waits.append(wait / s.batches)
    return per, waits


def _make_step(kind: str, step_s: float) -> Callable[[], None]:
    """The simulated step: a GIL-releasing matmul loop (a CPU step) or a sleep (a GPU step: the CPU is free)."""
    return _calibrate_matmul(step_s) if kind == "matmul" else (lambda: time.sleep(step_s))


def _setting_rows(s: _Setup, read_s: float, depth: int, threads: int, hints: bool) -> list[PrefetchRow]:
    """One loader setting: its standalone row, then a row for each simulated step."""
    alone, _ = _loader_runs(s, depth, threads, hints, None)
    rows = [PrefetchRow("none", 0.0, 0.0, depth, threads, hints, alone, [0.0] * len(alone), med(alone))]
    for kind in ("matmul", "sleep"):
        for factor in (0.5, 1.0, 2.0):
            # Reads slower than steps: half the loader's own standalone time in this setting (a loader
            # faster than the serial read would otherwise face a step as long as its reads). Steps at
            # least as long as a read: multiples of the serial read.
            step_s = factor * (med(alone) if factor < 1 else read_s)
            per, waits = _loader_runs(s, depth, threads, hints, _make_step(kind, step_s))
            rows.append(PrefetchRow(kind, factor, step_s, depth, threads, hints, per, waits, med(alone)))
    return rows


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

    from dataset_cache.format import open_cache
    from dataset_cache.sampler import BucketSampler

    torch.set_num_threads(1)  # the step uses one core
    rows: list[PrefetchRow] = []
    with open_cache(root) as reader:
        samples = reader.dataset("bench")
        sampler = BucketSampler(samples, [0] * len(samples), batch_size, seed=0)
        setup = _Setup(root, reader, sampler, runs, batches)
        read_s = _serial_read_s(setup)
        for depth, threads, hints in LOADER_CONFIGS:
            rows += _setting_rows(setup, read_s, depth, threads, hints)
    return PrefetchFigures(len(samples), batch_size, batches, read_s, rows)
