"""What ``scripts/bench-gpu --profile`` costs beyond the steps it records, measured on the CPU.

A profiled step runs slower than a plain one (the profiler records every dispatcher op), and after the recorded
steps the profiler's events are parsed into Python objects, averaged and exported as a trace: work that grows with
the events recorded, i.e. ops per step × recorded steps. A full-size SDXL step dispatches ~62,000 ops, so that cost
is what :mod:`bench.gpu_budget` must foresee (:func:`bench.gpu_budget.profile_cost`). It is measured here on the
full-depth, narrow models of ``scripts/bench-step-ops`` (:data:`bench.step_ops.NARROW`: the real op count, little
arithmetic per op): per family, the bound's plain steps against its profiled ones, the events recorded, and the
time of each part of the analysis. The figures go to docs/BENCHMARKS.md ("GPU benchmarks", ``--profile``).

    "$COMFYUI_PYTHON" bench/run_comfyui.py profile-cost [--only sd15,sdxl] [--active 1,3] [--parse]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["measure_family", "main"]

PROG = "bench/run_comfyui.py profile-cost"


def _plain(trainers: Any, model: Any, data: Any, fig: Any, steps: int) -> tuple[float, float]:
    """(median step s, arm wall s) of the bound without the profiler."""
    from .gpu_train import arm_settings, free_device, train_ours
    from .step_ops import SETTINGS

    free_device(trainers.device)
    fig.settings = arm_settings(fig, steps, SETTINGS)
    t0 = time.perf_counter()
    ends, _, _ = train_ours(trainers, model, data, fig, bound=True)
    wall = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(ends[2:], ends[3:-1])]
    return statistics.median(gaps), wall


def _profiled(trainers: Any, model: Any, data: Any, fig: Any, active: int, out: Path, parse: bool
              ) -> dict[str, Any]:
    """One profiled run of the bound (2 steps skipped, ``active`` recorded): its times, part by part (``parse``:
    also torch's own parse of the events, ``prof.events()``)."""
    from .gpu_profile import breakdown, keep_trace, profiled_steps
    from .gpu_train import arm_settings, free_device, train_ours
    from .step_ops import SETTINGS

    free_device(trainers.device)
    steps = 2 + active + 1
    fig.settings = arm_settings(fig, steps, SETTINGS)
    got: dict[str, Any] = {"active": active}
    ends: list[float] = []

    def ready(prof: Any) -> None:
        t0 = time.perf_counter()
        fig_p = breakdown(prof, fig.id, None)
        t1 = time.perf_counter()
        got["trace"] = keep_trace(prof, out, f"cost_{fig.family}_{active}")
        t2 = time.perf_counter()
        packed = out / f"trace_cost_{fig.family}_{active}.json.gz"
        got.update(events=fig_p.events, analysis_s=t1 - t0, export_s=t2 - t1, step_ms=fig_p.step_ms,
                   gz_bytes=packed.stat().st_size if packed.exists() else None)
        if parse:  # what the breakdown took before it read the raw events: torch's FunctionEvent tree
            got["parse_s"] = -time.perf_counter()
            got["parsed_events"] = len(prof.events())
            got["parse_s"] += time.perf_counter()

    t0 = time.perf_counter()
    with profiled_steps(2, active, trainers.device, ready) as prof:

        def on_step(_report: Any) -> None:
            ends.append(time.perf_counter())
            prof.step()

        train_ours(trainers, model, data, fig, bound=True, hook=on_step)
    got["wall_s"] = time.perf_counter() - t0
    got["recorded_s"] = ends[2 + active - 1] - ends[1] if len(ends) > 2 + active - 1 else None
    free_device(trainers.device)
    return got


def measure_family(ctx: Any, name: str, actives: Sequence[int], out: Path, say: Any, parse: bool = False
                   ) -> dict[str, Any]:
    """The bound of ``name``'s narrow model: plain steps, then profiled with each of ``actives`` recorded steps."""
    import torch

    from .gpu_data import write_family_cache
    from .gpu_figures import TrainFigures
    from .gpu_models import build_diffusion_model
    from .gpu_train import free_device
    from .step_ops import NARROW

    spec = NARROW[name]
    model = build_diffusion_model(spec, ctx.device, torch.float32)
    root = ctx.work / f"cache_{name}"
    data = write_family_cache(spec, root, 16)
    fig = TrainFigures(f"{name}/b1/bound", name, 1, "bound", 1)
    try:
        step, wall = _plain(ctx.trainers, model, data, fig, 8)
        res: dict[str, Any] = {"family": name, "plain_step_s": step, "plain_wall_s": wall, "plain_steps": 8,
                               "profiled": []}
        say(f"{name}: plain {step:.3f} s/step, {wall:.1f} s for 8 steps")
        for active in actives:
            got = _profiled(ctx.trainers, model, data, fig, active, out, parse)
            res["profiled"].append(got)
            say(f"{name} active {active}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()))
        return res
    finally:
        del model
        free_device(ctx.device)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each family and write ``out/profile-cost.json``; the figures are printed as they come."""
    import torch

    from .common import PACK_ROOT
    from .gpu import _setup

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="sd15,sdxl,flux", help="families of bench.step_ops.NARROW (%(default)s)")
    ap.add_argument("--active", default="1,3", help="recorded steps to try (%(default)s)")
    ap.add_argument("--parse", action="store_true", help="also time torch's parse of the events (prof.events())")
    ap.add_argument("--out", type=Path, default=PACK_ROOT / "out" / "profile-cost")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(f"[profile-cost {time.perf_counter() - t0:6.1f}s] {line}", flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="streamcache-profile-cost-"))
    try:
        torch.set_num_threads(1)  # as scripts/bench-step-ops: comparable on a shared machine
        ctx, _, _, _ = _setup(work, a.out, say, True)
        results = [measure_family(ctx, n.strip(), [int(x) for x in a.active.split(",")], a.out, say, a.parse)
                   for n in a.only.split(",") if n.strip()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (a.out / "profile-cost.json").write_text(json.dumps(results, indent=1))
    return 0
