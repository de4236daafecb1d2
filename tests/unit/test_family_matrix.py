"""scripts/family_matrix.py renders the family matrix from the tests' record, and only from it.

The record is what ``support.matrix.record`` writes (merged across runs); the table must show each cell's status
as recorded, "not run" where nothing was recorded, and replace only the marked section of a document.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from support.matrix import Cell, record
from support.paths import PACK_ROOT


@pytest.fixture(scope="module")
def matrix_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("family_matrix_under_test",
                                                  PACK_ROOT / "scripts" / "family_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(table: str, title: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(f"| {title} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_cells_come_from_the_record_merged_across_runs(matrix_script: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    one, two = Cell("sd15", "train", "batch 1"), Cell("sd15", "train", "batch 2")
    one.passed("batch 1: loss 1.000 → 0.500")
    two.passed("batch 2: loss 1.000 → 0.500")
    failed = Cell("sd15", "parity")
    failed.note("the pack's trainer, 1 step")  # the test failed after this note
    record([one, two, failed], out)
    known = Cell("flux_kontext", "builtin")
    known.known_failure("TrainLoraNode raises TypeError: x | y")
    record([known], out)  # a second run: merged, not overwritten

    table = matrix_script.render(json.loads(out.read_text()))
    sd15 = _row(table, "SD1.5")
    assert sd15[0] == "SD1.5"
    assert sd15[2] == "✓ batch 1, 2: loss 1.000 → 0.500"  # parts saying the same are joined
    assert sd15[5] == "**FAILED** the pack's trainer, 1 step"
    assert sd15[1] == sd15[3] == sd15[4] == sd15[6] == "not run"
    kontext = _row(table.replace("\\|", "¦"), "Flux Kontext (reference latents in the conditioning)")
    assert kontext[6] == "✗ TrainLoraNode raises TypeError: x ¦ y"  # a '|' in a text cannot break the table
    assert "not run" == _row(table, "Lumina 2")[1]


def test_a_record_naming_an_unknown_family_is_refused(matrix_script: ModuleType, tmp_path: Path) -> None:
    record([Cell("sd15", "train")], tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text())
    data["results"]["sd9"] = data["results"].pop("sd15")
    with pytest.raises(ValueError, match="sd9"):
        matrix_script.render(data)
    with pytest.raises(ValueError, match="unknown matrix column 'speed'"):
        Cell("sd15", "speed")


def test_only_the_marked_section_is_replaced(matrix_script: ModuleType) -> None:
    start, end = matrix_script.START, matrix_script.END
    doc = f"before\n{start}\nold table\n{end}\nafter\n"
    assert matrix_script.replace_section(doc, f"{start}\nnew\n{end}", "doc") == f"before\n{start}\nnew\n{end}\nafter\n"
    with pytest.raises(ValueError, match="exactly one"):
        matrix_script.replace_section("no markers", "x", "README.md")
    with pytest.raises(ValueError, match="exactly one"):
        matrix_script.replace_section(doc + doc, "x", "README.md")


def test_nothing_is_written_without_a_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STREAMCACHE_MATRIX_OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    record([Cell("sd15", "train")])
    assert list(tmp_path.iterdir()) == []
