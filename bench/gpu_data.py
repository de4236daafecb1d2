"""The training data of ``scripts/bench-gpu``: a real cache of one family's sample shapes, and the page cache.

Each family gets one cache written by our ``CacheWriter`` (random latents and conditionings of the family's real
shapes, bf16, one caption per image), and the same samples kept in memory for ComfyUI's built-in trainer (its data
is in memory by design). Before "ours" runs, the cache's pages are dropped from the OS page cache, so its reads come
from the disk as in a first epoch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gpu_models import FamilySpec, conditioning, latent

__all__ = ["FamilyData", "write_family_cache", "drop_page_cache"]


@dataclass
class FamilyData:
    """A family's cache (``root``, dataset ``"train"``) and the same samples in memory (for the built-in)."""

    root: Path
    samples: int
    latents: list[dict[str, Any]]
    conditionings: list[list]
    bytes: int


def write_family_cache(spec: FamilySpec, root: Path, samples: int, seed: int = 0) -> FamilyData:
    """Write ``samples`` random samples of ``spec``'s shapes into a new cache at ``root``; keep them in memory."""
    import torch

    from dataset_cache.dataset import Sample
    from dataset_cache.format import CacheWriter

    gen = torch.Generator().manual_seed(seed)
    latents, conds, rows = [], [], []
    with torch.inference_mode(), CacheWriter(root) as writer:
        for i in range(samples):
            lat = latent(spec, gen, torch.bfloat16)
            cond = conditioning(spec, gen, torch.bfloat16)
            writer.add(f"{i:032x}", lat, kind="latent")
            writer.add(f"{i + samples:032x}", cond, kind="conditioning")
            rows.append(Sample(f"{i:032x}", (f"{i + samples:032x}",), source=f"img{i}.png"))
            latents.append(lat)
            conds.append(cond)
        writer.set_dataset("train", rows)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return FamilyData(root, samples, latents, conds, size)


def drop_page_cache(root: Path) -> str:
    """Drop ``root``'s files from the page cache; return how: ``"drop_caches"`` (root: the kernel's whole page
    cache, after ``sync``), ``"fadvise"`` (``POSIX_FADV_DONTNEED`` per file, after ``fsync``: needs no privilege,
    only clean pages go) or ``"none"`` (neither works here)."""
    files = [f for f in root.rglob("*") if f.is_file()]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "drop_caches"
        except OSError:
            pass
    if not hasattr(os, "posix_fadvise"):
        return "none"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return "none"
        finally:
            os.close(fd)
    return "fadvise"
