"""Render the family matrix (README.md, docs/BENCHMARKS.md) from what the family tests recorded.

Every cell comes from a test run, none is written by hand: ``tests/comfy/test_families.py`` and
``tests/comfy/test_family_encode.py`` record one result per (family, column) into the JSON file named by
``STREAMCACHE_MATRIX_OUT`` (see ``tests/support/matrix.py``); this script turns that record into a Markdown table
and, with ``--write``, replaces the table between the ``<!-- family-matrix:start -->`` and
``<!-- family-matrix:end -->`` markers of both files (the text around them is kept). A cell reads ``✓`` and what
the test showed, ``✗`` and how a thing fails where a test showed that it fails (ComfyUI's own node on a family),
**FAILED** where a test failed, and "not run" where no test recorded it.

    STREAMCACHE_MATRIX_OUT=docs/family_matrix.json /opt/comfyui-dev/venv/bin/python -m pytest \\
        tests/comfy/test_families.py tests/comfy/test_family_encode.py
    python3 scripts/family_matrix.py docs/family_matrix.json --write
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.matrix import COLUMNS  # noqa: E402
from support.tiny_families import FAMILIES  # noqa: E402

START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"
TARGETS = (ROOT / "README.md", ROOT / "docs" / "BENCHMARKS.md")
MARK = {"pass": "✓", "known": "✗", "fail": "**FAILED**"}
LEGEND = (
    "*encode*: Encode Dataset with a tiny VAE of the family's latent shape, the latents compared with the VAE's own "
    "encode (the full-size text encoders are not run). *train*: Train LoRA (Stream Cache), 2 steps from a cache of two "
    "buckets, at batch 1 and 2. *LoRA keys applied*: the trained modules ComfyUI's LoRA loader patches, with no "
    "`lora key not loaded`. *sample*: a 1-step KSampler with the LoRA gives a finite latent. *same loss as ComfyUI's "
    "training*: one SGD step at batch 1 in fp32 with the same noise, sigma, latent, conditioning and starting LoRA as "
    "ComfyUI's own training; loss and the gradient of every LoRA tensor compared. *built-in works*: ComfyUI's "
    "`TrainLoraNode`, 2 steps at batch 1 on the same tiny model."
)


def _cell(parts: dict[str, dict[str, str]] | None) -> str:
    """One cell from its parts (``""`` or ``"batch 1"``, ``"batch 2"``...): parts that say the same are joined."""
    if not parts:
        return "not run"
    statuses = {p["status"] for p in parts.values()}
    status = "fail" if "fail" in statuses else "known" if "known" in statuses else "pass"
    texts: dict[str, list[str]] = {}
    for part in sorted(parts):
        text = parts[part]["text"]
        if part and text.startswith(f"{part}: "):
            text = text[len(part) + 2:]
        texts.setdefault(text, []).append(part)
    shown = []
    for text, names in texts.items():
        label = ", ".join(n for n in names if n)
        label = re.sub(r"(?<=, )batch ", "", label)  # "batch 1, 2"
        shown.append(f"{label}: {text}" if label else text)
    return f"{MARK[status]} " + "; ".join(shown).replace("|", "\\|")


def render(data: dict[str, Any]) -> str:
    """The table with its markers and one line saying where the cells were measured."""
    results = data.get("results", {})
    unknown = sorted(set(results) - set(FAMILIES))
    if unknown:
        raise ValueError(f"the record names families the tests do not have: {', '.join(unknown)}")
    lines = [START, "", "| family | " + " | ".join(COLUMNS.values()) + " |",
             "| --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    for name, fam in FAMILIES.items():
        row = results.get(name, {})
        lines.append(f"| {fam.title or name} | " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + " |")
    runs = "; ".join(data.get("runs", [])) or "no run recorded"
    lines += ["", f"Every cell is written by `scripts/family_matrix.py` from the record of a test run ({runs}), "
              "on tiny random-weight models of each family's real architecture read by ComfyUI's own loaders. "
              + LEGEND, "", END]
    return "\n".join(lines)


def replace_section(text: str, table: str, where: str) -> str:
    """``text`` with the part between the markers (markers included) replaced by ``table``."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{where}: needs exactly one {START} ... {END} section")
    return text[:text.index(START)] + table + text[text.index(END) + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="the JSON file the tests wrote (STREAMCACHE_MATRIX_OUT)")
    parser.add_argument("--write", action="store_true", help="replace the table in README.md and docs/BENCHMARKS.md")
    a = parser.parse_args(argv)
    try:
        data = json.loads(a.record.read_text(encoding="utf-8"))
        table = render(data)
        if a.write:
            for target in TARGETS:
                target.write_text(replace_section(target.read_text(encoding="utf-8"), table, str(target)),
                                  encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"scripts/family_matrix.py: {exc}", file=sys.stderr)
        return 2
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
