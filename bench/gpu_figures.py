"""The figures ``scripts/bench-gpu`` measures, as plain dataclasses (no torch, no ComfyUI): measured by
:mod:`bench.gpu_train` / :mod:`bench.gpu_encode`, written to JSON as the run goes (a run stopped by a time limit
still leaves its figures), rendered by :mod:`bench.gpu_report`."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LEFT_GIB", "Device", "TrainFigures", "EncodeFigures", "ProfileFigures", "GpuRun", "save_run", "load_run",
           "run_from_dict"]


@dataclass
class Device:
    """What ran the benchmark: the accelerator and the software versions."""

    kind: str  # "cuda" | "cpu"
    name: str
    memory_gib: float
    count: int = 1
    torch: str = ""
    cuda: str = ""
    cudnn: str = ""
    comfyui: str = ""
    python: str = ""
    host: str = ""
    """CPU model, cores and RAM of the machine around the device."""


LEFT_GIB = 0.25
"""An arm that leaves more than this allocated after its clean-up is named in its line and in the report."""


@dataclass
class TrainFigures:
    """One training arm: ``family/bB/arm`` (arm: ``bound``, ``ours``, ``builtin``, or a capped / multi-GPU arm).

    ``step_s``: seconds between consecutive step ends after the warm-up; ``first_s``: from the trainer's call to the
    end of its first step; ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the arm (``None`` on the CPU);
    ``data_wait_pct``: the share of the measured steps spent waiting for a batch (``None`` for the built-in, whose
    data is in memory). ``error`` (the failure, e.g. out of memory) or ``skipped`` (why it did not run) say why a
    figure is missing.
    """

    id: str
    family: str
    batch: int
    arm: str
    checkpoint_depth: int
    depth_note: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    first_s: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    data_wait_pct: float | None = None
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cap_gib: float | None = None
    error: str = ""
    skipped: str = ""
    rep: int = 0
    """Which repetition of the arm this is (``--repeat N``: 0 … N-1; the arm's id is the same in each)."""
    start_gib: float | None = None
    """``torch.cuda.memory_allocated`` as the arm started, every model unloaded: the harness's own tensors, plus what
    an earlier arm failed to give back (``None`` on the CPU and in runs before it was measured)."""
    left_gib: float | None = None
    """What the arm left allocated after its clean-up, over ``start_gib``: every later arm of the run starts with it
    (and its peak includes it)."""
    released_gib: float | None = None
    """A failed arm: what releasing the graph autograd kept of it gave back, after every model was unloaded (shows
    on the GPU whether that, or something else, held a failed arm's memory)."""
    memory_plan: str = ""
    """Ours and the bound: the description of the memory plan the run trained with (which blocks were checkpointed,
    kept whole or streamed, and the estimate); empty for the built-in and in runs before it was recorded."""
    startup: dict[str, float] = field(default_factory=dict)
    """Ours and the bound: seconds of each phase from the trainer's call to the end of its first step as the
    trainer times them (``TrainResult.startup``: data, model, memory plan, ...); empty for the built-in and in runs
    before it was recorded."""
    saves: dict[str, list[float]] = field(default_factory=dict)
    """Ours with ``save_every``: each save's seconds as the trainer times them (``TrainResult.saves``: ``waited_s``
    on the training thread, ``written_s`` on the writer's); empty otherwise."""
    kept_census: str = ""
    """An arm that kept memory (:attr:`kept_memory`): what of it Python still reaches, by what refers to it
    (:func:`bench.tensor_census.device_census`); what it does not reach, only C++ holds."""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def ok(self) -> bool:
        return bool(self.step_s) and not self.error and not self.skipped

    @property
    def kept_memory(self) -> bool:
        """It left more than :data:`LEFT_GIB` allocated after its clean-up."""
        return self.left_gib is not None and self.left_gib > LEFT_GIB


@dataclass
class EncodeFigures:
    """One encode row: our Encode Dataset and ComfyUI's folder loader + ``MakeTrainingDataset`` on one folder.

    ``*_s``: wall seconds for the whole folder (encoders unloaded before each, so model loading is included);
    ours includes its release of the encoders (``ours_release_s`` of it), the built-in leaves them loaded, and
    ``builtin_release_s`` is what unloading them afterwards took (what training pays before it starts);
    ``*_free_gib``: device memory free right after each (what training gets: ours releases its encoders, the
    built-in leaves them loaded), ``builtin_released_free_gib`` after the built-in's encoders were unloaded;
    ``free_before_gib``: free before either loaded anything; ``warmup_s``: the untimed run of both on a few
    images before the timed pair (``None`` in runs before it existed: there ours ran first on a cold device);
    ``ours_phases``: where ours' seconds went (``plan``: the library's plan, the folder hashed; ``run``: its
    encode run, whose own timings follow: ``encoder`` (the encoders' calls, their loading included),
    ``decode_wait``, ``commit``, ``commit_wait``, ``finish``, ...; empty in runs before it was recorded).
    """

    id: str
    title: str
    images: int
    size: tuple[int, int]
    ours_s: float | None = None
    builtin_s: float | None = None
    ours_free_gib: float | None = None
    builtin_free_gib: float | None = None
    free_before_gib: float | None = None
    peak_gib: float | None = None
    note: str = ""
    error: str = ""
    skipped: str = ""
    ours_release_s: float | None = None
    builtin_release_s: float | None = None
    builtin_released_free_gib: float | None = None
    warmup_s: float | None = None
    ours_phases: dict[str, float] = field(default_factory=dict)


@dataclass
class ProfileFigures:
    """Per-step averages from a ``torch.profiler`` trace of a few steps of one arm (``--profile``)."""

    id: str
    steps: int
    step_ms: float
    cpu_ms: float
    """Step time minus the time the training thread was blocked in synchronizations: its own (Python + launch) work."""
    sync_ms: float
    syncs: float
    items: float
    """``.item()`` / ``float(tensor)`` calls (``aten::_local_scalar_dense``) per step."""
    gpu_busy_ms: float
    h2d_pageable: float
    h2d_pageable_ms: float
    h2d_pinned: float
    labels_ms: dict[str, float] = field(default_factory=dict)
    """Time inside the labelled parts of our loop (conditioning preparation, waiting for the batch, ...)."""
    top_ops: list[tuple[str, float]] = field(default_factory=list)
    trace: str = ""
    error: str = ""
    events: int = 0
    """Events the profiler recorded (what its analysis and trace cost grow with: :mod:`bench.gpu_budget`)."""
    analysis_s: float = 0.0
    """Seconds the breakdown (and the trace's export) took after the recorded steps."""


@dataclass
class GpuRun:
    """Everything one ``scripts/bench-gpu`` run measured, and how it was run."""

    device: Device
    command: str
    steps: int
    warmup: int
    budget_s: float
    train: list[TrainFigures] = field(default_factory=list)
    encode: list[EncodeFigures] = field(default_factory=list)
    profile: list[ProfileFigures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """One line each: arms skipped as a group (a setting this checkout lacks, one GPU only), page-cache method."""
    builds: dict[str, float] = field(default_factory=dict)
    """Seconds to build each family's model (random weights generated on the device, loaded by ComfyUI)."""
    seconds: float = 0.0
    finished: bool = False
    date: str = ""
    """When the run started (UTC, ``YYYY-MM-DD HH:MM:SS``; a converted older run: the day only). With the device
    and the command it tells runs apart (the same run merged again replaces itself)."""
    commit: str = ""
    """The code measured: ``git rev-parse --short HEAD`` (``+changes`` when tracked files differed), or what
    ``scripts/device-prep`` wrote to ``.device/commit`` where the copy has no git."""
    repeat: int = 1
    """``--repeat N``: how many times each selected training row's arms ran (before 2026-11-26 afternoon: batch-1
    rows only)."""
    number: int = 0
    """The run's number in the ledger of accumulated runs (``R1``, ``R2``, …; 0: not merged yet)."""


def save_run(run: GpuRun, path: Path) -> None:
    """Write ``run`` as JSON (to a temporary name, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(run), indent=1, default=str))
    os.replace(tmp, path)


def load_run(path: Path) -> GpuRun:
    """The run saved by :func:`save_run`."""
    return run_from_dict(json.loads(path.read_text()))


def run_from_dict(data: dict[str, Any]) -> GpuRun:
    """A :class:`GpuRun` from its JSON form (fields added since a run was written take their defaults)."""
    data = dict(data)
    data["device"] = Device(**data["device"])
    data["train"] = [TrainFigures(**t) for t in data["train"]]
    data["encode"] = [EncodeFigures(**{**e, "size": tuple(e["size"])}) for e in data["encode"]]
    data["profile"] = [ProfileFigures(**{**p, "top_ops": [tuple(x) for x in p["top_ops"]]}) for p in data["profile"]]
    return GpuRun(**data)
