"""LoRA training on ComfyUI's own machinery, fed batch by batch from a StreamCache dataset.

Why not call ComfyUI's ``TrainLoraNode`` (or its ``TrainGuider``/``TrainSampler``): that driver sizes a dummy
latent and noise tensor to the whole dataset and moves them to the device, draws batches with the global RNG inside
each step (nothing can be read ahead, runs are not reproducible), and hands the guider one conditioning per batch row,
so ComfyUI's ``calc_cond_batch`` runs every caption over the *whole* batch and averages the predictions: with
``batch_size > 1`` every image is trained towards the mean of all the batch's captions. In bucket and multi-resolution
mode it also skips ``process_latent_in`` (the VAE-space → model-space scaling).

What this package does instead, per optimizer step: take the next :class:`~dataset_cache.loader.Batch` from a
:class:`~dataset_cache.loader.PrefetchLoader` (read ahead in background threads, already on the model's device),
scale the latents into model space, noise them at seeded sigmas, turn EACH row's own conditioning into the model's
keyword arguments (``convert_cond`` → ``encode_model_conds`` → ``process_cond`` → ``cond_cat``), and call the
model's ``apply_model`` once for the batch, as ComfyUI's sampler would for one conditioning. Everything else is
ComfyUI's: the model clone, compute dtype, the LoRA/LoHa/LoKr/OFT adapters and their weight wrappers, optimizers,
losses and model loading, taken from the live ``nodes_train`` module (see
:func:`~.comfy_parts.nodes_train_module`). Device memory is one batch plus the model, whatever the dataset's
size; each block of the model is its own gradient checkpoint, and the memory plan streams blocks' weights when
the model does not fit (``memory``).

Modules: ``settings`` (the options), ``run`` (``train_lora`` as its steps), ``loop`` (the step loop), ``step_losses``
(its losses read back, checked and tallied), ``loss`` (the batch's loss and its weights), ``conditioning`` (per-row
conditionings, the model call), ``report`` (step and run reports), ``comfy_parts`` (the ComfyUI functions driven),
``memory`` (the memory plan's step: budget, plan, putting it in place), ``blocks`` (a model's blocks), ``probe`` (what a
run's forward keeps, measured on fake tensors), ``resume`` (continuing a LoRA exactly), ``saves`` (the LoRA saved during
a run), ``lora_files`` (the LoRAs ``existing_lora`` offers), ``layers`` (the layers ``train_layers`` gives adapters).
Only the execution thread calls ComfyUI's progress and interrupt functions; the loader's threads only read.
"""

from __future__ import annotations

from .comfy_parts import nodes_train_module
from .report import RowCounts, StepReport, TrainResult
from .run import train_lora
from .settings import (CHECKPOINT_MODES, DEFAULT_SAVE_PREFIX, LOSS_FUNCTIONS, LOSS_TARGETS, LR_SCHEDULES,
                       MAX_EMA_DECAY, MAX_GRAD_NORM, MAX_LORA_ALPHA, MAX_MIN_SNR_GAMMA, MAX_MULTIRES_ITERATIONS,
                       MAX_NOISE_OFFSET, MAX_REG_RATIO, MAX_REG_WEIGHT, MAX_SEED, MAX_TIMESTEP, MAX_WARMUP_STEPS,
                       OPTIMIZERS, TIMESTEP_SAMPLINGS, TrainSettings)
from .step_losses import NonFiniteLossError

__all__ = [
    "CHECKPOINT_MODES",
    "DEFAULT_SAVE_PREFIX",
    "LOSS_FUNCTIONS",
    "LOSS_TARGETS",
    "LR_SCHEDULES",
    "MAX_EMA_DECAY",
    "MAX_GRAD_NORM",
    "MAX_LORA_ALPHA",
    "MAX_MIN_SNR_GAMMA",
    "MAX_MULTIRES_ITERATIONS",
    "MAX_NOISE_OFFSET",
    "MAX_REG_RATIO",
    "MAX_REG_WEIGHT",
    "MAX_SEED",
    "MAX_TIMESTEP",
    "MAX_WARMUP_STEPS",
    "NonFiniteLossError",
    "OPTIMIZERS",
    "RowCounts",
    "StepReport",
    "TIMESTEP_SAMPLINGS",
    "TrainResult",
    "TrainSettings",
    "nodes_train_module",
    "train_lora",
]
