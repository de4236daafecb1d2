"""LoRA training on ComfyUI's own machinery, fed batch by batch from a StreamCache dataset.

Why not call ComfyUI's ``TrainLoraNode`` (or its ``TrainGuider``/``TrainSampler``): that driver sizes a dummy
latent and noise tensor to the whole dataset and moves them to the device, draws batches with the global RNG inside
each step (nothing can be read ahead, runs are not reproducible), and hands the guider one conditioning per batch row,
so ComfyUI's ``calc_cond_batch`` runs every caption over the *whole* batch and averages the predictions: with
``batch_size > 1`` every image is trained towards the mean of all the batch's captions. In bucket and multi-resolution
mode it also skips ``process_latent_in`` (the VAE-space → model-space scaling).

What this module does instead, per optimizer step: take the next :class:`~dataset_cache.loader.Batch` from a
:class:`~dataset_cache.loader.PrefetchLoader` (read ahead in background threads, already on the model's device),
scale the latents into model space, noise them at seeded sigmas, turn EACH row's own conditioning into the model's
keyword arguments (``convert_cond`` → ``encode_model_conds`` → ``process_cond`` → ``cond_cat``), and call the
model's ``apply_model`` once for the batch, as ComfyUI's sampler would for one conditioning. Everything else is
ComfyUI's: the model clone, compute dtype, the LoRA/LoHa/LoKr/OFT adapters and their weight wrappers, optimizers,
losses, gradient checkpointing and model loading, taken from the live ``nodes_train`` module (see
:func:`nodes_train_module`). Device memory is one batch plus the model, whatever the dataset's size.

Only the execution thread calls ComfyUI's progress and interrupt functions; the loader's threads only read.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import math
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.samplers
import comfy.utils
import folder_paths
import node_helpers
from comfy.weight_adapter import adapter_maps

from ..dataset_cache.dataset import Sample
from ..dataset_cache.loader import Batch, PrefetchLoader
from ..dataset_cache.reading import DatasetReader
from ..dataset_cache.seeding import derive_seed, seeded_generator
from ..dataset_cache.sampler import BucketSampler, DatasetMix, Regularization, buckets_from_reader, fit_batch_size
from ..dataset_cache.trainable import check_trainable, non_finite_entries

__all__ = [
    "OPTIMIZERS",
    "LOSS_FUNCTIONS",
    "StepReport",
    "TrainResult",
    "TrainSettings",
    "nodes_train_module",
    "train_lora",
]

log = logging.getLogger("streamcache.train")

OPTIMIZERS = ("AdamW", "Adam", "SGD", "RMSprop")
"""The optimizers ComfyUI's ``_create_optimizer`` knows (same names as the built-in node)."""
LOSS_FUNCTIONS = ("MSE", "L1", "Huber", "SmoothL1")
"""The losses ComfyUI's ``_create_loss_function`` knows."""
TRAINING_DTYPES = ("bf16", "fp32", "none")
LORA_DTYPES = ("bf16", "fp32")

_NODES_TRAIN_NEEDS = ("_setup_lora_adapters", "_create_optimizer", "_create_loss_function",
                      "find_modules_at_depth", "patch", "unpatch")
_SIGMA_EDGE = 1e-5
"""Timestep percentages are drawn in ``[1e-5, 1 - 1e-5]``: ``percent_to_sigma(0)`` is a 1e9 sentinel, not a sigma."""
_SMOOTHING = 0.1
"""Weight of the newest loss in the exponential moving average reported as ``loss_smooth``."""
MAX_REG_RATIO = 16.0
"""Regularization occurrences per main occurrence: kohya's default is 1; past 16 the main dataset is noise."""
MAX_REG_WEIGHT = 16.0
"""Loss weight of a regularization row (kohya's ``prior_loss_weight``, usually 1)."""


@dataclass(frozen=True)
class TrainSettings:
    """The training options (the built-in node's, plus the loader's).

    Attributes mirror ComfyUI's "Train LoRA" inputs; ``steps`` counts optimizer steps, each made of
    ``grad_accumulation_steps`` batches of ``batch_size`` rows. ``prefetch_batches`` batches are read ahead by
    ``loader_threads`` threads (0: the loader's default). ``masked_loss`` weighs the loss by the batch's masks
    where the dataset has any (``unmasked_weight``: the weight where a mask is 0); see :meth:`_Loop._loss`.
    """

    steps: int = 16
    batch_size: int = 1
    grad_accumulation_steps: int = 1
    learning_rate: float = 5e-4
    rank: int = 8
    optimizer: str = "AdamW"
    loss_function: str = "MSE"
    masked_loss: bool = True
    unmasked_weight: float = 0.1
    seed: int = 0
    training_dtype: str = "bf16"
    lora_dtype: str = "bf16"
    algorithm: str = "LoRA"
    gradient_checkpointing: bool = True
    checkpoint_depth: int = 1
    offloading: bool = False
    existing_lora: str = "[None]"
    prefetch_batches: int = 2
    loader_threads: int = 0
    quantized_backward: bool = False
    bypass_mode: bool = False
    # training-time variety (#16): the sampler's caption dropout and the regularization set's share and weight
    caption_dropout: float = 0.0
    reg_ratio: float = 1.0
    reg_weight: float = 1.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option and the accepted values."""
        for name, value, allowed in (
            ("algorithm", self.algorithm, tuple(adapter_maps)),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("loss_function", self.loss_function, LOSS_FUNCTIONS),
            ("training_dtype", self.training_dtype, TRAINING_DTYPES),
            ("lora_dtype", self.lora_dtype, LORA_DTYPES),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")
        for name in ("steps", "batch_size", "grad_accumulation_steps", "rank", "checkpoint_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefetch_batches < 0 or self.loader_threads < 0:
            raise ValueError("prefetch_batches and loader_threads must be >= 0")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if not 0.0 <= self.unmasked_weight <= 1.0:  # also refuses NaN
            raise ValueError(f"unmasked_weight must be between 0 and 1 (the loss weight where a mask is 0; 1: masks "
                             f"have no effect), got {self.unmasked_weight}")
        for name, top in (("caption_dropout", 1.0), ("reg_ratio", MAX_REG_RATIO), ("reg_weight", MAX_REG_WEIGHT)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= top):
                raise ValueError(f"{name} must be a number from 0 to {top:g}, got {value!r:.40}")


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did (passed to ``on_step`` on the execution thread).

    Attributes:
        step: optimizer steps done (1-based).
        total: optimizer steps of the run.
        loss: this step's loss (mean over its accumulated batches).
        loss_smooth: exponential moving average of ``loss``.
        samples_per_s: batch rows trained per second since the start.
        data_wait_pct: share of the time the step loop waited for the loader, in percent.
        epoch: the dataset epoch of the step's last batch.
    """

    step: int
    total: int
    loss: float
    loss_smooth: float
    samples_per_s: float
    data_wait_pct: float
    epoch: int


@dataclass
class RowCounts:
    """What the trained batch rows were: how many, and how many took each variant (caption dropout, a mirror, a
    loss mask, a regularization image), so the summary shows that a setting did what it says."""

    trained: int = 0
    dropped: int = 0
    mirrored: int = 0
    masked: int = 0
    regularization: int = 0

    def add(self, plan: Any, main_samples: int) -> None:
        """Count the rows of one batch plan (rows of samples from ``main_samples`` on are regularization rows)."""
        self.trained += len(plan.sample_indices)
        self.dropped += sum(plan.dropped)
        self.mirrored += sum(plan.mirrored)
        self.masked += sum(k is not None for k in plan.mask_keys)
        self.regularization += sum(i >= main_samples for i in plan.sample_indices)

    def describe(self) -> str:
        """``"rows: 48 trained, 5 with the empty caption, ..."``, or ``""`` when no row took a variant."""
        parts = [(self.dropped, "with the empty caption"), (self.mirrored, "mirrored"), (self.masked, "with a mask"),
                 (self.regularization, "regularization")]
        if not any(n for n, _ in parts):
            return ""
        return f"rows: {self.trained} trained, " + ", ".join(f"{n} {what}" for n, what in parts if n)


def _counted(batches: Iterator[Batch], counts: RowCounts, main_samples: int) -> Iterator[Batch]:
    """``batches``, counting each one's rows into ``counts`` as it is handed to the step loop."""
    for batch in batches:
        counts.add(batch.plan, main_samples)
        yield batch


@dataclass
class TrainResult:
    """The trained adapter weights and what the run measured.

    Attributes:
        lora: ComfyUI ``LORA_MODEL``: adapter parameter name → detached CPU tensor (``SaveLoRA``'s keys).
        losses: one loss per optimizer step.
        steps: total steps including those of ``existing_lora`` (what ``SaveLoRA`` names the file with).
        seconds: wall time of the step loop.
        samples_per_s: batch rows per second over the run.
        data_wait_pct: share of the loop's time spent waiting for data, in percent.
        buckets: latent shape ``(C, H, W)`` (``(C, T, H, W)`` for video latents) → occurrences per epoch.
        notes: settings the run had to change, for the user (a batch size clamped to the largest bucket).
        rows: the trained rows and how many took each variant.
    """

    lora: dict[str, torch.Tensor]
    losses: list[float]
    steps: int
    seconds: float
    samples_per_s: float
    data_wait_pct: float
    buckets: dict[Any, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    rows: RowCounts = field(default_factory=RowCounts)

    def summary(self) -> str:
        """One paragraph for the node's UI (what was changed from the settings first)."""
        first = sum(self.losses[:5]) / max(1, len(self.losses[:5]))
        last = sum(self.losses[-5:]) / max(1, len(self.losses[-5:]))
        rows = self.rows.describe()
        return "".join(f"NOTE: {n}. " for n in self.notes) + (
            f"trained {len(self.losses)} steps ({self.steps} in total) in {self.seconds:.1f} s: "
            f"{self.samples_per_s:.2f} samples/s, waited for data {self.data_wait_pct:.1f}% of the time; "
            f"loss {first:.4f} (first 5) → {last:.4f} (last 5); "
            f"buckets {', '.join(f'{list(b)}×{n}' for b, n in self.buckets.items())}"
            + (f"; {rows}" if rows else "")
        )


# ------------------------------------------------------------------------------------------- ComfyUI pieces
def nodes_train_module() -> ModuleType:
    """ComfyUI's live ``comfy_extras/nodes_train`` module (the one its "Train LoRA" node runs from).

    ComfyUI imports ``comfy_extras`` files under their path as module name, so ``import comfy_extras.nodes_train``
    would create a second copy; the live one is found through the registered node class, and the plain import is
    the fallback when the built-in nodes are not loaded (scripts, tests).

    Raises:
        RuntimeError: ComfyUI's training module lacks a function this pack calls (a ComfyUI version that
            changed its private training helpers).
    """
    module: ModuleType | None = None
    nodes = sys.modules.get("nodes")
    node_class = getattr(nodes, "NODE_CLASS_MAPPINGS", {}).get("TrainLoraNode") if nodes else None
    if node_class is not None:
        module = sys.modules.get(node_class.__module__)
    if module is None:
        module = importlib.import_module("comfy_extras.nodes_train")
    missing = [name for name in _NODES_TRAIN_NEEDS if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(
            f"ComfyUI's training module {module.__name__} has no {', '.join(missing)}: this ComfyUI version "
            "changed its LoRA training helpers; update ComfyUI-StreamCache (or use a ComfyUI it supports)"
        )
    return module


def _load_existing_lora(name: str) -> tuple[dict[str, torch.Tensor], int]:
    """Weights and step count of a LoRA in the ``loras`` folder (``"[None]"``: none).

    The step count is read from ``SaveLoRA``'s file name (``<prefix>_<steps>_steps_<counter>_.safetensors``); any
    other name counts 0 steps instead of failing (the built-in node raises on such names).
    """
    if name == "[None]":
        return {}, 0
    path = folder_paths.get_full_path("loras", name)
    if path is None:
        raise ValueError(f"existing_lora {name!r} is not in the loras folder; pick one from the list or [None]")
    match = re.search(r"(\d+)_steps_", name)
    return comfy.utils.load_torch_file(path, safe_load=True), int(match.group(1)) if match else 0


def _resume_exactly(lora_sd: dict[str, torch.Tensor], existing: dict[str, torch.Tensor]) -> None:
    """Start from every value of the existing LoRA, not only its up/down matrices.

    ComfyUI's adapter setup re-creates ``diff``/``diff_b`` (norm and bias deltas) as zeros and reads ``alpha`` from a
    key it never saves (``<module>.weight.alpha``), so a continued LoRA would silently lose those; copying the
    saved tensors over the freshly built parameters (same names, as ``SaveLoRA`` wrote them) continues exactly.
    """
    with torch.no_grad():
        for key, param in lora_sd.items():
            saved = existing.get(key)
            if saved is not None and saved.shape == param.shape:
                param.copy_(saved.to(param.dtype))


def _dtypes(mp: Any, training_dtype: str, lora_dtype: str) -> tuple[torch.dtype, torch.dtype, bool]:
    """(autocast dtype, adapter dtype, use a GradScaler) with the built-in node's rules; sets the compute dtype."""
    adapter_dtype = node_helpers.string_to_torch_dtype(lora_dtype)
    if training_dtype != "none":
        dtype = node_helpers.string_to_torch_dtype(training_dtype)
        mp.set_model_compute_dtype(dtype)
        return dtype, adapter_dtype, False
    if mp.model.get_dtype() == torch.float16:  # GradScaler handles fp16 gradients only, not bf16 adapters
        return torch.float16, adapter_dtype, adapter_dtype != torch.bfloat16
    return torch.bfloat16, adapter_dtype, False


def _check_latent_channels(mp: Any, buckets: Sequence[tuple[int, ...]]) -> None:
    expected = getattr(getattr(mp.model, "latent_format", None), "latent_channels", None)
    found = sorted({b[0] for b in buckets})
    if expected is not None and found != [expected]:
        raise ValueError(
            f"the dataset's latents have {found} channel(s) but the model expects {expected}: the cache was "
            "encoded with another model family's VAE; encode the dataset with this model's VAE"
        )


class _Conditioner:
    """Turns each batch row's own conditioning into the keyword arguments of ``BaseModel.apply_model``.

    Per row: ``convert_cond`` (ComfyUI's dict form of a conditioning entry) → ``encode_model_conds`` with the
    model's ``extra_conds`` (``c_crossattn``, ``y`` for SDXL-style pooled vectors, concat inputs, ...) for that row's
    noise and latent → ``process_cond(batch_size=1)``; then ``cond_cat`` joins the rows, padding cross-attention of
    different token lengths the way ComfyUI's sampler does. Rows whose conditionings cannot be joined (an LLM
    encoder's captions of different lengths, a T5 prompt past its padded length) form groups of their own, each
    run through the model separately, as ComfyUI's sampler runs conditionings it cannot batch.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def __call__(self, conditionings: Sequence[Any], noise: torch.Tensor, latents: torch.Tensor,
                 seed: int) -> list[tuple[list[int], dict[str, Any]]]:
        """Return ``(row indices, apply_model keyword arguments)`` per group of rows that batch together."""
        rows = []
        for i, conditioning in enumerate(conditionings):
            # check_trainable refused multi-entry conditionings and sampler-only options when the dataset opened
            (entry,) = comfy.sampler_helpers.convert_cond(conditioning)
            (encoded,) = comfy.samplers.encode_model_conds(
                self.model.extra_conds, [entry], noise[i : i + 1], self.device, "positive",
                latent_image=latents[i : i + 1], seed=seed,
            )
            rows.append({k: v.process_cond(batch_size=1, area=None) for k, v in encoded["model_conds"].items()})
        groups: list[list[int]] = []
        for i, row in enumerate(rows):
            home = next((g for g in groups if comfy.samplers.cond_equal_size(rows[g[0]], row)), None)
            if home is None:
                groups.append([i])
            else:
                home.append(i)
        return [(g, comfy.samplers.cond_cat([rows[i] for i in g], device=self.device)) for g in groups]


class _Forward:
    """One call of the model on a batch, as ComfyUI's ``_calc_cond_batch`` makes it for a single conditioning:
    the patcher's transformer options, wrappers and callbacks, ``model_function_wrapper`` when set."""

    def __init__(self, mp: Any, model_options: dict[str, Any]) -> None:
        self.mp = mp
        self.model_options = model_options
        self.uuid = uuid.uuid4()

    def __call__(self, xt: torch.Tensor, sigma: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        self.mp.prepare_state(sigma, self.model_options)
        options = dict(self.model_options.get("transformer_options", {}))
        options.update(cond_or_uncond=[0], uuids=[self.uuid], sigmas=sigma)
        c = {**kwargs, "transformer_options": options}
        wrapper = self.model_options.get("model_function_wrapper")
        if wrapper is not None:
            return wrapper(self.mp.model.apply_model,
                           {"input": xt, "timestep": sigma, "c": c, "cond_or_uncond": [0]})
        return self.mp.model.apply_model(xt, sigma, **c)


def _release(mp: Any) -> None:
    """Unload the training clone now (device memory back, weight wrappers removed) instead of at the next GC."""
    try:
        loaded = comfy.model_management.current_loaded_models
        for entry in [lm for lm in loaded if lm.model is mp]:
            entry.model_unload()
            loaded.remove(entry)
    except Exception:  # a ComfyUI that changed its loaded-model list: the clone is freed when collected
        log.debug("could not unload the training clone explicitly", exc_info=True)


# ----------------------------------------------------------------------------------------------- training
def train_lora(
    model: Any,
    reader: DatasetReader,
    samples: Sequence[Sample] | DatasetMix,
    settings: TrainSettings,
    *,
    on_step: Callable[[StepReport], None] | None = None,
    reg: Sequence[Sample] | DatasetMix | None = None,
    reg_name: str = "the regularization dataset",
) -> TrainResult:
    """Train a LoRA (or LoHa/LoKr/OFT) on ``model`` over the cached ``samples`` and return its weights.

    Runs on the calling thread (ComfyUI's execution thread): the interrupt flag is checked before every batch and
    while waiting for data, so Cancel stops within one batch; the loader's threads are stopped and joined whatever
    happens. The model passed in is not modified (a deep copy is trained and discarded).

    Args:
        model: a ComfyUI ``ModelPatcher`` (the ``MODEL`` socket's value).
        reader: the open cache reader of the datasets: a ``CacheReader``, or a ``MultiCacheReader`` when they (or
            the regularization set) live in several caches.
        samples: the dataset's samples, or a :class:`~dataset_cache.sampler.DatasetMix` of several datasets.
        settings: the options; validated here.
        on_step: called after every optimizer step on this thread (progress, websocket events).
        reg: regularization samples (read through ``reader`` too), mixed in at ``settings.reg_ratio`` with loss weight
            ``settings.reg_weight``; ``None``: none.
        reg_name: the regularization dataset's name, for messages.

    Raises:
        ValueError: bad settings, an empty dataset, or latents the model cannot take.
        comfy.model_management.InterruptProcessingException: the user cancelled the run.
    """
    settings.validate()
    main = samples.samples if isinstance(samples, DatasetMix) else samples
    if not main:
        raise ValueError("the dataset has no samples; encode a folder with images first")
    train = nodes_train_module()
    existing, existing_steps = _load_existing_lora(settings.existing_lora)
    buckets = buckets_from_reader(reader, main)
    check_trainable(reader, main)  # integer latents, combined or area conditionings: refused before any step
    regularization = None
    if reg is not None:
        reg_samples = reg.samples if isinstance(reg, DatasetMix) else reg
        reg_buckets = buckets_from_reader(reader, reg_samples)
        check_trainable(reader, reg_samples)
        regularization = Regularization(reg, reg_buckets, settings.reg_ratio, settings.reg_weight, name=reg_name)
        buckets_seen = [*buckets, *reg_buckets]
    else:
        buckets_seen = buckets
    notes: list[str] = []
    fitted = fit_batch_size(main, buckets, settings.batch_size)
    if fitted < settings.batch_size:  # the rest of each batch would be copies: clamp, and say so on the node
        notes.append(f"batch_size {settings.batch_size} is larger than this dataset's largest bucket ({fitted} "
                     f"images × repeats per epoch): trained with batch_size {fitted}")
        log.warning("Train LoRA: %s", notes[-1])
        settings = dataclasses.replace(settings, batch_size=fitted)

    with torch.inference_mode(False):
        mp = model.clone(force_deepcopy=True)
        dtype, adapter_dtype, use_scaler = _dtypes(mp, settings.training_dtype, settings.lora_dtype)
        _check_latent_channels(mp, buckets_seen)
        mp.model.requires_grad_(False).train()
        device = mp.load_device
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        bypass = None
        with torch.random.fork_rng(devices=rng_devices):  # seeded adapter init, the caller's RNG untouched
            torch.manual_seed(derive_seed(settings.seed, "adapters"))
            if settings.bypass_mode:
                lora_sd, adapters, bypass = _bypass_setup(train)(
                    mp, existing, settings.algorithm, adapter_dtype, settings.rank)
            else:
                lora_sd, adapters = train._setup_lora_adapters(
                    mp, existing, settings.algorithm, adapter_dtype, settings.rank)
        _resume_exactly(lora_sd, existing)
        optimizer = train._create_optimizer(settings.optimizer, lora_sd.values(), settings.learning_rate)
        loss_fn = train._create_loss_function(settings.loss_function)
        scaler = torch.amp.GradScaler() if use_scaler else None
        model_options = comfy.model_patcher.create_model_options_clone(mp.model_options)
        sampler = BucketSampler(samples, buckets, settings.batch_size, settings.seed, tail="wrap",
                                rank=0, world_size=1, caption_dropout=settings.caption_dropout, reg=regularization)
        first_batch = existing_steps * settings.grad_accumulation_steps  # continuing: where the last run stopped
        if first_batch and len(sampler):
            sampler.seek(first_batch // len(sampler), first_batch % len(sampler))
        loader_device = device if device.type in ("cpu", "cuda") else torch.device("cpu")
        loader = PrefetchLoader(
            reader, sampler, prefetch_batches=settings.prefetch_batches,
            threads=settings.loader_threads or None, device=loader_device, epochs=None,
            on_wait=comfy.model_management.throw_exception_if_processing_interrupted,
        )
        injections: list[Any] = []
        fp8_bwd = getattr(comfy.model_management, "training_fp8_bwd", False)
        try:
            comfy.model_management.training_fp8_bwd = settings.quantized_backward  # as the built-in node
            if settings.gradient_checkpointing:
                for m in train.find_modules_at_depth(mp.model.diffusion_model, depth=settings.checkpoint_depth):
                    train.patch(m, offloading=settings.offloading)
            comfy.sampler_helpers.prepare_model_patcher(mp, {}, model_options)  # patcher wrappers + callbacks
            # As the built-in node: free the device for training (1e20 unloads every other model).
            comfy.model_management.load_models_gpu([mp], memory_required=1e20,
                                                   force_full_load=not settings.offloading)
            comfy.samplers.cast_to_load_options(model_options, device=device, dtype=mp.model_dtype())
            if bypass is not None:  # adapters as forward hooks: the (quantized) weights are never rewritten
                for injection in bypass.create_injections(mp.model):
                    injection.inject(mp)
                    injections.append(injection)
            mp.pre_run()
            comfy.model_management.in_training = True
            counts = RowCounts()
            loop = _Loop(mp, settings, dtype, loss_fn, optimizer, scaler, _Forward(mp, model_options),
                         _Conditioner(mp.model, device), device, first_batch=first_batch)
            losses, seconds, rows, waited = loop.run(_counted(iter(loader), counts, sampler.main_samples), on_step)
        finally:
            comfy.model_management.in_training = False
            comfy.model_management.training_fp8_bwd = fp8_bwd
            loader.close()
            for injection in reversed(injections):
                injection.eject(mp)
            for m in mp.model.modules():
                train.unpatch(m)
            mp.cleanup()
            comfy.samplers.cast_to_load_options(model_options, device=mp.offload_device)
            _release(mp)
        lora = {k: v.detach().to("cpu", adapter_dtype).clone() for k, v in lora_sd.items()}
        for adapter in adapters:
            adapter.requires_grad_(False)
        del adapters, optimizer, lora_sd, mp
    wait_pct = 100.0 * waited / seconds if seconds > 0 else 0.0
    return TrainResult(lora, losses, settings.steps + existing_steps, seconds, rows / seconds if seconds else 0.0,
                       wait_pct, dict(sampler.buckets), tuple(notes), counts)


class NonFiniteLossError(ValueError):
    """Training stopped at a NaN or infinite loss: every later step would only spread it into the LoRA."""

    def __init__(self, step: int, loss: float, batch: Batch) -> None:
        plan = batch.plan
        bad = non_finite_entries(plan.latent_keys, batch.latents, plan.caption_keys, batch.conditioning)
        cause = (f"these entries hold NaN or infinite values: {', '.join(bad[:4])}"
                 f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; the cache's checksums cannot catch values "
                 "that were stored that way: re-encode those images and captions" if bad else
                 "the batch's values are finite, so the model diverged: lower the learning rate, or train in "
                 "bf16/fp32 rather than fp16")
        super().__init__(f"training stopped at step {step}: the loss is {loss} (batch {plan.index} of epoch "
                         f"{plan.epoch}, latents {', '.join(plan.latent_keys[:4])}"
                         f"{' ...' if len(plan.latent_keys) > 4 else ''}); {cause}. No LoRA was written")
        self.step = step
        self.entries = bad


def _bypass_setup(train: ModuleType) -> Callable[..., tuple[dict[str, torch.Tensor], list[Any], Any]]:
    """ComfyUI's bypass-mode adapter setup (adapters applied by forward hooks), or a ValueError naming the input
    when this ComfyUI has none."""
    setup = getattr(train, "_setup_lora_adapters_bypass", None)
    if setup is None:
        raise ValueError("bypass_mode is on, but this ComfyUI's training code has no bypass mode "
                         "(comfy_extras/nodes_train.py _setup_lora_adapters_bypass): update ComfyUI or turn "
                         "bypass_mode off")
    return setup


class _Loop:
    """The step loop: ``steps`` optimizer steps of ``grad_accumulation_steps`` batches each.

    ``first_batch`` is the global number of the first batch: a run continuing an existing LoRA starts where the
    earlier run stopped, so its batch order, noise and timesteps are those an uninterrupted run would have had.
    """

    def __init__(self, mp: Any, settings: TrainSettings, dtype: torch.dtype, loss_fn: Any, optimizer: Any,
                 scaler: Any, forward: _Forward, conditioner: _Conditioner, device: torch.device, *,
                 first_batch: int = 0) -> None:
        self.first_batch = first_batch
        self.mp = mp
        self.settings = settings
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scaler = scaler
        self.forward = forward
        self.conditioner = conditioner
        self.device = device
        self.model_sampling = mp.model.model_sampling
        self._elementwise: Any = None  # the per-element form of loss_fn, made when a batch first needs it

    def run(self, batches: Any, on_step: Callable[[StepReport], None] | None
            ) -> tuple[list[float], float, int, float]:
        """Return (loss per optimizer step, seconds, batch rows trained, seconds spent waiting for batches)."""
        s = self.settings
        throw_if_interrupted = comfy.model_management.throw_exception_if_processing_interrupted
        pbar = comfy.utils.ProgressBar(s.steps)
        losses: list[float] = []
        smooth = None
        rows = 0
        wait = 0.0
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        for step in range(s.steps):
            total = 0.0
            for micro in range(s.grad_accumulation_steps):
                throw_if_interrupted()
                t_wait = time.perf_counter()
                batch: Batch = next(batches)
                wait += time.perf_counter() - t_wait
                index = self.first_batch + step * s.grad_accumulation_steps + micro
                batch_loss = self._fwd_bwd(batch, index)
                if not math.isfinite(batch_loss):
                    raise NonFiniteLossError(step + 1, batch_loss, batch)
                total += batch_loss
                rows += batch.latents.shape[0]
            self._optimizer_step()
            loss = total / s.grad_accumulation_steps
            losses.append(loss)
            smooth = loss if smooth is None else (1 - _SMOOTHING) * smooth + _SMOOTHING * loss
            pbar.update(1)  # ComfyUI's progress hook also checks the interrupt flag
            if on_step is not None:
                elapsed = time.perf_counter() - t0
                on_step(StepReport(step + 1, s.steps, loss, smooth, rows / elapsed if elapsed else 0.0,
                                   100.0 * wait / elapsed if elapsed else 0.0, batch.plan.epoch))
        return losses, time.perf_counter() - t0, rows, wait

    def _fwd_bwd(self, batch: Batch, index: int) -> float:
        ms = self.model_sampling
        latents = self.mp.model.process_latent_in(batch.latents.to(self.device, torch.float32))
        sigma, noise = self._draw(tuple(latents.shape), index)
        sigma, noise = sigma.to(self.device), noise.to(self.device)
        xt = ms.noise_scaling(sigma, noise, latents, False)
        x0 = ms.noise_scaling(torch.zeros_like(sigma), torch.zeros_like(noise), latents, False)
        groups = self.conditioner(batch.conditioning, noise, latents, derive_seed(self.settings.seed, index))
        with self._autocast():
            # inputs require grad as in the built-in trainer: its offload checkpointing only records a graph then
            xt, sigma = xt.requires_grad_(True), sigma.requires_grad_(True)
            if len(groups) == 1:
                pred = self.forward(xt, sigma, groups[0][1])
            else:  # one model call per group, the predictions put back in row order
                order = torch.tensor([i for rows, _ in groups for i in rows], device=self.device)
                parts = [self.forward(xt[rows], sigma[rows], kwargs) for rows, kwargs in groups]
                pred = torch.cat(parts)[torch.argsort(order)]
            loss = self._loss(pred.float(), x0.float(), batch)
        scaled = loss / self.settings.grad_accumulation_steps
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return float(loss.detach())

    def _loss(self, pred: torch.Tensor, target: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The batch's loss: ComfyUI's loss module as it is, or its per-element form weighted by masks and rows.

        Without a weight to apply (no masks or ``masked_loss`` off, no row weight other than 1) this is exactly the
        call ComfyUI's own trainer makes, so the parity test with its ``TrainLoraNode`` stays bit-identical. With
        weights, the same loss class with the same parameters (a copy of ComfyUI's module with ``reduction="none"``)
        gives the per-element loss, which is multiplied by ``_loss_weight`` and averaged over every element, as
        kohya's trainer does (the mean over each row times the row's weight, averaged over the rows: rows of a batch
        share one shape). Not divided by the sum of the weights: then a row's weight ``w`` scales its own
        contribution by exactly ``w`` whatever the other rows weigh, a row of weight 0 adds nothing, and a mask
        that keeps a quarter of an image keeps a quarter of its loss (kohya's and OneTrainer's default).
        """
        weight = self._loss_weight(batch, pred)
        if weight is None:
            return self.loss_fn(pred, target)
        per_element = self._per_element_loss()(pred, target)
        if per_element.shape != pred.shape:
            raise RuntimeError(f"ComfyUI's {self.settings.loss_function} loss with reduction='none' returned shape "
                               f"{tuple(per_element.shape)} for a prediction of {tuple(pred.shape)}: masked and "
                               "weighted losses need a per-element loss; turn masked_loss off and use rows of weight 1")
        return (per_element * weight).mean()

    def _loss_weight(self, batch: Batch, pred: torch.Tensor) -> torch.Tensor | None:
        """Per-element loss weight of the batch (broadcastable to ``pred``, fp32 on the training device), or
        ``None`` when every element weighs 1.

        A mask ``m`` gives ``unmasked_weight + (1 - unmasked_weight) * m``, the same for every channel; video
        latents (``[B, C, T, h, w]``) have no masks (the loader gives clips none; any it gives are ignored). A row
        weight (``BatchPlan.weights``: a regularization dataset's loss weight) multiplies the whole row.
        """
        s = self.settings
        rows = pred.shape[0]
        weight: torch.Tensor | None = None
        masks = batch.masks
        if s.masked_loss and masks is not None and s.unmasked_weight != 1.0 and pred.ndim == 4:
            expected = (rows, 1, *pred.shape[-2:])
            if tuple(masks.shape) != expected:
                raise ValueError(
                    f"the loss masks of batch {batch.plan.index} of epoch {batch.plan.epoch} have shape "
                    f"{tuple(masks.shape)}, its latents need {expected} (latents "
                    f"{', '.join(batch.plan.latent_keys[:4])}): the masks were encoded for other latents; encode "
                    "the dataset's masks again, or turn masked_loss off")
            masks = masks.to(self.device, torch.float32)
            weight = s.unmasked_weight + (1.0 - s.unmasked_weight) * masks
        row_weights = batch.plan.weights
        if row_weights and any(w != 1.0 for w in row_weights):
            if len(row_weights) != rows:
                raise ValueError(f"batch {batch.plan.index} of epoch {batch.plan.epoch} has {rows} rows but "
                                 f"{len(row_weights)} loss weights: the sampler's plan does not match its batch")
            per_row = torch.tensor(row_weights, dtype=torch.float32, device=self.device)
            per_row = per_row.view(rows, *([1] * (pred.ndim - 1)))
            weight = per_row if weight is None else weight * per_row
        return weight

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

    def _draw(self, shape: tuple[int, ...], index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmas (one per row) and noise of batch ``index``, on the CPU.

        They depend on the seed and the batch number alone, so a run is reproducible and a continued run draws what
        an uninterrupted one would; the parity test with ComfyUI's trainer replaces this one method.
        """
        g = seeded_generator(self.settings.seed, index, "noise")
        u = torch.rand(shape[0], generator=g, dtype=torch.float64).clamp(_SIGMA_EDGE, 1 - _SIGMA_EDGE)
        sigma = torch.tensor([float(self.model_sampling.percent_to_sigma(float(p))) for p in u], dtype=torch.float32)
        return sigma, torch.randn(shape, generator=g, dtype=torch.float32)

    def _autocast(self) -> Any:
        """Autocast to the training dtype as the built-in trainer does; none for fp32 (CPU autocast refuses it)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        for group in self.optimizer.param_groups:  # as the built-in: gradients in the parameters' dtype
            for p in group["params"]:
                if p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
