"""``scripts/bench-step-ops``: the ops a training step dispatches, counted on the CPU for full-depth, narrow models.

A GPU step at batch 1 is launch-bound (docs/BENCHMARKS.md, "GPU benchmarks": SD1.5 512² took about as long at
batch 8 as at batch 1), so which trainer is faster there is decided by how many ops each one issues per step, and
those can be counted exactly on the CPU. Each family is built with ComfyUI's classes at its real depth (every
block, every layer) but narrow (:data:`NARROW`: small widths and latents, so a step takes a second), by
:func:`bench.gpu_models.build_diffusion_model` (ComfyUI's detection must name the family). The arms are those of
``scripts/bench-gpu`` (:mod:`bench.gpu_train`): the in-memory bound, ours (Train LoRA's loop reading the cache,
``memory`` auto: on a CPU, whose memory free is its RAM, every block kept whole), ``lean`` (ours with ``memory`` no
offload: every block checkpointed, as ours was before blocks were kept whole) and ComfyUI's ``TrainLoraNode``, with
the CPU stand-in's settings (fp32, rank 16, AdamW, checkpoint depth 1).

Per arm: 2 warm-up steps, ``timed`` steps timed without counting (the CPU wall time, a rough proxy), ``counted``
steps counted by :class:`bench.step_ops_count.OpCounter` (window = one optimizer step: ours from one ``on_step`` to
the next, the built-in from one ``fwd_bwd`` call to the next), and one more step. Optimizers left at
``foreach=None`` take the ``foreach`` implementation and ComfyUI's models attend with torch's SDPA, as on CUDA
(:func:`bench.step_ops_count.cuda_like_optimizers`, :func:`~bench.step_ops_count.cuda_like_attention`).

    scripts/bench-step-ops                    # every family, rewrites the step-ops section of docs/BENCHMARKS.md
    scripts/bench-step-ops --only sd15,flux --no-doc
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .gpu_models import FULL_FAMILIES, FamilySpec
from .step_ops_count import OpCounter, StepCounts, cuda_like_attention, cuda_like_optimizers, phases_marked

__all__ = ["NARROW", "BATCHES", "ArmCounts", "count_arm", "measure", "main"]

PROG = "scripts/bench-step-ops"
SECTION = "step-ops"
ARMS = ("bound", "ours", "lean", "builtin")
LEAN = {"memory": "no offload"}
"""The ``lean`` arm's options: ours with every block checkpointed (the leanest plan without streaming)."""


def _narrow(name: str, title: str, changes: dict[str, Any], latent: tuple[int, ...], tokens: int,
            note: str) -> FamilySpec:
    full = FULL_FAMILIES[name]
    return FamilySpec(name, title, full.model_class, {**full.unet_config, **changes}, latent, tokens, full.width,
                      full.pooled, dict(full.extras), shape_note=note)


NARROW: dict[str, FamilySpec] = {f.name: f for f in (
    # ComfyUI's detection needs model_channels 320 and context 768: every level at 320 (channel_mult 1s)
    _narrow("sd15", "SD1.5", {"channel_mult": [1, 1, 1, 1]}, (1, 4, 8, 8), 77, "width 320 at every level, 64²"),
    # SDXL's transformer depths [0,0,2,2,10,10], middle 10, output [0,0,0,2,2,2,10,10,10], all at width 320
    _narrow("sdxl", "SDXL", {"channel_mult": [1, 1, 1]}, (1, 4, 8, 8), 77, "width 320 at every level, 64²"),
    # 19 double + 38 single blocks; one head of 128 (the rope axes fix the head width)
    _narrow("flux", "Flux-dev", {"hidden_size": 128, "num_heads": 1}, (1, 16, 8, 8), 16,
            "hidden 128, 64², 16 tokens"),
    # 30 blocks, one head of 128
    _narrow("wan21", "WAN 2.1 1.3B", {"dim": 128, "num_heads": 1, "ffn_dim": 256}, (1, 16, 3, 8, 8), 16,
            "dim 128, 9 frames 64², 16 tokens"),
)}
"""The families at full depth, narrow (real block structure, small widths: the op count per step is the real one,
the work per op is not)."""
BATCHES: dict[str, tuple[int, ...]] = {"sd15": (1, 2), "sdxl": (1,), "flux": (1,), "wan21": (1,)}
SETTINGS = {"training_dtype": "fp32", "lora_dtype": "fp32"}
"""The CPU stand-in's settings (:data:`bench.gpu.STANDIN_SETTINGS`): bf16 autocast on a CPU is far slower."""


@dataclass
class ArmCounts:
    """One arm's figures: ops per step (:class:`StepCounts`), CPU seconds per step, or the error."""

    family: str
    arm: str
    batch: int
    counts: StepCounts = field(default_factory=StepCounts)
    step_s: list[float] = field(default_factory=list)
    params: int = 0
    """Tensors the optimizer steps (the LoRA's)."""
    error: str = ""
    gc_passes: list[tuple[int, float]] = field(default_factory=list)
    """The cyclic collector's passes on the training thread during the timed steps: (generation, seconds)."""

    @property
    def id(self) -> str:
        return f"{self.family}/b{self.batch}/{self.arm}"

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "arm": self.arm, "batch": self.batch, "counts": self.counts.to_json(),
                "step_s": self.step_s, "params": self.params, "error": self.error,
                "gc_passes": [list(p) for p in self.gc_passes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ArmCounts:
        return cls(d["family"], d["arm"], d["batch"], StepCounts.from_json(d["counts"]), d["step_s"], d["params"],
                   d["error"], [(int(g), float(t)) for g, t in d.get("gc_passes", [])])


class _CollectorClock:
    """The cyclic collector's passes on the thread that marks the timed steps, while they run (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._thread: int | None = None
        self._start = 0.0

    def timing(self, on: bool) -> None:
        if on and self._thread is None:
            self._thread = threading.get_ident()
            gc.callbacks.append(self._seen)
        elif not on and self._thread is not None:
            gc.callbacks.remove(self._seen)
            self._thread = None

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((int(info["generation"]), time.perf_counter() - self._start))


class _Windows:
    """Step boundaries of one arm: the warm-up, ``timed`` steps timed (nothing counted, the counter off), one step
    with Python calls counted, one with the dispatch mode on following host tensors, ``counted`` steps counted,
    and one more step."""

    WARMUP = 2

    def __init__(self, counter: OpCounter, timed: int, counted: int, skip: int = 0) -> None:
        self.counter, self.timed, self.counted, self.skip = counter, timed, counted, skip
        self.seen = -skip
        self.times: list[float] = []
        self.collector = _CollectorClock()

    @property
    def total(self) -> int:
        """Steps the arm runs (the last boundary of a counted window must be a step's, not the run's end)."""
        return self.WARMUP + self.timed + 2 + self.counted + 1

    def boundary(self) -> None:
        """Called at each step boundary: ours after each reported step from its second on (``skip`` 1: the first
        step's loss is read at once, each later one a step late, as the next step's host work ends), the built-in
        before each ``fwd_bwd`` (``skip`` 2: its first two are the warm-up's). Either way the warm-up is over at
        boundary 1 and each window after it holds one step's host work."""
        self.seen += 1
        if self.seen < 1:
            return
        calls = self.timed + 1  # boundary 1 ends the warm-up
        if self.seen <= calls:
            self.times.append(time.perf_counter())
            self.collector.timing(self.seen < calls)
        if self.seen == calls:
            self.counter.start_calls()
        elif self.seen == calls + 1:
            self.counter.stop_calls()
            self.counter.start()
        elif self.seen == calls + 2:
            self.counter.count()
        elif calls + 2 < self.seen <= calls + 2 + self.counted:
            self.counter.boundary()
            if self.seen == calls + 2 + self.counted:
                self.counter.stop()

    def step_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def count_arm(trainers: Any, model: Any, data: Any, family: str, arm: str, batch: int, timed: int = 3,
              counted: int = 2, options: dict[str, Any] | None = None) -> ArmCounts:
    """Run one arm (``bound``, ``ours``, ``lean`` or ``builtin``) and count its steps (see the module docstring);
    ``options``: Train LoRA inputs the arm sets besides the stand-in's (:mod:`bench.dropout_cost`'s arms)."""
    from .gpu_figures import TrainFigures
    from .gpu_train import arm_settings, free_device

    result = ArmCounts(family, arm, batch)
    counter = OpCounter()
    windows = _Windows(counter, timed, counted, skip=_Windows.WARMUP if arm == "builtin" else 1)
    fig = TrainFigures(result.id, family, batch, arm, 1)
    fig.settings = arm_settings(fig, windows.total, {**SETTINGS, **(LEAN if arm == "lean" else {}), **(options or {})})
    free_device(trainers.device)
    try:
        with cuda_like_optimizers(), cuda_like_attention(), phases_marked(counter):
            if arm == "builtin":
                result.params = _run_builtin(trainers, model, data, fig, windows)
            else:
                result.params = _run_ours(trainers, model, data, fig, windows)
        if counter.counts.steps != counted:
            raise RuntimeError(f"counted {counter.counts.steps} steps of {counted} (ran {windows.seen} boundaries)")
        result.counts = counter.counts
        result.step_s = windows.step_s()
        result.gc_passes = windows.collector.passes
    except Exception as exc:  # a failed arm is a figure of the run
        result.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        counter.stop()
        windows.collector.timing(False)
        free_device(trainers.device)
    return result


def _optimized_tensors(captured: list[Any]) -> int:
    return sum(len(g["params"]) for opt in captured[:1] for g in opt.param_groups)


def _capture_optimizers() -> tuple[list[Any], Any]:
    import torch.optim.optimizer as topt

    captured: list[Any] = []
    handle = topt.register_optimizer_step_pre_hook(
        lambda opt, _a, _k: captured.append(opt) if not captured else None)
    return captured, handle


def _run_ours(trainers: Any, model: Any, data: Any, fig: Any, windows: _Windows) -> int:
    from .gpu_train import train_ours

    captured, handle = _capture_optimizers()
    try:
        train_ours(trainers, model, data, fig, bound=fig.arm == "bound", hook=lambda _report: windows.boundary())
    finally:
        handle.remove()
    return _optimized_tensors(captured)


def _run_builtin(trainers: Any, model: Any, data: Any, fig: Any, windows: _Windows) -> int:
    from .gpu_train import builtin_steps

    captured, handle = _capture_optimizers()
    try:
        builtin_steps(trainers, model, data, fig, windows.total, before=windows.boundary)
    finally:
        handle.remove()
    return _optimized_tensors(captured)


# ------------------------------------------------------------------------------------------------ the run
def measure(ctx: Any, families: dict[str, FamilySpec], batches: dict[str, tuple[int, ...]], timed: int,
            counted: int, say: Callable[[str], None], on_arm: Callable[[ArmCounts], None] | None = None
            ) -> list[ArmCounts]:
    """Every arm of every family in ``families`` at ``batches``; each result handed to ``on_arm`` as it comes."""
    import torch

    from .gpu_data import write_family_cache
    from .gpu_models import build_diffusion_model
    from .gpu_train import free_device

    results: list[ArmCounts] = []
    for name, spec in families.items():
        t = time.perf_counter()
        model = build_diffusion_model(spec, ctx.device, torch.float32)
        root = ctx.work / f"cache_{name}"
        total = _Windows(OpCounter(), timed, counted).total
        # no epoch ends within the run (a new epoch's plan is made on the training thread, once per epoch)
        data = write_family_cache(spec, root, max(batches.get(name, (1,))) * (total + 4))
        say(f"{name}: built in {time.perf_counter() - t:.1f} s")
        try:
            for batch in batches.get(name, (1,)):
                for arm in ARMS:
                    t = time.perf_counter()
                    res = count_arm(ctx.trainers, model, data, name, arm, batch, timed, counted)
                    say(_line(res, time.perf_counter() - t))
                    results.append(res)
                    if on_arm is not None:
                        on_arm(res)
        finally:
            del model
            free_device(ctx.device)
            gc.collect()
            shutil.rmtree(root, ignore_errors=True)
    return results


def _line(res: ArmCounts, seconds: float) -> str:
    if res.error:
        return f"{res.id}: FAILED {res.error[:300]}"
    c = res.counts
    return (f"{res.id}: {c.per_step():,.0f} ops/step ({c.per_step(kind='kernel'):,.0f} kernel, "
            f"{c.per_step(kind='sync'):g} syncs), windows {c.totals}, CPU {res.median_s or 0:.3f} s/step "
            f"({seconds:.0f} s)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated families (sd15, sdxl, flux, wan21)")
    ap.add_argument("--timed", type=int, default=3, help="steps timed without counting per arm (%(default)s)")
    ap.add_argument("--counted", type=int, default=2, help="steps counted per arm (%(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default out/bench-step-ops)")
    ap.add_argument("--doc", type=Path, default=None, help="markdown file to update (default docs/BENCHMARKS.md)")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", type=Path, default=None, metavar="RESULTS",
                    help="render a saved results.json again instead of measuring")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Count every arm, print the tables, rewrite the step-ops section of the doc (unless ``--no-doc``); with
    ``--render``, only render a saved run again."""
    from .common import DOC, PACK_ROOT
    from .report import update_doc

    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(NARROW))
    if unknown:
        print(f"{PROG}: unknown families {', '.join(unknown)} (known: {', '.join(NARROW)})", file=sys.stderr)
        return 2
    out = a.out or PACK_ROOT / "out" / "bench-step-ops"
    if a.render is not None:
        saved = json.loads(a.render.read_text())
    else:
        families = {k: v for k, v in NARROW.items() if not only or k in only}
        command = " ".join([PROG, *(x for x in argv if x != "--no-doc")])
        saved = _measure_all(families, a.timed, a.counted, out, command)
    text = _render_saved(saved)
    out.mkdir(parents=True, exist_ok=True)
    (out / "section.md").write_text(text)
    if not a.no_doc:
        update_doc(a.doc or DOC, SECTION, text)
    sys.stdout.write(text)
    return 0


def _measure_all(families: dict[str, FamilySpec], timed: int, counted: int, out: Path, command: str
                 ) -> dict[str, Any]:
    """Measure every arm, saving ``out/results.json`` after each; the saved run."""
    import dataclasses

    import torch

    from .gpu import _setup

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(f"[step-ops {time.perf_counter() - t0:6.1f}s] {line}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="streamcache-step-ops-"))
    try:
        torch.set_num_threads(1)  # the count does not depend on it; the times then compare on a shared machine
        ctx, device, _, _ = _setup(work, out, say, True)
        saved: dict[str, Any] = {"device": dataclasses.asdict(device), "command": command, "timed": timed,
                                 "counted": counted, "families": list(families), "seconds": 0.0, "arms": []}

        def save(res: ArmCounts) -> None:
            saved["arms"].append(res.to_json())
            saved["seconds"] = time.perf_counter() - t0
            (out / "results.json").write_text(json.dumps(saved, indent=1))

        measure(ctx, families, BATCHES, timed, counted, say, save)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return saved


def _render_saved(saved: dict[str, Any]) -> str:
    from .gpu_figures import Device
    from .step_ops_report import render

    families = {k: NARROW[k] for k in saved["families"]}
    results = [ArmCounts.from_json(r) for r in saved["arms"]]
    return render(results, families, Device(**saved["device"]), saved["command"], saved["seconds"],
                  saved["timed"], saved["counted"])
