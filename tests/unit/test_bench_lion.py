"""bench.bench_lion runs (the harness cannot rot between runs) and counts what its table claims: our Lion step
dispatches a fixed number of ops and reads nothing, whatever the LoRA's tensor count; the reference's ops grow
with the tensors."""

from __future__ import annotations

import pytest

from bench.bench_lion import main, measure


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") == 4


def test_ours_issues_as_many_ops_for_many_tensors_as_for_few_and_reads_nothing() -> None:
    few, many = ({(what, dtype): (ops, reads) for what, dtype, ops, reads, _ms in measure(n, 1)} for n in (6, 60))
    for (what, dtype), (ops, reads) in few.items():
        if what.startswith("ours"):
            assert many[(what, dtype)] == (ops, reads) and reads == 0 and ops < 12
        else:  # the reference: a few ops per tensor
            assert many[(what, dtype)][0] > 5 * 60
