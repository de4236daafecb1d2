"""The step-ops section of docs/BENCHMARKS.md, rendered from :class:`bench.step_ops.ArmCounts` (nothing measured)."""

from __future__ import annotations

import collections
from typing import Any

from .gpu_models import FamilySpec
from .step_ops_count import CATEGORIES, METADATA_OPS, PHASES, SYNC_OPS

__all__ = ["render", "TITLE"]

TITLE = "## Ops per training step, counted on the CPU (`scripts/bench-step-ops`)"
_PYTHON_CATEGORIES = {**CATEGORIES, "torch": "torch's own Python with no caller of ours or ComfyUI's"}


def render(results: list[Any], families: dict[str, FamilySpec], device: Any, command: str, seconds: float,
           timed: int = 3, counted: int = 2) -> str:
    """The whole section (title, how it was made, the tables)."""
    lines = [TITLE, "", f"Regenerate: `{command}` (this run: {seconds / 60:.1f} min, torch's intra-op threads: 1).",
             "", f"- Machine: {device.name}; {device.host}",
             f"- Versions: torch {device.torch}; ComfyUI {device.comfyui}; Python {device.python}",
             "- Models: " + "; ".join(f"{f.title} {_structure(f)}" for f in families.values())
             + " (ComfyUI's classes at full depth, narrow; random weights; ComfyUI's detection names each family)",
             "- Settings: fp32 model and LoRA, rank 16, AdamW, MSE, checkpoint depth 1 (the built-in's one checkpoint "
             "around the whole model); ours and the bound with `memory` auto (on a CPU, whose memory free is its "
             "RAM, every block is kept whole: nothing recomputed), `lean` = ours with `memory` no offload (every "
             "block its own checkpoint, as ours was before blocks were kept whole); AdamW takes its `foreach` "
             "implementation as on "
             "CUDA (the CPU added to torch's list of foreach devices for the run; on the CPU it would loop over the "
             "parameters, ~10 ops and an `.item()` each); ComfyUI's models attend with `attention_pytorch` (torch's "
             "SDPA), as ComfyUI picks on an NVIDIA GPU (on the CPU it picks its sub-quadratic attention)",
             f"- Per arm: 2 warm-up steps, {timed} steps timed (nothing counted), 1 step of Python calls counted, 1 "
             f"step following host tensors, {counted} steps counted (" + _equal(results) + "), 1 more step. A "
             "step: ours from one `on_step` to the next, the built-in from one `fwd_bwd` call to the next",
             f"- No kernel on a GPU: {', '.join(f'`{n}`' for n in sorted(METADATA_OPS))}",
             f"- Host syncs: {', '.join(f'`{n}`' for n in sorted(SYNC_OPS))} on a device tensor; copies between host "
             "and device (no-ops on the CPU, seen by wrapping `Tensor.to`, `Tensor.cpu`, `torch.tensor(device=)`): "
             "device → host, and host → device unless `non_blocking` (torch makes a pageable copy blocking)",
             "- Host ops: on tensors a GPU run keeps on the host (AdamW's `step` counters; outside the model, tensors "
             "made from nothing: random draws with the CPU's generator, `torch.tensor(data)`, `torch.arange(n)`; "
             "what is computed from host tensors alone): no kernel, no sync",
             "- Not seen on the CPU: bf16 autocast's casts, the several kernels one `_foreach_*` op launches (one per "
             "~50–110 tensors), a device tensor indexed by a host one, the loss read of ours on CUDA (a "
             "non-blocking copy to pinned memory, waited for a step later)", ""]
    lines += _totals(results, families)
    lines += _by_category(results, families)
    lines += _python(results, families)
    lines += _differences(results, families)
    lines += _layer_path(results, families)
    lines += _collector(results, families, timed)
    return "\n".join(lines).rstrip() + "\n"


def _equal(results: list[Any]) -> str:
    ok = _ok(results)
    same = sum(all(w == r.counts.windows[0] for w in r.counts.windows) for r in ok)
    return (f"equal op for op in {same} of {len(ok)} arms" if same < len(ok) else
            "every arm's counted steps equal op for op")


def _structure(spec: FamilySpec) -> str:
    c = spec.unet_config
    if "transformer_depth" in c:
        return (f"(transformer depths {c['transformer_depth']}, middle {c['transformer_depth_middle']}, output "
                f"{c['transformer_depth_output']}; {spec.shape_note})")
    if "depth_single_blocks" in c:
        return f"({c['depth']} double + {c['depth_single_blocks']} single blocks; {spec.shape_note})"
    if "num_layers" in c:
        return f"({c['num_layers']} blocks; {spec.shape_note})"
    return f"({spec.shape_note})"


def _k(v: float) -> str:
    return f"{v:,.0f}" if v == int(v) else f"{v:,.1f}"


def _title(r: Any, families: dict[str, FamilySpec]) -> str:
    return families[r.family].title if r.family in families else r.family


def _ok(results: list[Any]) -> list[Any]:
    return [r for r in results if not r.error]


def _totals(results: list[Any], families: dict[str, FamilySpec]) -> list[str]:
    out = ["### S1. Per step: dispatcher ops, kernels, host syncs, by phase", "",
           "`forward`: inside the model call; `recompute`: checkpointed forwards run again in the backward; `loop`: "
           "everything else on the training thread (batch, conditioning, loss, bookkeeping). CPU s/step: median of "
           "the timed steps (a rough proxy: on the CPU the model's arithmetic dominates). Python calls: function "
           "calls of the training thread in one step.", "",
           "| family | batch | arm | ops/step | kernel | no kernel | host | syncs | "
           + " | ".join(PHASES) + " | Python calls | CPU s/step |",
           "|" + "---|" * 3 + "---:|" * (7 + len(PHASES))]
    for r in results:
        if r.error:
            out.append(f"| {_title(r, families)} | {r.batch} | {r.arm} | failed: {r.error[:160]} |"
                       + " |" * (6 + len(PHASES)))
            continue
        c = r.counts
        cells = [_k(c.per_step()), _k(c.per_step(kind="kernel")), _k(c.per_step(kind="meta")),
                 _k(c.per_step(kind="host")), _k(c.per_step(kind="sync"))]
        cells += [_k(c.per_step(phase=p)) for p in PHASES]
        cells += [f"{c.calls_per_step():,}", f"{r.median_s:.2f}" if r.median_s is not None else "—"]
        out.append(f"| {_title(r, families)} | {r.batch} | {r.arm} | " + " | ".join(cells) + " |")
    return out + [""]


def _by_category(results: list[Any], families: dict[str, FamilySpec]) -> list[str]:
    cats = [k for k in CATEGORIES if any(r.counts.per_step(kind="kernel", category=k) for r in _ok(results))]
    out = ["### S2. Kernel-launching ops per step, by where they come from", "",
           "; ".join(f"`{k}`: {CATEGORIES[k]}" for k in cats) + ".", "",
           "| family | batch | arm | " + " | ".join(cats) + " |", "|---|---|---|" + "---:|" * len(cats)]
    for r in _ok(results):
        out.append(f"| {_title(r, families)} | {r.batch} | {r.arm} | "
                   + " | ".join(_k(r.counts.per_step(kind="kernel", category=k)) for k in cats) + " |")
    return out + [""]


def _python(results: list[Any], families: dict[str, FamilySpec]) -> list[str]:
    cats = [k for k in _PYTHON_CATEGORIES if any(r.counts.calls_per_step(category=k) for r in _ok(results))]
    out = ["### S3. Python calls per step, by whom they are made for", "",
           "A call counts for the innermost caller that is not torch's or the standard library's (a module's "
           "`__call__` machinery called by the model's layers counts for `model`); `checkpoint`: torch's checkpoint "
           "code, for every checkpointed block.", "",
           "| family | batch | arm | " + " | ".join(cats) + " |", "|---|---|---|" + "---:|" * len(cats)]
    for r in _ok(results):
        out.append(f"| {_title(r, families)} | {r.batch} | {r.arm} | "
                   + " | ".join(f"{r.counts.calls_per_step(category=k):,}" for k in cats) + " |")
    return out + [""]


def _pairs(results: list[Any]) -> list[tuple[Any, Any]]:
    by = {(r.family, r.batch, r.arm): r for r in _ok(results)}
    return [(by[(f, b, "ours")], by[(f, b, "builtin")]) for (f, b, a) in by if a == "ours" and (f, b, "builtin") in by]


def _differences(results: list[Any], families: dict[str, FamilySpec], top: int = 6) -> list[str]:
    out = ["### S4. The built-in against ours, by call site", "",
           f"The {top} sites whose ops per step differ most (built-in − ours; `backward`/`optimizer`: the whole "
           "phase).",
           "", "| family | batch | site | built-in | ours | difference |", "|---|---|---|---:|---:|---:|"]
    for ours, builtin in _pairs(results):
        o, b = _site_steps(ours), _site_steps(builtin)
        diffs = sorted(set(o) | set(b), key=lambda s: (-abs(b.get(s, 0) - o.get(s, 0)), s))[:top]
        for site in diffs:
            cat, where = site.split("|", 1)
            delta = b.get(site, 0) - o.get(site, 0)
            if delta:
                out.append(f"| {_title(ours, families)} | {ours.batch} | {cat}: `{where}` | {_k(b.get(site, 0))} | "
                           f"{_k(o.get(site, 0))} | {delta:+,.0f} |")
    return out + [""]


def _site_steps(r: Any) -> dict[str, float]:
    return {k: v / max(r.counts.steps, 1) for k, v in r.counts.sites.items()}


def _layer_path(results: list[Any], families: dict[str, FamilySpec]) -> list[str]:
    out = ["### S5. ComfyUI's per-layer weight path (ours with every block checkpointed, `lean`, batch 1)", "",
           "Ops per step of the weight cast and the adapters (forward and recompute; their backward is in "
           "`backward`), and per LoRA layer and pass (LoRA layers: the adapter's `mm` count / 2, the two passes "
           "being the forward and the recompute).", "",
           "| family | layers | op | kind | per step | per layer and pass |", "|---|---:|---|---|---:|---:|"]
    for r in _ok(results):
        if r.arm != "lean" or r.batch != 1:
            continue
        n = max(r.counts.steps, 1)
        ops: collections.Counter = collections.Counter()
        for key, v in r.counts.ops.items():
            cat, rest = key.split("|", 1)
            if cat in ("cast", "adapter", "bias"):
                ops[(cat, rest)] += v / n
        layers = ops.get(("adapter", "kernel:mm"), 0) / 2
        for (cat, rest), v in sorted(ops.items(), key=lambda kv: -kv[1]):
            kind, name = rest.split(":", 1)
            per = f"{v / (2 * layers):.2f}" if layers else "—"
            out.append(f"| {_title(r, families)} | {layers:,.0f} | {cat}: `{name}` | {kind} | {_k(v)} | {per} |")
    return out + [""]


def _collector(results: list[Any], families: dict[str, FamilySpec], timed: int) -> list[str]:
    """S6: the cyclic collector's passes on the training thread during the timed steps."""
    ok = [r for r in _ok(results) if r.step_s]
    if not any(r.gc_passes for r in ok):
        return []
    out = ["### S6. The cyclic garbage collector on the training thread", "",
           f"Passes of Python's cyclic collector made on the training thread during the {timed} timed steps of each "
           "arm, per step, and the time they took (wall time on this CPU). The built-in leaves the collector as it "
           "is: it starts a young pass every 700 allocations and, every few steps, a full pass over every object of "
           "the process (ComfyUI's ~400,000 before any model). Ours pauses it for the loop and collects at each "
           "step's end, the objects from before the loop frozen (`dataset_cache/gcpause.py`, `StepCollector`).", "",
           "| family | batch | arm | young passes/step | full passes/step | collector ms/step | longest pass ms |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in ok:
        steps = len(r.step_s)
        young = sum(1 for g, _ in r.gc_passes if g < 2) / steps
        full = sum(1 for g, _ in r.gc_passes if g == 2) / steps
        total = sum(t for _, t in r.gc_passes) / steps * 1e3
        longest = max((t for _, t in r.gc_passes), default=0.0) * 1e3
        out.append(f"| {_title(r, families)} | {r.batch} | {r.arm} | {young:.1f} | {full:.2f} | {total:.1f} | "
                   f"{longest:.1f} |")
    return out + [""]
