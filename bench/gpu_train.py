"""One training arm of ``scripts/bench-gpu``, measured: the in-memory bound, ours, or ComfyUI's ``TrainLoraNode``.

* **bound**: our ``train_lora`` with every batch of the run read onto the device before the loop starts (the
  ``PrefetchLoader`` the trainer makes is replaced by a list of those batches): the step time no data path can beat.
* **ours**: ``train_lora`` reading the cache through ``PrefetchLoader`` (what Train LoRA runs), after the cache's
  pages were dropped from the page cache.
* **builtin**: ComfyUI's ``ResolutionBucket`` → ``TrainLoraNode(bucket_mode=True)`` on the same samples held in
  memory, the same options.

Step ends: ours' public ``on_step``; the built-in's ``TrainSampler.fwd_bwd`` return, followed by a device
synchronize (its own ``loss.item()`` comes next). Our loop reports a step once its loss is back from the device:
the first step's at once, each later one's when the next step has been queued, and the last step's at once after
the loop. So its first report marks the first step's end as the built-in's does, its second comes two steps after
the first (the steady steps start after it), and the gap before its last report is no step (under 0.2 ms on the
H200 run, against 0.4–1.3 s steps: one of the 20 values each median took). Ours and the bound therefore train one
step more than they time (``warmup + steps + 1`` steps, the last report left out: ``steps`` gaps timed, as for
the built-in), and one more again with fewer than 2 warm-up steps (the two-step gap is then not in the warm-up).
Before the first loss was read at once (runs R1–R8), the first report came a step late. Peak device memory:
``torch.cuda.max_memory_allocated`` from the arm's start (every model unloaded first), so it includes the model.
Settings a checkout's trainer lacks (#25's ``memory``, #26's ``devices``) make the arm ``skipped`` with one line
instead of failing.

A failed arm gives its memory back before the next one starts: autograd keeps a failed backward pass's graph until
the thread's next backward pass (``dataset_cache/autograd_release.py``; ComfyUI's node does not release it). In the
H100 run R4, ~57 GiB stayed allocated after the built-in's out-of-memory failure, under every later arm. Each arm
now records what was allocated as it started and what it left after its clean-up, so a leak shows in its own line.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .gpu_data import FamilyData
from .gpu_figures import TrainFigures
from .tensor_census import device_census

__all__ = ["BASE_SETTINGS", "Trainers", "in_memory_loader", "ours_steps", "run_arm", "arm_settings", "train_ours",
           "builtin_steps", "missing_settings", "free_device", "allocated_gib", "memory_gib"]

BASE_SETTINGS: dict[str, Any] = {
    "grad_accumulation_steps": 1, "learning_rate": 1e-4, "rank": 16, "optimizer": "AdamW", "loss_function": "MSE",
    "seed": 7, "training_dtype": "bf16", "lora_dtype": "bf16", "algorithm": "LoRA", "gradient_checkpointing": True,
    "offloading": False, "existing_lora": "[None]",
}
"""The options every arm shares (the built-in gets the same); ours adds the loader's prefetch (2, default threads)."""
GIB = 1 << 30


@dataclass
class Trainers:
    """The modules an arm calls: our trainer (``TrainSettings``, ``train_lora``) and ``handles`` (as ComfyUI imports
    the pack), ComfyUI's live ``nodes_train`` and ``nodes_dataset``, the device, and the trainer's module that makes
    the ``PrefetchLoader`` (the bound replaces it there; the profiler labels its parts)."""

    loop: ModuleType
    handles: ModuleType
    nodes_train: ModuleType
    nodes_dataset: ModuleType
    device: Any
    run: ModuleType | None = None

    @property
    def maker(self) -> Any:  # a module: Any, as its PrefetchLoader is read and replaced
        return self.run if self.run is not None else self.loop

    def settings_fields(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self.loop.TrainSettings)}


def missing_settings(trainers: Trainers, extra: dict[str, Any]) -> list[str]:
    """The names in ``extra`` this checkout's ``TrainSettings`` does not have."""
    return sorted(set(extra) - trainers.settings_fields())


def memory_gib(device: Any) -> tuple[float | None, float | None]:
    """(peak allocated, peak reserved) GiB since the last reset; ``(None, None)`` off CUDA."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def forget_probes(trainers: Trainers) -> None:
    """Forget the memory probe's remembered results, so each arm's first step includes its probe as a first run
    of a model in a fresh ComfyUI does (a checkout without the cache has nothing to forget)."""
    import importlib

    try:
        probe = importlib.import_module(f"{trainers.loop.__name__}.probe")
    except ImportError:
        return
    clear = getattr(probe, "clear_probe_cache", None)
    if clear is not None:
        clear()


def free_device(device: Any) -> None:
    """Unload every model ComfyUI holds, collect, return cached blocks, and reset the peak counters."""
    import torch

    import comfy.model_management as mm

    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated_gib(device: Any) -> float | None:
    """GiB the caching allocator has handed out now; ``None`` off CUDA."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / GIB


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def ours_steps(warmup: int, steps: int) -> int:
    """Steps ours and the bound train to time ``steps`` after ``warmup`` (module doc): one more for the last report,
    and one more again with fewer than 2 warm-up steps (the gap from the first report to the second is two)."""
    return warmup + steps + 1 + (1 if warmup < 2 else 0)


def run_arm(trainers: Trainers, model: Any, data: FamilyData, fig: TrainFigures, steps: int, warmup: int,
            extra: dict[str, Any] | None = None, say: Callable[[str], None] = print) -> TrainFigures:
    """Train ``warmup + steps`` steps in the arm ``fig`` describes and fill in its figures (errors included:
    a failed arm never stops the run)."""
    import torch

    extra = dict(extra or {})
    missing = missing_settings(trainers, extra)
    if missing and fig.arm != "builtin":
        fig.skipped = f"this checkout's Train LoRA has no {', '.join(missing)} setting yet"
        return fig
    free_device(trainers.device)
    forget_probes(trainers)
    fig.start_gib = allocated_gib(trainers.device)
    total = warmup + steps if fig.arm == "builtin" else ours_steps(warmup, steps) - 1  # reports timed
    fig.settings = arm_settings(fig, total + (0 if fig.arm == "builtin" else 1), extra)
    capped = _cap(trainers.device, fig.cap_gib)
    t0 = time.perf_counter()
    try:
        if fig.arm == "builtin":
            ends, losses = builtin_steps(trainers, model, data, fig, total)
            waits: list[tuple[float, float]] = []
        else:
            ends, losses, waits = train_ours(trainers, model, data, fig, bound=fig.arm == "bound")
            ends, waits = ends[:total], waits[:total]  # the last report follows the one before at once
        fig.first_s = ends[0] - t0 if ends else None
        first = max(warmup - 1, 0 if fig.arm == "builtin" else 1)  # ours: from its second report (module doc)
        fig.step_s = [b - a for a, b in zip(ends[first:], ends[first + 1:])]
        fig.losses = [float(x) for x in losses]
        fig.data_wait_pct = _steady_wait(waits, warmup) if waits else None
    except torch.OutOfMemoryError as exc:
        fig.error = f"out of memory ({str(exc).splitlines()[0][:160]})"
    except Exception as exc:  # a failed arm is a figure of the run, the run goes on
        fig.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        fig.wall_s = time.perf_counter() - t0
        fig.peak_gib, fig.reserved_gib = memory_gib(trainers.device)
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, trainers.device)
        _clean_up(trainers.device, fig)
    say(_line(fig))
    return fig


def _clean_up(device: Any, fig: TrainFigures) -> None:
    """Give the arm's memory back before the next arm (a failed one's graph too) and record what it kept."""
    free_device(device)
    end = allocated_gib(device)
    if fig.error:  # autograd keeps a failed backward pass's graph until the next one (the built-in's too)
        from dataset_cache.autograd_release import release_failed_backward

        release_failed_backward([device])
        free_device(device)
        held, end = end, allocated_gib(device)
        if held is not None and end is not None:
            fig.released_gib = held - end
    if end is not None and fig.start_gib is not None:
        fig.left_gib = end - fig.start_gib
    if fig.kept_memory:
        fig.kept_census = device_census(device)


def arm_settings(fig: TrainFigures, total: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The arm's training options: :data:`BASE_SETTINGS`, its batch, depth and step count, and ``extra``."""
    return {**BASE_SETTINGS, "batch_size": fig.batch, "checkpoint_depth": fig.checkpoint_depth, "steps": total,
            **extra}


def _cap(device: Any, cap_gib: float | None) -> bool:
    """Cap the caching allocator at ``cap_gib`` (``set_per_process_memory_fraction``); False when not capped."""
    import torch

    if cap_gib is None or getattr(device, "type", "cpu") != "cuda":
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    return True


def _line(fig: TrainFigures) -> str:
    """One progress line for the arm."""
    if fig.error:
        return f"{fig.id}: FAILED {fig.error[:200]}" + _left(fig)
    med = fig.median_s
    parts = [f"{fig.id} (depth {fig.checkpoint_depth}): median {med:.3f} s/step over {len(fig.step_s)}"
             if med is not None else f"{fig.id}: no steady steps"]
    if fig.first_s is not None:
        parts.append(f"first step {fig.first_s:.1f} s")
    if fig.peak_gib is not None:
        parts.append(f"peak {fig.peak_gib:.1f} GiB")
    if fig.data_wait_pct is not None:
        parts.append(f"data wait {fig.data_wait_pct:.1f}%")
    return ", ".join(parts) + _left(fig)


def _left(fig: TrainFigures) -> str:
    """The line's memory warnings: what a failed arm's release gave back, and what the arm kept."""
    out = ""
    if fig.released_gib is not None:
        out += f"; releasing the failed pass's graph gave back {fig.released_gib:.2f} GiB"
    if fig.kept_memory:
        out += f"; WARNING: {fig.left_gib:.1f} GiB still allocated after its clean-up (every later arm starts with it)"
    return out


# ------------------------------------------------------------------------------------------------ ours / bound
def train_ours(trainers: Trainers, model: Any, data: FamilyData, fig: TrainFigures, bound: bool,
               hook: Callable[[Any], None] | None = None
               ) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Run ``train_lora`` with ``fig.settings``; return step ends, losses and (elapsed, waited) seconds after each
    step. ``bound``: every batch read onto the device first; ``hook``: also called after each step."""
    loop = trainers.loop
    settings = loop.TrainSettings(**fig.settings, prefetch_batches=2, loader_threads=0)
    ends: list[float] = []
    waits: list[tuple[float, float]] = []

    def on_step(report: Any) -> None:
        ends.append(time.perf_counter())
        if getattr(report, "elapsed_s", 0.0) > 0:  # the loop's own seconds, and its wait (cumulative)
            waits.append((report.elapsed_s, report.waited_s))
        elif report.samples_per_s > 0:  # a checkout from before they were reported: rows / (rows/s) (whose rows
            elapsed = report.step * fig.batch / report.samples_per_s  # run a step ahead of a lagged report)
            waits.append((elapsed, elapsed * report.data_wait_pct / 100.0))
        if hook is not None:
            hook(report)

    reader, samples = trainers.handles.StreamDatasetHandle(str(data.root), "train").open()
    maker = trainers.maker
    real = maker.PrefetchLoader
    if bound:
        maker.PrefetchLoader = in_memory_loader(real, fig.settings["steps"])
    try:
        import torch

        with torch.inference_mode():
            result = loop.train_lora(model, reader, samples, settings, on_step=on_step)
    finally:
        maker.PrefetchLoader = real
        reader.close()
    fig.memory_plan = str(result.memory_plan.get("description", ""))
    fig.startup = {str(k): float(v) for k, v in getattr(result, "startup", {}).items()}
    fig.saves = {str(k): [float(x) for x in v] for k, v in getattr(result, "saves", {}).items()}
    return ends, list(result.losses), waits


def in_memory_loader(real: Any, count: int) -> type:
    """A stand-in for ``PrefetchLoader`` (``real``) that reads ``count`` batches onto the loader's device when made,
    before the loop: the in-memory bound of the GPU and the ComfyUI benchmarks."""

    class InMemory:
        """Every batch the run will use, read before the loop starts."""

        def __init__(self, reader: Any, sampler: Any, **kw: Any) -> None:
            kw["prefetch_batches"] = 0
            with real(reader, sampler, **kw) as loader:
                it = iter(loader)
                self.batches = [next(it) for _ in range(count)]

        def __iter__(self) -> Iterator[Any]:
            return iter(self.batches)

        def close(self) -> None:
            self.batches = []

    return InMemory


def _steady_wait(waits: list[tuple[float, float]], warmup: int) -> float | None:
    """Percent of the time after the warm-up steps spent waiting for batches."""
    if len(waits) <= warmup:
        return None
    (e0, w0), (e1, w1) = waits[max(warmup - 1, 0)] if warmup else (0.0, 0.0), waits[-1]
    return 100.0 * (w1 - w0) / (e1 - e0) if e1 > e0 else None


# ------------------------------------------------------------------------------------------------ built-in
def builtin_steps(trainers: Trainers, model: Any, data: FamilyData, fig: TrainFigures, total: int,
                  before: Callable[[], None] | None = None) -> tuple[list[float], list[float]]:
    """ComfyUI's ResolutionBucket → TrainLoraNode (bucket mode) on the in-memory samples; step ends, losses.
    ``before``: also called as each step's forward and backward begin."""
    import torch

    nt, nd = trainers.nodes_train, trainers.nodes_dataset
    ends: list[float] = []
    original = nt.TrainSampler.fwd_bwd

    def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        out = original(self, *args, **kwargs)
        _sync(trainers.device)
        ends.append(time.perf_counter())
        return out

    nt.TrainSampler.fwd_bwd = fwd_bwd
    try:
        with torch.inference_mode():
            latents = [{"samples": lat["samples"].clone()} for lat in data.latents]
            lat, cond = nd.ResolutionBucket.execute(latents, [list(c) for c in data.conditionings]).result
            opts = {k: [v] for k, v in fig.settings.items() if k in _BUILTIN_INPUTS}
            _, loss_map, _ = nt.TrainLoraNode.execute(
                model=[model], latents=lat, positive=cond, quantized_backward=[False], bucket_mode=[True],
                bypass_mode=[False], **opts).result
    finally:
        nt.TrainSampler.fwd_bwd = original
    return ends, list(loss_map["loss"])


_BUILTIN_INPUTS = ("batch_size", "steps", "grad_accumulation_steps", "learning_rate", "rank", "optimizer",
                   "loss_function", "seed", "training_dtype", "lora_dtype", "algorithm", "gradient_checkpointing",
                   "checkpoint_depth", "offloading", "existing_lora")
