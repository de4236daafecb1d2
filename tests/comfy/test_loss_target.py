"""``loss_target`` "prediction" on ComfyUI's own samplings: the loss of the model's output against the output that
gives the clean latent, the objective kohya, musubi-tuner, ai-toolkit and OneTrainer train with.

The trainer only sees ComfyUI's prediction of the clean latent (``calculate_denoised`` of the model's output). Each
case here draws a raw model output, turns it into that prediction with the sampling's own code, and checks the
pack's loss against the loss computed directly on the output, with each family's target written out from the
literature, not from the pack's rule: ε for ε-prediction, ``v = α·ε − s·x0`` (``α = 1/√(σ²+1)``, ``s = σ·α``) for
v-prediction, the velocity ``ε − x0`` for rectified flow, ``x0`` for an x0 model.
"""

from __future__ import annotations

import importlib
import math
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

PERCENTS = (0.1, 0.4, 0.7, 0.9)  # of the schedule; sigmas from 14.6 (SD1.5's noisiest) down to a flow model's 0.1
LOSSES: dict[str, Callable[[], torch.nn.Module]] = {"MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss,
                                                    "Huber": torch.nn.HuberLoss}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


def _sampling(kind: str) -> Any:
    """A sampling as ComfyUI composes one for a model (``comfy.model_base.model_sampling``), at its defaults."""
    import comfy.model_sampling as ms

    bases = {"eps": (ms.ModelSamplingDiscrete, ms.EPS), "v": (ms.ModelSamplingDiscrete, ms.V_PREDICTION),
             "flow": (ms.ModelSamplingFlux, ms.CONST), "x0": (ms.ModelSamplingDiscrete, ms.X0)}[kind]
    return type(f"Sampling_{kind}", bases, {})()


def _target(kind: str, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The output a model of ``kind`` should give for this clean latent and noise (the literature's targets)."""
    s = sigma.view(-1, 1, 1, 1).double()
    if kind == "eps":
        return eps
    if kind == "v":
        alpha = 1 / torch.sqrt(s ** 2 + 1)
        return (alpha * eps - s * alpha * x0).float()
    if kind == "flow":
        return eps - x0
    return x0


def _loss(pack: ModuleType, loss_fn: torch.nn.Module, sampling: Any, **settings: Any) -> Any:
    train = _module(pack, "nodes.training.settings").TrainSettings(**settings)
    return _module(pack, "nodes.training.loss").WeightedLoss(loss_fn, train, torch.device("cpu"), sampling)


def _batch() -> Any:
    return types.SimpleNamespace(masks=None, extras={}, plan=types.SimpleNamespace(weights=(), index=0, epoch=0))


def _draw(sampling: Any, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Sigmas at :data:`PERCENTS`, a clean latent, noise and a raw model output (4 rows, SD-shaped latents)."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.tensor([float(sampling.percent_to_sigma(p)) for p in PERCENTS])
    x0, eps, out = (torch.randn(4, 4, 8, 8, generator=g) for _ in range(3))
    return sigma, x0, eps, out


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("kind", ["eps", "v", "flow", "x0"])
def test_the_prediction_loss_is_the_models_output_against_its_familys_target(pack: ModuleType, kind: str,
                                                                             loss_name: str) -> None:
    """Tolerance: the clean-latent prediction is rounded in fp32 (at most 2⁻²⁴ of |x_t| ≤ 60 per element), which the
    output space divides by |β| ≥ 0.09 here (the smallest σ's coefficient): under 2e-5 on errors of size ~1, so the
    losses agree to 1e-4 relative."""
    sampling = _sampling(kind)
    sigma, x0, eps, out = _draw(sampling)
    xt = sampling.noise_scaling(sigma, eps, x0)
    pred = sampling.calculate_denoised(sigma, out, xt)
    loss = _loss(pack, LOSSES[loss_name](), sampling, loss_target="prediction")(pred, x0, _batch(), sigma)
    expected = LOSSES[loss_name]()(out, _target(kind, x0, eps, sigma))
    assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    clean = _loss(pack, LOSSES[loss_name](), sampling)(pred, x0, _batch(), sigma)
    assert torch.equal(clean, LOSSES[loss_name]()(pred, x0))  # the default: ComfyUI's loss, the same call
    if kind != "x0":  # an x0 model's output is the clean latent: the two targets are one
        assert not math.isclose(float(loss), float(clean), rel_tol=1e-2)


@pytest.mark.parametrize("kind", ["eps", "v", "flow"])
def test_with_min_snr_both_targets_give_the_same_mse(pack: ModuleType, kind: str) -> None:
    """Min-SNR's weight is the paper's for each target, so its MSE loss is one objective whichever the target: the
    two differ by the fp32 rounding of the scaled rows (relative 1e-5 of each row's loss, well inside 1e-4)."""
    sampling = _sampling(kind)
    sigma, x0, eps, out = _draw(sampling, seed=1)
    pred = sampling.calculate_denoised(sigma, out, sampling.noise_scaling(sigma, eps, x0))
    losses = [_loss(pack, torch.nn.MSELoss(), sampling, loss_target=target, min_snr_gamma=5.0)(
        pred, x0, _batch(), sigma) for target in ("clean latent", "prediction")]
    assert float(losses[1]) == pytest.approx(float(losses[0]), rel=1e-4)


def test_the_scales_drawn_on_a_loader_worker_are_the_ones_the_step_computes(pack: ModuleType) -> None:
    """What the loader carries to the device with a batch (``drawn``) is what the loss would compute itself."""
    sampling = _sampling("flow")
    sigma, x0, eps, out = _draw(sampling, seed=2)
    pred = sampling.calculate_denoised(sigma, out, sampling.noise_scaling(sigma, eps, x0))
    loss = _loss(pack, torch.nn.MSELoss(), sampling, loss_target="prediction")
    drawn = loss.drawn(sigma)
    assert set(drawn) == {"prediction_scales"}
    torch.testing.assert_close(drawn["prediction_scales"], 1 / sigma, rtol=1e-6, atol=0)  # flow: β = -σ
    carried = types.SimpleNamespace(masks=None, extras=drawn, plan=_batch().plan)
    assert torch.equal(loss(pred, x0, carried, sigma), loss(pred, x0, _batch(), sigma))


def test_the_summary_names_what_each_family_predicts(pack: ModuleType) -> None:
    names = {kind: _loss(pack, torch.nn.MSELoss(), _sampling(kind), loss_target="prediction").describe_target()
             for kind in ("eps", "v", "flow", "x0")}
    assert names == {
        "eps": "the loss is on the model's prediction (the noise), not the clean latent",
        "v": "the loss is on the model's prediction (v), not the clean latent",
        "flow": "the loss is on the model's prediction (the velocity, noise minus latent), not the clean latent",
        "x0": "loss_target prediction: this model predicts the clean latent, so its loss is the clean latent's"}
    assert _loss(pack, torch.nn.MSELoss(), _sampling("eps")).describe_target() is None


@pytest.mark.parametrize("kind", ["eps", "v"])
def test_debiased_estimation_weighs_each_rows_prediction_loss_as_kohya(pack: ModuleType, kind: str) -> None:
    """kohya's debiased estimation on the prediction loss: each row's MSE of output against target (the
    literature's, as above) times 1/√SNR (ε) or 1/(SNR + 1) (v), SNR = 1/σ² capped at 1000, averaged over the rows
    (the rows share one shape). Tolerance as above."""
    sampling = _sampling(kind)
    sigma, x0, eps, out = _draw(sampling, seed=3)
    pred = sampling.calculate_denoised(sigma, out, sampling.noise_scaling(sigma, eps, x0))
    loss = _loss(pack, torch.nn.MSELoss(), sampling, loss_target="prediction", debiased_estimation=True)(
        pred, x0, _batch(), sigma)
    snr = (1 / sigma.double() ** 2).clamp(max=1000.0)
    weights = 1 / snr.sqrt() if kind == "eps" else 1 / (snr + 1)
    rows = ((out.double() - _target(kind, x0, eps, sigma).double()) ** 2).mean(dim=(1, 2, 3))
    assert float(loss) == pytest.approx(float((rows * weights).mean()), rel=1e-4)


def test_debiased_estimation_is_refused_for_a_model_it_has_no_weight_for(pack: ModuleType) -> None:
    for kind in ("flow", "x0"):
        with pytest.raises(ValueError, match="debiased_estimation is kohya's weighting for noise- and v-prediction "
                                             "models .* turn debiased_estimation off"):
            _loss(pack, torch.nn.MSELoss(), _sampling(kind), loss_target="prediction", debiased_estimation=True)


def test_scale_v_pred_loss_makes_a_v_models_loss_its_noise_prediction_loss(pack: ModuleType) -> None:
    """kohya's scale_v_pred_loss_like_noise_pred: a v model's prediction MSE, each row weighed by SNR/(SNR + 1),
    is the MSE of the noise its output implies (``(x_t - x0') / σ`` against ε; SNR = 1/σ² ≤ 100 here, under the
    cap). Tolerance as above: both sides divide the fp32 clean-latent prediction's rounding by σ ≥ 0.09. The
    weights drawn on a loader worker are the step's."""
    sampling = _sampling("v")
    sigma, x0, eps, out = _draw(sampling, seed=4)
    xt = sampling.noise_scaling(sigma, eps, x0)
    pred = sampling.calculate_denoised(sigma, out, xt)
    loss = _loss(pack, torch.nn.MSELoss(), sampling, loss_target="prediction", scale_v_pred_loss=True)
    got = loss(pred, x0, _batch(), sigma)
    implied = (xt.double() - pred.double()) / sigma.double().view(-1, 1, 1, 1)
    assert float(got) == pytest.approx(float(((implied - eps.double()) ** 2).mean()), rel=1e-4)
    plain = _loss(pack, torch.nn.MSELoss(), sampling, loss_target="prediction")(pred, x0, _batch(), sigma)
    assert not math.isclose(float(got), float(plain), rel_tol=1e-2)
    drawn = loss.drawn(sigma)
    assert set(drawn) == {"prediction_scales", "noise_like_weights"}
    carried = types.SimpleNamespace(masks=None, extras=drawn, plan=_batch().plan)
    assert torch.equal(loss(pred, x0, carried, sigma), got)
    assert "each image's v loss weighed by SNR/(SNR + 1) of its noise level" in loss.describe()[0]


def test_scale_v_pred_loss_is_refused_for_a_model_that_does_not_predict_v(pack: ModuleType) -> None:
    for kind, predicts in (("eps", "noise"), ("flow", "velocity"), ("x0", "x0")):
        with pytest.raises(ValueError, match=rf"scale_v_pred_loss weighs a v-prediction model's loss like a "
                                             rf"noise-prediction one's.*\(it predicts {predicts}\): turn "
                                             "scale_v_pred_loss off"):
            _loss(pack, torch.nn.MSELoss(), _sampling(kind), loss_target="prediction", scale_v_pred_loss=True)


def test_v_pred_like_loss_adds_the_v_loss_an_eps_models_output_implies(pack: ModuleType) -> None:
    """kohya's v_pred_like_loss λ on an ε model: the prediction MSE with each row weighed by 1 + λ·(SNR + 1)/SNR
    is the ε MSE plus λ times the MSE of the v the output implies against the literature's v (``v = α·ε − s·x0``,
    ``α = 1/√(σ²+1)``, ``s = σ·α``; per row: MSE_v = MSE_ε·(SNR + 1)/SNR). Tolerance as above."""
    sampling, lam = _sampling("eps"), 0.1
    sigma, x0, eps, out = _draw(sampling, seed=5)
    xt = sampling.noise_scaling(sigma, eps, x0)
    pred = sampling.calculate_denoised(sigma, out, xt)
    loss = _loss(pack, torch.nn.MSELoss(), sampling, loss_target="prediction", v_pred_like_loss=lam)
    got = loss(pred, x0, _batch(), sigma)
    s = sigma.double().view(-1, 1, 1, 1)
    alpha = 1 / torch.sqrt(s ** 2 + 1)
    x0_implied = xt.double() - s * out.double()  # the clean latent the ε output implies
    v_out = alpha * out.double() - s * alpha * x0_implied  # the v of that output's (ε, x0) pair
    v_target = _target("v", x0, eps, sigma).double()
    want = ((out.double() - eps.double()) ** 2).mean() + lam * ((v_out - v_target) ** 2).mean(dim=(1, 2, 3)).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    assert set(loss.drawn(sigma)) == {"prediction_scales", "v_like_weights"}
    assert "plus 0.1 times the v loss it implies" in loss.describe()[0]
    for kind, predicts in (("v", "v"), ("flow", "velocity"), ("x0", "x0")):
        with pytest.raises(ValueError, match=rf"v_pred_like_loss adds a noise-prediction model's implied v loss.*"
                                             rf"\(it predicts {predicts}\): set v_pred_like_loss to 0"):
            _loss(pack, torch.nn.MSELoss(), _sampling(kind), loss_target="prediction", v_pred_like_loss=lam)
