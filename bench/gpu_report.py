"""The GPU section of docs/BENCHMARKS.md, rendered from the accumulated runs (:class:`~bench.gpu_ledger.Ledger`;
nothing measured here). Every row names the run that measured it (``R1`` …), and the header lists the runs.

Goals checked per family/batch (issue #24 item 3): ours ≥ 99% of the in-memory bound's speed; at batch 1 ours at
least as fast as the built-in; at batch ≥ 2 ours ≥ 1.5× the built-in and never more device memory than it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .gpu_figures import EncodeFigures, GpuRun, ProfileFigures, TrainFigures
from .gpu_ledger import Figure, Ledger, owners
from .gpu_models import FULL_FAMILIES, FamilySpec

__all__ = ["render", "PLACEHOLDER", "SECTION", "Arm"]

SECTION = "gpu"
TITLE = "## GPU benchmarks (`scripts/bench-gpu`)"
PLACEHOLDER = f"""{TITLE}

**Unmeasured**: these figures come from `scripts/bench-gpu` on a machine with a CUDA GPU, which has not run on this
version yet. On a GPU machine without network, `scripts/device-prep` here and `scripts/device-run` there (README,
"Benchmarks on a GPU") rewrite this section: step time of the in-memory bound, ours and ComfyUI's `TrainLoraNode` per
family and batch, time to the first step, peak device memory, data wait, Encode Dataset against `MakeTrainingDataset`,
and with `--profile` where a step's time goes.
"""
ACCUMULATE = ("Runs accumulate: a GPU session measures what earlier ones left (`bash scripts/device-run` runs "
              "`scripts/bench-gpu --missing`) and the figures of the groups it did not run again stay, each row "
              "naming the run that measured it; a group measured again replaces the old one (a group = the figures "
              "compared side by side, which always come from one run). The figures: `docs/bench-gpu-results.json`; "
              "`scripts/bench-gpu --merge RESULTS.json` adds a run's `results.json` to it and rewrites this section.")


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "—" if value is None else f"{value:{fmt}}"


@dataclass
class Arm:
    """One arm of a group, over its repetitions (``--repeat``): the median of the per-run medians and their range."""

    figs: list[TrainFigures]

    @property
    def done(self) -> list[TrainFigures]:
        return [f for f in self.figs if f.ok]

    @property
    def ok(self) -> bool:
        return bool(self.done)

    @property
    def median_s(self) -> float | None:
        meds = [f.median_s for f in self.done if f.median_s is not None]
        return statistics.median(meds) if meds else None

    @property
    def spread(self) -> tuple[float, float] | None:
        meds = [f.median_s for f in self.done if f.median_s is not None]
        return (min(meds), max(meds)) if len(meds) > 1 else None

    def quantile(self, q: int) -> float | None:
        """The ``q``-th percentile (10, 90) of every step of every repetition (``None`` under 2 steps)."""
        steps = [x for f in self.done for x in f.step_s]
        if len(steps) < 2:
            return None
        return statistics.quantiles(steps, n=10, method="inclusive")[q // 10 - 1]

    @property
    def first_s(self) -> float | None:
        firsts = [f.first_s for f in self.done if f.first_s is not None]
        return statistics.median(firsts) if firsts else None

    @property
    def peak_gib(self) -> float | None:
        peaks = [f.peak_gib for f in self.done if f.peak_gib is not None]
        return max(peaks) if peaks else None

    @property
    def data_wait_pct(self) -> float | None:
        waits = [f.data_wait_pct for f in self.done if f.data_wait_pct is not None]
        return statistics.median(waits) if waits else None

    @property
    def error(self) -> str:
        return next((f.error for f in self.figs if f.error), "")

    @property
    def skipped(self) -> str:
        return next((f.skipped for f in self.figs if f.skipped), "")


def _cell(arm: Arm | None, what: str) -> str:
    if arm is None:
        return "—"
    if not arm.ok:
        if arm.skipped:
            return "skipped"
        return "out of memory" if arm.error.startswith("out of memory") else "failed"
    if what == "step":
        spread = arm.spread
        return _f(arm.median_s) + (f" ({spread[0]:.3f}–{spread[1]:.3f})" if spread else "")
    value = {"first": arm.first_s, "peak": arm.peak_gib}[what]
    return _f(value, ".1f")


def _goals(batch: int, bound: Arm | None, ours: Arm | None, builtin: Arm | None) -> tuple[str, str, str]:
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


def _spread(bound: Arm | None, ours: Arm | None, builtin: Arm | None = None) -> str:
    """Ours' steps from p10 to p90, then ours against the bound and against the built-in at p10 (the fast steps,
    which noise on the host slows least), e.g. ``1.048–1.440; 100.7%; 1.21×``."""
    if ours is None or not ours.ok:
        return "—"
    lo, hi = ours.quantile(10), ours.quantile(90)
    if lo is None or hi is None:
        return "—"
    bound_lo = bound.quantile(10) if bound is not None and bound.ok else None
    builtin_lo = builtin.quantile(10) if builtin is not None and builtin.ok else None
    return (f"{lo:.3f}–{hi:.3f}; " + (f"{bound_lo / lo:.1%}" if bound_lo is not None else "—")
            + (f"; {builtin_lo / lo:.2f}×" if builtin_lo is not None else ""))


def _label(run: GpuRun, figs: Iterable[Figure] = ()) -> str:
    reps = max((getattr(f, "rep", 0) for f in figs), default=0) + 1
    return f"R{run.number}" + (f" ×{reps}" if reps > 1 else "")


def _order(families: dict[str, FamilySpec], family: str, batch: int) -> tuple[int, int]:
    names = list(families)
    return (names.index(family) if family in names else len(names), batch)


def _training(shown: dict[str, tuple[GpuRun, list[Figure]]], families: dict[str, FamilySpec]) -> list[str]:
    rows = []
    for key, (run, figs) in shown.items():
        train = [f for f in figs if isinstance(f, TrainFigures)]
        if train and key.count("/") == 1 and not key.startswith(("cap/", "ckpt/", "options/", "devices/", "profile/",
                                                                          "encode/")):
            rows.append((_order(families, train[0].family, train[0].batch), run, train))
    o = ["### G1. Training step: the in-memory bound, ours, ComfyUI's `TrainLoraNode`", "",
         "Median seconds per step over the steps after the warm-up (the run's line says how many; bf16 model and "
         "LoRA, rank 16, AdamW, gradient checkpointing at the depth shown, one caption per image); ours = Train "
         "LoRA's `train_lora` reading the cache through `PrefetchLoader` after the cache's pages were dropped; bound "
         "= the same trainer with every batch on the device before the loop; built-in = `ResolutionBucket` → "
         "`TrainLoraNode(bucket_mode=True)` with the samples in memory. A run ×N (`--repeat N`) ran the row's arms N "
         "times in turn: the median of the N medians (their range). Ours and the bound train with `memory` = auto "
         "(the default): from R9 on, at batch 1, it keeps blocks whole (not recomputed) in half the memory every "
         "block checkpointed leaves free, so on a large GPU no block is recomputed; at batch ≥ 2 it checkpoints "
         "every block, as every run before R9 did at every batch (the plans are listed below the table from R9 "
         "on). First step: from the trainer's call "
         "(model copy, load and memory probe included: its remembered result is forgotten before each arm) to "
         "the end of its first step (ours and the bound read their first step's loss at once from R9 on; in the "
         "runs before they reported it once the next step was queued, a step late; from R9 on the phases of ours' "
         "first step are listed below the table). Peak: `torch.cuda.max_memory_allocated` over the "
         "arm, model included. Speed ratios are of step times (ours / bound = bound time ÷ ours). Ours' steps "
         "p10–p90: the spread of ours' step times (every repetition's steps together), then ours vs bound at p10 "
         "(bound p10 ÷ ours p10: the fast steps, which noise on the host slows least) and the built-in's time ÷ "
         "ours at p10.", "",
         "| family | shape, batch | run | depth | bound s/step | ours s/step | built-in s/step | ours vs bound "
         "| built-in time ÷ ours | first step s: bound / ours / built-in | peak GiB: bound / ours / built-in "
         "| ours' steps p10–p90 s; vs bound, built-in ÷ ours at p10 | ours data wait | goals |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|"]
    problems: list[tuple[GpuRun, TrainFigures]] = []
    planned: list[tuple[GpuRun, TrainFigures]] = []
    for (_, batch), run, train in sorted(rows, key=lambda r: r[0]):
        arms = {k: Arm([f for f in train if f.arm == k]) for k in ("bound", "ours", "builtin")}
        bound, ours, builtin = (a if a.figs else None for a in arms.values())
        first = train[0]
        vs_bound, vs_builtin, goals = _goals(batch, bound, ours, builtin)
        wait = _f(ours.data_wait_pct, ".1f") + "%" if ours is not None and ours.data_wait_pct is not None else "—"
        depth = f"{first.checkpoint_depth}" + (f" ({first.depth_note})" if first.depth_note else "")
        spec = families.get(first.family)
        title, shape = (spec.title, f"{spec.shape_note}, " if spec.shape_note else "") if spec else (first.family, "")
        o.append(f"| {title} | {shape}b{batch} | {_label(run, train)} | {depth} "
                 f"| {_cell(bound, 'step')} | {_cell(ours, 'step')} | {_cell(builtin, 'step')} "
                 f"| {vs_bound} | {vs_builtin} "
                 f"| {' / '.join(_cell(a, 'first') for a in (bound, ours, builtin))} "
                 f"| {' / '.join(_cell(a, 'peak') for a in (bound, ours, builtin))} | {_spread(bound, ours, builtin)} "
                 f"| {wait} | {goals} |")
        problems += [(run, f) for f in train if _noted(f)]
        planned += [(run, f) for f in train if f.arm == "ours"]
    return o + _plans(planned) + _startups(planned) + _problems(problems)


def _noted(f: TrainFigures) -> bool:
    """An arm the section names below its table: without figures, or one that left memory allocated."""
    return bool(f.skipped or f.error) or f.kept_memory


def _first_of_each_arm(figs: list[tuple[GpuRun, TrainFigures]], recorded: Callable[[TrainFigures], object]
                       ) -> list[tuple[GpuRun, TrainFigures]]:
    """Each arm's first repetition that recorded what ``recorded`` reads (the plan and the start-up are the same in
    each repetition)."""
    seen: set[str] = set()
    out = []
    for run, f in figs:
        if recorded(f) and f.id not in seen:
            seen.add(f.id)
            out.append((run, f))
    return out


def _plans(figs: list[tuple[GpuRun, TrainFigures]]) -> list[str]:
    """Ours' memory plans, one line per arm that recorded one."""
    lines = [f"- `{f.id}` (R{run.number}): {f.memory_plan}"
             for run, f in _first_of_each_arm(figs, lambda f: f.memory_plan)]
    return ["", "Ours' memory plans:", *lines] if lines else []


def _startups(figs: list[tuple[GpuRun, TrainFigures]]) -> list[str]:
    """Where ours' first step went, one line per arm that recorded it."""
    lines = [f"- `{f.id}` (R{run.number}): {sum(f.startup.values()):.2f} s = "
             + ", ".join(f"{name} {seconds:.2f}" for name, seconds in f.startup.items())
             for run, f in _first_of_each_arm(figs, lambda f: f.startup)]
    if not lines:
        return []
    return ["", "Where ours' first step went (seconds, as the trainer times its phases: from its call to its "
            "first step's end, the loss read):", *lines]


def _problems(figs: list[tuple[GpuRun, TrainFigures]]) -> list[str]:
    seen: set[tuple[str, str]] = set()
    lines, left = [], []
    for run, f in figs:
        why = f.skipped or f.error
        if why and (f.id, why) not in seen:
            seen.add((f.id, why))
            lines.append(f"- `{f.id}` (R{run.number}): {why}")
        if f.kept_memory:
            released = "" if f.released_gib is None else \
                f" (releasing the graph autograd kept of its failed pass gave back {f.released_gib:.1f} GiB)"
            census = f"; Python reaches {f.kept_census}" if f.kept_census else ""
            left.append(f"- `{f.id}` (R{run.number}): {f.left_gib:.1f} GiB still allocated after its clean-up"
                        f"{released}{census}; the arms after it in that run started with it, and their peaks "
                        "include it")
    out = ["", "Arms without figures:", *lines] if lines else []
    return out + (["", "Arms that did not give their device memory back:", *left] if left else [])


def _grouped(shown: dict[str, tuple[GpuRun, list[Figure]]], prefix: str, title: str, intro: str, *,
             reference: str = "none", versus: str = "uncapped", cap_column: bool = True) -> list[str]:
    """A section of groups of ours' arms, each against its group's reference arm (the one whose id ends in
    ``-{reference}/ours``: ``cap/sdxl-none/ours``, ``ckpt/sdxl-exact/ours``), named ``versus`` in the header."""
    groups = [(run, [f for f in figs if isinstance(f, TrainFigures)]) for key, (run, figs) in shown.items()
              if key.startswith(prefix)]
    o = [title, "", intro]
    if not groups:
        return o
    o += ["", f"| arm | run |{' cap GB |' if cap_column else ''} s/step | vs {versus} | peak GiB | first step s "
          f"| max loss Δ vs {versus} |", "|---|---|" + "---:|" * (6 if cap_column else 5)]
    problems: list[tuple[GpuRun, TrainFigures]] = []
    planned: list[tuple[GpuRun, TrainFigures]] = []
    for run, figs in groups:
        arms = {i: Arm([f for f in figs if f.id == i]) for i in dict.fromkeys(f.id for f in figs)}
        ref = next((a for i, a in arms.items() if a.ok and i.endswith(f"-{reference}/ours")), None)
        for arm_id, arm in arms.items():
            speed = delta = "—"
            if arm.ok and ref is not None and ref is not arm:
                speed = f"{ref.median_s / arm.median_s:.1%}"  # type: ignore[operator]
                delta = _loss_delta(ref.done[0], arm.done[0])
            cap = f" {_f(arm.figs[0].cap_gib, 'g')} |" if cap_column else ""
            o.append(f"| `{arm_id}` | {_label(run, arm.figs)} |{cap} {_cell(arm, 'step')} | {speed} "
                     f"| {_cell(arm, 'peak')} | {_cell(arm, 'first')} | {delta} |")
            problems += [(run, f) for f in arm.figs if _noted(f)]
            planned += [(run, f) for f in arm.figs]
    return o + _plans(planned) + _startups(planned) + _problems(problems)


def _loss_delta(ref: TrainFigures, fig: TrainFigures) -> str:
    """The largest difference of the two arms' losses step by step (their first repetitions: same seed, same
    batches)."""
    n = min(len(ref.losses), len(fig.losses))
    return f"{max(abs(a - b) for a, b in zip(ref.losses[:n], fig.losses[:n])):.2e}" if n else "—"


def _rate(images: int, seconds: float | None) -> float | None:
    return images / seconds if seconds else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "—"


def _encode(shown: dict[str, tuple[GpuRun, list[Figure]]]) -> list[str]:
    rows = [(run, f) for key, (run, figs) in shown.items() if key.startswith("encode/")
            for f in figs if isinstance(f, EncodeFigures)]
    o = ["### G4. Encode Dataset on the GPU against `MakeTrainingDataset`", "",
         "The same folder of PNG images with one caption each, full-size random-weight encoders built from ComfyUI's "
         "classes (VAE fp32 weights, ComfyUI picks the working dtype; CLIP-L fp16; T5-XXL stored in fp8 e4m3fn). "
         "Ours: `StreamCache_EncodeDataset.execute` from the folder to a written cache (batch 4; fingerprints and "
         "writes included); at its end it unloads its encoders (*release*: their weights copied back to the host, "
         "~5 GB for T5-XXL), timed inside its run. Built-in: `LoadImageTextDataSetFromFolder` → "
         "`MakeTrainingDataset` into memory, which leaves the encoders loaded; training unloads them later, when it "
         "needs the memory: the same copy, paid then, timed here right after it as `unload_all_models()` + "
         "`soft_empty_cache()`. *Encode* = without the release, *+ release* = with it, for both. Every model unloaded "
         "before each, so loading the encoders onto the device is included; both ran once untimed on 4 images "
         "first, so neither pays for the first use of the kernels (a row without it says so below: ours, always "
         "first, paid it). Free memory: `torch.cuda.mem_get_info` "
         "right after each (the built-in's: with its encoders loaded / after the release), what training would get. "
         "From R9 on, where ours' seconds went is listed below the table: `plan` (the folder listed and hashed), "
         "`run` (the encode), and the run's own parts (`encoder`: the encoders' calls, loading them included).",
         ""]
    if not rows:
        return [*o, "Not run."]
    o += ["| row | run | images | ours images/s: encode / + release | built-in images/s: encode / + release "
          "| ours ÷ built-in: encode / + release | release s: ours / built-in | free GiB before | free after ours "
          "| free after built-in: loaded / released |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for run, r in rows:
        size = f"{r.images} × {r.size[0]}×{r.size[1]}"
        if r.error or r.skipped:
            o.append(f"| {r.title} | R{run.number} | {size} | {'skipped' if r.skipped else 'failed'} | | | | | | |")
            notes.append(f"- `{r.id}` (R{run.number}): {r.skipped or r.error}")
            continue
        ours_with = _rate(r.images, r.ours_s)
        ours_enc = _rate(r.images, r.ours_s - r.ours_release_s) if r.ours_s and r.ours_release_s is not None \
            else None
        builtin_enc = _rate(r.images, r.builtin_s)
        builtin_with = _rate(r.images, r.builtin_s + r.builtin_release_s) \
            if r.builtin_s and r.builtin_release_s is not None else None
        o.append(f"| {r.title} | R{run.number} | {size} | {_f(ours_enc, '.2f')} / {_f(ours_with, '.2f')} "
                 f"| {_f(builtin_enc, '.2f')} / {_f(builtin_with, '.2f')} "
                 f"| {_ratio(ours_enc, builtin_enc)} / {_ratio(ours_with, builtin_with)} "
                 f"| {_f(r.ours_release_s, '.2f')} / {_f(r.builtin_release_s, '.2f')} | {_f(r.free_before_gib, '.1f')} "
                 f"| {_f(r.ours_free_gib, '.1f')} | {_f(r.builtin_free_gib, '.1f')} / "
                 f"{_f(r.builtin_released_free_gib, '.1f')} |")
        if r.ours_release_s is None:
            notes.append(f"- `{r.id}` (R{run.number}): the releases were not timed in that run; ours with its "
                         f"release ÷ the built-in without: {_ratio(ours_with, builtin_enc)}")
        if r.ours_phases:
            notes.append(f"- `{r.id}` (R{run.number}): ours' seconds: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r.ours_phases.items() if v >= 0.005))
        if r.warmup_s is None and r.ours_release_s is not None:
            notes.append(f"- `{r.id}` (R{run.number}): no warm-up in that run: ours ran first on kernels the process "
                         "had not used yet")
    return o + (["", *notes] if notes else [])


def _profile(shown: dict[str, tuple[GpuRun, list[Figure]]]) -> list[str]:
    rows = [(run, p) for run, figs in shown.values() for p in figs if isinstance(p, ProfileFigures)]
    if not rows:
        return []
    o = ["### G5. Where a step's time goes (`--profile`, `torch.profiler`)", "",
         "Per step, averaged over the recorded steps. CPU = step time minus the time the training thread was blocked "
         "in `cuda*Synchronize`: its own Python and kernel-launch work (ours above the bound = the data path's cost on "
         "the training thread, GIL contention with the loader's threads included; the built-in against the bound = "
         "what the two trainers' steps cost the host, data aside: its step runs from one `fwd_bwd` call's start to "
         "the next). H2D: host-to-device copies from "
         "pageable / pinned memory. Labels: time inside our loop's parts.", "",
         "| arm | run | steps | step ms | CPU ms | blocked ms (syncs) | .item() | device busy ms | H2D pageable (ms) "
         "| H2D pinned | labelled parts ms | top CPU ops ms | trace |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for run, p in rows:
        if p.error:
            o.append(f"| `{p.id}` | R{run.number} | failed: {p.error[:120]} | | | | | | | | | | |")
            continue
        labels = ", ".join(f"{k.split('.')[-1]} {v:.1f}" for k, v in p.labels_ms.items()) or "—"
        top = ", ".join(f"{name} {ms:.1f}" for name, ms in p.top_ops[:4])
        o.append(f"| `{p.id}` | R{run.number} | {p.steps} | {p.step_ms:.1f} | {p.cpu_ms:.1f} "
                 f"| {p.sync_ms:.1f} ({p.syncs:.1f}) | {p.items:.1f} | {p.gpu_busy_ms:.1f} "
                 f"| {p.h2d_pageable:.1f} ({p.h2d_pageable_ms:.2f}) | {p.h2d_pinned:.1f} | {labels} | {top} "
                 f"| {p.trace or '—'} |")
    return o


def _run_line(run: GpuRun, families: dict[str, FamilySpec]) -> str:
    d = run.device
    state = "finished" if run.finished else "stopped before the end"
    builds = ", ".join(f"{families[k].title if k in families else k} {v:.0f} s" for k, v in run.builds.items())
    return (f"- **R{run.number}** {run.date or 'date unknown'}, {d.name} {d.memory_gib:.1f} GiB"
            + (f" (×{d.count})" if d.count > 1 else "") + f", commit {run.commit or 'unknown'}: `{run.command}` "
            f"({run.seconds / 60:.1f} min of a {run.budget_s / 60:.1f} min budget, {state}; {run.steps} steps after "
            f"{run.warmup} warm-up" + (f", rows ×{run.repeat}" if run.repeat > 1 else "") + "). "
            f"torch {d.torch}" + (f", CUDA {d.cuda}" if d.cuda else "") + (f", cuDNN {d.cudnn}" if d.cudnn else "")
            + f"; ComfyUI {d.comfyui}; Python {d.python}; host: {d.host}."
            + (f" Models built in: {builds}." if builds else "")
            + (" Notes: " + "; ".join(n.rstrip(".") for n in run.notes) + "." if run.notes else ""))


def render(runs: Ledger | GpuRun, families: dict[str, FamilySpec] | None = None,
           pending: list[str] | None = None) -> str:
    """The section's Markdown (without the markers) from the accumulated runs (or one run); ``families`` names and
    shapes the rows (default: full size); ``pending``: the groups still without figures, in the order
    ``--missing`` runs them."""
    families = families if families is not None else FULL_FAMILIES
    ledger = runs if isinstance(runs, Ledger) else Ledger([runs if runs.number else _numbered(runs)])
    if not ledger.runs:
        return PLACEHOLDER
    shown = owners(ledger.runs)
    o = [TITLE, "", ACCUMULATE, "", "Runs:", "", *[_run_line(r, families) for r in ledger.runs],
         "- Models: full-size, random weights, built from ComfyUI's classes on `meta` and loaded by "
         "`comfy.sd.load_diffusion_model_state_dict` (ComfyUI's detection names each family).", ""]
    o += _training(shown, families)
    o += ["", *_grouped(shown, "cap/", "### G2. Memory plan under a device cap (#25)",
                        "Ours with `memory` = auto, the device capped with "
                        "`torch.cuda.set_per_process_memory_fraction`; speed against the uncapped run of the same "
                        "settings (same run), losses compared step by step (bf16: equal up to rounding).")]
    o += ["", *_grouped(shown, "devices/", "### G3. Every GPU of the machine (#26)",
                        "Ours with `devices` = auto against one GPU: samples/s scale with the GPUs when the step time "
                        "stays flat at the same per-GPU batch.")]
    o += ["", *_encode(shown)]
    o += ["", *_grouped(shown, "ckpt/", "### G6. How ours checkpoints: exact, fast, blocks kept whole",
                        "Ours at batch 1, where the step is host-bound. `exact`: every block checkpointed (`memory` = "
                        "no offload) with torch's non-reentrant checkpoint (the same gradients bit for bit as "
                        "ComfyUI's node); `fast`: the same with the reentrant one (fewer ops and Python calls per "
                        "step, gradients equal up to rounding); `kept` (runs from R9 on): `memory` = auto + keep "
                        "blocks whole (at batch 1 the plan auto picks), blocks kept whole (not recomputed) in half the "
                        "memory every block checkpointed leaves free, the rest exact (bit for bit as exact). "
                        "`ckpt/sdxl_b4`: exact and kept at batch 4, where auto checkpoints every block: what the mode "
                        "buys and what memory it costs. Speed against exact (same run), losses compared step by "
                        "step; the plans below the table. Runs before R9 measured `exact` and `fast` with `memory` = "
                        "auto, which then checkpointed every block: the same plan.",
                        reference="exact", versus="exact", cap_column=False)]
    o += ["", *_grouped(shown, "options/",
                        "### G7. The step's options: gradient clipping, the weights' average, Min-SNR, part of the "
                        "layers, Prodigy, Adafactor, Lion, the 8-bit optimizers, dropout",
                        "Ours at batch 1 (`memory` = auto) without the step's options (`plain`; the gradient norm is "
                        "measured every step all the same) and with each: `clip` = `max_grad_norm` 1, `ema` = "
                        "`ema_decay` 0.999 (an fp32 average of the bf16 LoRA, updated every step), `snr` = "
                        "`min_snr_gamma` 5; `all` = the three; `layers` = adapters on part of the layers "
                        "(`train_layers` `attn` for SD1.5 and SDXL, `double_blocks` for Flux: "
                        "`bench/train_layers.py` counts what each trains); `prodigy` = `optimizer` Prodigy at "
                        "`learning_rate` 1 (plain: AdamW); `adafactor` = `optimizer` Adafactor (kohya's settings); "
                        "`lion`, `adamw8bit`, `lion8bit` = `optimizer` Lion, AdamW8bit, Lion8bit (bitsandbytes' "
                        "8-bit optimizers in PyTorch; the Lions at `learning_rate` 1e-4); "
                        "`dropout` = `rank_dropout` and `module_dropout` 0.1. Speed against plain (same run); "
                        "losses compared step by step (the average does not change the training's losses; "
                        "clipping, Min-SNR, another LoRA, another optimizer and dropout do). "
                        "`bench/bench_step_extras.py`, `bench/bench_prodigy.py`, `bench/bench_adafactor.py`, "
                        "`bench/bench_lion.py`, `bench/bench_adamw8bit.py` and "
                        "`scripts/bench-comfy dropout` count the ops each adds on the CPU.",
                        reference="plain", versus="plain", cap_column=False)]
    prof = _profile(shown)
    if prof:
        o += ["", *prof]
    if pending:
        o += ["", "Still without figures (or whose last figures are partial, skipped or failed), in the order "
              "`scripts/bench-gpu --missing` runs them: " + ", ".join(f"`{k}`" for k in pending) + "."]
    return "\n".join(o) + "\n"


def _numbered(run: GpuRun) -> GpuRun:
    from dataclasses import replace

    return replace(run, number=1)
