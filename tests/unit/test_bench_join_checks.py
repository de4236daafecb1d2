"""``bench/bench_join_checks.py`` runs end to end on small sizes (its figures are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import re

from bench.bench_join_checks import main


def test_the_join_checks_benchmark_runs_and_reports_every_figure(capsys) -> None:
    assert main(["--sizes", "20,40", "--file-gb", "0.02", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| 20 \| \d+ ms \| \d+ ms \| [\d.]+ ms \| \d+ ms \|$", out, re.M), out
    assert re.search(r"^\| 40 \|", out, re.M), out
    assert re.search(r"its ends [\d.]+ ms; the whole file [\d.]+ s \([\d.]+ GB/s", out), out
    assert "a 23.8 GB Flux-dev file hashed whole:" in out
