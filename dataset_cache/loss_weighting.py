"""What a row's loss is measured on and weighed by: the clean latent or the model's own prediction, and Min-SNR-γ
(Hang et al. 2023), each row's loss weighed by ``min(SNR, γ)`` of its noise level.

Low-noise timesteps have a high signal-to-noise ratio, and a loss that weighs them like the rest spends most of
the training on details the model already gets right; Min-SNR caps their weight at ``γ``. kohya
(``--min_snr_gamma``, 5 usual), OneTrainer and ai-toolkit offer it.

ComfyUI's trainer (and ours) computes the loss between the predicted and the true clean latent (x0). The paper's
weight in that space is ``min(SNR, γ)`` itself, and for ε- and v-prediction models (SD1.5, SDXL, SD2) with the MSE
loss it gives exactly kohya's objective: kohya weighs the ε loss by ``min(SNR, γ) / SNR`` (the v loss by
``min(SNR, γ) / (SNR + 1)``), and the ε loss is the x0 loss times ``SNR`` (the v loss times ``SNR + 1``). For
rectified-flow models (SD3, Flux, Qwen-Image, Lumina 2, WAN) the same weight applies with their SNR,
``((1 - σ) / σ)²``.

The SNR comes from the model's own ``noise_scaling`` (the caller's): ``x_t = signal · x0 + noise · ε``, so
``SNR = (signal / noise)²`` for any of ComfyUI's samplings.

**The loss target.** The loss on the clean latent is not the loss kohya, musubi-tuner, ai-toolkit and OneTrainer
train with: they compare the model's own output with the output that would give the clean latent (the noise ε for
SD1.5 and SDXL, v for v-prediction models, the velocity ε - x0 for flow models). ComfyUI's prediction of the clean
latent is affine in the model's output, ``x0' = a·x_t + β·output`` (its ``calculate_denoised``), so an error of the
output is the clean latent's error divided by ``β``: with ``loss_target`` "prediction" each row's prediction and
target are divided by ``|β|`` before the loss, which gives the output-space loss exactly for every loss ComfyUI
offers (each a function of the difference). For MSE that weighs the clean-latent loss by ``1/β²``: ``SNR`` for an
ε model, ``SNR + 1`` for a v model, ``1/σ²`` for a flow model, so the noisy rows weigh less than in ComfyUI's own
trainer and the nearly clean ones more. Min-SNR's weight is the paper's for each target
(``min(SNR, γ) · β²`` on the output), so with it both targets give the same MSE loss.
"""

from __future__ import annotations

import torch

from .checks import check_number

__all__ = ["DEBIASED_SNR_CAP", "LOSS_TARGETS", "MAX_MIN_SNR_GAMMA", "MAX_V_PRED_LIKE_LOSS", "check_min_snr_gamma",
           "check_v_pred_like_loss", "v_like_weights", "debiased_weights",
           "min_snr_weights", "noise_like_weights", "prediction_scales"]

LOSS_TARGETS = ("clean latent", "prediction")
"""What a row's loss compares: the predicted and true clean latent (ComfyUI's own trainer), or the model's output and
the output that gives the clean latent (kohya's, musubi-tuner's, ai-toolkit's, OneTrainer's)."""

DEBIASED_SNR_CAP = 1000.0
"""kohya's cap on the SNR of debiased estimation (its timestep 0 has an infinite SNR)."""
MAX_MIN_SNR_GAMMA = 100.0
"""The largest γ accepted: at 100 only the lowest noise levels of SD1.5's schedule are capped."""


def check_min_snr_gamma(value: object) -> None:
    """Refuse a ``min_snr_gamma`` that is not a number from 0 (no weighting) to :data:`MAX_MIN_SNR_GAMMA`.

    Raises:
        ValueError: naming ``min_snr_gamma``, the value and the usual setting.
    """
    check_number("min_snr_gamma", value, MAX_MIN_SNR_GAMMA, zero="no weighting", hint="5 is usual")


def prediction_scales(coefficients: torch.Tensor) -> torch.Tensor:
    """``1 / |β|`` per row (fp32), ``β`` each row's coefficient of the model's output in its predicted clean latent
    (``calculate_denoised(σ, output=1, x_t=0)``): what turns a clean-latent error into the output's error.

    Raises:
        ValueError: a coefficient is 0 or not finite (a sampling whose output does not move its prediction at that
            noise level), naming ``loss_target``.
    """
    beta = coefficients.double().abs()
    if not bool(torch.isfinite(beta).all() and (beta > 0).all()):
        raise ValueError(f"loss_target 'prediction': this model's prediction of the clean latent does not depend on "
                         f"its output at some noise level (coefficients {coefficients.tolist()!r:.80}); use "
                         "loss_target 'clean latent'")
    return (1.0 / beta).float()


def _snr(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``(signal / noise)²`` per row in fp64, infinite for a row without noise."""
    signal, noise = signal.double(), noise.double()
    return torch.where(noise == 0, torch.full_like(signal, float("inf")), (signal / noise) ** 2)


def min_snr_weights(signal: torch.Tensor, noise: torch.Tensor, gamma: float) -> torch.Tensor:
    """``min(SNR, gamma)`` per row (fp32, ``signal``'s device), ``SNR = (signal / noise)²`` computed in fp64.

    ``signal`` and ``noise`` are each row's coefficients of the clean latent and of the noise in the noised input.
    A row without noise (an infinite SNR) weighs ``gamma``.
    """
    return _snr(signal, noise).clamp(max=gamma).float()


def debiased_weights(signal: torch.Tensor, noise: torch.Tensor, v_prediction: bool) -> torch.Tensor:
    """kohya's debiased estimation (``--debiased_estimation_loss``) per row (fp32): the prediction loss of an
    ε-prediction model weighed by ``1/√SNR``, of a v-prediction model by ``1/(SNR + 1)``, the SNR (computed in fp64
    from the rows' signal and noise coefficients, as for Min-SNR) capped at :data:`DEBIASED_SNR_CAP` as kohya's is.

    It counters the bias of the ε loss toward nearly clean images (Yu et al. 2023); kohya offers it for SD1.5,
    SDXL and SD2, not for flow models.
    """
    snr = _snr(signal, noise).clamp(max=DEBIASED_SNR_CAP)
    return (1.0 / (snr + 1.0) if v_prediction else 1.0 / snr.sqrt()).float()


MAX_V_PRED_LIKE_LOSS = 1.0
"""As much v-like loss as the noise loss itself; kohya's guides use about 0.1."""


def check_v_pred_like_loss(value: object) -> None:
    """Refuse a ``v_pred_like_loss`` outside ``[0, MAX_V_PRED_LIKE_LOSS]``, naming it.

    Raises:
        ValueError: naming ``v_pred_like_loss``, what 0 means and the usual value.
    """
    check_number("v_pred_like_loss", value, MAX_V_PRED_LIKE_LOSS, zero="none", hint="about 0.1 in kohya's guides")


def v_like_weights(signal: torch.Tensor, noise: torch.Tensor, strength: float) -> torch.Tensor:
    """kohya's ``--v_pred_like_loss`` per row (fp32): a noise-prediction model's loss plus ``strength`` times the
    v loss it implies, ``1 + strength · (SNR + 1) / SNR``, the SNR (fp64, from the rows' coefficients) capped at
    :data:`DEBIASED_SNR_CAP` as kohya's ``get_snr_scale`` caps it.

    The MSE of v is the clean latent's times ``SNR + 1`` and the noise's the clean latent's times ``SNR`` (see
    :func:`noise_like_weights`), so the added term weighs the noisy levels up as training v would, while the model
    keeps predicting the noise.
    """
    snr = _snr(signal, noise).clamp(max=DEBIASED_SNR_CAP)
    return (1.0 + strength * (snr + 1.0) / snr).float()


def noise_like_weights(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """kohya's ``--scale_v_pred_loss_like_noise_pred`` per row (fp32): a v-prediction model's loss weighed by
    ``SNR / (SNR + 1)``, the SNR (fp64, from the rows' coefficients) capped at :data:`DEBIASED_SNR_CAP` as kohya's.

    The MSE of v is the clean latent's times ``SNR + 1`` and the MSE of the noise the clean latent's times ``SNR``,
    so this weight makes a v model's loss weigh its noise levels as an ε model's does (the recipes written for
    ε models then carry over to v-prediction ones such as SD2 768-v or NoobAI-XL v-pred).
    """
    snr = _snr(signal, noise).clamp(max=DEBIASED_SNR_CAP)
    return (snr / (snr + 1.0)).float()
