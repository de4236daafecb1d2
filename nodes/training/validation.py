"""The validation loss: the loss of a held-out dataset (``val_dataset``) with the same noise and timestep for each
image every time it is measured, before the first step, every ``val_every`` steps and after the last.

The training loss moves with each batch's random timesteps as much as with the LoRA; a fixed set, drawn the same
way each time, gives a curve that moves only with the LoRA, and one that rises again on images the LoRA never
trained on is the usual sign of overfitting (kohya's ``--validation_split``, OneTrainer's validation). It runs
without gradients through the run's own model call, loss and memory plan, and draws nothing from the training's
generators, so a run with validation trains the same LoRA bit for bit as one without.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...dataset_cache.dataset import Sample
from ...dataset_cache.loader import PrefetchLoader
from ...dataset_cache.noise_draws import draw_percents
from ...dataset_cache.reading import DatasetReader
from ...dataset_cache.sampler import BatchPlan, BucketSampler
from ...dataset_cache.seeding import derive_seed, seeded_generator

__all__ = ["Validation"]

log = logging.getLogger("streamcache.train")


class Validation:
    """Measures the validation loss of ``samples`` (each once, in dataset order, batches of ``batch_size`` rows of
    one bucket) and keeps every measurement.

    Args:
        loop: the run's :class:`~.loop.StepLoop` (its model call, loss and its weights, autocast and
            model sampling).
        reader: the reader of the validation samples' cache.
        samples: the validation samples; ``buckets``: the latent shape of each.
        batch_size: rows per batch; ``seed``: the run's seed (each image's draws are ``(seed, "validation", its
            latent key)``'s).
        every: measure after every ``every`` steps (global step numbers); 0: before the first and after the last
            only. ``last``: the run's last global step.
        device: where the loader delivers batches; ``interrupt``: checked while waiting for them (Cancel).
    """

    def __init__(self, loop: Any, reader: DatasetReader, samples: Sequence[Sample], buckets: Sequence[Any], *,
                 batch_size: int, seed: int, every: int, last: int, device: torch.device | None,
                 interrupt: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self.reader = reader
        self.samples = list(samples)
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.seed = seed
        self.every = every
        self.last = last
        self.device = device
        self.interrupt = interrupt
        self.results: list[tuple[int, float]] = []  # (global step, loss)
        self.seconds = 0.0

    @property
    def latest(self) -> tuple[int, float] | None:
        """The latest ``(step, loss)``, or ``None`` before the first measurement."""
        return self.results[-1] if self.results else None

    def due(self, step: int) -> bool:
        """Whether the validation loss is measured after global step ``step``."""
        return step == self.last or (self.every > 0 and step % self.every == 0)

    def measure(self, step: int) -> float:
        """The validation loss of the LoRA after global step ``step``: the mean over every validation image (each
        batch's mean weighted by its rows); recorded and returned."""
        t0 = time.perf_counter()
        sampler = BucketSampler(self.samples, self.buckets, self.batch_size, self.seed, tail="short", rank=0,
                                world_size=1, shuffle=False, name="val_dataset")
        loader = PrefetchLoader(self.reader, sampler, prefetch_batches=2, threads=1, device=self.device, epochs=1,
                                on_wait=self.interrupt, per_batch=self._draws)
        losses: list[torch.Tensor] = []  # on the device: read once at the end, not one wait for it per batch
        counts: list[int] = []
        try:
            with torch.no_grad():
                for number, batch in enumerate(loader):
                    if self.interrupt is not None:
                        self.interrupt()
                    seed = derive_seed(self.seed, "validation", batch.plan.latent_keys[0])
                    losses.append(self.loop.batch_loss(batch, number, cond_seed=seed).detach().reshape(()))
                    counts.append(int(batch.latents.shape[0]))
        finally:
            loader.close()
        total = 0.0  # in double, batch by batch
        for loss, n in zip(torch.stack(losses).tolist() if losses else [], counts):
            total += loss * n
        rows = sum(counts)
        value = total / max(rows, 1)
        self.results.append((step, value))
        self.seconds += time.perf_counter() - t0
        log.info("Train LoRA: validation loss %.5f at step %d (%d images, %.1f s)", value, step, rows,
                 time.perf_counter() - t0)
        return value

    def _draws(self, number: int, plan: BatchPlan, shape: torch.Size) -> dict[str, torch.Tensor]:
        """Each row's sigma (a uniform timestep of the training's timestep range, whatever distribution the training
        draws from) and plain noise, from a generator of its image (``(seed, "validation", latent key)``): the same
        at every measurement, whatever the batch size, the order or the number of devices."""
        percents, noises = [], []
        for key in plan.latent_keys:
            g = seeded_generator(self.seed, "validation", key)
            percents.append(draw_percents(g, 1, "uniform", span=self.loop.percent_span))
            noises.append(torch.randn((1, *shape[1:]), generator=g, dtype=torch.float32))
        sigma = self.loop.sigmas(torch.cat(percents))
        return {"sigma": sigma, "noise": torch.cat(noises), **self.loop.loss.drawn(sigma)}  # weighed as training

    def describe(self) -> str:
        """``validation loss (N images, fixed noise and timesteps): 0.12 at step 0 → 0.10 at step 500, lowest ...``."""
        if not self.results:
            return ""
        first, last = self.results[0], self.results[-1]
        best = min(self.results, key=lambda r: r[1])
        text = (f"validation loss ({len(self.samples)} images, the same noise and timesteps each time): "
                f"{first[1]:.4f} at step {first[0]}")
        if len(self.results) > 1:
            text += f" → {last[1]:.4f} at step {last[0]}"
        if best not in (first, last):
            text += f", lowest {best[1]:.4f} at step {best[0]}"
        return text + f" ({len(self.results)} measurements, {self.seconds:.1f} s)"
