"""The GPU runs accumulated so far (``docs/bench-gpu-results.json``): no one GPU session can measure everything, so
each run keeps the figures of earlier runs it did not measure again.

The unit of a merge is a group (:func:`bench.gpu_plan.group_key`): the figures that must come from one run side by
side (a family/batch row's three arms, a capped family's arms, an encode row). A group's state in a run:

* ``measured``: every arm has figures (an arm out of device memory counts: that is its result);
* ``failed``: every arm ran, and one failed otherwise (an exception of the harness or the trainer);
* ``partial``: some arms ran, others were skipped or not selected (``--only flux/ours``, a run cut short);
* ``skipped``: nothing ran (the time budget).

A later run's group replaces the earlier one's unless it holds less: a partial group never replaces a measured or
failed one (its arms would no longer be side by side), a skipped one replaces only a skipped one (the newer reason).
A re-measured group replaces the old one whatever it shows, a failure included. Each run keeps only the figures it
still shows; a run left with none is dropped. ``--missing`` selects the groups not ``measured``.

Plain data (no torch): the unit tests merge fixed runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .gpu_figures import EncodeFigures, GpuRun, ProfileFigures, TrainFigures, run_from_dict
from .gpu_plan import expected_ids, group_key

__all__ = ["Ledger", "Figure", "run_groups", "group_state", "merge", "owners", "missing", "identity",
           "load_ledger", "save_ledger", "FORMAT"]

FORMAT = "streamcache-bench-gpu/1"
SCORE = {"measured": 3, "failed": 3, "partial": 1, "skipped": 0}
Figure = TrainFigures | EncodeFigures | ProfileFigures


@dataclass
class Ledger:
    """The runs whose figures the GPU section shows, oldest first (each numbered, ``R1`` …)."""

    runs: list[GpuRun] = field(default_factory=list)


def run_groups(run: GpuRun) -> dict[str, list[Figure]]:
    """``run``'s figures by group, in the order they were measured."""
    out: dict[str, list[Figure]] = {}
    figs: list[Figure] = [*run.train, *run.encode, *run.profile]
    for fig in figs:
        out.setdefault(group_key(fig.id), []).append(fig)
    return out


def _ran(fig: Figure) -> bool:
    return not getattr(fig, "skipped", "")


def _failed(fig: Figure) -> bool:
    error = getattr(fig, "error", "")
    return bool(error) and not error.startswith("out of memory")


def group_state(key: str, figs: list[Figure]) -> str:
    """``measured``, ``failed``, ``partial`` or ``skipped`` (see the module's docstring)."""
    ran = {f.id for f in figs if _ran(f)}
    if not ran:
        return "skipped"
    wanted = expected_ids(key)
    if wanted is not None and not wanted <= ran:
        return "partial"
    return "failed" if any(_failed(f) for f in figs if _ran(f)) else "measured"


def identity(run: GpuRun) -> tuple[str, str, str]:
    """What tells runs apart: when it started, on which device, with which command."""
    return run.date, run.device.name, run.command


def owners(runs: list[GpuRun]) -> dict[str, tuple[GpuRun, list[Figure]]]:
    """Which run shows each group, folding ``runs`` in order by the merge rule."""
    shown: dict[str, tuple[GpuRun, list[Figure]]] = {}
    for run in runs:
        for key, figs in run_groups(run).items():
            old = shown.get(key)
            if old is None or SCORE[group_state(key, figs)] >= SCORE[group_state(key, old[1])]:
                shown[key] = (run, figs)
    return shown


def merge(ledger: Ledger, run: GpuRun) -> Ledger:
    """``ledger`` with ``run`` added (numbered after the others; the same run merged again replaces itself): each
    run keeps the groups it still shows, a run left with none is dropped. Neither argument is changed."""
    same = [r for r in ledger.runs if identity(r) == identity(run)]
    others = [r for r in ledger.runs if identity(r) != identity(run)]
    number = run.number or (same[0].number if same else max((r.number for r in others), default=0) + 1)
    runs = sorted(others, key=lambda r: r.number) + [replace(run, number=number)]
    shown = owners(runs)
    kept = []
    for r in runs:
        mine = {id(f) for owner, figs in shown.values() if owner is r for f in figs}
        if not mine:
            continue
        kept.append(replace(r, train=[f for f in r.train if id(f) in mine],
                            encode=[f for f in r.encode if id(f) in mine],
                            profile=[f for f in r.profile if id(f) in mine]))
    return Ledger(kept)


def missing(ledger: Ledger, keys: list[str]) -> list[str]:
    """Of ``keys`` (in their order), those with no figures yet or whose figures shown are not ``measured``."""
    shown = owners(ledger.runs)
    return [k for k in keys if k not in shown or group_state(k, shown[k][1]) != "measured"]


def load_ledger(path: Path | None) -> Ledger:
    """The ledger at ``path`` (an empty one where there is none); a file of another format is an error naming it."""
    if path is None or not path.exists():
        return Ledger()
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a bench-gpu ledger (format {data.get('format')!r}, expected {FORMAT!r}); "
                         "move it away or pass another --ledger")
    return Ledger([run_from_dict(r) for r in data["runs"]])


def save_ledger(ledger: Ledger, path: Path) -> None:
    """Write ``ledger`` (to a temporary name, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    body = {"format": FORMAT, "runs": [asdict(r) for r in ledger.runs]}
    tmp.write_text(json.dumps(body, indent=1, default=str) + "\n")
    os.replace(tmp, path)
