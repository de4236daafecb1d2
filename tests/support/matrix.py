"""The family matrix's results: each family test records what it showed, the table is rendered from the record.

README.md and docs/BENCHMARKS.md carry a table *family | encode | train | ...* whose cells must all come from a
test run, none written by hand. Tests take the ``matrix`` fixture (``tests/comfy/test_families.py``), open a
:class:`Cell` for their family and column, and call :meth:`Cell.passed` with what they checked once every assertion
held (or :meth:`Cell.known_failure` when the test showed that a thing fails, as expected); a cell opened by a test
that then failed is recorded as failed, with the last note it had. Results go to the
JSON file named by ``STREAMCACHE_MATRIX_OUT`` (nothing is written when it is unset), merged with what earlier runs
recorded there, so the light and the heavy families can be run separately; ``scripts/family_matrix.py`` renders it.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "ENV", "Cell", "matrix", "record"]

ENV = "STREAMCACHE_MATRIX_OUT"
COLUMNS = {
    "encode": "encode",
    "train": "train",
    "lora_keys": "LoRA keys applied",
    "sample": "sample",
    "parity": "same loss as ComfyUI's training",
    "builtin": "built-in works",
}
"""Column id → header, in table order."""


class Cell:
    """One (family, column, part) result of the running test; ``part`` tells apart parametrised runs (batch 1/2)."""

    def __init__(self, family: str, column: str, part: str = "") -> None:
        if column not in COLUMNS:
            raise ValueError(f"unknown matrix column {column!r}; use one of {', '.join(COLUMNS)}")
        self.family = family
        self.column = column
        self.part = part
        self.status = "fail"
        self.text = ""

    def note(self, text: str) -> None:
        """What the test is checking now (kept as the cell's text if the test fails after it)."""
        self.text = text

    def passed(self, text: str) -> None:
        """Every assertion behind this cell held; ``text`` says what was shown, with figures."""
        self.status = "pass"
        self.text = text

    def known_failure(self, text: str) -> None:
        """The thing does not work, and the test showed exactly that failure (a known limitation, not a pass)."""
        self.status = "known"
        self.text = text


def record(cells: list[Cell], path: str | os.PathLike[str] | None = None) -> None:
    """Merge ``cells`` into the JSON file at ``path`` (default: ``$STREAMCACHE_MATRIX_OUT``; unset: no-op).

    The file is locked while it is read and rewritten, so concurrent test processes do not lose each other's cells.
    """
    target = path or os.environ.get(ENV)
    if not target or not cells:
        return
    file = Path(target)
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        raw = fh.read()
        data: dict[str, Any] = json.loads(raw) if raw.strip() else {}
        results = data.setdefault("results", {})
        for cell in cells:
            parts = results.setdefault(cell.family, {}).setdefault(cell.column, {})
            parts[cell.part] = {"status": cell.status, "text": cell.text or "the test failed before its first check"}
        data["runs"] = sorted({*data.get("runs", []), _environment()})
        fh.seek(0)
        fh.truncate()
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")


def _environment() -> str:
    """Where the cells were measured: date, ComfyUI and torch versions, machine (one line per run day)."""
    import torch

    try:
        import comfyui_version

        comfy = comfyui_version.__version__
    except ImportError:  # pragma: no cover - a ComfyUI without its version module
        comfy = "unknown"
    return (f"{time.strftime('%Y-%m-%d', time.gmtime())}: ComfyUI {comfy}, torch {torch.__version__}, "
            f"{platform.machine()} CPU, fp32")


def _fixture() -> Any:
    import pytest

    @pytest.fixture
    def matrix() -> Any:
        """``matrix(family, column, part="")`` opens a :class:`Cell`; the cells are recorded when the test ends."""
        cells: list[Cell] = []

        def open_cell(family: str, column: str, part: str = "") -> Cell:
            cells.append(Cell(family, column, part))
            return cells[-1]

        yield open_cell
        record(cells)

    return matrix


matrix = _fixture()
"""The pytest fixture; a test module imports it (``from support.matrix import matrix``) to use it."""
