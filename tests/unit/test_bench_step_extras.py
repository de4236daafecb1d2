"""bench.bench_step_extras runs (the harness cannot rot between runs) and counts what its table claims: the
weights' average and the gradient norm issue a fixed number of ops a step, whatever the LoRA's tensor count."""

from __future__ import annotations

import pytest

from bench.bench_step_extras import main, measure


def test_the_smoke_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert out.count("| smoke (30) |") == 7
    assert "| smoke (30) | ema_decay: a cast per tensor + lerp | bf16 |" in out


def test_the_extras_issue_as_many_ops_for_many_tensors_as_for_few() -> None:
    few, many = ({(what, dtype): ops for what, dtype, ops, _ms in measure(n, 1)} for n in (6, 60))
    for key, ops in few.items():
        if "per tensor" in key[0]:
            assert many[key] > ops >= 6  # the design not taken: an op per tensor
        else:
            assert many[key] == ops <= 8, key  # one fused op per step and dtype, a few scalar ops
    assert few[("ema_decay: fused cast + lerp (ours)", "fp32")] == 1
    assert few[("ema_decay: fused cast + lerp (ours)", "bf16")] == 2
