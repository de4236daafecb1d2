"""The step loop: batches in, noise and timesteps drawn per batch, ComfyUI's loss (weighted only when asked:
:mod:`.loss`), optimizer steps out."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import comfy.model_management
import comfy.model_sampling
import comfy.utils

from ...dataset_cache.autograd_release import release_failed_backward
from ...dataset_cache.ema import WeightAverage
from ...dataset_cache.gcpause import StepCollector
from ...dataset_cache.grad_clip import clip_gradients
from ...dataset_cache.loader import Batch
from ...dataset_cache.lr_schedule import LrSchedule
from ...dataset_cache.noise_draws import draw_noise, draw_percents, draw_perturbation, percent_span
from ...dataset_cache.sampler import BatchPlan
from ...dataset_cache.seeding import derive_seed, seeded_generator
from ...dataset_cache.sharding import share_of
from .dropout import AdapterDropout
from .conditioning import Conditioner, ModelCall
from .loss import WeightedLoss
from .report import Startup, StepReport
from .settings import TrainSettings
from .step_losses import Done, LaggedLosses, NonFiniteLossError, Tally, finite_losses

__all__ = ["StepLoop"]

log = logging.getLogger("streamcache.train")


def _checked_by_the_ranks() -> None:
    """The interrupt check of one rank of several: none here, the ranks agree on stopping after each step."""


def _on_cpu(sampling: Any) -> Any:
    """A copy of ``sampling`` (a model's ``model_sampling``) with its tensors on the CPU, for the draws of loader
    threads while the model itself moves to the device and trains."""
    if not isinstance(sampling, torch.nn.Module):
        return sampling
    return copy.deepcopy(sampling).to("cpu")


def _own_rows(plan: BatchPlan, count: int, drawn: torch.Tensor) -> torch.Tensor:
    """This process's ``count`` rows of ``drawn``, a draw for the global batch (:func:`share_of`): all of it on one
    process, else a copy of its slice (the draw itself is not kept)."""
    rows, first = share_of(plan, count)
    return drawn if (first, count) == (0, rows) else drawn[first:first + count].clone()


class StepLoop:
    """The step loop: ``steps`` optimizer steps of ``grad_accumulation_steps`` batches each.

    ``first_batch`` is the global number of the first batch: a run continuing an existing LoRA starts where the
    earlier run stopped, so its batch order, noise and timesteps are those an uninterrupted run would have had.
    Each optimizer step clips the gradients' global norm to ``settings.max_grad_norm`` (0: no clipping) and reports
    the norm they had (:mod:`dataset_cache.grad_clip`).
    ``schedule`` sets each optimizer step's learning rate by the step's global number (``first_step`` + the step);
    ``None``: the optimizer's own, unchanged. ``validation`` (a :class:`~.validation.Validation`, set after the loop
    is made: it measures through it) measures the validation loss before the first step and after the steps it is
    due at.
    ``world`` (a :class:`~dataset_cache.collective.Collective`, ``None``: one process) makes this one rank of a
    data-parallel run: its batches are its rows of global batches (:func:`~dataset_cache.sharding.share_of`), whose
    noise and timesteps it draws whole and slices; gradients are averaged over the ranks before each optimizer step,
    the loss reported is the ranks' mean, and a stop (Cancel on rank 0) is agreed by every rank at a step boundary
    instead of checked here alone.
    """

    def __init__(self, mp: Any, settings: TrainSettings, dtype: torch.dtype, loss_fn: Any, optimizer: Any,
                 scaler: Any, forward: ModelCall, conditioner: Conditioner, device: torch.device, *,
                 first_batch: int = 0, world: Any = None, startup: Startup | None = None,
                 save: Callable[[int, BatchPlan, BaseException | None], None] | None = None,
                 schedule: LrSchedule | None = None, first_step: int = 0) -> None:
        self.first_batch = first_batch
        self.validation: Any = None  # a .validation.Validation, set by the run (it measures through this loop)
        self.sampling: Any = None  # a .samples.Sampling, set by the run (it samples through this loop)
        self.average: WeightAverage | None = None  # with ema_decay: the weights' average, set by the run
        self.dropout: AdapterDropout | None = None  # the adapters' dropout, set by the run (drawn per batch here)
        self.schedule = schedule
        self.first_step = first_step
        self.save = save  # the saves during the run (.saves.RunSaves): every settings.save_every steps, and on a stop
        self.completed = 0  # optimizer steps done
        self.grad_norms: list[float] = []  # each reported step's gradient norm before clipping, in step order
        self._last_plan: BatchPlan | None = None  # the last batch of the last step done
        self._saved_at = 0
        self._in_optimizer = False
        self.startup = startup  # its last two phases, the first batch's wait and the first step, end here
        self.world = world
        self.mp = mp
        self.settings = settings
        self.dtype = dtype
        self.optimizer = optimizer
        self.scaler = scaler
        self.forward = forward
        self.conditioner = conditioner
        self.device = device
        # the model's sampling as ComfyUI samples it: a Model Sampling node's object patch (a shift, v-prediction,
        # zero terminal SNR), which ComfyUI sets on the model only when it loads it, after this
        self.model_sampling = mp.get_model_object("model_sampling")
        # the draws' own copy, on the CPU: ComfyUI's load moves the model's (each scalar read then a synchronization)
        self._sampling_cpu = _on_cpu(self.model_sampling)
        self.loss = WeightedLoss(loss_fn, settings, device, self._sampling_cpu)  # the batch's loss and its weights
        # the percents of the schedule whose timesteps lie in min_timestep..max_timestep ((0, 1): all of them)
        self.percent_span = percent_span(self.timestep_at, settings.min_timestep, settings.max_timestep)
        self._params: list[torch.Tensor] | None = None  # the optimizer's parameters, listed at its first step

    def run(self, batches: Any, on_step: Callable[[StepReport], None] | None
            ) -> tuple[list[float], float, int, float]:
        """Return (loss per optimizer step, seconds, batch rows trained, seconds spent waiting for batches); each
        step's gradient norm before clipping is in :attr:`grad_norms` (also after an error: the steps reported).

        One process reads each step's loss from the device a step later (:class:`LaggedLosses`): reading it at once
        would make the training thread wait for the device to finish the step, and the device then idle while the
        thread prepares the next one (its conditionings, the model call's Python). The loss curve, the progress and
        a non-finite loss's error (naming its own step and batch) come one step later; the results are the same.
        The first step's loss is read at once (that one wait, once per run), so the first progress and the first
        loss show as soon as the first step is done. Several ranks agree on each step's loss at once
        (:meth:`~dataset_cache.collective.Collective.agree`).
        """
        s = self.settings
        throw_if_interrupted = comfy.model_management.throw_exception_if_processing_interrupted
        if self.world is not None:  # every rank stops at the same step: agreed in world.agree below
            throw_if_interrupted = _checked_by_the_ranks
        tally = Tally(s.steps, on_step, self._rate if self.schedule is not None else None, self.validation)
        self.grad_norms = tally.grad_norms
        lagged = LaggedLosses(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            if self.validation is not None:  # the curve's first point: the LoRA the run starts from
                self._validate(self.first_step)
                if self.startup is not None:
                    self.startup.mark("validation")
            if self.sampling is not None:  # the images of the LoRA the run starts from
                self._sample(self.first_step)
                if self.startup is not None:
                    self.startup.mark("samples")
            with StepCollector() as collector:  # the collector's passes between steps, not inside them
                if self.startup is not None:  # its first, full pass walks every object of the process
                    self.startup.mark("garbage collection")
                for step in range(s.steps):
                    self._step(step, batches, tally, lagged, throw_if_interrupted)
                    collector.step()
        except BaseException as error:  # out of memory in a backward pass: autograd would keep the failed step's graph
            release_failed_backward([self.device])  # (dataset_cache/autograd_release.py; its frames: the node)
            self._save_on_stop(error, lagged)
            raise
        self._report(lagged.swap(None, [], []), tally)
        return tally.losses, time.perf_counter() - tally.t0, tally.rows, tally.wait

    def _step(self, step: int, batches: Any, tally: Tally, lagged: LaggedLosses,
              throw_if_interrupted: Callable[[], None]) -> None:
        """One optimizer step: its batches forward and backward, the optimizer, the report of a finished step."""
        s = self.settings
        step_losses: list[torch.Tensor] = []
        step_batches: list[Batch] = []
        stopping = False
        for micro in range(s.grad_accumulation_steps):
            throw_if_interrupted()
            t_wait = time.perf_counter()
            batch: Batch = next(batches)
            tally.wait += time.perf_counter() - t_wait
            if step == 0 and micro == 0 and self.startup is not None:
                self.startup.mark("first batch")
            index = self.first_batch + step * s.grad_accumulation_steps + micro
            try:
                loss = self._fwd_bwd(batch, index)
            except comfy.model_management.InterruptProcessingException:  # from any of ComfyUI's ops
                if self.world is None:
                    raise
                stopping = True  # several ranks: all stop after this step's exchanges, none is left waiting
                break
            if self.world is not None:
                finite_losses(step, [loss], [batch])  # this rank stops at once with its own message
            step_losses.append(loss)
            step_batches.append(batch)
            tally.rows += share_of(batch.plan, batch.latents.shape[0])[0]  # one rank of several: the global's
        if self.world is not None:
            self.world.reduce_gradients(p for g in self.optimizer.param_groups for p in g["params"])
        grad_norm = None
        if not stopping:
            self._in_optimizer = True
            grad_norm = self._optimizer_step(step)
            self._in_optimizer = False
            self.completed, self._last_plan = step + 1, step_batches[-1].plan
        saving = self.save is not None and not stopping and s.save_every > 0 and (step + 1) % s.save_every == 0
        if self.world is not None:
            values = [float(v) for v in step_losses]
            tally.add(step, self.world.agree(sum(values) / s.grad_accumulation_steps, stop=stopping),
                      step_batches[-1] if step_batches else batch, float(grad_norm) if grad_norm is not None else None)
        else:
            self._report(lagged.swap(step, step_losses, step_batches, grad_norm), tally)
            if step == 0 or saving:  # the first loss at once: progress shows when the first step is done, not a
                self._report(lagged.swap(None, [], []), tally)  # step later; a save only of a step read finite
        if saving:
            self._save(None)
        if step == 0 and self.startup is not None:  # the first step done, on the device too (its loss was read)
            self.startup.mark("first step")
            log.info("Train LoRA: %s", self.startup.describe())
        if self.validation is not None and not stopping and self.validation.due(self.first_step + step + 1):
            self._validate(self.first_step + step + 1)
        if self.sampling is not None and not stopping and self.sampling.due(self.first_step + step + 1):
            self._sample(self.first_step + step + 1)

    def _validate(self, step: int) -> None:
        """The validation loss after global step ``step``, of the LoRA the run outputs: with ``ema_decay`` the
        average, swapped into the parameters for the measurement (the trained values back after it)."""
        assert self.validation is not None
        with self.average.swapped_in() if self.average is not None else contextlib.nullcontext():
            self.validation.measure(step)

    def _sample(self, step: int) -> None:
        """The sample images after global step ``step``, of the LoRA the run outputs (with ``ema_decay`` the average,
        swapped in as for :meth:`_validate`)."""
        assert self.sampling is not None
        with self.average.swapped_in() if self.average is not None else contextlib.nullcontext():
            self.sampling.take(step)

    def _save(self, stopped_by: BaseException | None) -> None:
        assert self.save is not None and self._last_plan is not None
        self._saved_at = self.completed
        self.save(self.completed, self._last_plan, stopped_by)

    def _save_on_stop(self, error: BaseException, lagged: LaggedLosses) -> None:
        """A run stopping early (Cancel, an error) saves what its completed steps trained: not when nothing new was
        trained since the last save, an optimizer step was cut short, a loss was not finite, or the process is
        being stopped (Ctrl+C). A failed save is logged and never hides ``error``."""
        stop = (Exception, comfy.model_management.InterruptProcessingException)  # the latter: a BaseException
        if (self.save is None or not isinstance(error, stop) or isinstance(error, NonFiniteLossError)
                or self._in_optimizer or self.completed <= self._saved_at):
            return
        try:
            done = lagged.swap(None, [], []) if self.world is None else None
            if done is not None:
                finite_losses(done.step, done.losses, done.batches)
            self._save(error)
        except Exception as exc:  # the run's own error follows; this one is only said
            log.warning("Train LoRA: the LoRA trained before the run stopped was not saved: %s", exc)

    def _report(self, done: Done | None, tally: Tally) -> None:
        """A step's losses read back from the device: checked, averaged over its batches, reported with its
        gradient norm."""
        if done is None:
            return
        finite_losses(done.step, done.losses, done.batches)
        tally.add(done.step, sum(done.losses) / self.settings.grad_accumulation_steps, done.batches[-1],
                  done.grad_norm)

    def per_batch(self, number: int, plan: BatchPlan, shape: torch.Size) -> dict[str, torch.Tensor]:
        """The loader's ``per_batch`` hook: the sigmas, noise and row weights of the loop's batch ``number``, drawn
        on a loader worker. They reach the device with the batch, copied from pinned memory on the loader's side
        stream, instead of as pageable copies the training thread would make (each one a synchronization that
        drains the GPU's queue). The loop takes its batches in the loader's order, so batch ``number`` is batch
        ``first_batch + number`` of the run: the same draws as :meth:`_fwd_bwd` would make itself."""
        sigma, noise = self._share(plan, tuple(shape), self.first_batch + number)
        out = {"sigma": sigma, "noise": noise}
        perturbation = self._perturbation(plan, tuple(shape), self.first_batch + number)
        if perturbation is not None:
            out["perturbation"] = perturbation
        if plan.weights and any(w != 1.0 for w in plan.weights) and len(plan.weights) == shape[0]:
            out["row_weights"] = torch.tensor(plan.weights, dtype=torch.float32)
        return {**out, **self.loss.drawn(sigma)}

    def _share(self, plan: BatchPlan, shape: tuple[int, ...], index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmas and noise of this process's rows of batch ``index`` (CPU): one rank of several draws for its
        global batch (seeded by its number) and keeps its own rows."""
        rows = share_of(plan, shape[0])[0]
        sigma, noise = self._draw((rows, *shape[1:]), index)
        return _own_rows(plan, shape[0], sigma), _own_rows(plan, shape[0], noise)

    def _perturbation(self, plan: BatchPlan, shape: tuple[int, ...], index: int) -> torch.Tensor | None:
        """This process's rows of batch ``index``'s input perturbation (``ip_noise_gamma``; CPU), ``None`` without
        one: drawn for the global batch from a generator of its own, so the other draws are those of a run
        without it."""
        rows = share_of(plan, shape[0])[0]
        s = self.settings
        drawn = draw_perturbation((rows, *shape[1:]), seeded_generator(s.seed, index, "perturbation"),
                                  s.ip_noise_gamma, s.ip_noise_gamma_random_strength)
        return None if drawn is None else _own_rows(plan, shape[0], drawn)

    def _fwd_bwd(self, batch: Batch, index: int) -> torch.Tensor:
        """One batch forward and backward; its loss, detached, where it was computed (read later: :meth:`run`).
        The adapters' dropout draws in both (its masks seeded by the batch's number and this rank)."""
        drawing = contextlib.nullcontext() if self.dropout is None else \
            self.dropout.batch(index, self.device, self.world.rank if self.world is not None else 0)
        with drawing:
            loss = self.batch_loss(batch, index)
            scaled = loss / self.settings.grad_accumulation_steps
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def batch_loss(self, batch: Batch, index: int, cond_seed: int | None = None) -> torch.Tensor:
        """The loss of batch ``index`` (its sigmas and noise from ``batch.extras`` when the loader drew them, else
        drawn here), with the graph a backward pass needs when grad is enabled; ``cond_seed``: the seed ComfyUI's
        conditioning code is given (default: the batch's)."""
        ms = self.model_sampling
        latents = self.mp.model.process_latent_in(batch.latents.to(self.device, torch.float32))
        if "sigma" in batch.extras and "noise" in batch.extras:  # drawn by the loader (:meth:`per_batch`)
            sigma, noise = batch.extras["sigma"], batch.extras["noise"]
            perturbation = batch.extras.get("perturbation")
        else:
            sigma, noise = self._share(batch.plan, tuple(latents.shape), index)
            sigma, noise = sigma.to(self.device), noise.to(self.device)
            perturbation = self._perturbation(batch.plan, tuple(latents.shape), index)
            perturbation = perturbation.to(self.device) if perturbation is not None else None
        x0 = ms.noise_scaling(torch.zeros_like(sigma), torch.zeros_like(noise), latents, False)
        if perturbation is None or not torch.is_grad_enabled():  # validation measures the unperturbed loss
            xt = ms.noise_scaling(sigma, noise, latents, False)
        else:
            xt, x0 = self._perturbed(sigma, noise, perturbation, latents, x0)
        seed = derive_seed(self.settings.seed, index) if cond_seed is None else cond_seed
        groups = self.conditioner(batch.conditioning, noise, latents, seed)
        with self._autocast():
            # inputs require grad as in the built-in trainer: its offload checkpointing only records a graph then
            xt, sigma = xt.requires_grad_(True), sigma.requires_grad_(True)
            pred = self.predict(xt, sigma, groups)
            return self.loss(pred.float(), x0.float(), batch, sigma)

    def _perturbed(self, sigma: torch.Tensor, noise: torch.Tensor, perturbation: torch.Tensor, latents: torch.Tensor,
                   x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's input noised with ``noise + perturbation`` (``ip_noise_gamma``), and the clean latent the loss
        compares with: ``x0`` for the clean-latent loss; for the prediction loss the denoised latent that the output
        kohya targets (that of the noise alone: ε, v, or the flow's velocity) gives at the perturbed input, ``x0 +
        α'·(x_t' - x_t)`` with ``α'`` the input's coefficient in the model's ``calculate_denoised``."""
        ms = self.model_sampling
        xt = ms.noise_scaling(sigma, noise + perturbation, latents, False)
        if self.settings.loss_target != "prediction":
            return xt, x0
        plain = ms.noise_scaling(sigma, noise, latents, False)
        zero = torch.zeros_like(xt)
        return xt, x0 + (ms.calculate_denoised(sigma, zero, xt) - ms.calculate_denoised(sigma, zero, plain))

    def predict(self, xt: torch.Tensor, sigma: torch.Tensor, groups: list[tuple[list[int], dict[str, Any]]]
                ) -> torch.Tensor:
        """The model's prediction of the clean latent for noised ``xt`` at ``sigma``: one model call, or one per
        group of rows whose conditionings do not batch (:class:`~.conditioning.Conditioner`), put back in row
        order."""
        if len(groups) == 1:
            return self.forward(xt, sigma, groups[0][1])
        order = torch.tensor([i for rows, _ in groups for i in rows], device=self.device)
        parts = [self.forward(xt[rows], sigma[rows], kwargs) for rows, kwargs in groups]
        return torch.cat(parts)[torch.argsort(order)]

    def _draw(self, shape: tuple[int, ...], index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmas (one per row) and noise of batch ``index``, on the CPU (``timestep_sampling``, ``noise_offset``
        (with its random strength) and the multi-resolution noise: :mod:`dataset_cache.noise_draws`).

        They depend on the seed and the batch number alone, so a run is reproducible and a continued run draws what
        an uninterrupted one would; the parity test with ComfyUI's trainer replaces this one method.
        """
        s = self.settings
        g = seeded_generator(s.seed, index, "noise")
        sigma = self.sigmas(draw_percents(g, shape[0], s.timestep_sampling, span=self.percent_span))
        return sigma, draw_noise(shape, g, s.noise_offset, s.multires_noise_iterations, s.multires_noise_discount,
                                 s.noise_offset_random_strength)

    def timestep_at(self, percent: float) -> float:
        """The timestep of a percent of the model's schedule on the 0-1000 scale kohya and musubi-tuner use: a flow
        model's (shifted) sigma × 1000 (ComfyUI's flow samplings count it in their own units: Flux's is the sigma
        itself), a discrete schedule's index (SD1.5, SDXL); other samplings' own ``timestep`` (EDM's log-sigma
        units, which :func:`~dataset_cache.noise_draws.percent_span` refuses). From the CPU copy of its sampling."""
        sampling = self._sampling_cpu
        sigma = float(sampling.percent_to_sigma(percent))
        if isinstance(sampling, comfy.model_sampling.CONST):  # x_t = (1 - σ) x0 + σ ε
            return 1000.0 * sigma
        return float(sampling.timestep(torch.tensor([sigma], dtype=torch.float64))[0])

    def sigmas(self, percents: torch.Tensor) -> torch.Tensor:
        """The model's sigmas (fp32, CPU) of timestep ``percents``, by its own ``percent_to_sigma`` (shift included),
        read from a CPU copy of its sampling (any thread may call this)."""
        return torch.tensor([float(self._sampling_cpu.percent_to_sigma(float(p))) for p in percents],
                            dtype=torch.float32)

    def _autocast(self) -> Any:
        """Autocast to the training dtype as the built-in trainer does; none for fp32 (CPU autocast refuses it)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _rate(self, step: int) -> float:
        assert self.schedule is not None
        return self.schedule.rate(self.first_step + step)

    def _optimizer_step(self, step: int) -> torch.Tensor:
        """Set the step's rate, unscale, clip (``max_grad_norm``) and step; return the gradients' norm before
        clipping, on the device (read with the step's loss)."""
        if self.schedule is not None:
            rate = self._rate(step)
            for group in self.optimizer.param_groups:
                group["lr"] = rate
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        for group in self.optimizer.param_groups:  # as the built-in: gradients in the parameters' dtype
            for p in group["params"]:
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
        if self._params is None:  # once: a generator over them would be a Python call per parameter and step
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = clip_gradients(self._params, self.settings.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.average is not None:
            self.average.update(self.first_step + step + 1)
        return grad_norm
