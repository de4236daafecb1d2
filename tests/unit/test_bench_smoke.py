"""Smoke run of ``python -m dataset_cache bench --smoke``: every table is produced (no timing assertions); the
command hands its arguments to the repository's ``bench`` package and says so when that is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_writes_every_table(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written text\n\n"
                   "<!-- bench:library:begin -->\nold\n<!-- bench:library:end -->\n"
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
    assert "Regenerate: `python -m dataset_cache bench --smoke --dir " in text  # the command as typed


def test_bench_is_a_cli_subcommand_that_hands_its_arguments_over() -> None:
    from dataset_cache.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--no-doc", "--sd15", "10,20"])
    assert args.command == "bench" and args.bench_args == ["--quick", "--no-doc", "--sd15", "10,20"]
    args = build_parser().parse_args(["-v", "bench", "--help"])
    assert args.verbose and args.bench_args == ["--help"]  # the benchmark's own help, not the CLI's


def test_bench_help_comes_from_the_bench_package(capsys: pytest.CaptureFixture[str]) -> None:
    from dataset_cache.cli import main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m dataset_cache bench") and "--smoke" in out and "--sd15" in out


def test_bench_without_the_bench_package_exits_2_saying_why(tmp_path: Path) -> None:
    """An installed pack (the registry archive leaves bench/ out) has only the library: a clear error, exit 2."""
    (tmp_path / "dataset_cache").symlink_to(PACK_ROOT / "dataset_cache", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "dataset_cache", "bench", "--smoke", "--no-doc"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: ") and "bench/" in proc.stderr and "git checkout" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
