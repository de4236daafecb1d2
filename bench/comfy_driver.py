"""The run driver of ``scripts/bench-comfy``: what one run measures (:class:`Settings`), the figures it returns
(:class:`ComfyRun`) and :func:`measure`, which writes each section's datasets and starts its child processes.

Why apart from the children and the report: the driver decides the order (C1, C5, C2) and the interleaving, the
children measure one thing each in a fresh interpreter, and the report only formats a :class:`ComfyRun` (so the
tests can render one from fixed figures without ComfyUI).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .comfy_open import prep_open
from .comfy_reencode import builtin_reencode
from .comfy_train import clip_template, prep_train
from .common import Machine, last_json_result, med

__all__ = ["ComfyRun", "Settings", "measure", "RUNNER"]

RUNNER = Path(__file__).resolve().parent / "run_comfyui.py"


@dataclass
class ComfyRun:
    """Everything one run measured, plus what the report says about the run itself."""

    mode: str
    runs: int
    steps: int
    machine: Machine
    open: dict[int, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    """C1: N → "builtin" / "ours" / "lazy" → "open_s" / "growth_mib" / "rss_mib" → one value per run."""
    save_s: dict[int, float] = field(default_factory=dict)
    """C1: N → seconds of the built-in ``SaveTrainingDataset`` writing the samples."""
    train: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    """C2: ("ours" / "bound" / "builtin", N) → :func:`bench.comfy_train.child_train`'s figures, or
    ``{"error": text}``."""
    reencode: dict[str, Any] = field(default_factory=dict)
    """C5: :func:`bench.comfy_reencode.builtin_reencode`'s counts and times (empty when not run)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Settings:
    """What one run measures, resolved from the options."""

    mode: str
    runs: int
    steps: int
    open_sizes: list[int]
    train_sizes: list[int]
    builtin_train_sizes: list[int]
    bound_sizes: list[int]
    reencode_n: int
    sections: frozenset[str]


def _child(args_list: list[str], timeout: float = 900) -> dict[str, Any]:
    """One measurement in a fresh interpreter (the runner again, with ``--child``): its last JSON line."""
    return last_json_result([sys.executable, str(RUNNER), *args_list], timeout=timeout)


def measure(s: Settings, work: Path, models: str, machine: Machine, say: Callable[[str], None]) -> ComfyRun:
    """Run the ComfyUI benchmarks in the scratch folder ``work`` (ComfyUI set up, tiny models in ``models``) and
    return the figures (no Markdown here)."""
    run = ComfyRun(mode=s.mode, runs=s.runs, steps=s.steps, machine=machine)
    if "c1" in s.sections:
        for n in s.open_sizes:
            _measure_open(run, s.runs, n, work, say)
    if "c5" in s.sections:
        say("C5: built-in MakeTrainingDataset re-encode")
        run.reencode = builtin_reencode(work, models, s.reencode_n)
    if "c2" in s.sections:
        _measure_train(run, s, work, models, say)
    return run


def _measure_open(run: ComfyRun, runs: int, n: int, work: Path, say: Callable[[str], None]) -> None:
    """C1 at N: the three layouts written, then ``runs`` fresh-process opens of each, interleaved."""
    say(f"C1 N={n}: writing built-in / ours / lazy")
    paths = prep_open(work, n)
    run.save_s[n] = paths["save_s"]
    res: dict[str, dict[str, list[float]]] = {}
    for _ in range(runs):  # interleaved: machine noise hits all three alike
        for kind in ("builtin", "ours", "lazy"):
            r = _child(["--child", "open", kind, paths[kind], str(work)])
            d = res.setdefault(kind, {"open_s": [], "growth_mib": [], "rss_mib": []})
            for k in d:
                d[k].append(r[k])
    run.open[n] = res
    say(f"C1 N={n}: built-in {med(res['builtin']['open_s']):.2f}s, ours {med(res['ours']['open_s']):.4f}s")
    shutil.rmtree(paths["builtin_dir"], ignore_errors=True)
    shutil.rmtree(paths["ours"], ignore_errors=True)
    shutil.rmtree(paths["lazy"], ignore_errors=True)


def _measure_train(run: ComfyRun, s: Settings, work: Path, models: str, say: Callable[[str], None]) -> None:
    """C2: per N, the two datasets written, then each trainer in a fresh process (a failure is reported, the other
    figures kept)."""
    train_sizes, btrain, bound_sizes = s.train_sizes, s.builtin_train_sizes, s.bound_sizes
    template = clip_template(models) if train_sizes or btrain else None
    for n in sorted(set(train_sizes) | set(btrain)):
        say(f"C2 N={n}: writing training datasets")
        paths = prep_train(work, n, template)
        kinds = (["ours"] if n in train_sizes else []) + (["bound"] if n in bound_sizes else []) \
            + (["builtin"] if n in btrain else [])
        for kind in kinds:
            say(f"C2 N={n}: {kind}")
            target = paths["builtin"] if kind == "builtin" else paths["ours"]
            try:
                run.train[(kind, n)] = _child(["--child", "train", kind, target, str(s.steps), models, str(work)])
            except Exception as exc:  # report, keep the other figures
                run.train[(kind, n)] = {"error": str(exc)[-600:]}
                say(f"  failed: {str(exc)[-300:]}")
