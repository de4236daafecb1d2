"""The LoRA a run outputs and how it is written: the adapter tensors with the run's description attached, and the
file named as Save LoRA Weights names it, with that description as safetensors metadata.

ComfyUI's ``LORA_MODEL`` is a plain dict of tensors; :class:`TrainedLora` is one (every node that takes a
``LORA_MODEL`` takes it unchanged) that also carries the training keys of :mod:`dataset_cache.lora_metadata`, which
Save LoRA (Stream Cache) and ``save_every`` write into the file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import safetensors.torch
import torch

import comfy.model_sampling
import folder_paths

from ...dataset_cache import __version__
from ...dataset_cache.dataset import Sample
from ...dataset_cache.format.durable import atomic_write
from ...dataset_cache.lora_metadata import architecture_of, file_metadata, training_metadata
from ...dataset_cache.tag_frequency import merge_tag_frequency, read_tag_frequency, source_folder
from .settings import TrainSettings

__all__ = ["TrainedLora", "describe_training", "write_lora"]


class TrainedLora(dict[str, torch.Tensor]):
    """A ``LORA_MODEL`` (adapter name -> tensor) with ``metadata``: the keys that describe its training."""

    metadata: dict[str, str]

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        super().__init__(tensors)
        self.metadata = dict(metadata)


def _family(model: Any) -> tuple[str, bool]:
    """The class name of the model's ComfyUI config and whether it predicts v (a Model Sampling node's patch
    included)."""
    inner = getattr(model, "model", None)
    config = type(getattr(inner, "model_config", None)).__name__
    sampling = model.get_model_object("model_sampling") if hasattr(model, "get_model_object") else None
    v_prediction = isinstance(sampling, (comfy.model_sampling.V_PREDICTION, comfy.model_sampling.V_PREDICTION_DDPM))
    return config, v_prediction


def dataset_dirs(samples: Iterable[tuple[Sample, str]]) -> dict[str, dict[str, int]]:
    """kohya's ``ss_dataset_dirs`` of ``(sample, its dataset folder's name)`` pairs: folder -> its repeats (the
    highest of its samples', a combined dataset's multiplied in) and its images (distinct sources)."""
    repeats: dict[str, int] = {}
    sources: dict[str, set[str]] = {}
    for sample, dataset in samples:
        folder = source_folder(sample.source or "", dataset)
        repeats[folder] = max(repeats.get(folder, 0), sample.repeats)
        sources.setdefault(folder, set()).add(sample.source or sample.latent)
    return {folder: {"n_repeats": repeats[folder], "img_count": len(sources[folder])} for folder in sorted(repeats)}


def describe_training(model: Any, settings: TrainSettings, named: Iterable[tuple[Sample, str]],
                      reg: Iterable[Sample], infos: Iterable[Mapping[str, Any]], started_at: float
                      ) -> dict[str, str]:
    """The training keys of a run (:func:`dataset_cache.lora_metadata.training_metadata`), before its steps.

    Args:
        model: the ``MODEL`` trained on; ``settings``: the run's.
        named: the trained samples with their dataset folder's name (the dataset's when unknown: what a source
            at the folder's top counts under, as in the tag counts); ``reg``: the regularization samples.
        infos: the infos of the datasets trained on (their encode settings and tag counts; an older cache's lack
            them, and the keys that need them are left out).
        started_at: the run's start, seconds since the epoch.
    """
    config, v_prediction = _family(model)
    named = list(named)
    infos = list(infos)
    return training_metadata(
        arch=architecture_of(config, v_prediction), v_prediction=v_prediction,
        settings=dataclasses.asdict(settings), resolution=_resolution(infos), dataset_dirs=dataset_dirs(named),
        train_images=sum(s.repeats for s, _ in named), reg_images=sum(s.repeats for s in reg),
        tag_frequency=merge_tag_frequency(read_tag_frequency(i.get("tag_frequency")) for i in infos),
        started_at=started_at, version=__version__)


def _resolution(infos: Iterable[Mapping[str, Any]]) -> tuple[int, int] | None:
    """The bucket resolution the first dataset that states one was encoded at."""
    for info in infos:
        settings = info.get("settings")
        bucket = settings.get("bucket") if isinstance(settings, dict) else None
        side = bucket.get("resolution") if isinstance(bucket, dict) else None
        if type(side) is int and side > 0:
            return side, side
    return None


def write_lora(lora: Mapping[str, torch.Tensor], prefix: str, steps: int | None,
               metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``lora`` as Save LoRA Weights names it, ``<prefix>_<steps>_steps_<counter>_.safetensors``
    (``<prefix>_<counter>_.safetensors`` without ``steps``) under ComfyUI's output folder, atomically (a crash
    leaves the whole file or none), with ``metadata`` (the training keys) completed by
    :func:`dataset_cache.lora_metadata.file_metadata`; return its path.

    The counter is one more than the highest of the files already named so (ComfyUI's own counter reads the step
    count as one). A file is never replaced.

    Raises:
        OSError: the folder or the file cannot be written (naming it); ValueError: the prefix leaves the output
            folder (ComfyUI's check).
    """
    try:
        folder, name, _, _, _ = folder_paths.get_save_image_path(prefix, folder_paths.get_output_directory())
    except OSError:
        raise
    except Exception as exc:  # ComfyUI raises a plain Exception for a prefix outside the output folder
        raise ValueError(f"save_prefix {prefix!r}: {str(exc).strip().splitlines()[0].strip('* ')}") from None
    os.makedirs(folder, exist_ok=True)
    middle = r"_\d+_steps" if steps is not None else ""
    taken = re.compile(re.escape(name) + middle + r"_(\d+)_\.safetensors", re.IGNORECASE)
    counters = [int(m.group(1)) for m in map(taken.fullmatch, os.listdir(folder)) if m]
    stem = f"{name}_{steps}_steps" if steps is not None else name
    path = Path(folder) / f"{stem}_{max(counters, default=0) + 1:05}_.safetensors"
    if os.path.lexists(path):
        raise OSError(f"{path} already exists")
    tensors = dict(lora)
    header = file_metadata(tensors, metadata or {}, title=PurePosixPath(name).name, saved_at=time.time(),
                           steps=steps)
    data = safetensors.torch.save(tensors, metadata=header)
    atomic_write(path, lambda f: f.write(data))
    return path
