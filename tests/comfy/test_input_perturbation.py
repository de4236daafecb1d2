"""Train LoRA's ip_noise_gamma (kohya's input perturbation) on the real ComfyUI, CPU, tiny SD1.5 (an ε model,
``x_t = x0 + σ·noise``): the model's input carries γ times more noise than the target is made of, the target is the
clean latent for the clean-latent loss and kohya's ε target for the prediction loss, the validation loss is
measured without it, a continued run draws what the run that never stopped drew, bad values are refused by name;
with ``ip_noise_gamma_random_strength`` (and ``noise_offset_random_strength``, kohya's) each image's strength is a
uniform draw up to the one set."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import save_lora, train

GAMMA = 0.1






@pytest.fixture
def seen(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """Per training model call: the clean latent, sigma, noise (the batch's), the model's input and the target the
    loss compared with."""
    loop = importlib.import_module(f"{pack.__name__}.nodes.training.loop")
    loss = importlib.import_module(f"{pack.__name__}.nodes.training.loss")
    out: list[dict[str, torch.Tensor]] = []
    batch_loss, predict, compare = loop.StepLoop.batch_loss, loop.StepLoop.predict, loss.WeightedLoss.__call__

    def on_batch(self: Any, batch: Any, index: int, cond_seed: Any = None) -> Any:
        if torch.is_grad_enabled():
            x0 = self.mp.model.process_latent_in(batch.latents.to(self.device, torch.float32))
            out.append({"x0": x0, "sigma": batch.extras["sigma"].detach().clone(),
                        "noise": batch.extras["noise"].detach().clone()})
        return batch_loss(self, batch, index, cond_seed)

    def on_predict(self: Any, xt: torch.Tensor, *args: Any) -> Any:
        if torch.is_grad_enabled():
            out[-1]["xt"] = xt.detach().clone()
        return predict(self, xt, *args)

    def on_compare(self: Any, pred: torch.Tensor, target: torch.Tensor, *args: Any) -> Any:
        if torch.is_grad_enabled():
            out[-1]["target"] = target.detach().clone()
        return compare(self, pred, target, *args)

    monkeypatch.setattr(loop.StepLoop, "batch_loss", on_batch)
    monkeypatch.setattr(loop.StepLoop, "predict", on_predict)
    monkeypatch.setattr(loss.WeightedLoss, "__call__", on_compare)
    return out


def _extra(call: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the input holds besides σ·noise, per unit of σ: the perturbation (ε model: x_t = x0 + σ·noise)."""
    sigma = call["sigma"].view(-1, 1, 1, 1)
    return (call["xt"] - call["x0"] - sigma * call["noise"]) / sigma


@pytest.mark.parametrize("target", ["clean latent", "prediction"])
def test_the_input_carries_gamma_more_noise_and_the_target_that_of_the_noise_alone(
        train_node: type, models: tuple, six_images: Any, seen: list, target: str) -> None:
    """The extra noise is Gaussian with deviation γ (512 values per batch: the sample deviation lies within 0.02 of
    0.1 but at 6 standard errors, and the seed is fixed); the clean-latent loss compares with x0 exactly; the
    prediction loss with x0 + σ·ξ, the denoised latent of kohya's target ε at the perturbed input (to fp32
    rounding of values of size σ·|noise|: 1e-5 relative to the input's scale)."""
    train(train_node, models[0], six_images, ip_noise_gamma=GAMMA, loss_target=target)
    assert len(seen) == 3
    draws = []
    for call in seen:
        extra = _extra(call)
        draws.append(extra)
        scale = float(call["xt"].abs().max())
        if target == "clean latent":
            assert torch.equal(call["target"], call["x0"])
        else:
            sigma = call["sigma"].view(-1, 1, 1, 1)
            torch.testing.assert_close(call["target"], call["x0"] + sigma * extra, rtol=0, atol=1e-5 * scale)
    deviation = float(torch.cat([d.flatten() for d in draws]).std())
    assert abs(deviation - GAMMA) < 0.02
    assert not torch.allclose(draws[0], draws[1])  # each batch its own


def test_a_flow_models_target_is_kohyas_velocity_of_the_unperturbed_noise(
        train_node: type, models: tuple, six_images: Any, seen: list) -> None:
    """The same UNet sampled as a flow model (ModelSamplingSD3: ``x_t = (1 - σ)·x0 + σ·noise``, denoised ``x_t -
    σ·v``): kohya's target is the velocity ``noise - x0`` of the noise alone, so the denoised latent the loss compares
    with at the perturbed input is ``x_t' - σ·(noise - x0)`` (fp32 rounding, as above), and the perturbation is what
    the input holds besides ``(1 - σ)·x0 + σ·noise``."""
    import comfy_extras.nodes_model_advanced as advanced

    (flow,) = advanced.ModelSamplingSD3().patch(models[0], 3.0)
    train(train_node, flow, six_images, ip_noise_gamma=GAMMA, loss_target="prediction", steps=2)
    for call in seen:
        sigma = call["sigma"].view(-1, 1, 1, 1)
        extra = (call["xt"] - (1 - sigma) * call["x0"] - sigma * call["noise"]) / sigma
        assert 0.05 < float(extra.std()) < 0.15
        want = call["xt"] - sigma * (call["noise"] - call["x0"])
        torch.testing.assert_close(call["target"], want, rtol=0, atol=1e-5 * float(call["xt"].abs().max()))


def test_no_gamma_draws_nothing_and_trains_as_before(train_node: type, models: tuple, six_images: Any,
                                                     seen: list) -> None:
    train(train_node, models[0], six_images)
    assert all(torch.allclose(_extra(c), torch.zeros(()), atol=1e-4) for c in seen)
    assert all(torch.equal(c["target"], c["x0"]) for c in seen)


def test_validation_continuation_refusals_and_metadata(train_node: type, models: tuple, six_images: Any,
                                                       lora_folder: Path) -> None:
    """The validation loss before the first step is the same with and without the perturbation (measured without
    it); 2 steps, Save LoRA Weights, 2 more == 4 at once, bit for bit; out-of-range values refused by name; the
    LoRA file says the setting as kohya does."""
    split = {"val_split": 0.34, "steps": 2}
    plain = train(train_node, models[0], six_images, **split).result[1]["val_loss"]
    perturbed = train(train_node, models[0], six_images, ip_noise_gamma=GAMMA, **split).result[1]["val_loss"]
    assert plain[0] == perturbed[0] and plain[-1] != perturbed[-1]  # the first the same LoRA, the last not
    whole = train(train_node, models[0], six_images, steps=4, ip_noise_gamma=GAMMA).result
    first = train(train_node, models[0], six_images, steps=2, ip_noise_gamma=GAMMA).result
    name = save_lora(first[0], first[2], "loras/ip")
    rest = train(train_node, models[0], six_images, steps=2, ip_noise_gamma=GAMMA, existing_lora=name).result
    assert first[1]["loss"] + rest[1]["loss"] == whole[1]["loss"]
    assert all(torch.equal(rest[0][k], whole[0][k]) for k in whole[0])
    assert whole[0].metadata["ss_ip_noise_gamma"] == "0.1"
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"ip_noise_gamma must be a number from 0 \(no perturbation\) to 1"):
            train(train_node, models[0], six_images, ip_noise_gamma=bad)


def _row_scale(scaled: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """Per row, the factor ``u`` that best gives ``scaled`` from ``plain`` (least squares), after checking that one
    factor gives the whole row: the residual is the rounding of recovering the perturbation from the input (about
    1e-5 absolute on values of size 0.1, so 1e-3 of the row's norm is ample)."""
    s, p = scaled.flatten(1), plain.flatten(1)
    u = (s * p).sum(1) / (p * p).sum(1)
    residual = (s - u[:, None] * p).norm(dim=1) / p.norm(dim=1)
    assert float(residual.max()) < 1e-3, residual
    return u


def test_a_random_strength_scales_each_images_perturbation_by_its_own_uniform(
        train_node: type, models: tuple, six_images: Any, seen: list) -> None:
    """``ip_noise_gamma_random_strength``: the perturbation drawn without it, each image's times one factor in
    [0, 1) (kohya's: one per batch; here one per image, the same distribution for each), the factors differing."""
    train(train_node, models[0], six_images, ip_noise_gamma=GAMMA, steps=2)
    plain = [_extra(c) for c in seen]
    seen.clear()
    train(train_node, models[0], six_images, ip_noise_gamma=GAMMA, ip_noise_gamma_random_strength=True, steps=2)
    factors = torch.cat([_row_scale(_extra(c), p) for c, p in zip(seen, plain, strict=True)])
    assert len(factors) == 4 and float(factors.min()) >= 0 and float(factors.max()) < 1 + 1e-3
    assert float(factors.std()) > 0.01, factors  # each image its own strength


def test_random_strengths_continue_exactly_need_their_setting_and_are_in_the_metadata(
        train_node: type, models: tuple, six_images: Any, lora_folder: Path) -> None:
    """Both random strengths on: 2 steps, saved, 2 more == 4 at once, bit for bit (the strengths come from each
    batch's own generators); either without the setting it scales is refused by name before anything loads; the
    LoRA file names them as kohya does."""
    opts = {"noise_offset": 0.1, "noise_offset_random_strength": True, "ip_noise_gamma": GAMMA,
            "ip_noise_gamma_random_strength": True}
    whole = train(train_node, models[0], six_images, steps=4, **opts).result
    first = train(train_node, models[0], six_images, steps=2, **opts).result
    name = save_lora(first[0], first[2], "loras/ip_random")
    rest = train(train_node, models[0], six_images, steps=2, existing_lora=name, **opts).result
    assert first[1]["loss"] + rest[1]["loss"] == whole[1]["loss"]
    assert all(torch.equal(rest[0][k], whole[0][k]) for k in whole[0])
    assert whole[0].metadata["ss_noise_offset_random_strength"] == "True"
    assert whole[0].metadata["ss_ip_noise_gamma_random_strength"] == "True"
    for switch, base in (("noise_offset_random_strength", "noise_offset"),
                         ("ip_noise_gamma_random_strength", "ip_noise_gamma")):
        with pytest.raises(ValueError, match=rf"{switch} scales {base} by a random strength per image, but {base} "
                                             rf"is 0; set {base} \(e.g. 0.1\) or turn {switch} off"):
            train(train_node, "not a model: refused before it is used", six_images, **{switch: True})
