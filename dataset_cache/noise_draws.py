"""What a training batch is noised with besides the latents: the timesteps' distribution, the noise offset and
multi-resolution noise.

ComfyUI's own trainer draws each row's timestep uniformly (a percent of the sampling schedule, which its
``percent_to_sigma`` turns into a sigma with the model's own shift) and noises with plain Gaussian noise. Two
settings of kohya, OneTrainer and ai-toolkit change that, and both are drawn here from the batch's own generator, so
a run stays reproducible and a continued run draws what the uninterrupted one did:

* ``logit-normal`` timesteps (Esser et al. 2024, the SD3 paper: ``t = sigmoid(n)``, ``n ~ N(0, 1)``): more of the
  training at middle noise levels, which that paper found better for rectified-flow models (SD3, Flux, Qwen-Image,
  Lumina 2, WAN);
* a noise offset (kohya's ``--noise_offset``): each row and channel's noise shifted by one Gaussian value times the
  offset, so the model also learns to change an image's mean brightness (images much darker or lighter than average);
* a timestep range (kohya's and musubi-tuner's ``--min_timestep`` / ``--max_timestep``, on the model's own 0-1000
  timestep scale, 1000 the noisiest): a LoRA of WAN 2.2's high-noise expert trains where that expert denoises (875 to
  1000), its low-noise expert's below; a style LoRA can leave out the noisiest steps. The draws are mapped into the
  percents of the schedule whose timesteps lie in the range (:func:`percent_span`), so the distribution keeps its
  shape over the range;
* multi-resolution ("pyramid") noise (kohya's ``--multires_noise_iterations`` / ``--multires_noise_discount``, from
  Whitaker's report): Gaussian noise at lower resolutions, upsampled and added with a weight that falls by the
  discount per level, so the noise also holds large blotches and the model learns to change an image's
  coarse layout and colours, not only its details. :func:`pyramid_noise` follows kohya's rule, level by level;
* input perturbation (kohya's ``--ip_noise_gamma``, Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in
  Diffusion Models"): the model's input is noised with the noise plus ``gamma`` times more Gaussian noise
  (:func:`draw_perturbation`), its target stays that of the noise alone, so training sees inputs as imperfect as
  the ones its own sampling steps will give it.

kohya's ``--noise_offset_random_strength`` and ``--ip_noise_gamma_random_strength`` scale the offset and the
perturbation of each row by a uniform draw (:func:`random_strengths`), so training sees every strength up to the one
set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .checks import check_number

__all__ = ["MAX_IP_NOISE_GAMMA", "MAX_MULTIRES_ITERATIONS", "MAX_NOISE_OFFSET", "MAX_TIMESTEP", "PERCENT_EDGE",
           "TIMESTEP_SAMPLINGS", "check_ip_noise_gamma", "check_multires", "check_noise_settings",
           "check_random_strength", "check_timestep_range", "draw_noise", "draw_percents", "draw_perturbation",
           "offset_noise", "percent_span", "pyramid_noise", "random_strengths"]

TIMESTEP_SAMPLINGS = ("uniform", "logit-normal")
"""How a row's timestep percent is drawn: uniformly (ComfyUI's own trainer), or ``sigmoid`` of a standard normal."""
MAX_NOISE_OFFSET = 1.0
"""An offset as large as the noise itself; kohya's recommended values are 0.05-0.1."""
MAX_IP_NOISE_GAMMA = 1.0
"""A perturbation as large as the noise itself; kohya's and the paper's value is 0.1."""
MAX_MULTIRES_ITERATIONS = 10
"""The most levels of multi-resolution noise (kohya suggests 6-10): past it every level is already 1×1."""
MAX_TIMESTEP = 1000
"""The top of the timestep scale ``min_timestep`` / ``max_timestep`` use, kohya's and musubi-tuner's: the index of
SD's discrete schedule, a flow model's shifted sigma × 1000."""
_BISECTIONS = 60
"""Halvings of the percent interval when finding where the model's timestep crosses a bound (below 1e-18)."""
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


def check_ip_noise_gamma(value: object) -> None:
    """Refuse an ``ip_noise_gamma`` outside ``[0, MAX_IP_NOISE_GAMMA]``, naming it.

    Raises:
        ValueError: naming ``ip_noise_gamma``, what 0 means and the usual value.
    """
    check_number("ip_noise_gamma", value, MAX_IP_NOISE_GAMMA, zero="no perturbation", hint="0.1 is kohya's")


def check_multires(iterations: object, discount: object) -> None:
    """Refuse a level count that is not a whole number from 0 to :data:`MAX_MULTIRES_ITERATIONS`, or a discount
    outside ``[0, 1]``, naming the field.

    Raises:
        ValueError: naming ``multires_noise_iterations`` or ``multires_noise_discount``, the value and the range.
    """
    if type(iterations) is not int or not 0 <= iterations <= MAX_MULTIRES_ITERATIONS:
        raise ValueError(f"multires_noise_iterations must be a whole number from 0 (no multi-resolution noise) to "
                         f"{MAX_MULTIRES_ITERATIONS}, got {iterations!r:.20} (6 to 10 is kohya's advice)")
    check_number("multires_noise_discount", discount, 1.0, hint="0.3 is kohya's default, 0.1 to 0.8 usual")


def check_timestep_range(min_timestep: object, max_timestep: object) -> None:
    """Refuse a timestep range that is not two whole numbers ``0 <= min_timestep < max_timestep <= 1000``.

    Raises:
        ValueError: naming both settings, the values and what the range means.
    """
    if (type(min_timestep) is not int or type(max_timestep) is not int
            or not 0 <= min_timestep < max_timestep <= MAX_TIMESTEP):
        raise ValueError(f"min_timestep and max_timestep must be whole numbers with 0 <= min_timestep < max_timestep "
                         f"<= {MAX_TIMESTEP} (the model's timesteps, {MAX_TIMESTEP} the noisiest; 0 and "
                         f"{MAX_TIMESTEP}: every timestep), got {min_timestep!r:.20} and {max_timestep!r:.20}")


def percent_span(timestep_at: Callable[[float], float], min_timestep: int, max_timestep: int,
                 edge: float = PERCENT_EDGE) -> tuple[float, float]:
    """The percents ``(lo, hi)`` of the schedule between which the model's timestep falls from ``max_timestep`` to
    ``min_timestep``; ``timestep_at(percent)`` is the model's timestep at a percent (falling as the percent rises:
    percent 0 is the noisiest). ``(0.0, 1.0)`` for the whole scale, so the draws stay what they were.

    Raises:
        ValueError: the model's timesteps are not on a 0-1000 scale (a continuous EDM sampling), or the range
            holds none of them.
    """
    if (min_timestep, max_timestep) == (0, MAX_TIMESTEP):
        return 0.0, 1.0
    top, bottom = timestep_at(edge), timestep_at(1 - edge)
    if not top > MAX_TIMESTEP / 2:
        raise ValueError(f"min_timestep / max_timestep: this model's timesteps are not on a 0-{MAX_TIMESTEP} scale "
                         f"(its noisiest is {top:.3g}); leave them at 0 and {MAX_TIMESTEP}")
    if min_timestep >= top or max_timestep <= bottom:
        raise ValueError(f"min_timestep {min_timestep} to max_timestep {max_timestep} holds none of this model's "
                         f"timesteps (from {bottom:.1f} to {top:.1f})")

    def crossing(target: float) -> float:
        """The percent where the timestep falls to ``target`` (the edges where it never does)."""
        lo, hi = edge, 1 - edge
        if target >= top:
            return lo
        if target <= bottom:
            return hi
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if timestep_at(mid) > target else (lo, mid)
        return (lo + hi) / 2

    return crossing(max_timestep), crossing(min_timestep)


def draw_percents(generator: torch.Generator, rows: int, sampling: str, edge: float = PERCENT_EDGE,
                  span: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """``rows`` timestep percents in ``[edge, 1 - edge]`` (float64), drawn from ``generator`` as ``sampling`` says,
    mapped linearly into ``span`` (:func:`percent_span`).

    ``uniform`` over the whole span draws exactly what the trainer drew before these settings existed (the same
    generator calls, no mapping).
    """
    if sampling == "uniform":
        u = torch.rand(rows, generator=generator, dtype=torch.float64)
    elif sampling == "logit-normal":
        u = torch.sigmoid(torch.randn(rows, generator=generator, dtype=torch.float64))
    else:
        raise ValueError(f"unknown timestep_sampling {sampling!r:.40}; use one of {', '.join(TIMESTEP_SAMPLINGS)}")
    if span != (0.0, 1.0):
        u = span[0] + u * (span[1] - span[0])
    return u.clamp(edge, 1 - edge)


def offset_noise(noise: torch.Tensor, generator: torch.Generator, offset: float,
                 random_strength: bool = False) -> torch.Tensor:
    """``noise`` (rows, channels, ...) plus ``offset`` times one standard normal value per row and channel, drawn from
    ``generator`` after the noise; ``noise`` itself (nothing drawn) when ``offset`` is 0.

    With ``random_strength`` (kohya's ``--noise_offset_random_strength``) each row's offset is ``offset`` times a
    uniform draw in ``[0, 1)``, drawn after the shifts (:func:`random_strengths`)."""
    if offset == 0:
        return noise
    shift = torch.randn(noise.shape[:2], generator=generator, dtype=noise.dtype) * offset
    if random_strength:
        shift *= random_strengths(noise.shape[0], generator, noise.dtype).reshape(-1, 1)
    return noise + shift.reshape(*noise.shape[:2], *(1,) * (noise.ndim - 2))


def random_strengths(rows: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One uniform strength in ``[0, 1)`` per row, from ``generator``: kohya's ``*_random_strength`` settings scale a
    noise offset or an input perturbation by such a draw. kohya draws one per batch; one per row keeps a row's
    noise independent of the rows batched with it, with the same distribution per row."""
    return torch.rand(rows, generator=generator, dtype=dtype)


def pyramid_noise(noise: torch.Tensor, generator: torch.Generator, iterations: int,
                  discount: float) -> torch.Tensor:
    """``noise`` (rows, channels, ..., h, w) with ``iterations`` levels of lower-resolution noise added, each row then
    scaled to a standard deviation of 1; ``noise`` itself (nothing drawn) when ``iterations`` is 0.

    Level ``i`` (from 0) draws ``r`` uniform in ``[2, 4)`` and Gaussian noise of ``int(h / r**i)`` by
    ``int(w / r**i)`` (at least 1), upsamples it bilinearly to ``h`` by ``w`` and adds it times ``discount**i``; the
    levels stop after the first with a side of 1. That is kohya's rule (level 0 is a second full-resolution noise, so
    the finest detail keeps its share); kohya scales the whole batch by one standard deviation, here each row by its
    own, so a row's noise does not depend on the rows it is batched with. Every value comes from ``generator``
    (after the noise and the offset), so a run is reproducible. A video's frames (the dimensions between channels
    and height) each get their own low-resolution noise.
    """
    if iterations == 0:
        return noise
    rows, h, w = noise.shape[0], noise.shape[-2], noise.shape[-1]
    planes = noise.reshape(rows, -1, h, w)  # channels x frames as planes of one image
    out = planes.clone()
    for i in range(iterations):
        r = 2.0 + 2.0 * float(torch.rand((), generator=generator, dtype=torch.float64))
        hn, wn = max(1, int(h / r ** i)), max(1, int(w / r ** i))
        level = torch.randn((rows, planes.shape[1], hn, wn), generator=generator, dtype=noise.dtype)
        out += F.interpolate(level, size=(h, w), mode="bilinear", align_corners=False) * discount ** i
        if hn == 1 or wn == 1:
            break
    out /= out.reshape(rows, -1).std(dim=1).reshape(rows, 1, 1, 1)
    return out.reshape(noise.shape)


def draw_noise(shape: tuple[int, ...], generator: torch.Generator, offset: float, iterations: int,
               discount: float, offset_random_strength: bool = False) -> torch.Tensor:
    """A batch's noise (fp32, CPU): Gaussian noise of ``shape``, then its offset (:func:`offset_noise`, its strength
    random per row with ``offset_random_strength``), then its multi-resolution levels (:func:`pyramid_noise`), each
    drawn from ``generator`` in that order; plain noise (the one draw) with neither."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    noise = offset_noise(noise, generator, offset, offset_random_strength)
    return pyramid_noise(noise, generator, iterations, discount)


def draw_perturbation(shape: tuple[int, ...], generator: torch.Generator, gamma: float,
                      random_strength: bool = False) -> torch.Tensor | None:
    """The input perturbation of a batch (fp32, CPU): ``gamma`` times Gaussian noise of ``shape``, drawn from
    ``generator`` after the batch's noise; ``None`` (and no draw: the batch's other draws as before) at 0. With
    ``random_strength`` (kohya's ``--ip_noise_gamma_random_strength``) each row's gamma is ``gamma`` times a uniform
    draw in ``[0, 1)``, drawn after the noise (:func:`random_strengths`)."""
    if gamma <= 0.0:
        return None
    drawn = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(gamma)
    if random_strength:
        drawn *= random_strengths(shape[0], generator).reshape(-1, *(1,) * (len(shape) - 1))
    return drawn


def check_random_strength(name: str, enabled: object, base: str, value: float) -> None:
    """Refuse ``name`` (a ``*_random_strength`` switch) on while the setting it scales, ``base``, is 0: the run
    would draw strengths for nothing, and the user most likely meant to set ``base`` too.

    Raises:
        ValueError: naming both settings.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"{name} must be true or false, got {enabled!r:.40}")
    if enabled and value <= 0.0:
        raise ValueError(f"{name} scales {base} by a random strength per image, but {base} is 0; set {base} "
                         f"(e.g. 0.1) or turn {name} off")
