"""Benchmark: the time from Train LoRA's call to the end of its first step, ours against ComfyUI's ``TrainLoraNode``,
at full model size on the CPU, and where ours' time goes.

Why it exists: on every GPU row of ``scripts/bench-gpu`` (G1, runs R1–R8) ours' first step took about twice the
built-in's. Part of that was how ours reported it (a step late, until the first loss was read at once); the rest is
work the built-in does not do (the memory plan's probe, the collector's first full pass) or does the same way (the
model's copy and load). Ours times its own phases (``TrainResult.startup``); this runs both trainers on the same
full-size random-weight model (``bench.gpu_models``, bf16 weights and SDPA attention as a GPU run sets them up:
``bench.plan_shapes.configure_comfyui``) with a small latent, so that a CPU step stays short while every phase
before it works at the size a GPU run has. The arms alternate in one process, the probe's remembered result
forgotten before each of ours (``bench.gpu_train.run_arm``), as in the GPU benchmark.

    scripts/bench-comfy startup                       # SD1.5, 3 runs of each arm
    scripts/bench-comfy startup --only sdxl --runs 2  # on a host with more than 24 GiB of RAM

SDXL does not fit 24 GiB of RAM this way: the model, ComfyUI's copy of it for training (``clone(force_deepcopy)``)
and the built-in's step held 23 GiB, and ours was then killed for memory.

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does). ``--tiny`` runs the same on the GPU
harness's tiny stand-in models (what its test runs: figures of no meaning).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import stat

__all__ = ["StartupFigures", "full_size_session", "machine_line", "measure", "spread", "render", "main"]

LATENT_SIDE = 16
"""The latent's height and width (128 px for SD1.5 and SDXL): the step stays seconds long on a CPU core."""
ARMS = ("builtin", "ours")


@dataclass
class StartupFigures:
    """One family: each arm's time from its call to its first step's end, run by run, and ours' phases."""

    family: str
    title: str
    first_s: dict[str, list[float]] = field(default_factory=dict)
    phases: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def small_latent(spec: Any) -> Any:
    """``spec`` with a ``LATENT_SIDE``² latent (its channels and frames kept)."""
    return dataclasses.replace(spec, latent=(*spec.latent[:-2], LATENT_SIDE, LATENT_SIDE))


def measure(ctx: Any, spec: Any, runs: int, work: Path, say: Callable[[str], None] = print) -> StartupFigures:
    """Build ``spec``'s model once, then run the arms in turn ``runs`` times, one step each after the first."""
    import torch

    from .gpu_data import write_family_cache
    from .gpu_figures import TrainFigures
    from .gpu_models import build_diffusion_model
    from .gpu_train import free_device, run_arm

    fig = StartupFigures(spec.name, spec.title)
    model = build_diffusion_model(spec, ctx.device, torch.bfloat16)
    data = write_family_cache(spec, work / f"cache-{spec.name}", 8)
    for run in range(runs):
        for arm in ARMS:
            arm_fig = TrainFigures(f"{spec.name}/b1/{arm}", spec.name, 1, arm, 1, rep=run)
            run_arm(ctx.trainers, model, data, arm_fig, 1, 1, say=say)
            if arm_fig.error or arm_fig.first_s is None:
                fig.errors.append(f"{arm_fig.id} run {run + 1}: {arm_fig.error or 'no step'}")
                continue
            fig.first_s.setdefault(arm, []).append(arm_fig.first_s)
            if arm == "ours":
                fig.phases.append(arm_fig.startup)
    del model, data
    free_device(ctx.device)  # the next family's model is built in the RAM this one held
    return fig


def render(figs: Sequence[StartupFigures], seconds: float, machine: str) -> list[str]:
    """The Markdown table: per family, each arm's first step (median of the runs, their range) and ours' phases
    (medians)."""
    phases = list(dict.fromkeys(name for f in figs for p in f.phases for name in p))
    lines = [f"Run of {time.strftime('%Y-%m-%d')} on {machine}, {seconds:.0f} s; latent {LATENT_SIDE}×{LATENT_SIDE}, "
             "batch 1, bf16 weights, rank-16 LoRA, AdamW; first step = from the trainer's call to its first step's "
             "end (median of the runs, min–max); ours' phases: medians, seconds.", "",
             "| family | built-in first step s | ours first step s | ours ÷ built-in | "
             + " | ".join(f"ours: {name}" for name in phases) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(phases)]
    for f in figs:
        built, ours = f.first_s.get("builtin", []), f.first_s.get("ours", [])
        ratio = f"{statistics.median(ours) / statistics.median(built):.2f}" if built and ours else "—"
        cells = [f"{statistics.median([p.get(name, 0.0) for p in f.phases]):.2f}" if f.phases else "—"
                 for name in phases]
        lines.append(f"| {f.title} | {spread(built)} | {spread(ours)} | {ratio} | " + " | ".join(cells) + " |")
    errors = [e for f in figs for e in f.errors]
    return lines + (["", "Arms without figures:", *(f"- {e}" for e in errors)] if errors else [])


def spread(values: list[float]) -> str:
    """``median (min–max)`` of ``values`` in seconds, or a dash for none."""
    return stat(values, fmt=".2f") if values else "—"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench-comfy startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="sd15", help="families, comma-separated (%(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each arm, alternating (%(default)s)")
    ap.add_argument("--tiny", action="store_true", help="the GPU harness's tiny stand-in models (a functional check)")
    return ap


def full_size_session(work: Path, tiny: bool, only: str) -> tuple[Any, list[Any]]:
    """ComfyUI set up in ``work`` as a GPU run sets the model up, the pack imported, and the families of ``only``
    (comma-separated) with a :func:`small_latent`: ``(context, specs)`` for :func:`bench.gpu_train.run_arm`.
    ``tiny``: the GPU harness's tiny stand-ins. Shared by ``bench-comfy startup`` and ``saves``."""
    from .plan_shapes import configure_comfyui

    configure_comfyui(work)
    from support.pack import import_pack

    from .gpu import context_from_pack, tiny_specs
    from .gpu_models import FULL_FAMILIES

    families = tiny_specs()[0] if tiny else FULL_FAMILIES
    wanted = [f.strip() for f in only.split(",") if f.strip()]
    unknown = sorted(set(wanted) - set(families))
    if unknown:
        raise SystemExit(f"--only: unknown families {unknown}; known: {sorted(families)}")
    return context_from_pack(import_pack(), work, work / "out", print), [small_latent(families[n]) for n in wanted]


def machine_line() -> str:
    """The machine, as the tables' first line names it."""
    from .common import machine_info

    m = machine_info()
    return f"{m.cpu} ({m.cores} cores), {m.ram} RAM"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        ctx, specs = full_size_session(work, args.tiny, args.only)
        t = time.perf_counter()
        figs = [measure(ctx, spec, args.runs, work) for spec in specs]
        lines = render(figs, time.perf_counter() - t, machine_line())
    print("\n".join(lines))
    return 1 if any(f.errors for f in figs) else 0

if __name__ == "__main__":
    sys.exit(main())
