"""What a training batch is noised with besides the latents: the timesteps' distribution and the noise offset.

ComfyUI's own trainer draws each row's timestep uniformly (a percent of the sampling schedule, which its
``percent_to_sigma`` turns into a sigma with the model's own shift) and noises with plain Gaussian noise. Two
settings of kohya, OneTrainer and ai-toolkit change that, and both are drawn here from the batch's own generator, so
a run stays reproducible and a continued run draws what the uninterrupted one did:

* ``logit-normal`` timesteps (Esser et al. 2024, the SD3 paper: ``t = sigmoid(n)``, ``n ~ N(0, 1)``): more of the
  training at middle noise levels, which that paper found better for rectified-flow models (SD3, Flux, Qwen-Image,
  Lumina 2, WAN);
* a noise offset (kohya's ``--noise_offset``): each row and channel's noise shifted by one Gaussian value times the
  offset, so the model also learns to change an image's mean brightness (images much darker or lighter than average).
"""

from __future__ import annotations

import torch

from .checks import check_number

__all__ = ["MAX_NOISE_OFFSET", "PERCENT_EDGE", "TIMESTEP_SAMPLINGS", "check_noise_settings", "draw_percents",
           "offset_noise"]

TIMESTEP_SAMPLINGS = ("uniform", "logit-normal")
"""How a row's timestep percent is drawn: uniformly (ComfyUI's own trainer), or ``sigmoid`` of a standard normal."""
MAX_NOISE_OFFSET = 1.0
"""An offset as large as the noise itself; kohya's recommended values are 0.05-0.1."""
PERCENT_EDGE = 1e-5
"""Timestep percents are drawn in ``[1e-5, 1 - 1e-5]``: ComfyUI's ``percent_to_sigma(0)`` is a 1e9 sentinel, not a
sigma."""


def check_noise_settings(timestep_sampling: object, noise_offset: object) -> None:
    """Refuse an unknown timestep sampling or an offset outside ``[0, MAX_NOISE_OFFSET]``, naming the field.

    Raises:
        ValueError: naming ``timestep_sampling`` or ``noise_offset`` and the accepted values.
    """
    if timestep_sampling not in TIMESTEP_SAMPLINGS:
        raise ValueError(f"unknown timestep_sampling {timestep_sampling!r:.40}; use one of "
                         f"{', '.join(TIMESTEP_SAMPLINGS)}")
    check_number("noise_offset", noise_offset, MAX_NOISE_OFFSET)


def draw_percents(generator: torch.Generator, rows: int, sampling: str, edge: float = PERCENT_EDGE) -> torch.Tensor:
    """``rows`` timestep percents in ``[edge, 1 - edge]`` (float64), drawn from ``generator`` as ``sampling`` says.

    ``uniform`` draws exactly what the trainer drew before this setting existed (the same generator calls).
    """
    if sampling == "uniform":
        u = torch.rand(rows, generator=generator, dtype=torch.float64)
    elif sampling == "logit-normal":
        u = torch.sigmoid(torch.randn(rows, generator=generator, dtype=torch.float64))
    else:
        raise ValueError(f"unknown timestep_sampling {sampling!r:.40}; use one of {', '.join(TIMESTEP_SAMPLINGS)}")
    return u.clamp(edge, 1 - edge)


def offset_noise(noise: torch.Tensor, generator: torch.Generator, offset: float) -> torch.Tensor:
    """``noise`` (rows, channels, ...) plus ``offset`` times one standard normal value per row and channel, drawn from
    ``generator`` after the noise; ``noise`` itself (nothing drawn) when ``offset`` is 0."""
    if offset == 0:
        return noise
    shift = torch.randn(noise.shape[:2], generator=generator, dtype=noise.dtype) * offset
    return noise + shift.reshape(*noise.shape[:2], *(1,) * (noise.ndim - 2))
