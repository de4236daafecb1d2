"""Train LoRA's options: the built-in node's, the loader's and the variety settings, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

from comfy.weight_adapter import adapter_maps

from ...dataset_cache.adapter_dropout import DropoutRates
from ...dataset_cache.checks import check_number
from ...dataset_cache.ema import MAX_EMA_DECAY, check_ema_decay
from ...dataset_cache.grad_clip import MAX_GRAD_NORM, check_max_grad_norm
from ...dataset_cache.holdout import check_val_split
from ...dataset_cache.layer_filter import LayerFilter
from ...dataset_cache.loss_weighting import LOSS_TARGETS, MAX_MIN_SNR_GAMMA, check_min_snr_gamma, check_v_pred_like_loss
from ...dataset_cache.lr_schedule import LR_SCHEDULES, LrSchedule
from ...dataset_cache.memory_plan import AUTO, MEMORY_MODES
from ...dataset_cache.sample_choice import check_sample_size, check_sampling
from ...dataset_cache.seeding import MAX_SEED
from .optimizers import check_args
from .samples import check_sampler
from ...dataset_cache.noise_draws import (MAX_MULTIRES_ITERATIONS, MAX_NOISE_OFFSET, MAX_TIMESTEP, TIMESTEP_SAMPLINGS,
                                          check_ip_noise_gamma, check_multires, check_noise_settings,
                                          check_random_strength, check_timestep_range)

__all__ = ["CHECKPOINT_MODES", "LORA_DTYPES", "LOSS_FUNCTIONS", "LR_SCHEDULES", "MAX_NOISE_OFFSET", "MAX_REG_RATIO",
           "MAX_REG_WEIGHT", "MAX_SEED", "MAX_TIMESTEP", "MAX_WARMUP_STEPS", "MAX_GRAD_NORM", "MAX_EMA_DECAY",
           "MAX_MIN_SNR_GAMMA",
           "MEMORY_MODES", "OPTIMIZERS", "LOSS_TARGETS", "MAX_MULTIRES_ITERATIONS", "MAX_LORA_ALPHA",
           "ALPHA_ALGORITHMS", "TIMESTEP_SAMPLINGS", "TRAINING_DTYPES", "DEFAULT_SAVE_PREFIX", "TrainSettings",
           "check_save_prefix"]

MAX_LORA_ALPHA = 4096.0
"""The largest ``lora_alpha``: past it the scale ``alpha / rank`` would turn a LoRA of any rank into noise."""
ALPHA_ALGORITHMS = ("LoRA", "LoHa", "LoKr")
"""The adapters whose ``alpha`` scales their difference by ``alpha / rank`` (OFT's is a constraint, fixed when made)."""
OPTIMIZERS = ("AdamW", "Adam", "SGD", "RMSprop", "Prodigy", "Lion", "Adafactor", "AdamW8bit", "Lion8bit")
"""The optimizers ComfyUI's ``_create_optimizer`` knows (same names as the built-in node), then ours
(:mod:`dataset_cache.prodigy`, :mod:`dataset_cache.lion`, :mod:`dataset_cache.adafactor`,
:mod:`dataset_cache.adamw8bit`, :mod:`dataset_cache.lion8bit`, made by :mod:`.optimizers`)."""
LOSS_FUNCTIONS = ("MSE", "L1", "Huber", "SmoothL1")
"""The losses ComfyUI's ``_create_loss_function`` knows."""
TRAINING_DTYPES = ("bf16", "fp32", "none")
LORA_DTYPES = ("bf16", "fp32")
CHECKPOINT_MODES = ("exact", "fast")
"""How blocks are checkpointed: "exact" (torch's non-reentrant checkpoint: the built-in node's gradients bit for
bit) or "fast" (the reentrant one: fewer host calls, gradients equal up to float rounding)."""

DEFAULT_SAVE_PREFIX = "loras/streamcache_lora"
"""Where saves during a run go, in ComfyUI's output folder (Save LoRA Weights': ``loras/ComfyUI_trained_lora``)."""

MAX_REG_RATIO = 16.0
"""Regularization occurrences per main occurrence: kohya's default is 1; past 16 the main dataset is noise."""
MAX_REG_WEIGHT = 16.0
"""Loss weight of a regularization row (kohya's ``prior_loss_weight``, usually 1)."""
MAX_WARMUP_STEPS = 100000
"""The node's largest ``steps``: a longer warm-up would never end."""


@dataclass(frozen=True)
class TrainSettings:
    """The training options (the built-in node's, plus the loader's).

    Attributes mirror ComfyUI's "Train LoRA" inputs; ``steps`` counts optimizer steps, each made of
    ``grad_accumulation_steps`` batches of ``batch_size`` rows. ``prefetch_batches`` batches are read ahead by
    ``loader_threads`` threads (0: the loader's default). ``masked_loss`` weighs the loss by the batch's masks
    where the dataset has any (``unmasked_weight``: the weight where a mask is 0); see :class:`~.loss.WeightedLoss`.
    ``memory`` picks the memory plan (:mod:`dataset_cache.memory_plan`; ``stream_blocks``: its block count for
    the stream modes, 0 as many as needed; ``allow_fp8``: block weights may be stored in fp8). ``checkpoint_depth``
    is no longer used: with ``gradient_checkpointing`` every block is its own checkpoint (0: set by a new node);
    ``checkpoint_mode`` picks how (:data:`CHECKPOINT_MODES`).
    ``save_every`` saves the LoRA trained so far every that many steps, and when the run stops early, the latest
    save with its training state (0: never; :mod:`.saves`), as
    ``<save_prefix>_<steps>_steps_<counter>_.safetensors`` in ComfyUI's output folder.
    ``lr_schedule`` and ``warmup_steps`` set each step's learning rate (:class:`~dataset_cache.lr_schedule.LrSchedule`
    over the steps the existing LoRA had plus ``steps``; "constant" without warm-up: ``learning_rate`` throughout, as
    ComfyUI's own trainer). ``timestep_sampling`` and ``noise_offset`` change what a batch is noised with
    (:mod:`dataset_cache.noise_draws`; "uniform" and 0: ComfyUI's own trainer's draws). ``max_grad_norm`` clips
    each step's gradients to that global L2 norm (:mod:`dataset_cache.grad_clip`; 0: no clipping, as ComfyUI's own).
    ``ema_decay`` makes the LoRA the run outputs (and saves, and validates) the moving average of its weights
    (:mod:`dataset_cache.ema`; 0: the last step's weights, as ComfyUI's own). ``min_snr_gamma`` weighs each row's
    loss by ``min(SNR, γ)`` of its noise level (:mod:`dataset_cache.loss_weighting`; 0: unweighted, as ComfyUI's own).
    ``train_layers`` gives adapters to the layers whose names its patterns choose (:mod:`dataset_cache.layer_filter`;
    empty: every layer, as ComfyUI's own). ``min_timestep`` and ``max_timestep`` keep the noise levels drawn to that
    range of the model's 0-1000 timesteps (:func:`dataset_cache.noise_draws.percent_span`; 0 and 1000: all).
    ``loss_target`` says what the loss compares (:data:`~dataset_cache.loss_weighting.LOSS_TARGETS`; "clean latent":
    ComfyUI's own trainer; "prediction": the model's output, as kohya's). ``multires_noise_iterations`` levels of
    lower-resolution noise, weighed down by ``multires_noise_discount`` per level, are added to each row's noise
    (:func:`dataset_cache.noise_draws.pyramid_noise`; 0: plain noise, as ComfyUI's own trainer). ``sample_count``
    cached captions are turned into images before the first step, every ``sample_every`` steps and after the last,
    with ``sample_steps`` steps of ComfyUI's ``sample_sampler`` over its ``sample_scheduler`` at guidance
    ``sample_cfg`` (:mod:`.samples`; 0: none). ``debiased_estimation``
    weighs each row's prediction loss as kohya's ``--debiased_estimation_loss`` (with ``loss_target`` "prediction"),
    ``scale_v_pred_loss`` a v-prediction model's as its ``--scale_v_pred_loss_like_noise_pred``.
    ``network_dropout``, ``rank_dropout`` and ``module_dropout`` drop parts of the adapters in each training forward,
    as kohya's LoRA networks (:mod:`.dropout`; 0: none, as ComfyUI's own). ``optimizer_args`` sets the optimizer's
    own settings as kohya's ``optimizer_args`` (:mod:`dataset_cache.optimizer_args`; empty: its defaults).
    ``ip_noise_gamma`` perturbs each training batch's input noise (kohya's input perturbation; 0: none);
    ``v_pred_like_loss`` adds a noise-prediction model's implied v loss (kohya's; 0: none).
    ``noise_offset_random_strength`` and ``ip_noise_gamma_random_strength`` draw each image's offset and
    perturbation strength uniformly up to the one set (kohya's; off: as set).
    ``devices`` says where to train (``None``: this process's device alone, as before; ``"auto"``, ``"0,1"``,
    ``(0, 1)`` or ``"cpu:N"``: see :mod:`.distributed`), each device taking ``batch_size`` rows of every step.
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
    checkpoint_depth: int = 0
    checkpoint_mode: str = "exact"
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
    # the memory plan (#25)
    memory: str = AUTO
    stream_blocks: int = 0
    allow_fp8: bool = False
    # several devices (#26): read by distributed.plan_team against the model's device
    devices: str | tuple[int, ...] | None = None
    # saves during the run (.saves): every ``save_every`` steps and when a run stops early; 0: none
    save_every: int = 0
    save_prefix: str = DEFAULT_SAVE_PREFIX
    # the learning rate of each step (dataset_cache.lr_schedule)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # what a batch is noised with (dataset_cache.noise_draws): ComfyUI's uniform timesteps and plain noise by default
    timestep_sampling: str = "uniform"
    noise_offset: float = 0.0
    # the validation loss of ``val_dataset`` (.validation): every ``val_every`` steps, 0: before and after the run only
    val_every: int = 0
    # each step's gradients clipped to this global L2 norm (dataset_cache.grad_clip); 0: none, as ComfyUI's trainer
    max_grad_norm: float = 0.0
    # the LoRA output is the moving average of the weights (dataset_cache.ema); 0: the last step's, as ComfyUI's
    ema_decay: float = 0.0
    # each row's loss weighed by min(SNR, gamma) (dataset_cache.loss_weighting); 0: unweighted, as ComfyUI's trainer
    min_snr_gamma: float = 0.0
    # the layers given adapters (dataset_cache.layer_filter): name patterns; "": every layer, as ComfyUI's trainer
    train_layers: str = ""
    # the model timesteps a batch is noised at (dataset_cache.noise_draws): 0 to 1000, every one, as ComfyUI's trainer
    min_timestep: int = 0
    max_timestep: int = MAX_TIMESTEP
    # a new adapter's scale is lora_alpha / rank (.comfy_parts.set_alpha); 1.0: ComfyUI's trainer's alpha
    lora_alpha: float = 1.0
    # the share of the dataset's sources held out for the validation loss (dataset_cache.holdout); 0: none
    val_split: float = 0.0
    # what the loss compares (dataset_cache.loss_weighting): the clean latents, as ComfyUI's trainer, or the model's
    # output and its target (kohya's, musubi-tuner's)
    loss_target: str = LOSS_TARGETS[0]
    # multi-resolution noise (dataset_cache.noise_draws.pyramid_noise): levels and their discount; 0: plain noise
    multires_noise_iterations: int = 0
    multires_noise_discount: float = 0.3
    # sample images (.samples): captions, how often, denoising steps, guidance; sample_count 0: none
    sample_count: int = 0
    sample_every: int = 0
    sample_steps: int = 20
    sample_cfg: float = 1.0
    # kohya's debiased estimation on the prediction loss (dataset_cache.loss_weighting); off: unweighted
    debiased_estimation: bool = False
    # the sample images' sampler and scheduler (.samples), ComfyUI's names; Euler over "simple" by default
    sample_sampler: str = "euler"
    sample_scheduler: str = "simple"
    # kohya's scale_v_pred_loss_like_noise_pred on a v-prediction model's prediction loss; off: unweighted
    scale_v_pred_loss: bool = False
    # the sample images' size in pixels (.samples.sized_plan); 0 and 0: the captions' bucket
    sample_width: int = 0
    sample_height: int = 0
    # the seed of the samples' noise; -1: the run's seed
    sample_seed: int = -1
    # kohya's dropout inside the adapters while they train (.dropout); 0: none
    network_dropout: float = 0.0
    rank_dropout: float = 0.0
    module_dropout: float = 0.0
    # the optimizer's settings as kohya's optimizer_args ("weight_decay=0.1 betas=0.9,0.99"); empty: its defaults
    optimizer_args: str = ""
    # kohya's ip_noise_gamma: the model's input noised with gamma times more noise than its target (0: none)
    ip_noise_gamma: float = 0.0
    # kohya's v_pred_like_loss: a noise-prediction model's loss plus this times the v loss it implies (0: none)
    v_pred_like_loss: float = 0.0
    # kohya's *_random_strength: each image's noise offset / input perturbation times a uniform draw; off: as set
    noise_offset_random_strength: bool = False
    ip_noise_gamma_random_strength: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option and the accepted values."""
        for name, value, allowed in (
            ("algorithm", self.algorithm, tuple(adapter_maps)),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("loss_function", self.loss_function, LOSS_FUNCTIONS),
            ("training_dtype", self.training_dtype, TRAINING_DTYPES),
            ("lora_dtype", self.lora_dtype, LORA_DTYPES),
            ("memory", self.memory, MEMORY_MODES),
            ("checkpoint_mode", self.checkpoint_mode, CHECKPOINT_MODES),
            ("lr_schedule", self.lr_schedule, LR_SCHEDULES),
            ("loss_target", self.loss_target, LOSS_TARGETS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")
        for name in ("steps", "batch_size", "grad_accumulation_steps", "rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefetch_batches", "loader_threads", "checkpoint_depth", "stream_blocks", "save_every",
                     "warmup_steps", "val_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if not 0.0 <= self.unmasked_weight <= 1.0:  # also refuses NaN
            raise ValueError(f"unmasked_weight must be between 0 and 1 (the loss weight where a mask is 0; 1: masks "
                             f"have no effect), got {self.unmasked_weight}")
        if not (self.devices is None or isinstance(self.devices, str) or (isinstance(self.devices, tuple) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.devices))):
            raise ValueError(f"devices must be 'auto', a list such as '0,1', 'cpu:N' or None, got {self.devices!r:.40}")
        for name, top in (("caption_dropout", 1.0), ("reg_ratio", MAX_REG_RATIO), ("reg_weight", MAX_REG_WEIGHT)):
            check_number(name, getattr(self, name), top)
        if self.warmup_steps > MAX_WARMUP_STEPS:
            raise ValueError(f"warmup_steps must be at most {MAX_WARMUP_STEPS}, got {self.warmup_steps}")
        check_save_prefix(self.save_prefix)
        self._check_noise()
        check_sampling(self.sample_count, self.sample_every, self.sample_steps, self.sample_cfg)
        check_sampler(self.sample_sampler, self.sample_scheduler)
        check_sample_size(self.sample_width, self.sample_height)
        if type(self.sample_seed) is not int or not -1 <= self.sample_seed <= MAX_SEED:
            raise ValueError(f"sample_seed must be -1 (the run's seed) or a seed from 0 to {MAX_SEED}, got "
                             f"{self.sample_seed!r:.30}")
        self._check_loss_weights()
        check_max_grad_norm(self.max_grad_norm)
        check_ema_decay(self.ema_decay)
        LayerFilter.parse(self.train_layers)
        check_timestep_range(self.min_timestep, self.max_timestep)
        check_val_split(self.val_split)
        check_number("lora_alpha", self.lora_alpha, MAX_LORA_ALPHA)
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be above 0 (the adapters' scale is lora_alpha / rank), got "
                             f"{self.lora_alpha!r}")
        if self.lora_alpha != 1.0 and self.algorithm not in ALPHA_ALGORITHMS:
            raise ValueError(f"lora_alpha scales {', '.join(ALPHA_ALGORITHMS)} adapters; {self.algorithm}'s alpha "
                             "is no scale (ComfyUI sets it when it makes the adapter): leave lora_alpha at 1")
        self._check_dropout()
        check_args(self.optimizer, self.optimizer_args)

    def _check_noise(self) -> None:
        """What a batch is noised with: the timesteps' distribution, the noise offset, multi-resolution noise and the
        input perturbation, each with its range, and a random strength only with what it scales."""
        check_noise_settings(self.timestep_sampling, self.noise_offset)
        check_multires(self.multires_noise_iterations, self.multires_noise_discount)
        check_ip_noise_gamma(self.ip_noise_gamma)
        check_random_strength("noise_offset_random_strength", self.noise_offset_random_strength, "noise_offset",
                              self.noise_offset)
        check_random_strength("ip_noise_gamma_random_strength", self.ip_noise_gamma_random_strength,
                              "ip_noise_gamma", self.ip_noise_gamma)

    def _check_loss_weights(self) -> None:
        """The loss weights' settings in range, and those defined on the loss on the model's prediction (kohya's
        debiased estimation, v scaling and v-like loss) only with ``loss_target`` prediction."""
        check_min_snr_gamma(self.min_snr_gamma)
        check_v_pred_like_loss(self.v_pred_like_loss)
        if self.loss_target == "prediction":
            return
        if self.debiased_estimation:
            raise ValueError("debiased_estimation weighs the loss on the model's prediction, as kohya's "
                             "--debiased_estimation_loss does: set loss_target to prediction")
        if self.scale_v_pred_loss:
            raise ValueError("scale_v_pred_loss weighs the loss on the model's prediction (v), as kohya's "
                             "--scale_v_pred_loss_like_noise_pred does: set loss_target to prediction")
        if self.v_pred_like_loss:
            raise ValueError("v_pred_like_loss adds to the loss on the model's prediction (the noise), as kohya's "
                             "--v_pred_like_loss does: set loss_target to prediction")

    def _check_dropout(self) -> None:
        """The dropout rates in range, and where they can act: a LoRA's hidden units exist only in bypass mode
        (otherwise the adapter changes the weight, and no activation of its own is there to drop)."""
        rates = self.dropout_rates
        rates.validate()
        if (rates.network or rates.rank) and self.algorithm != "LoRA":
            raise ValueError(f"network_dropout and rank_dropout drop a LoRA's ranks; algorithm is {self.algorithm}: "
                             "set them to 0 (module_dropout drops any adapter) or train a LoRA")
        if rates.network and not self.bypass_mode:
            raise ValueError("network_dropout drops a LoRA's hidden units, which exist only when the LoRA runs "
                             "beside the layer: turn bypass_mode on (or use rank_dropout, module_dropout)")

    @property
    def dropout_rates(self) -> DropoutRates:
        """``network_dropout``, ``rank_dropout`` and ``module_dropout`` as the library takes them."""
        return DropoutRates(self.network_dropout, self.rank_dropout, self.module_dropout)

    @property
    def samples_seed(self) -> int:
        """The seed of the sample images' noise: ``sample_seed``, or the run's ``seed`` when it is -1."""
        return self.seed if self.sample_seed < 0 else self.sample_seed

    def lr_schedule_after(self, done: int) -> LrSchedule:
        """The learning rate of every step of a run continuing a LoRA that had ``done`` steps: the schedule spans
        those and this run's ``steps``, so a continued run sets the rates the run that never stopped would have."""
        return LrSchedule(self.lr_schedule, float(self.learning_rate), self.warmup_steps, done + self.steps)


def check_save_prefix(prefix: object) -> None:
    """Refuse a ``save_prefix`` that would write outside ComfyUI's output folder or name no file, before training.

    Raises:
        ValueError: naming ``save_prefix``, what is wrong and what to write instead.
    """
    if type(prefix) is not str or not prefix.strip() or len(prefix) > 200 or any(ord(c) < 32 for c in prefix):
        raise ValueError(f"save_prefix must be a file name prefix of 1-200 printable characters such as "
                         f"{DEFAULT_SAVE_PREFIX!r}, got {prefix!r:.60}")
    posix, windows = PurePosixPath(prefix), PureWindowsPath(prefix)
    if posix.is_absolute() or windows.anchor or ".." in windows.parts:
        raise ValueError(f"save_prefix {prefix!r:.60} leaves ComfyUI's output folder: give a path inside it, such as "
                         f"{DEFAULT_SAVE_PREFIX!r} (no leading slash or drive, no '..')")
    if prefix.endswith(("/", "\\")):
        raise ValueError(f"save_prefix {prefix!r:.60} names a folder but no file name: add one, such as "
                         f"{prefix}streamcache_lora")
