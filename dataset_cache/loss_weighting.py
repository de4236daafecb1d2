"""Min-SNR-γ loss weighting (Hang et al. 2023): each row's loss weighed by ``min(SNR, γ)`` of its noise level.

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
"""

from __future__ import annotations

import torch

from .checks import check_number

__all__ = ["MAX_MIN_SNR_GAMMA", "check_min_snr_gamma", "min_snr_weights"]

MAX_MIN_SNR_GAMMA = 100.0
"""The largest γ accepted: at 100 only the lowest noise levels of SD1.5's schedule are capped."""


def check_min_snr_gamma(value: object) -> None:
    """Refuse a ``min_snr_gamma`` that is not a number from 0 (no weighting) to :data:`MAX_MIN_SNR_GAMMA`.

    Raises:
        ValueError: naming ``min_snr_gamma``, the value and the usual setting.
    """
    check_number("min_snr_gamma", value, MAX_MIN_SNR_GAMMA, zero="no weighting", hint="5 is usual")


def min_snr_weights(signal: torch.Tensor, noise: torch.Tensor, gamma: float) -> torch.Tensor:
    """``min(SNR, gamma)`` per row (fp32, ``signal``'s device), ``SNR = (signal / noise)²`` computed in fp64.

    ``signal`` and ``noise`` are each row's coefficients of the clean latent and of the noise in the noised input.
    A row without noise (an infinite SNR) weighs ``gamma``.
    """
    signal, noise = signal.double(), noise.double()
    snr = torch.where(noise == 0, torch.full_like(signal, float("inf")), (signal / noise) ** 2)
    return snr.clamp(max=gamma).float()
