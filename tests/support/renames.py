"""The node inputs renamed or added since workflows in ``tests/e2e/data/saved_by_0.2.0-pre`` were saved: the contract
old workflows and API prompts are checked against (written out here, not imported from the pack)."""

from __future__ import annotations

from typing import Any

from .workflow import input_default

__all__ = ["RENAMED", "ADDED", "as_current"]

RENAMED = {
    "StreamCache_EncodeDataset": {"dataset": "dataset_name"},
    "StreamCache_SaveCache": {"name": "cache"},
    "StreamCache_LoadLazyCache": {"name": "cache", "dataset": "dataset_name"},
    "StreamCache_CleanCache": {"name": "cache"},
}
"""Old input name -> current name, per node (0.2.0)."""

ADDED = {
    "StreamCache_TrainLoRA": ("quantized_backward", "bypass_mode", "masked_loss", "unmasked_weight",
                              "caption_dropout", "reg_ratio", "reg_weight", "memory", "stream_blocks", "allow_fp8",
                              "devices", "checkpoint_mode", "save_every", "save_prefix", "lr_schedule",
                              "warmup_steps", "timestep_sampling", "noise_offset", "val_every", "max_grad_norm",
                              "ema_decay", "min_snr_gamma", "train_layers", "min_timestep", "max_timestep",
                              "lora_alpha", "val_split", "loss_target", "multires_noise_iterations",
                              "multires_noise_discount", "sample_count", "sample_every", "sample_steps", "sample_cfg",
                              "debiased_estimation", "sample_sampler", "sample_scheduler",
                              "scale_v_pred_loss", "sample_width", "sample_height",
                              "sample_texts", "sample_seed", "network_dropout", "rank_dropout", "module_dropout",
                              "optimizer_args", "ip_noise_gamma", "v_pred_like_loss", "noise_offset_random_strength",
                              "ip_noise_gamma_random_strength"),
    "StreamCache_EncodeDataset": ("frame_count", "frame_sampling", "frame_step", "fps", "flip", "shuffle_variants",
                                  "keep_tokens", "empty_caption", "masks", "missing_caption",
                                  "extra_resolutions", "tag_dropout", "wildcards", "clips_per_video",
                                  "keep_tokens_separator", "caption_extension", "secondary_separator",
                                  "reference_folder"),
    "StreamCache_SaveCache": ("publish_to",),
}
"""Optional inputs added since; a prompt without them runs with their defaults (off, or images only; ``memory``
'auto', which changes where memory goes, not the results; ``checkpoint_mode`` 'exact'; ``save_every`` 0: no saves;
``lr_schedule`` 'constant' without warm-up: learning_rate throughout; ``timestep_sampling`` 'uniform' and
``noise_offset`` 0: ComfyUI's own trainer's draws; ``val_every`` 0, and no ``val_dataset``: no validation;
``max_grad_norm`` 0: no clipping; ``ema_decay`` 0: the last step's weights; ``min_snr_gamma`` 0: every row's
loss weighed alike; ``train_layers`` empty: every layer gets an adapter; ``min_timestep`` 0 and
``max_timestep`` 1000: every timestep; ``lora_alpha`` 1: ComfyUI's alpha; ``val_split`` 0: nothing held out;
``loss_target`` 'clean latent': ComfyUI's loss;
``multires_noise_iterations`` 0: plain noise (``multires_noise_discount`` then has no effect); ``sample_count`` 0: no
sample images (``sample_every``, ``sample_steps`` and ``sample_cfg`` then have no effect); ``debiased_estimation``
off: no debiasing weight; ``sample_sampler`` 'euler' and
``sample_scheduler`` 'simple': the samples' sampler before; ``scale_v_pred_loss`` off: no v weight;
``sample_width`` and ``sample_height`` 0: the samples at their bucket's size; ``sample_texts`` empty: no prompt lines;
``sample_seed`` -1: the samples' noise from the run's seed, as before; ``network_dropout``, ``rank_dropout`` and
``module_dropout`` 0: no dropout in the adapters; ``optimizer_args`` empty: the optimizer's defaults;
``ip_noise_gamma`` 0: no input perturbation; ``v_pred_like_loss`` 0: no v-like loss;
``noise_offset_random_strength`` and ``ip_noise_gamma_random_strength`` off: the offset and perturbation as set;
``missing_caption`` 'empty': a source without a caption file trains with the empty prompt; ``extra_resolutions``
empty: one resolution; ``tag_dropout`` 0: every tag in; ``wildcards`` off: braces encoded as written;
``clips_per_video`` 1: one clip per video; ``keep_tokens_separator`` empty: none; ``caption_extension`` '.txt': the
captions read before; ``secondary_separator`` empty: none; ``reference_folder`` 'none': no reference images))."""


def as_current(prompt: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` (API format, saved before the renames) under the current names, the added inputs at the
    defaults ``/object_info`` gives: what the front end queues for it today."""
    out = {}
    for node_id, node in prompt.items():
        kind = node["class_type"]
        inputs = {RENAMED.get(kind, {}).get(name, name): value for name, value in node["inputs"].items()}
        for name in ADDED.get(kind, ()):
            inputs.setdefault(name, input_default(object_info[kind], name))
        out[node_id] = {"class_type": kind, "inputs": inputs}
    return out
