"""``scripts/bench-gpu --profile``: where one training step's time goes, from a ``torch.profiler`` trace.

A few steps of the bound, ours and the built-in are recorded per family (the first steps are skipped: model loading
and the first kernels' set-up are not a step's cost); the built-in's step runs from the start of one of its
``fwd_bwd`` calls to the next (its optimizer step, loss read and progress bar included), as its timed steps do.
Parts of our loop are labelled for the trace while it runs (``record_function`` around the per-row conditioning
preparation, the model call and the wait for the next batch; a label whose function a refactor renamed is simply
absent). The breakdown per step:

* step time (the profiler's ``ProfilerStep`` ranges, one per optimizer step);
* time the training thread was blocked in synchronizations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``) and the ``.item()``/``float(tensor)`` calls behind them (``aten::_local_scalar_dense``);
* CPU time = step time minus that blocked time: the thread's own Python and kernel-launch work, the part that grows
  when loader threads contend for the GIL (compare ours with the bound);
* host-to-device copies from pageable vs pinned memory (count and device time);
* the device's busy time (sum of its kernels and copies), and the top CPU operators.
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from .gpu_data import FamilyData
from .gpu_figures import ProfileFigures, TrainFigures
from .gpu_train import Trainers, arm_settings, builtin_steps, free_device, train_ours

__all__ = ["labelled", "breakdown", "raw_events", "self_times", "keep_trace", "profiled_steps", "profile_arm",
           "describe", "failed", "PastDeadline"]

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LABELS = {"Conditioner": "streamcache.conditioning", "ModelCall": "streamcache.model_call"}
"""Our loop's classes (nodes/training/conditioning.py)."""
WAIT_LABEL = "streamcache.next_batch"
MAX_TRACE_BYTES = 12 << 20


@contextmanager
def labelled(loop: ModuleType) -> Iterator[None]:
    """Label our loop's parts for the trace while inside (``record_function`` around their calls)."""
    from torch.profiler import record_function

    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return original(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, call)

    for cls_name, label in LABELS.items():
        cls = getattr(loop, cls_name, None)
        if isinstance(cls, type):
            wrap(cls, "__call__", label)
    name = "counted" if callable(getattr(loop, "counted", None)) else "_counted"
    counted = getattr(loop, name, None)
    if counted is not None:
        def counted_timed(batches: Iterator[Any], *args: Any) -> Iterator[Any]:
            inner = counted(batches, *args)
            while True:
                with record_function(WAIT_LABEL):
                    try:
                        batch = next(inner)
                    except StopIteration:
                        return
                yield batch

        saved.append((loop, name, counted))
        setattr(loop, name, counted_timed)
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def profiled_steps(skip: int, active: int, device: Any, on_ready: Any) -> Any:
    """A ``torch.profiler.profile`` that records ``active`` steps after ``skip`` (advance it with ``.step()``) and
    hands itself to ``on_ready`` once they are recorded (one cycle only)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if getattr(device, "type", "cpu") == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, record_shapes=False, with_stack=False, on_trace_ready=on_ready,
                   schedule=schedule(wait=max(skip - 1, 0), warmup=1, active=active, repeat=1))


def raw_events(prof: Any) -> list[Any]:
    """The profiler's events as kineto recorded them (``_KinetoEvent``: name, device, start and duration), hidden
    ones left out. Not ``prof.events()``: that builds a Python ``FunctionEvent`` tree of every event, 30–90 µs an
    event on the CPU (docs/BENCHMARKS.md, ``--profile``), 10–30 s for one full-size SDXL step."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError("the profiler holds no kineto results (nothing recorded, or a torch without kineto)")
    return [e for e in results.events() if not e.is_hidden_event()]


def _us(evt: Any) -> float:
    return float(evt.duration_ns()) / 1e3


def self_times(cpu_events: list[Any]) -> dict[str, float]:
    """Self time (µs) per op name: each event's duration less that of the events nested in it on its thread."""
    ordered = sorted(cpu_events, key=lambda e: (e.start_thread_id(), e.start_ns(), -e.duration_ns()))
    self_us: dict[str, float] = {}
    stack: list[tuple[int, int, str]] = []  # (thread, end ns, name) of the open events
    for e in ordered:
        thread, start, dur = e.start_thread_id(), e.start_ns(), e.duration_ns()
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            stack.pop()
        name = e.name()
        self_us[name] = self_us.get(name, 0.0) + dur / 1e3
        if stack:
            parent = stack[-1][2]
            self_us[parent] = self_us.get(parent, 0.0) - dur / 1e3
        stack.append((thread, start + dur, name))
    return self_us


def breakdown(prof: Any, arm_id: str, out_dir: Path | None = None) -> ProfileFigures:
    """Per-step averages of the recorded steps of ``prof`` (see the module docstring), from its raw events; the
    trace is kept (gzip) in ``out_dir`` when given and small enough to bring back."""
    from torch.autograd import DeviceType

    t0 = time.perf_counter()
    events = raw_events(prof)
    cpu = [e for e in events if e.device_type() == DeviceType.CPU]
    dev = [e for e in events if e.device_type() != DeviceType.CPU and not e.is_user_annotation()]
    steps = [e for e in cpu if e.name().startswith("ProfilerStep")]
    n = max(len(steps), 1)
    step_ms = sum(_us(e) for e in steps) / n / 1e3
    syncs = [e for e in cpu if e.name() in SYNCS]
    sync_ms = sum(_us(e) for e in syncs) / n / 1e3
    pageable = [e for e in dev if "HtoD" in e.name() and "Pageable" in e.name()]
    pinned = [e for e in dev if "HtoD" in e.name() and "Pinned" in e.name()]
    labels = {}
    for label in (*LABELS.values(), WAIT_LABEL):
        inside = [e for e in cpu if e.name() == label]
        if inside:
            labels[label] = sum(_us(e) for e in inside) / n / 1e3
    ranked = sorted(self_times(cpu).items(), key=lambda kv: kv[1], reverse=True)
    top = [(k, us / n / 1e3) for k, us in ranked if not k.startswith(("ProfilerStep", "streamcache."))][:8]
    fig = ProfileFigures(
        id=arm_id, steps=len(steps), step_ms=step_ms, cpu_ms=max(step_ms - sync_ms, 0.0), sync_ms=sync_ms,
        syncs=len(syncs) / n, items=sum(1 for e in cpu if e.name() == "aten::_local_scalar_dense") / n,
        gpu_busy_ms=sum(_us(e) for e in dev) / n / 1e3, h2d_pageable=len(pageable) / n,
        h2d_pageable_ms=sum(_us(e) for e in pageable) / n / 1e3, h2d_pinned=len(pinned) / n, labels_ms=labels,
        top_ops=top, events=len(events))
    if out_dir is not None:
        fig.trace = keep_trace(prof, out_dir, arm_id.replace("/", "_"))
    fig.analysis_s = time.perf_counter() - t0
    return fig


def keep_trace(prof: Any, out_dir: Path, stem: str) -> str:
    """Export the Chrome trace, gzip it, and keep it only under :data:`MAX_TRACE_BYTES` (else say its size)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"trace_{stem}.json"
    prof.export_chrome_trace(str(raw))
    packed = raw.with_suffix(".json.gz")
    part = packed.with_name(packed.name + ".part")  # a run stopped while packing leaves no half trace to bring back
    with raw.open("rb") as src, gzip.open(part, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.unlink(raw)
    os.replace(part, packed)
    size = packed.stat().st_size
    if size > MAX_TRACE_BYTES:
        packed.unlink()
        return f"(trace of {size >> 20} MiB not kept)"
    return packed.name


def describe(fig: ProfileFigures) -> str:
    """One progress line."""
    if fig.error:
        return f"profile {fig.id}: FAILED {fig.error[:200]}"
    labels = ", ".join(f"{k.split('.')[1]} {v:.1f} ms" for k, v in fig.labels_ms.items())
    return (f"profile {fig.id}: step {fig.step_ms:.1f} ms, CPU {fig.cpu_ms:.1f} ms, blocked in {fig.syncs:.1f} "
            f"syncs {fig.sync_ms:.1f} ms, {fig.items:.1f} .item(), device busy {fig.gpu_busy_ms:.1f} ms, "
            f"H2D pageable {fig.h2d_pageable:.1f} ({fig.h2d_pageable_ms:.2f} ms) pinned {fig.h2d_pinned:.1f}"
            + (f"; {labels}" if labels else ""))



class PastDeadline(RuntimeError):
    """The profile reached the end of the time it was given (the run's budget) before it was done."""


def profile_arm(trainers: Trainers, model: Any, data: FamilyData, fig: TrainFigures, skip: int, active: int,
                out_dir: Path | None, extra: dict[str, Any] | None = None, deadline: float | None = None
                ) -> ProfileFigures:
    """Record ``active`` steps of ``fig.arm`` (ours, the bound or the built-in) after ``skip`` steps; their breakdown
    (the trace exported to ``out_dir`` unless ``None``). ``deadline`` (``time.perf_counter``): a step that ends past it
    stops the arm, and a breakdown is not begun past it; the profile is then reported as stopped, with no figure."""
    free_device(trainers.device)
    fig.settings = arm_settings(fig, skip + active + 1, extra or {})
    done: list[ProfileFigures] = []

    def ready(prof: Any) -> None:
        _check(deadline, "before its analysis")
        done.append(breakdown(prof, fig.id, out_dir))

    def step(prof: Any) -> None:
        _check(deadline, f"after {prof.step_num} of {skip + active} steps")
        prof.step()

    try:
        with labelled(trainers.maker), profiled_steps(skip, active, trainers.device, ready) as prof:
            if fig.arm == "builtin":  # a step from one forward and backward's start to the next one's
                builtin_steps(trainers, model, data, fig, skip + active + 1, before=lambda: step(prof))
            else:
                train_ours(trainers, model, data, fig, bound=fig.arm == "bound", hook=lambda _report: step(prof))
        if not done:
            raise RuntimeError(f"the profiler recorded no step (ran {skip + active + 1} steps)")
        return done[0]
    except Exception as exc:  # a failed profile is reported, the run goes on
        return failed(fig.id, f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        free_device(trainers.device)


def _check(deadline: float | None, where: str) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise PastDeadline(f"stopped at the run's time budget, {where}")


def failed(fig_id: str, error: str) -> ProfileFigures:
    """A profile without figures, saying why."""
    return ProfileFigures(id=fig_id, steps=0, step_ms=0.0, cpu_ms=0.0, sync_ms=0.0, syncs=0.0, items=0.0,
                          gpu_busy_ms=0.0, h2d_pageable=0.0, h2d_pageable_ms=0.0, h2d_pinned=0.0, error=error)
