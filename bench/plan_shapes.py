"""Benchmark: what each ``memory`` plan holds at the GPU benchmark's shapes, measured by Train LoRA's own probe.

Why it exists: ``auto`` keeps blocks whole (not recomputed) at batch size 1 only, and the reason is a memory figure
(docs/ARCHITECTURE.md, "Memory"): above batch 1 a kept block's activations grow with the batch, and on a large GPU
half the spare memory is more than ComfyUI's own node holds in all. This measures those figures from the repository
instead of quoting them, on a machine without a GPU.

How: full-size random-weight models built from ComfyUI's classes (``bench.gpu_models``; only families whose bf16
weights fit the host's RAM: Flux-dev and Qwen-Image do not on a 24 GiB machine), loaded in bf16 (``--bf16-unet``)
with PyTorch's SDPA attention (``--use-pytorch-cross-attention``), as a GPU run picks: the CPU's default attention
would save each attention matrix, which a GPU's flash attention never holds. For each shape the probe's forward runs
once (``nodes/training/probe.py``, what Train LoRA runs before its first step), and ``dataset_cache.memory_plan``
plans ``no offload``, ``auto`` and ``auto + keep blocks whole`` for the memory free given (an H100 80GB's by
default). The adapters count as a rank-16 LoRA with AdamW.

    scripts/bench-comfy plan-shapes                          # the G1 shapes, 77.5 GiB free
    scripts/bench-comfy plan-shapes --only sdxl/b4 --free-gib 22
    scripts/bench-comfy plan-shapes --write                  # rewrite its docs/BENCHMARKS.md part

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .comfyui import comfy_setup

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench-plan-shapes:start -->", "<!-- bench-plan-shapes:end -->"
GIB = 2**30
SHAPES: tuple[tuple[str, int], ...] = (("sd15", 1), ("sd15", 8), ("sdxl", 1), ("sdxl", 4), ("wan21", 1),
                                       ("lumina2", 1), ("lumina2", 2))
"""G1's rows whose models fit 24 GiB of RAM in bf16 (``bench.gpu_plan.BATCHES``)."""
MODES = ("no offload", "auto", "auto + keep blocks whole")
LORA_RANK = 16


@dataclass(frozen=True)
class PlanFigures:
    """One shape: what the probe measured and what each plan holds (bytes)."""

    family: str
    title: str
    shape_note: str
    batch: int
    blocks: int
    held: int
    held_checkpointed: int
    estimates: dict[str, int]
    kept: dict[str, int]
    keepable_bytes: int
    probe_s: float


def configure_comfyui(work: Path) -> None:
    """ComfyUI on the CPU as a GPU run would set the model up: bf16 weights, SDPA attention (set before the model
    code imports, which reads the attention choice once)."""
    comfy_setup(work)
    from comfy.cli_args import args

    args.bf16_unet = True
    args.use_pytorch_cross_attention = True


def lora_bytes(adapted: Iterable[Any], rank: int = LORA_RANK, element: int = 2, optimizer_states: int = 2) -> int:
    """A rank-``rank`` LoRA of each matrix in ``adapted`` (those ComfyUI's trainer adapts), with its gradient and
    the optimizer's states: ``rank × (fan-in + fan-out)`` parameters per weight."""
    params = sum(rank * (t[0].numel() + t.shape[0]) for t in adapted if t.dim() >= 2)
    return params * element * (2 + optimizer_states)


def measure_shape(pack: Any, spec: Any, batch: int, free_bytes: int) -> PlanFigures:
    """Build ``spec``'s model, run the probe at ``batch`` and plan each of :data:`MODES` for ``free_bytes``."""
    import torch

    blocks_mod = importlib.import_module(f"{pack.__name__}.nodes.training.blocks")
    probe = importlib.import_module(f"{pack.__name__}.nodes.training.probe")
    runner = importlib.import_module(f"{pack.__name__}.dataset_cache.block_runner")
    plans = importlib.import_module(f"{pack.__name__}.dataset_cache.memory_plan")
    from .gpu_models import build_diffusion_model, conditioning

    mp = build_diffusion_model(spec, torch.device("cpu"), torch.bfloat16)
    dm = mp.model.diffusion_model
    blocks, _how = blocks_mod.find_blocks(dm)
    runners = runner.BlockRunners([b.module for b in blocks], checkpoint=True)
    try:
        cond = conditioning(spec, torch.Generator().manual_seed(0), torch.bfloat16)
        t = time.perf_counter()
        result = probe.measure(mp, {}, torch.bfloat16, blocks, runners, (batch, *spec.latent[1:]), cond,
                               trainable_bytes=lora_bytes(probe.adapted(dm)), weight_copies=True)
        probe_s = time.perf_counter() - t
    finally:
        runners.remove()
    needs = result.needs
    made = {mode: plans.plan_memory(needs, plans.Budget(free_bytes), plans.MemoryRequest(mode, batch_size=batch))
            for mode in MODES}
    estimates = {mode: plan.estimate.total for mode, plan in made.items()}
    kept = {mode: len(plan.kept) for mode, plan in made.items()}
    keepable = made["auto"].keepable_bytes  # only auto names what keeping would add
    del mp, dm, blocks, runners, result
    gc.collect()
    return PlanFigures(spec.name, spec.title, spec.shape_note, batch, len(needs.blocks), needs.held_bytes,
                       needs.held_checkpointed_bytes, estimates, kept, keepable, probe_s)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def render(rows: Sequence[PlanFigures], free_gib: float, seconds: float, machine: str) -> list[str]:
    """The Markdown part for BENCHMARKS.md."""
    o = [f"Run of {time.strftime('%Y-%m-%d')} on {machine}, {seconds:.0f} s; memory free given to the plan: "
         f"{free_gib:g} GiB (an H100 80GB's). Saved = what the forward keeps for the backward pass (activations "
         "and ComfyUI's weight copies) with no block checkpointed / every block checkpointed; estimate = the plan's "
         "whole estimate (weights in bf16, a rank-16 LoRA with AdamW, the backward's peak, the 5% reserve), the "
         "figure Train LoRA compares with the memory free; kept = blocks kept whole.", "",
         "| family | shape, batch | blocks | saved GiB: none / every block checkpointed | estimate GiB: no offload "
         "/ auto / auto + keep blocks whole | kept: auto / keep whole | auto says keeping would add | probe s |",
         "|---|---|---:|---|---|---|---|---:|"]
    for r in rows:
        e, k = r.estimates, r.kept
        names = f"+{_gib(r.keepable_bytes)} GiB to keep {k['auto + keep blocks whole']}" if r.keepable_bytes else "—"
        o.append(f"| {r.title} | {r.shape_note}, b{r.batch} | {r.blocks} | {_gib(r.held)} / "
                 f"{_gib(r.held_checkpointed)} | {_gib(e['no offload'])} / {_gib(e['auto'])} / "
                 f"{_gib(e['auto + keep blocks whole'])} | {k['auto']} / {k['auto + keep blocks whole']} | {names} | "
                 f"{r.probe_s:.1f} |")
    return o


def write_section(lines: list[str], doc: Path = ROOT / "docs" / "BENCHMARKS.md") -> None:
    """Replace the text between this benchmark's markers in ``doc``."""
    text = doc.read_text(encoding="utf-8")
    block = "\n".join([START, *lines, END])
    if START not in text:
        raise SystemExit(f"{doc}: no {START} marker: add the section's heading and markers first")
    text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _m: block, text, flags=re.S)
    doc.write_text(text, encoding="utf-8")


def run(pack: Any, specs: dict[str, Any], shapes: Sequence[tuple[str, int]], free_gib: float,
        say: Callable[[str], None] = print) -> list[PlanFigures]:
    """Measure ``shapes``, one model built per family (in the order given)."""
    rows = []
    for family, batch in shapes:
        rows.append(measure_shape(pack, specs[family], batch, int(free_gib * GIB)))
        r = rows[-1]
        say(f"{family}/b{batch}: saved {_gib(r.held)} / {_gib(r.held_checkpointed)} GiB; estimates "
            + ", ".join(f"{m} {_gib(v)}" for m, v in r.estimates.items()) + f"; kept {r.kept}")
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench-comfy plan-shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated FAMILY/bB (default: every shape of SHAPES)")
    ap.add_argument("--free-gib", type=float, default=77.5, help="device memory free for the plans (GiB)")
    ap.add_argument("--write", action="store_true", help="rewrite this benchmark's part of docs/BENCHMARKS.md")
    return ap


def _shapes(only: str) -> list[tuple[str, int]]:
    if not only:
        return list(SHAPES)
    out = []
    for item in only.split(","):
        family, _, b = item.strip().partition("/b")
        if not family or not b.isdigit():
            raise SystemExit(f"--only {item!r}: expected FAMILY/bN, e.g. sdxl/b4")
        out.append((family, int(b)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shapes = _shapes(args.only)
    with tempfile.TemporaryDirectory(prefix="bench-plan-shapes-") as work:
        configure_comfyui(Path(work))
        from support.pack import import_pack

        from .common import machine_info
        from .gpu_models import FULL_FAMILIES

        unknown = sorted({f for f, _b in shapes} - set(FULL_FAMILIES))
        if unknown:
            raise SystemExit(f"--only: unknown families {unknown}; known: {sorted(FULL_FAMILIES)}")
        pack = import_pack()
        t = time.perf_counter()
        rows = run(pack, FULL_FAMILIES, shapes, args.free_gib)
        m = machine_info()
        lines = render(rows, args.free_gib, time.perf_counter() - t, f"{m.cpu} ({m.cores} cores), {m.ram} RAM")
    print("\n".join(lines))
    if args.write:
        write_section(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
