"""dataset_cache.loss_weighting: the Min-SNR weight of each row from its noise level's signal and noise scales."""

from __future__ import annotations

import math

import pytest
import torch

from dataset_cache.loss_weighting import (DEBIASED_SNR_CAP, MAX_MIN_SNR_GAMMA, check_min_snr_gamma, debiased_weights,
                                          min_snr_weights, noise_like_weights, prediction_scales,
                                          v_like_weights)


def test_an_eps_models_snr_is_one_over_sigma_squared_capped_at_gamma() -> None:
    """ε-prediction (x_t = x0 + σ·ε): SNR 1/σ²; σ = 0.1 gives 100 (capped at 5), σ = 2 gives 0.25."""
    sigma = torch.tensor([0.1, 0.5, 2.0, 14.6])
    weights = min_snr_weights(torch.ones(4), sigma, 5.0)
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([5.0, 4.0, 0.25, 1 / 14.6 ** 2], rel=1e-6)


def test_a_flow_models_snr_is_the_ratio_of_its_two_scales() -> None:
    """Rectified flow (x_t = (1 - σ)·x0 + σ·ε): SNR ((1 - σ)/σ)²; at σ = 0.5 it is 1, at 0.9 1/81."""
    sigma = torch.tensor([0.5, 0.9, 0.01])
    weights = min_snr_weights(1 - sigma, sigma, 5.0)
    assert weights.tolist() == pytest.approx([1.0, 1 / 81, 5.0], rel=1e-5)


def test_a_row_without_noise_weighs_gamma_and_pure_noise_weighs_nothing() -> None:
    assert min_snr_weights(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 3.0).tolist() == [3.0, 0.0]
    assert min_snr_weights(torch.tensor([0.0]), torch.tensor([0.0]), 3.0).tolist() == [3.0]  # no NaN


@pytest.mark.parametrize("value", [0, 0.0, 5, 5.0, MAX_MIN_SNR_GAMMA])
def test_min_snr_gamma_accepts_zero_to_the_maximum(value: float) -> None:
    check_min_snr_gamma(value)


@pytest.mark.parametrize("value", [-1.0, 101.0, math.nan, math.inf, True, "5", None])
def test_min_snr_gamma_refuses_other_values_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"min_snr_gamma must be a number from 0 \(no weighting\) to 100, got"):
        check_min_snr_gamma(value)


def test_a_rows_prediction_scale_is_one_over_its_coefficients_size() -> None:
    """β = -σ (an ε or flow model) and β = -σ/√(σ²+1) (v-prediction) give 1/σ and √(σ²+1)/σ, in fp32."""
    sigma = torch.tensor([0.5, 2.0], dtype=torch.float64)
    assert prediction_scales(-sigma).tolist() == pytest.approx([2.0, 0.5], rel=1e-7)
    v = prediction_scales(-sigma / torch.sqrt(sigma ** 2 + 1))
    assert v.dtype == torch.float32
    assert v.tolist() == pytest.approx([math.sqrt(1.25) / 0.5, math.sqrt(5.0) / 2.0], rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, math.inf, math.nan])
def test_an_output_that_does_not_move_the_prediction_is_refused_naming_the_setting(beta: float) -> None:
    with pytest.raises(ValueError, match="loss_target 'prediction': this model's prediction of the clean latent does "
                                         "not depend on its output .* use loss_target 'clean latent'"):
        prediction_scales(torch.tensor([0.5, beta]))



def test_debiased_estimation_is_one_over_the_root_snr_capped_as_kohyas() -> None:
    """ε-prediction (x_t = x0 + σ·ε, SNR 1/σ²): σ = 0.5 gives 1/√4, σ = 2 gives 1/√0.25; σ = 0.01 (SNR 10,000) is
    capped at SNR 1000; v-prediction weighs 1/(SNR + 1). A row without noise weighs as the cap."""
    sigma = torch.tensor([0.5, 2.0, 0.01, 0.0])
    eps = debiased_weights(torch.ones(4), sigma, v_prediction=False)
    assert eps.dtype == torch.float32
    assert eps.tolist() == pytest.approx([0.5, 2.0, DEBIASED_SNR_CAP ** -0.5, DEBIASED_SNR_CAP ** -0.5], rel=1e-6)
    v = debiased_weights(torch.ones(4), sigma, v_prediction=True)
    assert v.tolist() == pytest.approx([1 / 5, 1 / 1.25, 1 / 1001, 1 / 1001], rel=1e-6)


def test_the_v_scaling_is_snr_over_snr_plus_one_capped_as_kohyas() -> None:
    """x_t = x0 + σ·ε (SNR 1/σ²): σ = 0.5 gives 4/5, σ = 2 gives 0.25/1.25; σ = 0.01 (SNR 10,000) is capped at
    SNR 1000, as a row without noise is; pure noise weighs 0."""
    sigma = torch.tensor([0.5, 2.0, 0.01, 0.0])
    weights = noise_like_weights(torch.ones(4), sigma)
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([0.8, 0.2, 1000 / 1001, 1000 / 1001], rel=1e-6)
    assert noise_like_weights(torch.zeros(1), torch.ones(1)).tolist() == [0.0]


def test_v_like_weights_add_the_implied_v_loss_capped_as_kohyas() -> None:
    """ε model: SNR = 1/σ², so 1 + λ·(SNR + 1)/SNR = 1 + λ·(1 + σ²); σ = 0.01 has SNR 10⁴, capped at 1000: 1 +
    λ·1.001 (kohya's get_snr_scale caps the same way)."""
    sigma = torch.tensor([0.5, 2.0, 14.6, 0.01])
    weights = v_like_weights(torch.ones(4), sigma, 0.1)
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([1.125, 1.5, 1 + 0.1 * (1 + 14.6 ** 2), 1 + 0.1 * 1.001], rel=1e-6)
    assert v_like_weights(torch.ones(2), torch.tensor([0.5, 2.0]), 0.0).tolist() == [1.0, 1.0]
