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

The pieces, one job each: :mod:`bench.library_figures` (the dataclasses of a run), :mod:`bench.library_measure`
(L1, L3, L5 figures), :mod:`bench.library_prefetch` (L4), :mod:`bench.library_run` (the sizes the options ask for,
every figure measured in order), :mod:`bench.library_render` (the Markdown section, one function per table, and
the chart's panels). This module is the command: :func:`main`. ``python -m dataset_cache bench`` hands its
arguments to :func:`main` (run from the pack root, where this package is importable); ``python -m bench.library
--child-open`` is the fresh interpreter of one L1 open.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .common import DOC, PACK_ROOT, machine_info
from .library_figures import LibraryRun
from .library_measure import child_open
from .library_render import plot_panels, render
from .library_run import Settings, measure, settings_from
from .report import line_plot, update_doc

__all__ = ["main", "add_arguments"]

PROG = "python -m dataset_cache bench"


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


def _scratch(args: argparse.Namespace, s: Settings) -> tuple[Path, bool] | None:
    """The scratch folder and whether it is ours to delete, or None (said on stderr) when the disk is too small."""
    own_dir = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="streamcache-bench-")) if own_dir else args.dir
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if s.scratch_bytes() > free:
        sys.stderr.write(f"error: need {s.scratch_bytes() / 2**30:.1f} GiB free under {work}, "
                         f"have {free / 2**30:.1f}\n")
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        return None
    return work, own_dir


def _measure_in(work: Path, own_dir: bool, s: Settings, say: Callable[[str], None]) -> LibraryRun:
    """Every figure, measured in ``work`` (deleted afterwards when it is a temporary folder of ours)."""
    machine = machine_info(root=work.parent if own_dir else work)
    try:
        return measure(s, work, machine, say)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def _publish(run: LibraryRun, args: argparse.Namespace, argv: list[str]) -> None:
    """Print the section and, unless told not to, rewrite it (and draw its chart) in the doc."""
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


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the Markdown section, and rewrite it (and its chart) in the doc unless told not to."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--child-open", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_open:
        print(json.dumps(child_open(*args.child_open)))
        return 0

    import torch  # noqa: F401  (before the clock: the run's time is the benchmarks')

    t_start = time.perf_counter()
    s = settings_from(args)
    scratch = _scratch(args, s)
    if scratch is None:
        return 2

    def say(m: str) -> None:  # progress on stderr (quiet under --smoke)
        if not args.smoke:
            sys.stderr.write(f"[bench {time.perf_counter() - t_start:6.1f}s] {m}\n")

    run = _measure_in(*scratch, s, say)
    run.seconds = time.perf_counter() - t_start
    _publish(run, args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
