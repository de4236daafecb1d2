"""The ComfyUI section of docs/BENCHMARKS.md and its chart (``bench_comfy.png``), from a :class:`ComfyRun`.

Why apart from the driver: rendering only formats figures already measured, so the tests render a run of fixed
figures without ComfyUI; one function per section of the doc (C1, C2, C5) keeps each table next to its caption.
"""

from __future__ import annotations

from typing import Any

from .comfy_driver import ComfyRun
from .comfy_train import TRAIN_LATENT, TRAIN_OPTS
from .common import med
from .report import growth, machine_lines, stat

__all__ = ["render", "plot_panels", "render_header", "render_open", "render_train", "render_reencode"]

_TRAINERS = ["ours", "bound", "builtin"]
_LABELS = {"ours": "ours (StreamCache)", "bound": "bound (in memory)", "builtin": "built-in TrainLoraNode"}


def _open_series(run: ComfyRun) -> tuple[dict[str, list], dict[str, list]]:
    """C1 medians over N per design: open ms, RSS growth MiB (floored at 0.01 for the log scale)."""
    plot_t: dict[str, list] = {}
    plot_m: dict[str, list] = {}
    for n, res in run.open.items():
        for name, kind in (("built-in", "builtin"), ("ours", "ours"), ("lazy", "lazy")):
            d = res[kind]
            plot_t.setdefault(name, []).append((n, med(d["open_s"]) * 1e3))
            plot_m.setdefault(name, []).append((n, max(med(d["growth_mib"]), 0.01)))
    return plot_t, plot_m


def _train_order(run: ComfyRun) -> list[tuple[str, int]]:
    return sorted(run.train, key=lambda k: (k[1], _TRAINERS.index(k[0])))


def _peaks(run: ComfyRun) -> dict[str, list]:
    """C2 peak RSS over N per trainer ("ours", "bound", "built-in"), failed runs left out."""
    peaks: dict[str, list] = {}
    for (kind, n) in _train_order(run):
        r = run.train[(kind, n)]
        if "error" not in r:
            label = _LABELS[kind]
            peaks.setdefault(label.split(" (")[0] if kind != "builtin" else "built-in", []).append((n, r["peak_mib"]))
    return peaks


def plot_panels(run: ComfyRun) -> list[dict[str, Any]]:
    """The panels of ``bench_comfy.png``: C1 over N (with > 1 open size) and C2 peak RSS over N; none when C5 did
    not run (the section then ends before the chart) or when nothing has more than one N."""
    peaks = _peaks(run)
    if not run.reencode or not (len(run.open) > 1 or len(peaks.get("ours", [])) > 1):
        return []
    plot_t, plot_m = _open_series(run)
    panels: list[dict[str, Any]] = []
    if len(run.open) > 1:
        panels += [{"title": "Open a dataset (SD1.5), ms", "xlabel": "N samples", "ylabel": "ms",
                    "series": plot_t},
                   {"title": "RSS growth after open, MiB", "xlabel": "N samples", "ylabel": "MiB",
                    "series": plot_m}]
    if any(len(v) > 1 for v in peaks.values()):
        panels.append({"title": "Training peak RSS, MiB", "xlabel": "N samples", "ylabel": "MiB",
                       "series": peaks, "logy": False})
    return panels


def render(run: ComfyRun, cmd: str, plot_name: str | None = None) -> str:
    """The ComfyUI section of docs/BENCHMARKS.md for ``run``; ``cmd`` is the command shown to regenerate it and
    ``plot_name`` the chart (beside the doc) to link, if one was drawn."""
    o = render_header(run, cmd) + render_open(run) + render_train(run)
    if not run.reencode:
        return "\n".join(o) + "\n"
    o += render_reencode(run)
    if plot_name:
        o += ["", f"![open and training memory vs N]({plot_name})"]
    return "\n".join(o) + "\n"


def render_header(run: ComfyRun, cmd: str) -> list[str]:
    """The section's title, how to regenerate it, and the machine."""
    return [
        "## ComfyUI benchmarks (`scripts/bench-comfy`)",
        "",
        f"Regenerate: `{cmd}` (this run: mode {run.mode}, took {run.seconds / 60:.1f} min). "
        "Runs under ComfyUI's python and "
        "calls ComfyUI's own node functions in-process on the CPU (`args.cpu = True`).",
        "",
        *machine_lines(run.machine),
        "",
    ]


def render_open(run: ComfyRun) -> list[str]:
    """C1: one row per N (built-in vs ours vs lazy, the ratios and the goals), then the growth with N."""
    o = [
        "### C1. Open a dataset: ours vs the built-in `LoadTrainingDataset` vs the lazy-branch design",
        "",
        "The same SD1.5-sized samples (latent 4×64×64 fp16, conditioning 77×768 fp16 + pooled 768; ≈150 KB) "
        "written by the built-in `SaveTrainingDataset.execute` (shard_size 1000), by our `CacheWriter` and in the "
        f"lazy-branch layout. Each open in a fresh interpreter, {run.runs} runs interleaved, page cache warm. "
        "*Built-in*: `LoadTrainingDataset.execute(folder)` (this ComfyUI version `torch.load`s every shard: every "
        "tensor is read into RAM). *Ours*: `open_cache` + the dataset's sample list. *Lazy*: skeleton pickles + "
        "safetensors headers. RSS growth = RSS after opening (output alive) − RSS before, after imports. "
        "Goals at 5k: ≥ 100× faster and ≥ 20× less memory than the built-in; no slower than lazy.",
        "",
        "| N | built-in save s | built-in open ms | built-in RSS growth MiB | ours open ms | ours RSS growth MiB "
        "| lazy open ms | lazy RSS growth MiB | built-in / ours time | built-in / ours memory | goals |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    plot_t, plot_m = _open_series(run)
    for n, res in run.open.items():
        o.append(_open_row(n, run.save_s[n], res))
    ns = list(run.open)
    if len(ns) > 1:
        o += ["", "Growth with N (first to last N): " + "; ".join(
            f"{name} time {growth(ns, [y for _, y in pts])}" for name, pts in plot_t.items()) + "; " + "; ".join(
            f"{name} memory {growth(ns, [y for _, y in pts])}" for name, pts in plot_m.items()) + "."]
    return o


def _open_row(n: int, save_s: float, res: dict[str, dict[str, list[float]]]) -> str:
    """C1's table row at N."""
    b, u, lz = res["builtin"], res["ours"], res["lazy"]
    tr = med(b["open_s"]) / med(u["open_s"])
    mr = med(b["growth_mib"]) / max(med(u["growth_mib"]), 0.01)
    goals = []
    goals.append(f"time ≥100×: {'met' if tr >= 100 else 'NOT met'}")
    goals.append(f"memory ≥20×: {'met' if mr >= 20 else 'NOT met'}")
    goals.append(f"≤ lazy: {'met' if med(u['open_s']) <= med(lz['open_s']) else 'NOT met'}")
    mem_note = f"{mr:.0f}×" if med(u["growth_mib"]) >= 0.01 else f"> {mr:.0f}× (ours < 0.01 MiB)"
    return (f"| {n} | {save_s:.1f} | {stat(b['open_s'], 1e3, '.0f')} | {stat(b['growth_mib'], fmt='.0f')} "
            f"| {stat(u['open_s'], 1e3, '.2f')} | {stat(u['growth_mib'], fmt='.2f')} "
            f"| {stat(lz['open_s'], 1e3, '.2f')} | {stat(lz['growth_mib'], fmt='.2f')} | {tr:.0f}× | {mem_note} "
            f"| {'; '.join(goals)} |")


def render_train(run: ComfyRun) -> list[str]:
    """C2: one row per (N, trainer), vs the bound at the same N, then the peak RSS growth with N."""
    o = [
        "",
        "### C2. Training: time to first step, steady steps/s, peak RSS",
        "",
        f"Tiny SD1.5-shaped UNet (13.6M params), CPU, fp32, LoRA rank 4, AdamW, batch {TRAIN_OPTS['batch_size']}, "
        f"{run.steps} steps, one resolution bucket. Samples: latent {'×'.join(map(str, TRAIN_LATENT[1:]))} fp32 "
        "(kept small so a CPU step stays short) + a real CLIP-L conditioning from the tiny text encoder (77×768 + "
        "pooled 768, fp16): ≈120 KB a sample. Each run in a fresh interpreter (ComfyUI imported, model loaded, then "
        "the clock starts). *Ours*: `train_lora` (what `StreamCache_TrainLoRA` runs), prefetch 2, from the cache. "
        "*Built-in*: `LoadTrainingDataset` → `ResolutionBucket` → `TrainLoraNode(bucket_mode=True)`, same options. "
        "*Bound*: our loop with every batch read into (CPU) device memory before the clock of the first step. "
        "First step = clock start → end of the first step (includes opening/loading the dataset; ours: "
        "`train_lora`'s `on_step` after the optimizer step, built-in: the end of its forward/backward). "
        "Steady step = time between consecutive step ends, steps 3.. (median (min–max); ours reads a step's loss "
        "once the next step is queued, the first one at once: it trains one step more than the table times, "
        "whose report follows the one before at once). "
        "Peak RSS = the process's VmHWM (includes ComfyUI, torch and the model). "
        "Goals: ours' steady steps/s within 5% of the bound; ours' peak RSS flat in N.",
        "",
        "| N | trainer | first step s | steady step ms | steps/s | vs bound | peak RSS MiB | goal |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    o += [_train_row(run, kind, n) for (kind, n) in _train_order(run)]
    peaks = _peaks(run)
    if peaks.get("ours") and len(peaks["ours"]) > 1:
        xs = [x for x, _ in peaks["ours"]]
        o += ["", "Peak RSS growth with N: " + "; ".join(
            f"{k} {growth([x for x, _ in v], [y for _, y in v])}" for k, v in peaks.items() if len(v) > 1)
            + f" (goal for ours: flat — "
              f"{'met' if growth(xs, [y for _, y in peaks['ours']]).startswith('flat') else 'NOT met'})."]
    return o


def _train_row(run: ComfyRun, kind: str, n: int) -> str:
    """C2's table row for ``kind`` at N (a failed run shows the last line of its error)."""
    r = run.train[(kind, n)]
    label = _LABELS[kind]
    if "error" in r:
        return f"| {n} | {label} | failed | | | | | {r['error'][-200:].replace('|', '/').splitlines()[-1]} |"
    sps = 1 / med(r["step_s"]) if r["step_s"] else 0
    bound = run.train.get(("bound", n), {})
    vs, goal = "", ""
    if bound and "error" not in bound and bound.get("step_s"):
        ratio = sps * med(bound["step_s"])
        vs = f"{ratio:.1%}"
        if kind == "ours":
            goal = "within 5%: " + ("met" if ratio >= 0.95 else "NOT met")
    steady = stat(r["step_s"], 1e3, ".0f") if r["step_s"] else "— (too few steps)"
    return (f"| {n} | {label} | {r['first_s']:.2f} | {steady} | {sps:.2f} | {vs} "
            f"| {r['peak_mib']:.0f} | {goal} |")


def render_reencode(run: ComfyRun) -> list[str]:
    """C5: the built-in node's encoder calls before and after the edit (only when C5 ran)."""
    reenc = run.reencode
    return [
        "",
        "### C5. Built-in re-encode after a 1% edit (real `MakeTrainingDataset`, tiny VAE + CLIP)",
        "",
        f"{reenc['n']} images of 64×64 with one caption each; then {reenc['edited']} captions edited and "
        f"{reenc['added']} images added. The built-in node has no cache: every run encodes every image and caption. "
        "Ours on the same edit: see L5 above (only the edited captions and the new images are encoded).",
        "",
        "| run | images | VAE encode calls | CLIP encode calls | wall s |",
        "|---|---:|---:|---:|---:|",
        f"| first | {reenc['n']} | {reenc['first_vae']} | {reenc['first_clip']} | {reenc['first_s']:.2f} |",
        f"| after the edit | {reenc['n'] + reenc['added']} | {reenc['edit_vae']} | {reenc['edit_clip']} "
        f"| {reenc['edit_s']:.2f} |",
    ]
