"""bench.bench_prodigy runs (the harness cannot rot between runs) and counts what its table claims: our Prodigy
step dispatches a fixed number of ops and reads one pair of values, whatever the LoRA's tensor count; the
reference reads two values per tensor."""

from __future__ import annotations

import pytest

from bench.bench_prodigy import main, measure


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") == 4
    assert "| smoke (30) | ours (dataset_cache.prodigy) | bf16 | 27 | 1 |" in out


def test_ours_issues_as_many_ops_for_many_tensors_as_for_few_and_reads_once() -> None:
    few, many = ({(what, dtype): (ops, reads) for what, dtype, ops, reads, _ms in measure(n, 1)} for n in (6, 60))
    for (what, dtype), (ops, reads) in few.items():
        if what.startswith("ours"):
            assert many[(what, dtype)] == (ops, reads) and reads == 1 and ops < 40
        else:  # the reference: an .item() for each tensor's dot product and |s| sum
            assert reads == 2 * 6 and many[(what, dtype)][1] == 2 * 60 and many[(what, dtype)][0] > 10 * 60
