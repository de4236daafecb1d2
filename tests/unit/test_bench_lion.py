"""bench.bench_lion runs (the harness cannot rot between runs) and counts what its tables claim: our Lion step
dispatches a fixed number of ops and reads nothing, whatever the LoRA's tensor count; the reference's ops grow
with the tensors; Lion8bit adds one view per tensor (its gradient's) and keeps a byte per weight of its 8-bit
tensors."""

from __future__ import annotations

import pytest
import torch

from bench.bench_lion import MAKERS, main, measure
from bench.bench_step_extras import optimizer_state_bytes


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") == 8  # ours, Lion8bit and the reference in fp32 and bf16; two state rows


def test_ours_issues_as_many_ops_for_many_tensors_as_for_few_and_reads_nothing() -> None:
    few, many = ({(what, dtype): (ops, reads) for what, dtype, ops, reads, _ms in measure(n, 1)} for n in (6, 60))
    for (what, dtype), (ops, reads) in few.items():
        if what.startswith("ours"):
            assert many[(what, dtype)] == (ops, reads) and reads == 0 and ops < 12
        elif what.startswith("Lion8bit"):  # 54 more tensors, one gradient view each
            assert many[(what, dtype)] == (ops + 54, 0) and reads == 0
        else:  # the reference: a few ops per tensor
            assert many[(what, dtype)][0] > 5 * 60


def test_lion8bits_state_is_a_byte_per_weight_and_a_scale_per_block() -> None:
    """``lora_params``' 5,120-weight matrices keep one byte per weight and an fp32 scale per 256, the scalars an
    fp32 moment; Lion keeps its moment in the weights' dtype."""
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        got = optimizer_state_bytes(MAKERS, 30, dtype)
        assert got["Lion8bit"] == 20 * 5120 + 20 * (5120 // 256) * 4 + 10 * 4
        assert got["Lion"] == (20 * 5120 + 10) * size
