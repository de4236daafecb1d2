"""What a saved LoRA says about itself: kohya's ``ss_*`` training keys, the SAI model spec's ``modelspec.*`` keys
and the content hashes A1111's LoRA browser and Civitai read, as safetensors metadata (strings only).

kohya's sd-scripts and musubi-tuner write these into every LoRA; Civitai fills a model page's base model, training
settings and tags from them, and LoRA managers (A1111's, Forge's, ComfyUI's) show them. ComfyUI's own *Save LoRA
Weights* writes none. The training side (:func:`training_metadata`) says what was trained, how and on what; the
saving side (:func:`file_metadata`) adds what only the file knows: its title, the time and the tensors' hashes.

Keys follow kohya's spelling and value formats (``"True"``, JSON objects as strings) so the tools that read kohya's
files read ours; where ComfyUI differs, the value says what is true here (``ss_network_module`` names ComfyUI's
weight adapters, whose key layout is not kohya's).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from .optimizer_args import parse_optimizer_args

__all__ = ["ARCHITECTURES", "Architecture", "addnet_hashes", "architecture_of", "file_metadata", "network_shape",
           "training_metadata"]

MODELSPEC_VERSION = "1.0.0"
IMPLEMENTATION = "https://github.com/comfyanonymous/ComfyUI"
"""The ``modelspec.implementation`` of every LoRA trained here: its tensors are named as ComfyUI's model classes
name their weights (kohya's model spec names this implementation too)."""


@dataclass(frozen=True)
class Architecture:
    """A model family as the model spec and kohya name it.

    Attributes:
        modelspec: ``modelspec.architecture`` of the base model (the LoRA's is this + ``/lora``).
        base_version: kohya's ``ss_base_model_version``, ``None`` where kohya's trainers name none.
        resolution: the family's usual training side in pixels, for ``modelspec.resolution`` when the dataset says
            none.
    """

    modelspec: str
    base_version: str | None
    resolution: int


ARCHITECTURES: Mapping[str, Architecture] = {
    "SD15": Architecture("stable-diffusion-v1", "sd_v1", 512),
    "SD20": Architecture("stable-diffusion-v2-512", "sd_v2", 512),
    "SD21UnclipL": Architecture("stable-diffusion-v2-512", "sd_v2", 512),
    "SDXL": Architecture("stable-diffusion-xl-v1-base", "sdxl_base_v1-0", 1024),
    "SD3": Architecture("stable-diffusion-3", "sd3", 1024),
    "Flux": Architecture("flux-1-dev", "flux1", 1024),
    "FluxSchnell": Architecture("flux-1-schnell", "flux1", 1024),
    "Chroma": Architecture("chroma", "flux1", 1024),
    "Lumina2": Architecture("lumina-2", "lumina2", 1024),
    "QwenImage": Architecture("Qwen-Image", None, 1024),
    "WAN21_T2V": Architecture("wan2.1", None, 832),
    "WAN21_I2V": Architecture("wan2.1", None, 832),
    "WAN22_T2V": Architecture("wan2.2", None, 1280),
}
"""ComfyUI's model config class (``model.model.model_config``) -> its family; the spellings are kohya's
(sd-scripts' and musubi-tuner's model spec)."""


def architecture_of(config_name: str, v_prediction: bool) -> Architecture:
    """The family of ComfyUI's model config class ``config_name``; a family not in :data:`ARCHITECTURES` is named by
    its class (lowercased), with no kohya base version. An SD2 model trained for v-prediction is kohya's 768-v."""
    arch = ARCHITECTURES.get(config_name)
    if arch is None:
        return Architecture(config_name.lower() or "unknown", None, 1024)
    if arch.base_version == "sd_v2" and v_prediction:
        return Architecture("stable-diffusion-v2-768-v", "sd_v2", 768)
    return arch


_LOSS_TYPES = {"MSE": "l2", "L1": "l1", "Huber": "huber", "SmoothL1": "smooth_l1"}
"""ComfyUI's loss names -> kohya's ``ss_loss_type``."""


def _flag(value: bool) -> str:
    return "True" if value else "False"


def training_metadata(*, arch: Architecture, v_prediction: bool, settings: Mapping[str, Any],
                      resolution: tuple[int, int] | None, dataset_dirs: Mapping[str, Mapping[str, int]],
                      train_images: int, reg_images: int, tag_frequency: Mapping[str, Mapping[str, int]],
                      started_at: float, version: str) -> dict[str, str]:
    """The keys that describe a training run (see the module docstring), from plain values. The step counts are not
    among them: a run is described before it knows an existing LoRA's steps; its saves add them
    (``ss_max_train_steps``, and :func:`file_metadata`'s ``ss_steps``).

    Args:
        arch: the model's family; ``v_prediction``: whether it predicts v (``modelspec.prediction_type``).
        settings: the run's settings by Train LoRA's input names (every one is written, as JSON, under
            ``streamcache.settings``; the ones kohya names under its keys too).
        resolution: ``(width, height)`` the dataset was bucketed for, ``None`` when unknown (the family's usual).
        dataset_dirs: kohya's ``ss_dataset_dirs``: folder -> ``{"n_repeats", "img_count"}``.
        train_images, reg_images: occurrences of one epoch (images times repeats), kohya's counts.
        tag_frequency: folder -> tag -> images (:mod:`.tag_frequency`); ``{}`` writes none.
        started_at: the run's start, seconds since the epoch.
        version: this pack's version.
    """
    s = settings
    width, height = resolution or (arch.resolution, arch.resolution)
    algorithm = str(s.get("algorithm", "LoRA"))
    out = {
        "ss_network_module": "comfy.weight_adapter",
        "ss_network_args": json.dumps(_network_args(algorithm, s)),
        "ss_network_dropout": str(s.get("network_dropout", 0.0)),
        "ss_network_dim": str(s.get("rank")),
        "ss_network_alpha": str(s.get("lora_alpha")),
        "ss_network_train_unet_only": "True",
        "ss_learning_rate": str(s.get("learning_rate")),
        "ss_unet_lr": str(s.get("learning_rate")),
        "ss_optimizer": _optimizer(s),
        "ss_lr_scheduler": str(s.get("lr_schedule", "constant")),
        "ss_lr_warmup_steps": str(s.get("warmup_steps", 0)),
        "ss_batch_size_per_device": str(s.get("batch_size")),
        "ss_gradient_accumulation_steps": str(s.get("grad_accumulation_steps")),
        "ss_gradient_checkpointing": _flag(bool(s.get("gradient_checkpointing"))),
        "ss_mixed_precision": str(s.get("training_dtype")),
        "ss_seed": str(s.get("seed")),
        "ss_loss_type": _LOSS_TYPES.get(str(s.get("loss_function")), str(s.get("loss_function")).lower()),
        "ss_noise_offset": str(s.get("noise_offset", 0.0)),
        "ss_ip_noise_gamma": str(s.get("ip_noise_gamma", 0.0)),
        "ss_noise_offset_random_strength": _flag(bool(s.get("noise_offset_random_strength"))),
        "ss_ip_noise_gamma_random_strength": _flag(bool(s.get("ip_noise_gamma_random_strength"))),
        "ss_v_pred_like_loss": str(s.get("v_pred_like_loss", 0.0)),
        "ss_min_snr_gamma": str(s.get("min_snr_gamma", 0.0)),
        "ss_max_grad_norm": str(s.get("max_grad_norm", 0.0)),
        "ss_caption_dropout_rate": str(s.get("caption_dropout", 0.0)),
        "ss_multires_noise_iterations": str(s.get("multires_noise_iterations", 0)),
        "ss_multires_noise_discount": str(s.get("multires_noise_discount", 0.3)),
        "ss_min_timestep": str(s.get("min_timestep", 0)),
        "ss_max_timestep": str(s.get("max_timestep", 1000)),
        "ss_timestep_sampling": str(s.get("timestep_sampling", "uniform")),
        "ss_debiased_estimation": _flag(bool(s.get("debiased_estimation"))),
        "ss_scale_v_pred_loss_like_noise_pred": _flag(bool(s.get("scale_v_pred_loss"))),
        "ss_prior_loss_weight": str(s.get("reg_weight", 1.0)),
        "ss_v2": _flag(arch.base_version == "sd_v2"),
        "ss_v_parameterization": _flag(v_prediction),
        "ss_resolution": f"({width}, {height})",
        "ss_num_train_images": str(train_images),
        "ss_num_reg_images": str(reg_images),
        "ss_dataset_dirs": json.dumps(dataset_dirs, ensure_ascii=False),
        "ss_training_started_at": repr(float(started_at)),
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": f"{arch.modelspec}/lora",
        "modelspec.implementation": IMPLEMENTATION,
        "modelspec.resolution": f"{width}x{height}",
        "streamcache.version": version,
        "streamcache.settings": json.dumps(dict(s), ensure_ascii=False, sort_keys=True, default=str),
    }
    if arch.base_version is not None:
        out["ss_base_model_version"] = arch.base_version
    if tag_frequency:
        out["ss_tag_frequency"] = json.dumps(tag_frequency, ensure_ascii=False)
    if arch.base_version is not None and not arch.base_version.startswith("flux"):
        out["modelspec.prediction_type"] = "v" if v_prediction else "epsilon"
    low, high = int(s.get("min_timestep", 0)), int(s.get("max_timestep", 1000))
    if (low, high) != (0, 1000):
        out["modelspec.timestep_range"] = f"{low},{high}"
    return out


def _optimizer(settings: Mapping[str, Any]) -> str:
    """kohya's ``ss_optimizer``: the optimizer, with its ``optimizer_args`` as kohya writes them (``AdamW(
    weight_decay=0.1,betas=(0.9, 0.99))``); a stored text that no longer parses is left out."""
    name = str(settings.get("optimizer"))
    try:
        args = parse_optimizer_args(settings.get("optimizer_args") or "")
    except ValueError:
        args = {}
    return f"{name}({','.join(f'{k}={v}' for k, v in args.items())})" if args else name


def _network_args(algorithm: str, settings: Mapping[str, Any]) -> dict[str, str]:
    """kohya's ``network_args``: the adapter kind, and the rank and module dropout where set (as its strings)."""
    args = {"algo": algorithm.lower()}
    for name in ("rank_dropout", "module_dropout"):
        if float(settings.get(name) or 0.0) > 0:
            args[name] = str(settings[name])
    return args


def network_shape(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``ss_network_dim`` and ``ss_network_alpha`` as the tensors hold them, where they say: a LoRA's down matrices'
    rank when they share one, the adapters' ``alpha`` (their mean to 4 digits where they differ: ComfyUI's adapters
    train their alpha with the weights). A continued LoRA keeps its own, whatever the run's inputs."""
    out: dict[str, str] = {}
    ranks = {int(t.shape[0]) for k, t in tensors.items() if k.endswith(".lora_down.weight") and t.dim() >= 2}
    alphas = [float(t.item()) for k, t in tensors.items() if k.endswith(".alpha") and t.numel() == 1]
    if len(ranks) == 1:
        out["ss_network_dim"] = str(ranks.pop())
    if alphas:
        same = len(set(alphas)) == 1
        out["ss_network_alpha"] = str(alphas[0]) if same else f"{sum(alphas) / len(alphas):.4g}"
    return out


def addnet_hashes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """kohya's ``sshs_model_hash`` and ``sshs_legacy_hash`` of a LoRA: the SHA-256 of its safetensors data section
    (the tensors' bytes, whatever the header holds) and the legacy 8-hex hash of bytes 1 MiB to 1 MiB + 64 KiB of
    the file written with only its ``ss_*`` metadata (what A1111's additional-networks computed), so a browser need
    not hash the file itself."""
    training = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    data = safetensors.torch.save(dict(tensors), metadata=training)
    header = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(memoryview(data)[8 + header:]).hexdigest()
    legacy_hash = hashlib.sha256(memoryview(data)[0x100000:0x110000]).hexdigest()[:8]
    return model_hash, legacy_hash


def file_metadata(tensors: Mapping[str, torch.Tensor], training: Mapping[str, str], *, title: str,
                  saved_at: float, steps: int | None = None) -> dict[str, str]:
    """The metadata of the LoRA file ``tensors`` is written as: ``training`` with its title (``ss_output_name``,
    ``modelspec.title``), the time (``ss_training_finished_at``, ``modelspec.date``) and a save's step count, and
    the content hashes. A LoRA trained elsewhere (``training`` empty) gets only its name and hashes: nothing is
    claimed about a training this pack did not see."""
    out = dict(training)
    out["ss_output_name"] = title
    if training:
        out.update(network_shape(tensors))
        out["modelspec.title"] = title
        out["ss_training_finished_at"] = repr(float(saved_at))
        out["modelspec.date"] = datetime.datetime.fromtimestamp(int(saved_at), datetime.timezone.utc).isoformat()
        if steps is not None:
            out["ss_steps"] = str(steps)
    model_hash, legacy_hash = addnet_hashes(tensors, out)
    out["sshs_model_hash"] = model_hash
    out["sshs_legacy_hash"] = legacy_hash
    if training:
        out["modelspec.hash_sha256"] = f"0x{model_hash}"
    return out
