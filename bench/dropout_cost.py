"""Benchmark: what kohya's adapter dropout (``network_dropout``, ``rank_dropout``, ``module_dropout``) adds to a
training step, counted on the CPU as a GPU sees it.

At batch 1 a GPU step is launch-bound (docs/BENCHMARKS.md, "Ops per training step"), so what dropout costs there is
the ops it adds per step: a layer's skip is one draw of the CPU's generator (no kernel), a rank mask a few kernels
per adapter and model call. Each arm is ours (Train LoRA's loop reading a real cache) on a full-depth, narrow family
(:data:`bench.step_ops.NARROW`), counted by :func:`bench.step_ops.count_arm`: ``plain`` (no dropout, the reference),
each rate alone where the adapter changes the weight, and ``bypass_mode`` without and with all three.

    scripts/bench-comfy dropout                  # every arm of SD1.5 and Flux; rewrites the doc's dropout section
    scripts/bench-comfy dropout --only sd15 --timed 1 --counted 1 --no-doc     # the CPU test's run

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .step_ops import NARROW, ArmCounts, count_arm

__all__ = ["ARMS", "FAMILIES", "SECTION", "measure", "render", "main"]

SECTION = "dropout"
FAMILIES = ("sd15", "flux")
"""SD1.5's UNet (convolutions and attention, 3,265 adapter tensors at full depth) and Flux's transformer (linear
layers only, 57 blocks)."""
ARMS: dict[str, dict[str, Any]] = {
    "plain": {},
    "module": {"module_dropout": 0.1},
    "rank": {"rank_dropout": 0.1},
    "bypass": {"bypass_mode": True},
    "bypass + all": {"bypass_mode": True, "network_dropout": 0.1, "rank_dropout": 0.1, "module_dropout": 0.1},
}
"""Each arm's Train LoRA options; rates of 0.1, kohya's guides' usual (the op count does not depend on the rate)."""


def measure(families: Sequence[str], timed: int, counted: int, say: Any = print) -> list[tuple[str, ArmCounts]]:
    """Every arm of :data:`ARMS` on each family, batch 1: (arm name, its counts)."""
    import torch

    from .gpu import _setup
    from .gpu_data import write_family_cache
    from .gpu_models import build_diffusion_model

    out: list[tuple[str, ArmCounts]] = []
    work = Path(tempfile.mkdtemp(prefix="streamcache-dropout-"))
    try:
        torch.set_num_threads(1)  # the counts do not depend on it; the times then compare on a shared machine
        ctx, _, _, _ = _setup(work, work / "out", say, True)
        for name in families:
            spec = NARROW[name]
            model = build_diffusion_model(spec, ctx.device, torch.float32)
            data = write_family_cache(spec, work / f"cache_{name}", 2 + timed + counted + 4)
            for arm, options in ARMS.items():
                t = time.perf_counter()
                res = count_arm(ctx.trainers, model, data, name, "ours", 1, timed, counted, options)
                say(f"{name} {arm}: " + (res.error or f"{res.counts.per_step():,.0f} ops/step, "
                                         f"{time.perf_counter() - t:.0f} s"))
                out.append((arm, res))
            del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def render(results: Sequence[tuple[str, ArmCounts]], command: str) -> str:
    """The doc's section: per family and arm, the ops, kernels and host syncs a step dispatches, and the CPU's
    seconds per step, each against the family's ``plain``."""
    lines = [f"Measured by `{command}` (CPU, batch 1, fp32, rank 16; counts exact, CPU times a rough proxy).", "",
             "| family | arm | ops / step | kernels / step | syncs / step | × plain ops | CPU s / step | × plain |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain: dict[str, ArmCounts] = {r.family: r for arm, r in results if arm == "plain" and not r.error}
    for arm, r in results:
        title = NARROW[r.family].title
        if r.error:
            lines.append(f"| {title} | {arm} | failed: {r.error[:120]} | | | | | |")
            continue
        ops, base = r.counts.per_step(), plain.get(r.family)
        ratio = f"{ops / base.counts.per_step():.2f}" if base else "—"
        step = r.median_s or 0.0
        speed = f"{step / base.median_s:.2f}" if base and base.median_s else "—"
        lines.append(f"| {title} | {arm} | {ops:,.0f} | {r.counts.per_step(kind='kernel'):,.0f} | "
                     f"{r.counts.per_step(kind='sync'):g} | {ratio} | {step:.3f} | {speed} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench-comfy dropout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated families ({', '.join(FAMILIES)})")
    ap.add_argument("--timed", type=int, default=3, help="steps timed without counting per arm (%(default)s)")
    ap.add_argument("--counted", type=int, default=2, help="steps counted per arm (%(default)s)")
    ap.add_argument("--no-doc", action="store_true", help="print the section only")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the section and (unless ``--no-doc``) rewrite it in docs/BENCHMARKS.md."""
    from .common import DOC
    from .report import update_doc

    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    families = [x.strip() for x in a.only.split(",") if x.strip()] or list(FAMILIES)
    unknown = sorted(set(families) - set(NARROW))
    if unknown:
        print(f"scripts/bench-comfy dropout: unknown families {', '.join(unknown)} (known: {', '.join(NARROW)})",
              file=sys.stderr)
        return 2
    command = " ".join(["scripts/bench-comfy dropout", *(x for x in argv if x != "--no-doc")])
    text = render(measure(families, a.timed, a.counted), command)
    if not a.no_doc:
        update_doc(DOC, SECTION, text)
    sys.stdout.write(text)
    return 0
