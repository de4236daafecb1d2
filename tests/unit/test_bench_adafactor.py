"""bench.bench_adafactor runs (the harness cannot rot between runs) and counts what its table claims: per matrix
our Adafactor step dispatches only its three means and its outer product (a fixed number of fused ops besides), and
it reads nothing back."""

from __future__ import annotations

import pytest

from bench.bench_adafactor import main, measure


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") >= 6  # ours twice and AdamW, in fp32 and bf16 (and the reference if present)


def test_ours_issues_four_kernels_per_matrix_and_reads_nothing() -> None:
    """``lora_params`` makes matrices and scalars in turn: 60 tensors hold 20 more matrices and 10 more scalars
    than 30. Each matrix adds 6 dispatched ops (its three means and the outer product, and the two ``unsqueeze``
    views of its factors, no kernel); a scalar none (it only joins fused ops); in bf16 every tensor also adds two
    views, no kernel (its gradient's and weight's places in the fp32 copies, each list copied by one fused op, and
    copied back by one)."""
    rows = {n: {(what, dtype): (ops, reads) for what, dtype, ops, reads, _ms in measure(n, 1)} for n in (30, 60)}
    for (what, dtype), (ops, reads) in rows[30].items():
        if what.startswith("ours"):
            more, more_reads = rows[60][(what, dtype)]
            assert reads == more_reads == 0
            assert more - ops == 20 * 6 + (30 * 2 if dtype == "bf16" else 0), (what, dtype, ops, more)
