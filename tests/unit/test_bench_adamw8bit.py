"""bench.bench_adamw8bit runs (the harness cannot rot between runs) and counts what its section claims: per tensor
our AdamW8bit step dispatches one op, its gradient's flat view (no kernel; the views of weights and moments are
kept between steps), in fp32 and bf16 alike; it reads nothing back."""

from __future__ import annotations

import pytest
import torch

from bench.bench_adamw8bit import main, measure, state_bytes


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") >= 6  # ours and AdamW in fp32 and bf16, and both state rows


def test_ours_adds_views_per_tensor_not_kernels_and_reads_nothing() -> None:
    """``lora_params`` makes two 5,120-weight matrices (8-bit) and a scalar (fp32 moments) in turn: 60 tensors hold
    20 more matrices and 10 more scalars than 30."""
    rows = {n: {(what, dtype): (ops, reads) for what, dtype, ops, reads, _ms in measure(n, 1)} for n in (30, 60)}
    for dtype in ("fp32", "bf16"):
        ops, reads = rows[30][("ours", dtype)]
        more, more_reads = rows[60][("ours", dtype)]
        assert reads == more_reads == 0
        assert more - ops == 30, (dtype, ops, more)


def test_the_state_is_a_quarter_of_fp32_adamws() -> None:
    """Two bytes per weight of the 8-bit tensors plus a scale per 256, and a scalar's two fp32 moments, against
    AdamW's eight bytes per weight."""
    got = state_bytes(30, torch.float32)
    matrices, scalars = 20 * 5120, 10
    scales = 20 * 2 * (5120 // 256) * 4  # per matrix two moments' scales, fp32
    assert got["ours"] == matrices * 2 + scales + scalars * 8
    assert got["AdamW"] == (matrices + scalars) * 8
