"""``bench/bench_references.py`` runs end to end on small sizes (its figures are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import re

from bench.bench_references import batch_inputs, main


def test_the_references_benchmark_runs_and_reports_every_figure(capsys) -> None:
    assert main(["--n", "12", "--runs", "1", "--rows", "2", "--side", "64"]) == 0
    out = capsys.readouterr().out
    for row in ("without reference_folder", "with reference_folder"):
        assert re.search(rf"^\| {row} \| [\d.]+ \([\d.]+–[\d.]+\) \|$", out, re.M), out
    for row in ("no references", "with a reference per row"):
        assert re.search(rf"^\| {row} \| [\d.]+ \([\d.]+–[\d.]+\) \|$", out, re.M), out


def test_the_batch_with_references_names_one_per_row() -> None:
    plan, values = batch_inputs(3, (16, 8, 8), True)
    assert plan.reference_keys == ("r0", "r1", "r2") and all(k in values for k in plan.reference_keys)
    plain, _ = batch_inputs(3, (16, 8, 8), False)
    assert plain.reference_keys == ()
