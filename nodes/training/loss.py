"""The loss of a batch: ComfyUI's loss module as it is, or its per-element form weighted by the batch's masks, its
rows' weights (regularization) and their Min-SNR weights (``min_snr_gamma``), on the clean latent or on the model's
own prediction (``loss_target``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import comfy.model_sampling
import torch

from ...dataset_cache.loader import Batch
from ...dataset_cache.loss_weighting import (debiased_weights, min_snr_weights, noise_like_weights, prediction_scales,
                                              v_like_weights)
from .settings import TrainSettings

__all__ = ["WeightedLoss"]


class WeightedLoss:
    """The step loop's loss: ``loss_fn`` (the module ComfyUI's ``_create_loss_function`` made) with the weights
    ``settings`` ask for, on ``device``; ``sampling_cpu``: a CPU copy of the model's ``model_sampling`` (the SNR of
    a sigma)."""

    def __init__(self, loss_fn: Any, settings: TrainSettings, device: torch.device, sampling_cpu: Any) -> None:
        self.loss_fn = loss_fn
        self.settings = settings
        self.device = device
        self._sampling_cpu = sampling_cpu
        self._predicts = _predicts(sampling_cpu)
        if settings.debiased_estimation and self._predicts not in ("noise", "v"):
            raise ValueError(f"debiased_estimation is kohya's weighting for noise- and v-prediction models (SD1.5, "
                             f"SDXL, SD2); this model's sampling is {type(sampling_cpu).__name__}: turn "
                             "debiased_estimation off")
        if settings.scale_v_pred_loss and self._predicts != "v":
            raise ValueError(f"scale_v_pred_loss weighs a v-prediction model's loss like a noise-prediction one's, "
                             f"as kohya's --scale_v_pred_loss_like_noise_pred; this model's sampling is "
                             f"{type(sampling_cpu).__name__} (it predicts {self._predicts or 'something else'}): "
                             "turn scale_v_pred_loss off")
        if settings.v_pred_like_loss > 0 and self._predicts != "noise":
            raise ValueError(f"v_pred_like_loss adds a noise-prediction model's implied v loss, as kohya's "
                             f"--v_pred_like_loss; this model's sampling is {type(sampling_cpu).__name__} (it "
                             f"predicts {self._predicts or 'something else'}): set v_pred_like_loss to 0")
        # each per-row value a batch is drawn with, by its key in Batch.extras, that the settings ask for
        self._drawn: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        if settings.min_snr_gamma > 0:
            self._drawn["snr_weights"] = self.snr_weights
        if settings.loss_target == "prediction":
            self._drawn["prediction_scales"] = self.prediction_scales
        if settings.debiased_estimation:
            self._drawn["debiased_weights"] = self.debiased
        if settings.scale_v_pred_loss:
            self._drawn["noise_like_weights"] = self.noise_like
        if settings.v_pred_like_loss > 0:
            self._drawn["v_like_weights"] = self.v_like
        self._elementwise: Any = None  # the per-element form of loss_fn, made when a batch first needs it

    def __call__(self, pred: torch.Tensor, target: torch.Tensor, batch: Batch, sigma: torch.Tensor) -> torch.Tensor:
        """The batch's loss: ComfyUI's loss module as it is, or its per-element form weighted by masks and rows.

        Without a weight to apply (no masks or ``masked_loss`` off, no row weight other than 1) this is exactly the
        call ComfyUI's own trainer makes, so the parity test with its ``TrainLoraNode`` stays bit-identical. With
        weights, the same loss class with the same parameters (a copy of ComfyUI's module with ``reduction="none"``)
        gives the per-element loss, which is multiplied by :meth:`weight` and averaged over every element, as
        kohya's trainer does (the mean over each row times the row's weight, averaged over the rows: rows of a batch
        share one shape). Not divided by the sum of the weights: then a row's weight ``w`` scales its own
        contribution by exactly ``w`` whatever the other rows weigh, a row of weight 0 adds nothing, and a mask
        that keeps a quarter of an image keeps a quarter of its loss (kohya's and OneTrainer's default).

        With ``loss_target`` "prediction" each row's prediction and target are first divided by its ``|β|``
        (:func:`~dataset_cache.loss_weighting.prediction_scales`): the loss is then the one on the model's output.
        """
        scale = self._drawn_per_row("prediction_scales", batch, pred, sigma)
        if scale is not None:
            pred, target = pred * scale, target * scale
        weight = self.weight(batch, pred, sigma)
        if weight is None:
            return self.loss_fn(pred, target)
        per_element = self._per_element_loss()(pred, target)
        if per_element.shape != pred.shape:
            raise RuntimeError(f"ComfyUI's {self.settings.loss_function} loss with reduction='none' returned shape "
                               f"{tuple(per_element.shape)} for a prediction of {tuple(pred.shape)}: masked and "
                               "weighted losses need a per-element loss; turn masked_loss off and use rows of weight 1")
        return (per_element * weight).mean()

    def weight(self, batch: Batch, pred: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor | None:
        """Per-element loss weight of the batch (broadcastable to ``pred``, fp32 on the training device), or
        ``None`` when every element weighs 1: its mask's weight times its rows' weights times their Min-SNR,
        debiased-estimation, v-scaling and v-like weights, each only where it applies."""
        weight = self._mask_weight(batch, pred)
        drawn = [self._drawn_per_row(key, batch, pred, sigma)  # every drawn value but the scales is a row weight
                 for key in self._drawn if key != "prediction_scales"]
        for per_row in (self._row_weights(batch, pred), *drawn):
            if per_row is not None:
                weight = per_row if weight is None else weight * per_row
        return weight

    def _mask_weight(self, batch: Batch, pred: torch.Tensor) -> torch.Tensor | None:
        """A mask ``m`` gives ``unmasked_weight + (1 - unmasked_weight) * m``, the same for every channel; video
        latents (``[B, C, T, h, w]``) have no masks (the loader gives clips none; any it gives are ignored)."""
        s = self.settings
        masks = batch.masks
        if not (s.masked_loss and masks is not None and s.unmasked_weight != 1.0 and pred.ndim == 4):
            return None
        expected = (pred.shape[0], 1, *pred.shape[-2:])
        if tuple(masks.shape) != expected:
            raise ValueError(
                f"the loss masks of batch {batch.plan.index} of epoch {batch.plan.epoch} have shape "
                f"{tuple(masks.shape)}, its latents need {expected} (latents "
                f"{', '.join(batch.plan.latent_keys[:4])}): the masks were encoded for other latents; encode "
                "the dataset's masks again, or turn masked_loss off")
        masks = masks.to(self.device, torch.float32)
        return s.unmasked_weight + (1.0 - s.unmasked_weight) * masks

    def _row_weights(self, batch: Batch, pred: torch.Tensor) -> torch.Tensor | None:
        """Each row's weight (``BatchPlan.weights``: a regularization dataset's loss weight), shaped to multiply
        its whole row; ``None`` when every row weighs 1."""
        rows = pred.shape[0]
        row_weights = batch.plan.weights
        if not (row_weights and any(w != 1.0 for w in row_weights)):
            return None
        if len(row_weights) != rows:
            raise ValueError(f"batch {batch.plan.index} of epoch {batch.plan.epoch} has {rows} rows but "
                             f"{len(row_weights)} loss weights: the sampler's plan does not match its batch")
        per_row = batch.extras.get("row_weights")  # on the device already when the loader drew it
        if per_row is None:
            per_row = torch.tensor(row_weights, dtype=torch.float32, device=self.device)
        return per_row.view(rows, *([1] * (pred.ndim - 1)))

    def _drawn_per_row(self, key: str, batch: Batch, pred: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor | None:
        """The per-row value ``key`` of :attr:`_drawn` (drawn with the batch on a loader worker, else computed from
        ``sigma`` here), shaped to multiply its whole row; ``None`` when the settings do not ask for it."""
        compute = self._drawn.get(key)
        if compute is None:
            return None
        values = batch.extras.get(key)  # on the device already when the loader drew it
        if values is None:
            values = compute(sigma).to(self.device)
        return values.view(pred.shape[0], *([1] * (pred.ndim - 1)))

    def drawn(self, sigma: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row values drawn with a batch of ``sigma`` on a loader worker (they reach the device with it):
        those of :attr:`_drawn`."""
        return {key: compute(sigma) for key, compute in self._drawn.items()}

    def debiased(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's debiased-estimation weight (fp32, CPU; :func:`~dataset_cache.loss_weighting.debiased_weights`)
        from the CPU copy of the model's sampling (any thread may call this)."""
        signal, noise = self._signal_noise(sigma.detach().to("cpu", torch.float32))
        return debiased_weights(signal, noise, self._predicts == "v")

    def noise_like(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's ``scale_v_pred_loss`` weight (fp32, CPU; :func:`~dataset_cache.loss_weighting.noise_like_weights`)
        from the CPU copy of the model's sampling (any thread may call this)."""
        return noise_like_weights(*self._signal_noise(sigma.detach().to("cpu", torch.float32)))

    def v_like(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's ``v_pred_like_loss`` weight (fp32, CPU; :func:`~dataset_cache.loss_weighting.v_like_weights`)
        from the CPU copy of the model's sampling (any thread may call this)."""
        return v_like_weights(*self._signal_noise(sigma.detach().to("cpu", torch.float32)),
                              self.settings.v_pred_like_loss)

    def snr_weights(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's Min-SNR weight ``min(SNR, min_snr_gamma)`` (fp32, CPU), the SNR of its sigma by the model's
        own ``noise_scaling`` (:mod:`dataset_cache.loss_weighting`), from the CPU copy of its sampling (any thread
        may call this). With ``loss_target`` "prediction" times ``β²``: the paper's weight for the model's output,
        so the MSE loss is the clean latent's weighed by ``min(SNR, γ)`` whichever the target."""
        sigma = sigma.detach().to("cpu", torch.float32)
        signal, noise = self._signal_noise(sigma)
        weights = min_snr_weights(signal, noise, self.settings.min_snr_gamma)
        if self.settings.loss_target == "prediction":
            weights = (weights.double() * self._coefficients(sigma).double() ** 2).float()
        return weights

    def prediction_scales(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's ``1 / |β|`` (fp32, CPU; :func:`~dataset_cache.loss_weighting.prediction_scales`), from the CPU
        copy of the model's sampling (any thread may call this)."""
        return prediction_scales(self._coefficients(sigma.detach().to("cpu", torch.float32)))

    def _signal_noise(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's coefficients of the clean latent and of the noise in its noised input (CPU ``sigma``), by the
        model's own ``noise_scaling``."""
        rows = sigma.shape[0]
        scale = self._sampling_cpu.noise_scaling
        noise = scale(sigma, torch.ones(rows, 1), torch.zeros(rows, 1), False).reshape(rows)
        signal = scale(sigma, torch.zeros(rows, 1), torch.ones(rows, 1), False).reshape(rows)
        return signal, noise

    def describe(self) -> list[str]:
        """The summary's lines for the weights and the target this loss applies (none for ComfyUI's own loss)."""
        s = self.settings
        lines = []
        if s.min_snr_gamma > 0:
            lines.append(f"each image's loss weighed by min(SNR, {s.min_snr_gamma:g}) of its noise level")
        if s.debiased_estimation:
            lines.append("each image's prediction loss weighed by kohya's debiased estimation (1/√SNR of its noise "
                         "level; 1/(SNR + 1) for v-prediction)")
        if s.scale_v_pred_loss:
            lines.append("each image's v loss weighed by SNR/(SNR + 1) of its noise level, as a noise prediction's "
                         "(scale_v_pred_loss)")
        if s.v_pred_like_loss > 0:
            lines.append(f"each image's noise loss plus {s.v_pred_like_loss:g} times the v loss it implies "
                         "(v_pred_like_loss)")
        target = self.describe_target()
        return lines if target is None else [*lines, target]

    def describe_target(self) -> str | None:
        """The summary's line for ``loss_target`` "prediction", naming what this model's output is; ``None`` for the
        clean latent (ComfyUI's own loss)."""
        if self.settings.loss_target != "prediction":
            return None
        if self._predicts == "x0":
            return "loss_target prediction: this model predicts the clean latent, so its loss is the clean latent's"
        output = _OUTPUT_NAMES.get(self._predicts, f"the output of its {type(self._sampling_cpu).__name__} sampling")
        return f"the loss is on the model's prediction ({output}), not the clean latent"

    def _coefficients(self, sigma: torch.Tensor) -> torch.Tensor:
        """Each row's ``β``: its predicted clean latent per unit of the model's output, by the sampling's own
        ``calculate_denoised`` (an output of 1 at an input of 0)."""
        rows = sigma.shape[0]
        denoised = self._sampling_cpu.calculate_denoised(sigma, torch.ones(rows, 1), torch.zeros(rows, 1))
        return denoised.reshape(rows)

    def _per_element_loss(self) -> Any:
        """ComfyUI's loss module (from ``_create_loss_function``) with ``reduction="none"``: the same class and
        parameters (Huber's delta, SmoothL1's beta), made once per run."""
        if self._elementwise is None:
            if not isinstance(self.loss_fn, torch.nn.Module) or not isinstance(
                    getattr(self.loss_fn, "reduction", None), str):
                raise RuntimeError(
                    f"ComfyUI's {self.settings.loss_function} loss ({type(self.loss_fn).__name__}) has no "
                    "'reduction' setting, so it cannot be weighted per element: this ComfyUI changed its training "
                    "losses; turn masked_loss off (and train without loss weights) or update ComfyUI-StreamCache")
            self._elementwise = copy.deepcopy(self.loss_fn)
            self._elementwise.reduction = "none"
        return self._elementwise



_OUTPUT_NAMES = {"edm": "EDM's scaled output", "v": "v", "noise": "the noise",
                 "velocity": "the velocity, noise minus latent"}
"""How the summary names what a model outputs, by :func:`_predicts`."""


def _predicts(sampling: Any) -> str:
    """What a model of ``sampling`` outputs, by ComfyUI's sampling classes (the subclasses first): ``"x0"``,
    ``"edm"``, ``"v"``, ``"noise"``, ``"velocity"``, or ``""`` for another sampling."""
    ms = comfy.model_sampling
    for kind, name in ((ms.X0, "x0"), (ms.EDM, "edm"), (ms.V_PREDICTION, "v"), (ms.V_PREDICTION_DDPM, "v"),
                       (ms.EPS, "noise"), (ms.CONST, "velocity")):
        if isinstance(sampling, kind):
            return name
    return ""
