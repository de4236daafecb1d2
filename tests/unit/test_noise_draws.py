"""dataset_cache.noise_draws: the timestep percents and the noise offset a training batch is drawn with; the
defaults draw exactly what the trainer drew before they existed."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from dataset_cache.noise_draws import (
    MAX_MULTIRES_ITERATIONS, MAX_TIMESTEP, PERCENT_EDGE, TIMESTEP_SAMPLINGS, check_multires, check_noise_settings,
    check_random_strength, check_timestep_range, draw_noise, draw_percents, draw_perturbation, offset_noise,
    percent_span, pyramid_noise,
)

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


# ------------------------------------------------------------------------------------------------ timestep range
def _linear(p: float) -> float:
    """A schedule whose timestep falls linearly from 1000 to 0 as the percent rises."""
    return 1000.0 * (1.0 - p)


def _shifted(p: float, shift: float = 3.0) -> float:
    """A shifted flow's timestep: 1000 · σ with σ = shift·t / (1 + (shift − 1)·t), t = 1 − p (ComfyUI's
    ``time_snr_shift``)."""
    t = 1.0 - p
    return 1000.0 * shift * t / (1 + (shift - 1) * t)


def test_the_whole_scale_is_the_whole_schedule_and_draws_stay_what_they_were() -> None:
    assert percent_span(_linear, 0, MAX_TIMESTEP) == (0.0, 1.0)
    for sampling in TIMESTEP_SAMPLINGS:
        a = draw_percents(torch.Generator().manual_seed(4), 64, sampling)
        b = draw_percents(torch.Generator().manual_seed(4), 64, sampling, span=(0.0, 1.0))
        assert torch.equal(a, b)


@pytest.mark.parametrize("timestep_at", [_linear, _shifted])
def test_the_span_is_where_the_timestep_crosses_each_bound(timestep_at: Any) -> None:
    lo, hi = percent_span(timestep_at, 200, 875)
    # bisection to 1e-18 of the percent: the timesteps there equal the bounds up to float64 rounding
    assert timestep_at(lo) == pytest.approx(875, abs=1e-9) and timestep_at(hi) == pytest.approx(200, abs=1e-9)
    assert 0 < lo < hi < 1
    top = percent_span(timestep_at, 875, MAX_TIMESTEP)
    assert top[0] == PERCENT_EDGE and timestep_at(top[1]) == pytest.approx(875, abs=1e-9)


@pytest.mark.parametrize("sampling", TIMESTEP_SAMPLINGS)
def test_draws_are_mapped_into_the_span_keeping_their_order(sampling: str) -> None:
    span = percent_span(_shifted, 875, MAX_TIMESTEP)
    plain = draw_percents(torch.Generator().manual_seed(9), 4096, sampling)
    mapped = draw_percents(torch.Generator().manual_seed(9), 4096, sampling, span=span)
    assert bool(((mapped >= span[0]) & (mapped <= span[1])).all())
    assert torch.equal(torch.argsort(plain), torch.argsort(mapped))  # the same draws, rescaled in order
    timesteps = [_shifted(float(p)) for p in mapped]
    assert min(timesteps) >= 875 - 1e-9 and max(timesteps) <= MAX_TIMESTEP


def test_a_range_of_no_timestep_or_another_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="holds none of this model's timesteps"):
        percent_span(lambda p: 1000.0 - 600.0 * p, 100, 300)  # a schedule that never goes below 400
    with pytest.raises(ValueError, match="not on a 0-1000 scale"):
        percent_span(lambda p: 0.25 * math.log(80.0 * (1.0 - p) + 0.002), 100, 900)  # EDM's log-sigma units


@pytest.mark.parametrize(("low", "high"), [(900, 900), (901, 900), (-1, 500), (0, 1001), (0.5, 900), (True, 900)])
def test_a_bad_range_is_refused_naming_both_settings(low: Any, high: Any) -> None:
    with pytest.raises(ValueError, match="min_timestep and max_timestep must be whole numbers"):
        check_timestep_range(low, high)
    check_timestep_range(0, 1000)
    check_timestep_range(875, 1000)


# ------------------------------------------------------------------------------------- multi-resolution noise
def _low_to_high_power(x: torch.Tensor) -> float:
    """Mean spectral power of the lowest spatial frequencies (0 < |k| <= 3 cycles per side) over that of the
    highest (|k| >= side / 4): about 1 for white noise."""
    side = x.shape[-1]
    power = torch.fft.fft2(x.double()).abs() ** 2
    k = torch.fft.fftfreq(side, dtype=torch.float64) * side
    radius = (k[:, None] ** 2 + k[None, :] ** 2).sqrt()
    return float(power[..., (radius > 0) & (radius <= 3)].mean() / power[..., radius >= side / 4].mean())


def test_no_levels_is_the_noise_itself_and_draws_nothing() -> None:
    g = _gen()
    noise = torch.randn(2, 4, 8, 8, generator=g)
    assert pyramid_noise(noise, g, 0, 0.3) is noise
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=_after_noise((2, 4, 8, 8))))


def test_one_level_adds_a_second_full_resolution_noise_and_scales_each_row_to_unit_deviation() -> None:
    """Level 0 is kohya's: r ** 0 = 1, so a full-resolution noise of weight 1 (its r drawn, unused); the upsampling
    to the same size is the identity. Each row is divided by its own standard deviation, computed here alike."""
    g = _gen()
    noise = torch.randn(3, 4, 8, 8, generator=g)
    out = pyramid_noise(noise.clone(), g, 1, 0.3)
    reference = _gen()
    torch.randn(3, 4, 8, 8, generator=reference)
    torch.rand((), generator=reference, dtype=torch.float64)
    added = noise + torch.randn(3, 4, 8, 8, generator=reference)
    expected = added / added.reshape(3, -1).std(dim=1).reshape(3, 1, 1, 1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("discount", "low"), [(0.3, 1.2), (0.8, 8.0)])
def test_the_levels_put_power_in_the_low_frequencies(discount: float, low: float) -> None:
    """64 rows of 4×64×64: white noise has the same power at every frequency (ratio 1.0 ± 0.1 over this many
    rows); six levels move power to the coarse scales (measured about 1.5 at discount 0.3 and 21 at 0.8, so the
    bounds hold with margin on any CPU), and every row keeps a standard deviation of 1 (to fp32 rounding)."""
    noise = torch.randn(64, 4, 64, 64, generator=_gen())
    assert _low_to_high_power(noise) == pytest.approx(1.0, abs=0.1)
    out = pyramid_noise(noise.clone(), _gen(6), 6, discount)
    assert _low_to_high_power(out) > low
    torch.testing.assert_close(out.reshape(64, -1).std(dim=1), torch.ones(64), rtol=0, atol=1e-5)
    assert torch.equal(out, pyramid_noise(noise.clone(), _gen(6), 6, discount))  # seeded: reproducible


def test_a_videos_frames_each_get_their_own_coarse_noise() -> None:
    """[B, C, T, h, w]: the shape is kept, each row has unit deviation, and two frames of a row differ in their
    coarse part too (their means over the frame are independent draws)."""
    noise = torch.randn(2, 4, 3, 32, 32, generator=_gen())
    out = pyramid_noise(noise.clone(), _gen(1), 6, 0.8)
    assert out.shape == noise.shape
    torch.testing.assert_close(out.reshape(2, -1).std(dim=1), torch.ones(2), rtol=0, atol=1e-5)
    frame_means = out.mean(dim=(-2, -1))  # [B, C, T]
    assert not torch.allclose(frame_means[:, :, 0], frame_means[:, :, 1], atol=0.05)


@pytest.mark.parametrize(("iterations", "discount"), [(0, 0.3), (MAX_MULTIRES_ITERATIONS, 0.0), (6, 1.0)])
def test_multires_settings_accept_their_ranges(iterations: int, discount: float) -> None:
    check_multires(iterations, discount)


@pytest.mark.parametrize(("iterations", "discount", "message"), [
    (-1, 0.3, "multires_noise_iterations must be a whole number from 0 (no multi-resolution noise) to 10, got -1"),
    (11, 0.3, "multires_noise_iterations must be a whole number from 0 (no multi-resolution noise) to 10, got 11"),
    (6.0, 0.3, "multires_noise_iterations must be a whole number"),
    (True, 0.3, "multires_noise_iterations must be a whole number"),
    (6, 1.5, "multires_noise_discount must be a number from 0 to 1, got 1.5 (0.3 is kohya's default"),
    (6, math.nan, "multires_noise_discount must be a number from 0 to 1, got nan"),
])
def test_multires_settings_refuse_other_values_naming_the_field(iterations: Any, discount: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_multires(iterations, discount)


# ------------------------------------------------------------------------------------ random strengths (kohya's)


@pytest.mark.parametrize("shape", [(3, 4, 8, 6), (2, 16, 3, 4, 4)], ids=["image", "video"])
def test_a_random_strength_offset_scales_each_rows_shifts_by_a_uniform_drawn_after_them(shape: tuple[int, ...]
                                                                                       ) -> None:
    """kohya's --noise_offset_random_strength: the shifts of the plain offset, each row's times one uniform draw in
    [0, 1) taken from the generator right after them (here one per row where kohya takes one per batch)."""
    g = _gen()
    noise = torch.randn(shape, generator=g)
    shifted = offset_noise(noise, g, 0.1, random_strength=True)
    after = _after_noise(shape)
    shifts = 0.1 * torch.randn(shape[:2], generator=after)
    strengths = torch.rand(shape[0], generator=after)
    expected = shifts * strengths.reshape(-1, 1)
    per_channel = (shifted - noise).reshape(*shape[:2], -1)
    assert torch.allclose(per_channel, expected.unsqueeze(-1).expand_as(per_channel), rtol=0,
                          atol=4 * torch.finfo(torch.float32).eps * float(noise.abs().max()))
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=after))  # nothing else drawn
    assert offset_noise(noise, _gen(), 0.0, random_strength=True) is noise  # no offset: no strength either


def test_the_offsets_strengths_are_uniform_up_to_the_offset() -> None:
    """Over many rows each row's shift divided by its standard-normal draw is uniform on [0, offset): mean offset/2
    (standard error 0.29·offset/sqrt(N) = 0.0002 at 0.3), all inside the interval."""
    rows = 20_000
    g = _gen()
    noise = torch.zeros(rows, 1, 1, 1)
    shifted = offset_noise(noise, g, 0.3, random_strength=True).reshape(rows)
    plain = 0.3 * torch.randn(rows, 1, generator=_gen()).reshape(rows)  # the shifts, drawn first (no noise here)
    strength = shifted / plain  # exact up to rounding: both are 0.3 * n * u and 0.3 * n
    assert float(strength.min()) >= 0 and float(strength.max()) < 1 + 1e-6
    assert abs(float(strength.mean()) - 0.5) < 0.01


def test_a_random_strength_perturbation_scales_each_row_by_its_own_uniform() -> None:
    """kohya's --ip_noise_gamma_random_strength: gamma times the same Gaussian draw, each row's times a uniform in
    [0, 1) drawn after it; off, the plain perturbation and nothing more drawn; at gamma 0 nothing at all."""
    shape = (4, 16, 2, 6, 6)
    plain_g, random_g = _gen(), _gen()
    plain = draw_perturbation(shape, plain_g, 0.1)
    scaled = draw_perturbation(shape, random_g, 0.1, random_strength=True)
    assert plain is not None and scaled is not None
    strengths = torch.rand(shape[0], generator=plain_g)  # the draw that follows the plain one
    assert torch.equal(scaled, plain * strengths.reshape(-1, 1, 1, 1, 1))
    assert torch.equal(torch.rand(3, generator=plain_g), torch.rand(3, generator=random_g))
    untouched = _gen()
    assert draw_perturbation(shape, untouched, 0.0, random_strength=True) is None
    assert torch.equal(torch.rand(3, generator=untouched), torch.rand(3, generator=_gen()))


def test_draw_noise_passes_the_offsets_random_strength_on_and_keeps_the_plain_draws_without_it() -> None:
    shape = (2, 4, 8, 8)
    assert torch.equal(draw_noise(shape, _gen(), 0.1, 0, 0.3), draw_noise(shape, _gen(), 0.1, 0, 0.3, False))
    g = _gen()
    noise = torch.randn(shape, generator=g)
    expected = offset_noise(noise, g, 0.1, random_strength=True)
    assert torch.equal(draw_noise(shape, _gen(), 0.1, 0, 0.3, offset_random_strength=True), expected)


@pytest.mark.parametrize(("enabled", "value", "message"), [
    (True, 0.0, "noise_offset_random_strength scales noise_offset by a random strength per image, but noise_offset "
                "is 0; set noise_offset (e.g. 0.1) or turn noise_offset_random_strength off"),
    (1, 0.1, "noise_offset_random_strength must be true or false, got 1"),
])
def test_a_random_strength_without_what_it_scales_is_refused_naming_both(enabled: Any, value: float,
                                                                         message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_random_strength("noise_offset_random_strength", enabled, "noise_offset", value)
    check_random_strength("noise_offset_random_strength", False, "noise_offset", 0.0)
    check_random_strength("noise_offset_random_strength", True, "noise_offset", 0.05)
