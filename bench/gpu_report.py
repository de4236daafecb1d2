"""The GPU section of docs/BENCHMARKS.md, rendered from a :class:`~bench.gpu_figures.GpuRun` (nothing measured here).

Goals checked per family/batch (issue #24 item 3): ours ≥ 99% of the in-memory bound's speed; at batch 1 ours at
least as fast as the built-in; at batch ≥ 2 ours ≥ 1.5× the built-in and never more device memory than it.
"""

from __future__ import annotations

from collections.abc import Iterable

from .gpu_figures import EncodeFigures, GpuRun, ProfileFigures, TrainFigures
from .gpu_models import FULL_FAMILIES, FamilySpec

__all__ = ["render", "PLACEHOLDER", "SECTION"]

SECTION = "gpu"
TITLE = "## GPU benchmarks (`scripts/bench-gpu`)"
PLACEHOLDER = f"""{TITLE}

**Unmeasured**: these figures come from `scripts/bench-gpu` on a machine with a CUDA GPU, which has not run on this
version yet (the first figures of an earlier version, on one H200, are in `../shared/docs/gpu-notes.md`). On a GPU
machine without network, `scripts/device-prep` here and `scripts/device-run` there (README, "Benchmarks on a GPU")
rewrite this section: step time of the in-memory bound, ours and ComfyUI's `TrainLoraNode` per family and batch,
time to the first step, peak device memory, data wait, Encode Dataset against `MakeTrainingDataset`, and with
`--profile` where a step's time goes.
"""


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "—" if value is None else f"{value:{fmt}}"


def _arm_cell(fig: TrainFigures | None, what: str) -> str:
    if fig is None:
        return "—"
    if fig.skipped:
        return "skipped"
    if fig.error:
        return "out of memory" if fig.error.startswith("out of memory") else "failed"
    value = {"step": fig.median_s, "first": fig.first_s, "peak": fig.peak_gib}[what]
    return _f(value, {"step": ".3f", "first": ".1f", "peak": ".1f"}[what])


def _goals(batch: int, bound: TrainFigures | None, ours: TrainFigures | None,
           builtin: TrainFigures | None) -> tuple[str, str, str]:
    """(ours / bound speed, built-in / ours speed, goals met or not)."""
    goals = []
    vs_bound = vs_builtin = "—"
    if ours is not None and ours.ok and bound is not None and bound.ok:
        ratio = bound.median_s / ours.median_s  # type: ignore[operator]
        vs_bound = f"{ratio:.1%}"
        goals.append(f"≥ 99% of bound: {'met' if ratio >= 0.99 else 'NOT met'}")
    if ours is not None and ours.ok and builtin is not None:
        if builtin.ok:
            speedup = builtin.median_s / ours.median_s  # type: ignore[operator]
            vs_builtin = f"{speedup:.2f}×"
            need = 1.0 if batch == 1 else 1.5
            goals.append(f"≥ {need:g}× built-in: {'met' if speedup >= need else 'NOT met'}")
            if batch > 1 and ours.peak_gib is not None and builtin.peak_gib is not None:
                goals.append(f"memory ≤ built-in: {'met' if ours.peak_gib <= builtin.peak_gib else 'NOT met'}")
        elif builtin.error.startswith("out of memory"):
            vs_builtin = "built-in out of memory"
            goals.append("built-in out of memory: met")
    return vs_bound, vs_builtin, "; ".join(goals)


def _training(run: GpuRun, families: dict[str, FamilySpec]) -> list[str]:
    groups: dict[tuple[str, int], dict[str, TrainFigures]] = {}
    for fig in run.train:
        if fig.arm in ("bound", "ours", "builtin") and fig.id.count("/") == 2 and not fig.id.startswith(("cap/",
                                                                                                          "devices/")):
            groups.setdefault((fig.family, fig.batch), {})[fig.arm] = fig
    o = ["### G1. Training step: the in-memory bound, ours, ComfyUI's `TrainLoraNode`", "",
         f"Median seconds per step over {run.steps} steps after {run.warmup} warm-up steps (bf16 model and LoRA, rank "
         "16, AdamW, gradient checkpointing at the depth shown, one caption per image); ours = Train LoRA's "
         "`train_lora` reading the cache through `PrefetchLoader` after the cache's pages were dropped; bound = the "
         "same trainer with every batch on the device before the loop; built-in = `ResolutionBucket` → "
         "`TrainLoraNode(bucket_mode=True)` with the samples in memory. First step: from the trainer's call (model "
         "copy and load included) to the end of its first step. Peak: `torch.cuda.max_memory_allocated` over the "
         "arm, model included. Speed ratios are of step times (ours / bound = bound time ÷ ours).", "",
         "| family | shape, batch | depth | bound s/step | ours s/step | built-in s/step | ours vs bound "
         "| built-in time ÷ ours | first step s: bound / ours / built-in | peak GiB: bound / ours / built-in "
         "| ours data wait | goals |",
         "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for (family, batch), arms in groups.items():
        bound, ours, builtin = arms.get("bound"), arms.get("ours"), arms.get("builtin")
        any_fig = next(iter(arms.values()))
        vs_bound, vs_builtin, goals = _goals(batch, bound, ours, builtin)
        wait = _f(ours.data_wait_pct, ".1f") + "%" if ours is not None and ours.data_wait_pct is not None else "—"
        depth = f"{any_fig.checkpoint_depth}" + (f" ({any_fig.depth_note})" if any_fig.depth_note else "")
        spec = families.get(family)
        title, shape = (spec.title, f"{spec.shape_note}, " if spec.shape_note else "") if spec else (family, "")
        o.append(f"| {title} | {shape}b{batch} | {depth} "
                 f"| {_arm_cell(bound, 'step')} | {_arm_cell(ours, 'step')} | {_arm_cell(builtin, 'step')} "
                 f"| {vs_bound} | {vs_builtin} "
                 f"| {' / '.join(_arm_cell(f, 'first') for f in (bound, ours, builtin))} "
                 f"| {' / '.join(_arm_cell(f, 'peak') for f in (bound, ours, builtin))} | {wait} | {goals} |")
    o += _problems(f for f in run.train if f in [x for g in groups.values() for x in g.values()])
    return o


def _problems(figs: Iterable[TrainFigures]) -> list[str]:
    lines = [f"- `{f.id}`: {f.skipped or f.error}" for f in figs if f.skipped or f.error]
    return ["", "Arms without figures:", *lines] if lines else []


def _grouped(run: GpuRun, prefix: str, title: str, intro: str) -> list[str]:
    figs = [f for f in run.train if f.id.startswith(prefix)]
    o = [title, "", intro]
    if not figs:
        return o
    ref = {f.family: f for f in figs if f.cap_gib is None and f.ok}
    o += ["", "| arm | cap GB | s/step | vs uncapped | peak GiB | first step s | max loss Δ vs uncapped |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for f in figs:
        base = ref.get(f.family)
        speed = "—"
        delta = "—"
        if f.ok and base is not None and base is not f:
            speed = f"{base.median_s / f.median_s:.1%}"  # type: ignore[operator]
            n = min(len(base.losses), len(f.losses))
            if n:
                delta = f"{max(abs(a - b) for a, b in zip(base.losses[:n], f.losses[:n])):.2e}"
        o.append(f"| `{f.id}` | {_f(f.cap_gib, 'g')} | {_arm_cell(f, 'step')} | {speed} | {_arm_cell(f, 'peak')} "
                 f"| {_arm_cell(f, 'first')} | {delta} |")
    return o + _problems(figs)


def _encode(rows: list[EncodeFigures]) -> list[str]:
    o = ["### G4. Encode Dataset on the GPU against `MakeTrainingDataset`", "",
         "The same folder of PNG images with one caption each, full-size random-weight encoders built from ComfyUI's "
         "classes (VAE fp32 weights, ComfyUI picks the working dtype; CLIP-L fp16; T5-XXL stored in fp8 e4m3fn). "
         "Ours: `StreamCache_EncodeDataset.execute` from the folder to a written cache (batch 4; fingerprints and "
         "writes included). Built-in: `LoadImageTextDataSetFromFolder` → `MakeTrainingDataset` into memory. Every "
         "model unloaded before each, so loading the encoders onto the device is included. Free memory: "
         "`torch.cuda.mem_get_info` right after each, what training would get.", ""]
    if not rows:
        return [*o, "Not run."]
    o += ["| row | images | ours images/s | built-in images/s | ours ÷ built-in | free GiB before | free after ours "
          "| free after built-in |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in rows:
        if r.error or r.skipped:
            o.append(f"| {r.title} | {r.images} × {r.size[0]}×{r.size[1]} | {'skipped' if r.skipped else 'failed'} "
                     "| | | | | |")
            notes.append(f"- `{r.id}`: {r.skipped or r.error}")
            continue
        ours = r.images / r.ours_s if r.ours_s else None
        builtin = r.images / r.builtin_s if r.builtin_s else None
        ratio = f"{ours / builtin:.2f}×" if ours and builtin else "—"
        o.append(f"| {r.title} | {r.images} × {r.size[0]}×{r.size[1]} | {_f(ours, '.2f')} | {_f(builtin, '.2f')} "
                 f"| {ratio} | {_f(r.free_before_gib, '.1f')} | {_f(r.ours_free_gib, '.1f')} "
                 f"| {_f(r.builtin_free_gib, '.1f')} |")
    return o + (["", *notes] if notes else [])


def _profile(rows: list[ProfileFigures]) -> list[str]:
    if not rows:
        return []
    o = ["### G5. Where a step's time goes (`--profile`, `torch.profiler`)", "",
         "Per step, averaged over the recorded steps. CPU = step time minus the time the training thread was blocked "
         "in `cuda*Synchronize`: its own Python and kernel-launch work (ours above the bound = the data path's cost on "
         "the training thread, GIL contention with the loader's threads included). H2D: host-to-device copies from "
         "pageable / pinned memory. Labels: time inside our loop's parts.", "",
         "| arm | steps | step ms | CPU ms | blocked ms (syncs) | .item() | device busy ms | H2D pageable (ms) "
         "| H2D pinned | labelled parts ms | top CPU ops ms | trace |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for p in rows:
        if p.error:
            o.append(f"| `{p.id}` | failed: {p.error[:120]} | | | | | | | | | | |")
            continue
        labels = ", ".join(f"{k.split('.')[-1]} {v:.1f}" for k, v in p.labels_ms.items()) or "—"
        top = ", ".join(f"{name} {ms:.1f}" for name, ms in p.top_ops[:4])
        o.append(f"| `{p.id}` | {p.steps} | {p.step_ms:.1f} | {p.cpu_ms:.1f} | {p.sync_ms:.1f} ({p.syncs:.1f}) "
                 f"| {p.items:.1f} | {p.gpu_busy_ms:.1f} | {p.h2d_pageable:.1f} ({p.h2d_pageable_ms:.2f}) "
                 f"| {p.h2d_pinned:.1f} | {labels} | {top} | {p.trace or '—'} |")
    return o


def render(run: GpuRun, families: dict[str, FamilySpec] | None = None) -> str:
    """The section's Markdown (without the markers); ``families`` names and shapes the rows (default: full size)."""
    families = families if families is not None else FULL_FAMILIES
    d = run.device
    state = "finished" if run.finished else "stopped before the end: figures so far"
    o = [TITLE, "",
         f"Regenerate: `{run.command}` (this run: {run.seconds / 60:.1f} min of a {run.budget_s / 60:.1f} min budget, "
         f"{state}).", "",
         f"- Device: {d.name}, {d.memory_gib:.1f} GiB" + (f" (×{d.count})" if d.count > 1 else "")
         + f"; torch {d.torch}" + (f", CUDA {d.cuda}" if d.cuda else "") + (f", cuDNN {d.cudnn}" if d.cudnn else "")
         + f"; ComfyUI {d.comfyui}; Python {d.python}",
         f"- Host: {d.host}",
         "- Models: full-size, random weights, built from ComfyUI's classes on `meta` and loaded by "
         "`comfy.sd.load_diffusion_model_state_dict` (ComfyUI's detection names each family); "
         + ", ".join(f"{families[k].title if k in families else k} built in {v:.0f} s"
                   for k, v in run.builds.items()),
         *[f"- {n}" for n in run.notes], ""]
    o += _training(run, families)
    o += ["", *_grouped(run, "cap/", "### G2. Memory plan under a device cap (#25)",
                        "Ours with `memory` = auto, the device capped with "
                        "`torch.cuda.set_per_process_memory_fraction`; speed against the uncapped run of the same "
                        "settings, losses compared step by step (bf16: equal up to rounding).")]
    o += ["", *_grouped(run, "devices/", "### G3. Every GPU of the machine (#26)",
                        "Ours with `devices` = auto against one GPU: samples/s scale with the GPUs when the step time "
                        "stays flat at the same per-GPU batch.")]
    o += ["", *_encode(run.encode)]
    prof = _profile(run.profile)
    if prof:
        o += ["", *prof]
    return "\n".join(o) + "\n"
