"""Encode on the device for ``scripts/bench-gpu``: our Encode Dataset against ComfyUI's folder loader +
``MakeTrainingDataset``, on one folder of images with captions, with full-size random-weight encoders.

Both start with every model unloaded (each pays for moving its encoders to the device) and are timed over the whole
folder: ours from the folder to a written cache (reading, bucketing, VAE and text encoding, fingerprints, writes),
the built-in from ``LoadImageTextDataSetFromFolder`` to ``MakeTrainingDataset``'s lists in memory. After each, the
device's free memory is what training would get: our node releases its encoders, the built-in leaves them loaded
until the next model load evicts them.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .gpu_figures import EncodeFigures
from .gpu_models import VaeSpec
from .gpu_train import GIB, free_device

__all__ = ["write_image_folder", "run_encode_row"]


def write_image_folder(folder: Path, count: int, size: tuple[int, int], seed: int = 0) -> None:
    """``count`` smooth random PNG images of ``size`` (height, width), each with a one-line caption."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    h, w = size
    for i in range(count):
        base = rng.integers(0, 255, (max(h // 16, 1), max(w // 16, 1), 3), dtype=np.uint8)
        Image.fromarray(base).resize((w, h), Image.BILINEAR).save(folder / f"img_{i:03d}.png", compress_level=1)
        (folder / f"img_{i:03d}.txt").write_text(f"a photo of thing {i}, studio light, detailed", encoding="utf-8")


def _free_gib(device: Any) -> float | None:
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] / GIB


def run_encode_row(spec: VaeSpec, vae: Any, clip: Any, encode_node: type, nodes_dataset: ModuleType,
                   input_dir: Path, images: int, device: Any, say: Callable[[str], None] = print) -> EncodeFigures:
    """Encode one folder of ``images`` images of ``spec.size`` with ours and with the built-in; figures back."""
    import torch

    fig = EncodeFigures(id=f"encode/{spec.name}", title=spec.title, images=images, size=spec.size)
    name = f"bench_gpu_{spec.name}"
    folder = input_dir / name
    shutil.rmtree(folder, ignore_errors=True)
    write_image_folder(folder, images, spec.size)
    cache = sys.modules[encode_node.__module__].resolve_cache(name)  # models/streamcache/<name>
    shutil.rmtree(cache, ignore_errors=True)  # a cache left by an earlier run would leave nothing to encode
    h, w = spec.size
    resolution = -(-int((h * w) ** 0.5) // 8) * 8
    step = 64 if h % 64 == 0 and w % 64 == 0 else 32
    inputs = {"folder": name, "cache": name, "dataset_name": "default", "resolution": resolution,
              "bucket_step": step, "crop": "center", "caption_prefix": "", "caption_suffix": "", "batch_size": 4,
              "on_failure": "stop"}
    try:
        free_device(device)
        fig.free_before_gib = _free_gib(device)
        t = time.perf_counter()
        with torch.inference_mode():
            _, report = encode_node.execute(vae=vae, clip=clip, **inputs).result
        fig.ours_s = time.perf_counter() - t
        fig.ours_free_gib = _free_gib(device)
        fig.note = report.splitlines()[0][:160]
        free_device(device)
        t = time.perf_counter()
        with torch.inference_mode():
            loaded = nodes_dataset.LoadImageTextDataSetFromFolderNode.execute(name)
            pics, texts = loaded.result if hasattr(loaded, "result") else loaded
            nodes_dataset.MakeTrainingDataset.execute(pics, [vae], [clip], texts)
        fig.builtin_s = time.perf_counter() - t
        fig.builtin_free_gib = _free_gib(device)
        if getattr(device, "type", "cpu") == "cuda":
            fig.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
    except Exception as exc:  # a failed row is a figure of the run
        fig.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        free_device(device)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    say(_line(fig))
    return fig


def _line(fig: EncodeFigures) -> str:
    if fig.error:
        return f"{fig.id}: FAILED {fig.error[:200]}"
    ours = fig.images / fig.ours_s if fig.ours_s else 0.0
    builtin = fig.images / fig.builtin_s if fig.builtin_s else 0.0
    free = (f", free after: ours {fig.ours_free_gib:.1f} GiB, built-in {fig.builtin_free_gib:.1f} GiB"
            if fig.ours_free_gib is not None and fig.builtin_free_gib is not None else "")
    return f"{fig.id}: ours {ours:.2f} images/s, built-in {builtin:.2f} images/s{free}"
