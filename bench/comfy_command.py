"""Benchmarks that need the real ComfyUI (``scripts/bench-comfy``); rewrites the ComfyUI section of docs/BENCHMARKS.md.

Runs under ComfyUI's python and calls ComfyUI's own functions in-process (CPU, ``args.cpu = True``):

* **C1. Open a dataset**: the same SD1.5-sized samples written by the built-in ``SaveTrainingDataset.execute``,
  by our ``CacheWriter`` and in the lazy-branch layout; then, each in a fresh interpreter, the built-in
  ``LoadTrainingDataset.execute`` vs ``open_cache`` + the sample list vs the lazy-branch open: wall time and RSS.
* **C2. Training**: time to the first training step, steady steps/s and peak RSS of our trainer
  (``nodes/training.train_lora``, what ``StreamCache_TrainLoRA`` runs) vs the built-in ``LoadTrainingDataset``
  → ``ResolutionBucket`` → ``TrainLoraNode(bucket_mode=True)``, same batch size, steps and options, with the tiny
  SD1.5-shaped model; and the upper bound: our loop with every batch already in (CPU) device memory.
* **C5. Built-in re-encode**: ComfyUI's ``MakeTrainingDataset`` with the tiny VAE and CLIP on a small folder,
  before and after editing 1% of the captions and adding 1% images, counting its encoder calls.

    scripts/bench-comfy            # defaults (see --help), ~6-8 min on 2 cores
    scripts/bench-comfy --quick    # small N, for iteration

How it runs: ``scripts/bench-comfy`` starts :mod:`bench.run_comfyui` by path with ComfyUI's python, which loads
``support`` (tests/support), ``dataset_cache`` and this package from their folders and calls :func:`main` (the
pack root must stay off ``sys.path``: its ``nodes/`` would shadow ComfyUI's ``nodes.py``). Each fresh-interpreter
measurement starts the same runner with ``--child``, which this module hands to :mod:`bench.comfy_open` or
:mod:`bench.comfy_train`. :func:`bench.comfy_driver.measure` returns a :class:`bench.comfy_driver.ComfyRun` of plain
figures; :mod:`bench.comfy_render` turns it into the doc's section and chart. This module is the command line.
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

from .comfy_driver import ComfyRun, Settings, measure
from .comfy_open import child_open
from .comfy_render import plot_panels, render
from .comfy_train import child_train
from .comfyui import comfy_setup, comfy_version
from .common import DOC, machine_info
from .report import line_plot, update_doc

__all__ = ["main", "settings_from", "PROG"]

PROG = "scripts/bench-comfy"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small N for iteration")
    ap.add_argument("--open-sizes", default=None, help="SD1.5 N for C1 (default 1000,5000; --quick 1000)")
    ap.add_argument("--train-sizes", default=None, help="N for C2, ours (default 1000,5000; --quick 500,2000)")
    ap.add_argument("--builtin-train-sizes", default=None,
                    help="N for C2, built-in (default 1000; --quick 500)")
    ap.add_argument("--bound-sizes", default=None,
                    help="N for C2, the in-memory bound (default: the first of --train-sizes)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 20; --quick 12)")
    ap.add_argument("--runs", type=int, default=5, help="fresh-process runs per open figure (>= 5)")
    ap.add_argument("--reencode-n", type=int, default=None, help="images for C5 (default 100; --quick 20)")
    ap.add_argument("--sections", default="c1,c2,c5", help="which sections to run (default: %(default)s)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: temporary, deleted)")
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file to update (default: %(default)s)")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return ap


def settings_from(a: argparse.Namespace) -> Settings:
    """What to measure, from the options (``--quick`` picks the small defaults)."""
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    train_sizes = ints(a.train_sizes) if a.train_sizes else ([500, 2000] if a.quick else [1000, 5000])
    return Settings(
        mode="--quick" if a.quick else "default",
        runs=max(5, a.runs),
        steps=a.steps or (12 if a.quick else 20),
        open_sizes=ints(a.open_sizes) if a.open_sizes else ([1000] if a.quick else [1000, 5000]),
        train_sizes=train_sizes,
        builtin_train_sizes=ints(a.builtin_train_sizes) if a.builtin_train_sizes else ([500] if a.quick else [1000]),
        bound_sizes=ints(a.bound_sizes) if a.bound_sizes else train_sizes[:1],
        reencode_n=a.reencode_n or (20 if a.quick else 100),
        sections=frozenset(a.sections.lower().split(",")),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the Markdown section, and rewrite it (and its chart) in the doc unless ``--no-doc``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.child:
        return _run_child(a.child)

    t_start = time.perf_counter()

    def say(message: str) -> None:
        sys.stderr.write(f"[bench-comfy {time.perf_counter() - t_start:6.1f}s] {message}\n")

    run = _measure_in(a.dir, settings_from(a), say)
    run.seconds = time.perf_counter() - t_start

    cmd = " ".join([PROG, *(x for x in argv if x != "--no-doc")])  # as typed, to regenerate
    _report(run, cmd, None if a.no_doc else a.doc)
    return 0


def _run_child(child: list[str]) -> int:
    """One fresh-interpreter measurement (``--child open|train ... WORK``): its figures as one JSON line."""
    work = Path(child[-1])
    if child[0] == "open":
        print(json.dumps(child_open(child[1], child[2], work)))
    elif child[0] == "train":
        print(json.dumps(child_train(child[1], child[2], int(child[3]), work, child[4])))
    return 0


def _measure_in(folder: Path | None, s: Settings, say: Callable[[str], None]) -> ComfyRun:
    """ComfyUI set up in ``folder`` (default: a temporary folder, deleted after), the tiny models made, the run
    measured."""
    own = folder is None
    work = Path(tempfile.mkdtemp(prefix="streamcache-bench-comfy-")) if folder is None else folder
    work.mkdir(parents=True, exist_ok=True)
    try:
        install = comfy_setup(work)
        from support.tiny_models import ensure_tiny_models

        models = str(ensure_tiny_models(install.path, install.python).root)
        machine = machine_info({"ComfyUI": f"{comfy_version(install.path)} ({install.path})"},
                               root=Path(tempfile.gettempdir()))
        return measure(s, work, models, machine, say)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _report(run: ComfyRun, cmd: str, doc: Path | None) -> None:
    """Print the section; with ``doc``, draw the chart beside it and rewrite its section."""
    plot_name = None
    panels = [] if doc is None else plot_panels(run)
    if panels and doc is not None:
        plot = doc.parent / "bench_comfy.png"
        line_plot(plot, panels, "ComfyUI: built-in vs StreamCache (log-log unless noted)")
        plot_name = plot.name
    out = render(run, cmd, plot_name)
    sys.stdout.write(out)
    if doc is not None:
        update_doc(doc, "comfy", out)


if __name__ == "__main__":
    raise SystemExit("run it with scripts/bench-comfy (bench/run_comfyui.py under ComfyUI's python)")
