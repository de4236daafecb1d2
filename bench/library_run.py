"""The run of the library benchmarks: which sizes the options ask for, and every figure measured in order.

:func:`settings_from` resolves the command's options into :class:`Settings`; :func:`measure` writes the synthetic
datasets into a scratch folder and fills a :class:`~bench.library_figures.LibraryRun` table by table, deleting
each dataset once measured (the largest need gigabytes). No Markdown here: :mod:`bench.library_render` does that.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .common import PROFILES, Entries, Machine, Profile, evict, random_batches, read_ours, write_lazy, write_ours
from .library_figures import LibraryRun, OpenFigure, ReadFigure, WriteFigure
from .library_measure import incremental_bench, measure_open, read_floor, read_lazy, read_raw, validation_bench
from .library_prefetch import prefetch_bench

__all__ = ["Settings", "settings_from", "measure"]


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
    """The sizes and runs of ``--smoke``, ``--quick`` or the default, overridden by the options given."""
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


def _measure_reads(run: LibraryRun, s: Settings, pkey: str, prof: Profile, n: int, ours: Path, lazy: Path) -> None:
    """L3 at one size: every way of reading the same random batches, warm then cold."""
    runs = s.runs
    nb = {"sd15": 150, "flux": 15}[pkey] if not s.smoke else 5
    payload = nb * prof.batch * prof.sample_bytes
    for cold in (False, True):
        t_o: list[float] = []
        t_f: list[float] = []
        t_h: list[float] = []
        t_l: list[float] = []
        t_r: list[float] = []
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


def _measure_profile(run: LibraryRun, s: Settings, work: Path, pkey: str, sizes: list[int],
                     say: Callable[[str], None]) -> None:
    """L1 (and the writes) at every size of one profile, L3 at its largest; each dataset deleted after."""
    runs = s.runs
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
            _measure_reads(run, s, pkey, prof, n, ours, lazy)
        shutil.rmtree(work / f"{pkey}-{n}", ignore_errors=True)


def measure(s: Settings, work: Path, machine: Machine, say: Callable[[str], None]) -> LibraryRun:
    """Run every library benchmark in the scratch folder ``work`` and return the figures (no Markdown here)."""
    runs = s.runs
    run = LibraryRun(mode=s.mode, runs=runs, sd15=list(s.sd15), flux=list(s.flux), machine=machine)
    # ---------------------------------------------------------------- 1 + 3: write, open, read
    for pkey, sizes in (("sd15", s.sd15), ("flux", s.flux)):
        _measure_profile(run, s, work, pkey, sizes, say)

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
