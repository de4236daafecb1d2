"""Benchmark: what Train LoRA's ``save_every`` costs a step, at full model size on the CPU.

A save copies the LoRA and the optimizer's state off the device on the training thread, reads the step's loss at
once (losses are otherwise read a step late), and writes both files with an fsync each on a thread of its own. This
trains the same full-size random-weight model (``bench.gpu_models``, bf16 weights and SDPA attention as on a GPU, a
small latent so a CPU step stays seconds long, as ``bench.startup`` does) without saves and with a save after every
step, the arms alternating in one process, and gives the median step of each, their difference (what one save
costs a step, on a machine where the writer's thread competes with training for the CPU), how long each save held
the training thread (the copy off the device) and took to write on its own thread, as Train LoRA times them, and
the size of one save (the LoRA file and its training state).

    scripts/bench-comfy saves                      # SD1.5, 3 runs of each arm, 4 timed steps each
    scripts/bench-comfy saves --tiny               # the GPU harness's tiny stand-in models (no meaning)

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .startup import full_size_session, machine_line, spread

__all__ = ["SaveFigures", "measure", "render", "main"]

ARMS = {"no saves": {}, "save every step": {"save_every": 1, "save_prefix": "loras/bench_saves"}}
"""Each arm's settings beside the harness's own (rank-16 LoRA, AdamW, batch 1)."""


@dataclass
class SaveFigures:
    """One family: each arm's steps (every run's together), and the size of one save."""

    family: str
    title: str
    step_s: dict[str, list[float]] = field(default_factory=dict)
    waited_s: list[float] = field(default_factory=list)
    written_s: list[float] = field(default_factory=list)
    lora_mib: float = 0.0
    state_mib: float = 0.0
    errors: list[str] = field(default_factory=list)


def measure(ctx: Any, spec: Any, runs: int, steps: int, work: Path, output: Path,
            say: Callable[[str], None] = print) -> SaveFigures:
    """Build ``spec``'s model once, then train each arm ``runs`` times in turn, ``steps`` timed steps each."""
    import torch

    from .gpu_data import write_family_cache
    from .gpu_figures import TrainFigures
    from .gpu_models import build_diffusion_model
    from .gpu_train import free_device, run_arm

    fig = SaveFigures(spec.name, spec.title)
    model = build_diffusion_model(spec, ctx.device, torch.bfloat16)
    data = write_family_cache(spec, work / f"cache-{spec.name}", 8)
    for run in range(runs):
        for arm, extra in ARMS.items():
            arm_fig = TrainFigures(f"{spec.name}/b1/{arm}", spec.name, 1, "ours", 1, rep=run)
            run_arm(ctx.trainers, model, data, arm_fig, steps, 1, extra=extra, say=say)
            if arm_fig.error or arm_fig.skipped or not arm_fig.step_s:
                fig.errors.append(f"{arm} run {run + 1}: {arm_fig.error or arm_fig.skipped or 'no step'}")
                continue
            fig.step_s.setdefault(arm, []).extend(arm_fig.step_s)
            if extra:
                fig.waited_s.extend(arm_fig.saves.get("waited_s", []))
                fig.written_s.extend(arm_fig.saves.get("written_s", []))
                fig.lora_mib, fig.state_mib = _sizes(output)
    del model, data
    free_device(ctx.device)
    return fig


def _sizes(output: Path) -> tuple[float, float]:
    """MiB of the last save (its LoRA and its training state), then every save removed (the next run's are its
    own)."""
    loras = sorted((output / "loras").glob("bench_saves_*.safetensors"), key=lambda p: p.stat().st_mtime)
    states = sorted((output / "streamcache_train_state").glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    sizes = (loras[-1].stat().st_size / 2**20 if loras else 0.0, states[-1].stat().st_size / 2**20 if states else 0.0)
    for path in (*loras, *states):
        path.unlink()
    return sizes


def render(figs: Sequence[SaveFigures], seconds: float, machine: str, steps: int) -> list[str]:
    """The Markdown table: per family, each arm's median step (min–max over every run's steps), the difference
    and one save's size."""
    lines = [f"Run of {time.strftime('%Y-%m-%d')} on {machine}, {seconds:.0f} s; batch 1, rank-16 LoRA, AdamW, bf16 "
             f"weights; {steps} timed steps per run (after 1 warm-up step), the arms alternating; step = median "
             "(min–max) of every run's steps, seconds.", "",
             "| family | step without saves | step with a save after it | one save costs the step | training "
             "thread held per save | writing per save (its own thread) | LoRA file MiB | training state MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f in figs:
        plain, saving = f.step_s.get("no saves", []), f.step_s.get("save every step", [])
        cost = f"{statistics.median(saving) - statistics.median(plain):+.2f} s" if plain and saving else "—"
        lines.append(f"| {f.title} | {spread(plain)} | {spread(saving)} | {cost} | {spread(f.waited_s)} | "
                     f"{spread(f.written_s)} | {f.lora_mib:.1f} | {f.state_mib:.1f} |")
    errors = [e for f in figs for e in f.errors]
    return lines + (["", "Arms without figures:", *(f"- {e}" for e in errors)] if errors else [])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench-comfy saves", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="sd15", help="families, comma-separated (%(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each arm, alternating (%(default)s)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (%(default)s)")
    ap.add_argument("--tiny", action="store_true", help="the GPU harness's tiny stand-in models (a functional check)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.runs < 1 or args.steps < 2:
        raise SystemExit("--runs must be at least 1 and --steps at least 2")
    with tempfile.TemporaryDirectory(prefix="bench-saves-") as tmp:
        work = Path(tmp)
        ctx, specs = full_size_session(work, args.tiny, args.only)
        import folder_paths

        output = Path(folder_paths.get_output_directory())
        t = time.perf_counter()
        figs = [measure(ctx, spec, args.runs, args.steps, work, output) for spec in specs]
        lines = render(figs, time.perf_counter() - t, machine_line(), args.steps)
    print("\n".join(lines))
    return 1 if any(f.errors for f in figs) else 0

if __name__ == "__main__":
    sys.exit(main())
