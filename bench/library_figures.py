"""The figures of the library benchmarks (``python -m dataset_cache bench``): plain dataclasses, one per table.

Measuring fills them (:mod:`bench.library_measure`, :mod:`bench.library_prefetch`, driven by
:mod:`bench.library_run`) and rendering reads them (:mod:`bench.library_render`): kept apart so that the Markdown
can be rendered, and checked, from fixed figures without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .common import Machine

__all__ = [
    "WriteFigure", "OpenFigure", "ReadFigure", "PrefetchRow", "PrefetchFigures", "IncrementalFigures",
    "ValidationFigure", "LibraryRun",
]

@dataclass
class WriteFigure:
    """Seconds to write one synthetic dataset in each layout."""

    profile: str
    n: int
    gb: float
    ours_s: float
    lazy_s: float


@dataclass
class OpenFigure:
    """L1: per-run open seconds and RSS growth (MiB) of ours and the lazy design, page cache warm or dropped."""

    profile: str
    n: int
    cold: bool
    ours: dict[str, list[float]]
    lazy: dict[str, list[float]]


@dataclass
class ReadFigure:
    """L3: MB/s of tensor payload per run for each way of reading the same random batches."""

    profile: str
    n: int
    cold: bool
    batch: int
    ours: list[float]
    floor: list[float]
    floor_xxh3: list[float]
    safe_open: list[float]
    raw: list[float]


@dataclass
class PrefetchRow:
    """L4: one loader setting under one simulated step (``kind == "none"``: the loader alone, no step)."""

    kind: str
    factor: float
    step_s: float
    depth: int
    threads: int
    hints: bool
    per_batch_s: list[float]
    wait_s: list[float]
    standalone_s: float


@dataclass
class PrefetchFigures:
    """L4: the cache it ran over, the serial read time (the reference of the wait goal) and the rows."""

    samples: int
    batch: int
    batches: int
    serial_read_s: float
    rows: list[PrefetchRow]


@dataclass
class IncrementalFigures:
    """L5: encoder inputs after a 1% edit of a folder of ``n`` images, and the re-planning times."""

    n: int
    build_wall: float
    build_images: int
    build_texts: int
    edited: int
    added: int
    images: int
    texts: int
    wall: float
    validate: list[float]
    plan: list[float]


@dataclass
class ValidationFigure:
    """L5: wall and CPU seconds per run to validate an unchanged folder of ``files`` files."""

    files: int
    wall: list[float]
    cpu: list[float]


@dataclass
class LibraryRun:
    """Everything one run measured, plus what the report says about the run itself."""

    mode: str
    runs: int
    sd15: list[int]
    flux: list[int]
    machine: Machine
    writes: list[WriteFigure] = field(default_factory=list)
    opens: list[OpenFigure] = field(default_factory=list)
    reads: list[ReadFigure] = field(default_factory=list)
    prefetch: PrefetchFigures | None = None
    incremental: IncrementalFigures | str | None = None  # str: why it was not measured
    validation: list[ValidationFigure] = field(default_factory=list)
    seconds: float = 0.0
