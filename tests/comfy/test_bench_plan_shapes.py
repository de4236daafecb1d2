"""``scripts/bench-comfy plan-shapes``'s harness on tiny models of the same classes, so it cannot rot: the probe runs,
each plan is made for the memory free given, and the figures keep the relations the memory plan promises (``auto``
keeps blocks whole at batch 1 only; ``auto + keep blocks whole`` at any batch; above batch 1 ``auto`` holds what
``no offload`` holds and names what keeping would add). Nothing here is timed."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.pack import import_bench

import_bench()
from bench.gpu import tiny_specs  # noqa: E402
from bench.plan_shapes import END, START, lora_bytes, render, run, write_section  # noqa: E402

KEEP = "auto + keep blocks whole"


@pytest.fixture(scope="module")
def rows(pack: ModuleType) -> list:
    families, _vaes = tiny_specs()
    said: list[str] = []
    out = run(pack, families, [("sd15", 1), ("sd15", 2), ("flux", 2)], free_gib=8.0, say=said.append)
    assert len(said) == 3 and said[0].startswith("sd15/b1: saved ")
    return out


def test_auto_keeps_blocks_whole_at_batch_1_only(rows: list) -> None:
    b1 = rows[0]
    assert b1.batch == 1 and b1.held > b1.held_checkpointed > 0 and b1.blocks > 0
    assert b1.kept["no offload"] == 0 < b1.kept["auto"] == b1.kept[KEEP]
    assert b1.estimates["no offload"] < b1.estimates["auto"] == b1.estimates[KEEP] and b1.keepable_bytes == 0
    for above in rows[1:]:
        assert above.batch == 2 and above.kept["auto"] == 0 < above.kept[KEEP]
        assert above.estimates["auto"] == above.estimates["no offload"] < above.estimates[KEEP]
        assert above.keepable_bytes == above.estimates[KEEP] - above.estimates["auto"]
    assert rows[1].held > b1.held  # a batch of 2 saves more than one row


def test_the_section_renders_a_row_per_shape_between_its_markers(rows: list, tmp_path: Path) -> None:
    lines = render(rows, 8.0, 1.0, "a test machine")
    table = [line for line in lines if line.startswith("| ") and "shape, batch" not in line]
    assert len(table) == len(rows) and table[0].startswith("| SD1.5 (tiny) | 64², b1 |")
    assert "8 GiB" in lines[0] and "a test machine" in lines[0]
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\n{START}\nold\n{END}\n\nafter\n", encoding="utf-8")
    write_section(lines, doc)
    text = doc.read_text(encoding="utf-8")
    assert "old" not in text and table[0] in text and text.endswith(f"{END}\n\nafter\n")
    doc.write_text("# Benchmarks without the markers\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="no <!-- bench-plan-shapes:start --> marker"):
        write_section(lines, doc)


def test_the_adapters_count_as_a_rank_16_lora_with_adamw() -> None:
    weights = [torch.empty(320, 768), torch.empty(640, 320, 3, 3), torch.empty(320)]  # a bias has no LoRA
    params = 16 * (768 + 320) + 16 * (320 * 9 + 640)
    assert lora_bytes(weights) == params * 2 * 4  # bf16: the weight, its gradient, AdamW's two states
