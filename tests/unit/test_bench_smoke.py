"""Smoke run of ``python -m dataset_cache bench --smoke``: every table is produced (no timing assertions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_writes_every_table(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written text\n\n<!-- bench:library:begin -->\nold\n<!-- bench:library:end -->\n"
                   "\n<!-- bench:comfy:begin -->\nkept\n<!-- bench:comfy:end -->\n")
    env = {**os.environ, "PYTHONPATH": str(PACK_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "dataset_cache", "bench", "--smoke", "--dir", str(tmp_path / "work"),
         "--doc", str(doc)],
        cwd=PACK_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = doc.read_text()
    for title in ("L1. Open a dataset", "L3. Batch read throughput", "L4. Prefetch overlap",
                  "L5. Incremental encode and validation", "L6. Scaling with N"):
        assert title in proc.stdout and title in text, title
    assert "hand-written text" in text and "kept" in text and "\nold\n" not in text
    assert text.count("<!-- bench:library:begin -->") == 1
    assert "| SD1.5 | 40 | warm |" in text and "| Flux | 4 | dropped |" in text
    assert "- Versions: python" in text and "torch" in text
    assert "bench failed" not in text  # a section that catches its own error must still have run
    assert "| ours: VAE inputs |" in text  # the incremental table (bench/bench_incremental.py's generator)
    assert (tmp_path / "bench_open_library.png").exists() is False  # one size per profile: nothing to plot


def test_bench_is_a_cli_subcommand() -> None:
    from dataset_cache.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--no-doc"])
    assert args.command == "bench" and args.quick and args.no_doc
