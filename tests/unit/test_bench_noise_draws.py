"""bench.bench_noise_draws runs (the harness cannot rot between runs) and draws what the trainer draws."""

from __future__ import annotations

import pytest
import torch

from bench.bench_noise_draws import VARIANTS, _draw, main
from dataset_cache.noise_draws import draw_perturbation, offset_noise, pyramid_noise


def test_the_smoke_run_prints_a_row_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    out = capsys.readouterr().out
    assert [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| smoke")] == list(VARIANTS)


def test_a_draw_is_the_plain_noise_offset_then_pyramid_from_one_generator() -> None:
    g = torch.Generator().manual_seed(3)
    expected = pyramid_noise(offset_noise(torch.randn(2, 4, 16, 16, generator=g), g, 0.1), g, 6, 0.3)
    assert torch.equal(_draw((2, 4, 16, 16), 0.1, 6, 0.3, 0.0, seed=3), expected)
    assert torch.equal(_draw((2, 4, 16, 16), 0.1, 6, 0.3, 0.1, seed=3), expected)  # the perturbation draws apart


def test_the_perturbation_is_gamma_times_its_own_gaussian_draw_and_none_at_zero() -> None:
    g = torch.Generator().manual_seed(5)
    want = torch.randn(2, 4, 8, 8, generator=g) * 0.1
    assert torch.equal(draw_perturbation((2, 4, 8, 8), torch.Generator().manual_seed(5), 0.1), want)
    g = torch.Generator().manual_seed(5)
    assert draw_perturbation((2, 4, 8, 8), g, 0.0) is None
    assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(5)))
