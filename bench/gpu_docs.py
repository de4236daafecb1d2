"""The ledger of GPU runs and the doc outside a measuring run: ``--merge`` (add a run made elsewhere), ``--render``
(the doc's section again from the ledger), and the commit a run records. No torch, no ComfyUI: these run on any
machine, and the unit tests call them."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .gpu_figures import Device, load_run
from .gpu_ledger import Ledger, load_ledger, merge, missing, save_ledger
from .gpu_models import FULL_FAMILIES, FULL_VAES, FamilySpec, VaeSpec
from .gpu_plan import GroupPlan, plan_groups
from .gpu_report import SECTION, render

__all__ = ["LEDGER_NAME", "plan_of", "section_of", "merge_results", "render_doc", "checkout_commit"]

LEDGER_NAME = "bench-gpu-results.json"
"""The ledger's name, beside the doc (``docs/bench-gpu-results.json``)."""


def plan_of(device: Device, families: Mapping[str, FamilySpec] = FULL_FAMILIES,
            vaes: Mapping[str, VaeSpec] = FULL_VAES, **options: Any) -> list[GroupPlan]:
    """Every group a run on ``device`` plans (``options``: :func:`bench.gpu_plan.plan_groups`' keywords)."""
    cuda = device.kind == "cuda"
    return plan_groups({k: f.params_b for k, f in families.items()}, {k: v.text for k, v in vaes.items()},
                       device.memory_gib if cuda else float("inf"), device.count if cuda else 0, **options)


def section_of(ledger: Ledger) -> str:
    """The doc's GPU section for ``ledger`` at full size, with the groups still to measure."""
    device = ledger.runs[-1].device if ledger.runs else Device("cuda", "", 0.0)
    return render(ledger, FULL_FAMILIES, pending=missing(ledger, [g.key for g in plan_of(device)]))


def merge_results(results: Path, ledger_path: Path, doc: Path | None, date: str = "", commit: str = "") -> Ledger:
    """``--merge``: add the run in ``results`` to the ledger at ``ledger_path`` and rewrite the doc's section (a
    run merged again replaces itself). ``date``/``commit`` fill in what an older results.json lacks."""
    run = load_run(results)
    run = dataclasses.replace(run, date=run.date or date, commit=run.commit or commit or "unknown", number=0)
    if not run.date:
        raise ValueError(f"{results}: the run has no date; pass --run-date YYYY-MM-DD")
    ledger = merge(load_ledger(ledger_path), run)
    save_ledger(ledger, ledger_path)
    if doc is not None:
        from .report import update_doc

        update_doc(doc, SECTION, section_of(ledger))
    return ledger


def render_doc(ledger_path: Path, doc: Path) -> Ledger:
    """``--render``: rewrite the doc's GPU section from the ledger (after a change of the report's code)."""
    from .report import update_doc

    ledger = load_ledger(ledger_path)
    update_doc(doc, SECTION, section_of(ledger))
    return ledger


def checkout_commit(root: Path) -> str:
    """The code a run measures: ``git rev-parse --short HEAD`` (``+changes`` when tracked files differ from it), or
    ``.device/commit`` (written by ``scripts/device-prep``: the GPU machine's copy has no git), else ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=20).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    carried = root / ".device" / "commit"
    return carried.read_text().strip() if carried.is_file() else "unknown"
