"""dataset_cache.noise_draws: the timestep percents and the noise offset a training batch is drawn with; the
defaults draw exactly what the trainer drew before they existed."""

from __future__ import annotations

import math

import pytest
import torch

from dataset_cache.noise_draws import check_noise_settings, draw_percents, offset_noise

EDGE = 1e-5
N = 200_000
"""Draws for the distribution checks: the standard error of a mean of N standard normals is 1/sqrt(N) = 0.0022, of
their standard deviation about 1/sqrt(2N) = 0.0016; the tolerances below (0.02) are about 9 of those."""


def _gen(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_uniform_draws_what_the_trainer_drew_before() -> None:
    before = torch.rand(64, generator=_gen(), dtype=torch.float64).clamp(EDGE, 1 - EDGE)
    assert torch.equal(draw_percents(_gen(), 64, "uniform", EDGE), before)


def test_logit_normal_is_the_sigmoid_of_a_standard_normal_and_favours_the_middle() -> None:
    u = draw_percents(_gen(), N, "logit-normal", EDGE)
    assert float(u.min()) >= EDGE and float(u.max()) <= 1 - EDGE
    n = torch.logit(u)
    assert abs(float(n.mean())) < 0.02 and abs(float(n.std()) - 1.0) < 0.02
    middle = float(((u > 0.25) & (u < 0.75)).double().mean())
    expected = math.erf(math.log(3) / math.sqrt(2))  # P(|n| < logit(0.75)) = 0.7286
    assert abs(middle - expected) < 0.01  # standard error sqrt(p(1-p)/N) = 0.001
    uniform = draw_percents(_gen(), N, "uniform", EDGE)
    assert abs(float(((uniform > 0.25) & (uniform < 0.75)).double().mean()) - 0.5) < 0.01


def test_no_offset_is_the_noise_itself_and_draws_nothing() -> None:
    g = _gen()
    noise = torch.randn(2, 4, 8, 8, generator=g)
    assert offset_noise(noise, g, 0.0) is noise
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=_after_noise((2, 4, 8, 8))))


def _after_noise(shape: tuple[int, ...]) -> torch.Generator:
    g = _gen()
    torch.randn(shape, generator=g)
    return g


@pytest.mark.parametrize("shape", [(3, 4, 8, 6), (2, 16, 3, 4, 4)], ids=["image", "video"])
def test_an_offset_shifts_each_row_and_channel_by_one_value_drawn_after_the_noise(shape: tuple[int, ...]) -> None:
    g = _gen()
    noise = torch.randn(shape, generator=g)
    shifted = offset_noise(noise, g, 0.1)
    expected = 0.1 * torch.randn(shape[:2], generator=_after_noise(shape))
    shift = shifted - noise
    per_channel = shift.reshape(*shape[:2], -1)
    # one value per row and channel: noise + s - noise rounds to s within an ulp of the noise's size
    assert torch.allclose(per_channel, expected.unsqueeze(-1).expand_as(per_channel), rtol=0,
                          atol=4 * torch.finfo(torch.float32).eps * float(noise.abs().max()))


@pytest.mark.parametrize(("sampling", "offset", "message"), [
    ("beta", 0.0, "unknown timestep_sampling 'beta'; use one of uniform, logit-normal"),
    ("uniform", -0.1, "noise_offset must be a number from 0 to 1"),
    ("uniform", 1.5, "noise_offset must be a number from 0 to 1"),
    ("uniform", float("nan"), "noise_offset must be a number from 0 to 1"),
    ("uniform", "0.1", "noise_offset must be a number from 0 to 1"),
])
def test_bad_settings_are_refused_naming_the_field(sampling: object, offset: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_noise_settings(sampling, offset)
    check_noise_settings("logit-normal", 0.1)  # what is allowed passes
    with pytest.raises(ValueError, match="unknown timestep_sampling"):
        draw_percents(_gen(), 1, "beta", EDGE)
