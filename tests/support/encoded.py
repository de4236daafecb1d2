"""Caches written from tensors inside a test (ComfyUI suites): samples encoded with ComfyUI's own nodes, or random
samples of a tiny family's shapes. The pack is passed in (imported the way ComfyUI imports it); nothing is imported
at module level beyond torch."""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = ["key", "write_comfy_encoded", "write_random_samples"]


def key(text: str) -> str:
    """A 32-hex-digit cache key derived from ``text``."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _writer_and_sample(pack: ModuleType) -> tuple[Any, Any]:
    writer_mod = importlib.import_module(f"{pack.__name__}.dataset_cache.format.writer")
    return writer_mod.CacheWriter, importlib.import_module(f"{pack.__name__}.dataset_cache.dataset").Sample


def write_comfy_encoded(pack: ModuleType, comfy_nodes: ModuleType, clip: Any, vae: Any, root: Path,
                        sizes: Sequence[tuple[int, int]], seed: int, caption: str = "a photo of pattern {}",
                        extra: dict[str, Any] | None = None) -> list[Any]:
    """Write dataset ``"train"`` to ``root``: one random image of each size encoded with ComfyUI's ``VAEEncode``
    and its caption (``caption.format(i)``) with ``CLIPTextEncode``, as ComfyUI runs nodes (inference mode). The
    datasets of ``extra`` (name → a function of the samples giving its samples) are written too; returns the
    samples of ``"train"``."""
    writer_cls, sample_cls = _writer_and_sample(pack)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    with torch.inference_mode(), writer_cls(root) as writer:
        for i, (h, w) in enumerate(sizes):
            (latent,) = comfy_nodes.VAEEncode().encode(vae, torch.rand(1, h, w, 3, generator=gen))
            (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, caption.format(i))
            writer.add(key(f"latent{i}"), latent, kind="latent")
            writer.add(key(f"caption{i}"), cond, kind="conditioning")
            samples.append(sample_cls(key(f"latent{i}"), (key(f"caption{i}"),), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
        for name, make in (extra or {}).items():
            writer.set_dataset(name, make(sample_cls, samples))
    return samples


def write_random_samples(pack: ModuleType, family: Any, root: Path, count: int = 2, tokens: int = 12) -> Any:
    """Write dataset ``"train"``: ``count`` random samples of ``family``'s latent shape and conditionings
    (``support.tiny_families.Family``; one bucket), and return its ``StreamDatasetHandle``."""
    writer_cls, sample_cls = _writer_and_sample(pack)
    gen = torch.Generator().manual_seed(0)
    samples = []
    with torch.inference_mode(), writer_cls(root) as writer:
        for i in range(count):
            writer.add(f"{i:032x}", {"samples": torch.randn(family.latent, generator=gen)}, kind="latent")
            writer.add(f"{i + 100:032x}", family.conditioning(gen, tokens), kind="conditioning")
            samples.append(sample_cls(f"{i:032x}", (f"{i + 100:032x}",), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return importlib.import_module(f"{pack.__name__}.nodes.handles").StreamDatasetHandle(str(root), "train")
