"""Encode on the device for ``scripts/bench-gpu``: our Encode Dataset against ComfyUI's folder loader +
``MakeTrainingDataset``, on one folder of images with captions, with full-size random-weight encoders.

Both start with every model unloaded (each pays for moving its encoders to the device) and are timed over the whole
folder: ours from the folder to a written cache (reading, bucketing, VAE and text encoding, fingerprints, writes),
the built-in from ``LoadImageTextDataSetFromFolder`` to ``MakeTrainingDataset``'s lists in memory. After each, the
device's free memory is what training would get: our node releases its encoders, the built-in leaves them loaded
until the next model load evicts them.

The release is timed on both sides, so each can be compared with and without it: ours' inside its run (the pack's
``nodes.encoders.release`` wrapped while the row runs; the node itself is unchanged), the built-in's right after its
run as what training would have to do first (``unload_all_models()`` + ``soft_empty_cache()``). Each timed span ends
with a device synchronize, so work still queued is counted where it was asked for.

Before the timed pair, both run once untimed on a few images of the row's size (``warmup_s``): what a process pays
the first time it runs a model's kernels (CUDA loads kernels lazily, cuDNN picks per shape; the first release may
also be the first to allocate the host memory the weights go back to) would otherwise fall on whichever side runs
first, which is always ours (R7: SD1.5, the first row of its process, 0.80× the built-in; 1.05× in R1, where
training had run first).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from .gpu_figures import EncodeFigures
from .gpu_models import VaeSpec
from .gpu_train import GIB, free_device

__all__ = ["write_image_folder", "run_encode_row", "timed_release", "release_all"]


def write_image_folder(folder: Path, count: int, size: tuple[int, int], seed: int = 0) -> None:
    """``count`` smooth random PNG images of ``size`` (height, width), each with a one-line caption."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    h, w = size
    for i in range(count):
        base = rng.integers(0, 255, (max(h // 16, 1), max(w // 16, 1), 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
        image.save(folder / f"img_{i:03d}.png", compress_level=1)
        (folder / f"img_{i:03d}.txt").write_text(f"a photo of thing {i}, studio light, detailed", encoding="utf-8")


def _free_gib(device: Any) -> float | None:
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] / GIB


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _wrapped(module: ModuleType, wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]
             ) -> Iterator[bool]:
    """While inside, each ``module.<name>`` is ``wrappers[name]`` applied to it; yields whether every one existed
    (a checkout without them: nothing wrapped)."""
    real = {name: getattr(module, name, None) for name in wrappers}
    if not all(callable(f) for f in real.values()):
        yield False
        return
    for name, wrap in wrappers.items():
        setattr(module, name, wrap(real[name]))  # type: ignore[arg-type]
    try:
        yield True
    finally:
        for name, f in real.items():
            setattr(module, name, f)


@contextmanager
def timed_release(node_module: ModuleType, device: Any, spent: list[float]) -> Iterator[bool]:
    """While inside, each call of the pack's ``nodes.encoders.release`` (our encoders unloaded at the end of a run,
    ``node_module`` being the Encode Dataset node's module) adds its seconds to ``spent``; yields whether there was
    one to time."""
    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def release(*args: Any, **kwargs: Any) -> Any:
            _sync(device)
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                _sync(device)
                spent.append(time.perf_counter() - t)
        return release

    encoders = sys.modules[f"{node_module.__package__}.encoders"]
    with _wrapped(encoders, {"release": wrap}) as hooked:
        yield hooked


@contextmanager
def timed_phases(node_module: ModuleType, device: Any, phases: dict[str, float]) -> Iterator[None]:
    """While inside, the node module's ``plan_encode`` and ``run_encode`` add their seconds to ``phases`` (``plan``,
    ``run``), and the run's report its own timings (each name once: the last run's)."""
    def timed(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    out = real(*args, **kwargs)
                finally:
                    _sync(device)
                    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
                for key, seconds in (getattr(out, "timings", None) or {}).items():
                    phases[key] = float(seconds)
                return out
            return call
        return wrap

    with _wrapped(node_module, {"plan_encode": timed("plan"), "run_encode": timed("run")}):
        yield


def release_all(device: Any) -> float:
    """Seconds to unload every model ComfyUI holds and return the cached blocks: what training does before it
    loads its model when the built-in's encoders are still on the device."""
    import comfy.model_management as mm

    _sync(device)
    t = time.perf_counter()
    mm.unload_all_models()
    mm.soft_empty_cache()
    _sync(device)
    return time.perf_counter() - t


def run_encode_row(spec: VaeSpec, vae: Any, clip: Any, encode_node: Any, nodes_dataset: ModuleType,
                   input_dir: Path, images: int, device: Any, say: Callable[[str], None] = print) -> EncodeFigures:
    """Encode one folder of ``images`` images of ``spec.size`` with ours and with the built-in; figures back."""
    import torch

    fig = EncodeFigures(id=f"encode/{spec.name}", title=spec.title, images=images, size=spec.size)
    name = f"bench_gpu_{spec.name}"
    h, w = spec.size
    resolution = -(-int((h * w) ** 0.5) // 8) * 8
    step = 64 if h % 64 == 0 and w % 64 == 0 else 32
    inputs = {"dataset_name": "default", "resolution": resolution, "bucket_step": step, "crop": "center",
              "caption_prefix": "", "caption_suffix": "", "batch_size": 4, "on_failure": "stop"}
    node_module = sys.modules[encode_node.__module__]
    try:
        t = time.perf_counter()
        _warm_up(spec, vae, clip, encode_node, nodes_dataset, input_dir, min(images, WARMUP_IMAGES), inputs, device)
        fig.warmup_s = time.perf_counter() - t
        with _scratch_folder(input_dir, node_module, name, images, spec.size):
            free_device(device)
            fig.free_before_gib = _free_gib(device)
            released: list[float] = []
            t = time.perf_counter()
            with torch.inference_mode(), timed_release(node_module, device, released) as hooked, \
                    timed_phases(node_module, device, fig.ours_phases):
                _, report = encode_node.execute(vae=vae, clip=clip, folder=name, cache=name, **inputs).result
                _sync(device)
            fig.ours_s = time.perf_counter() - t
            fig.ours_release_s = sum(released) if hooked else None
            fig.ours_free_gib = _free_gib(device)
            fig.note = report.splitlines()[0][:160]
            free_device(device)
            t = time.perf_counter()
            with torch.inference_mode():
                _builtin_encode(nodes_dataset, name, vae, clip)
                _sync(device)
            fig.builtin_s = time.perf_counter() - t
            fig.builtin_free_gib = _free_gib(device)
            if getattr(device, "type", "cpu") == "cuda":
                fig.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
            fig.builtin_release_s = release_all(device)
            fig.builtin_released_free_gib = _free_gib(device)
    except Exception as exc:  # a failed row is a figure of the run
        fig.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        free_device(device)
    say(_line(fig))
    return fig


@contextmanager
def _scratch_folder(input_dir: Path, node_module: ModuleType, name: str, images: int, size: tuple[int, int],
                    seed: int = 0) -> Iterator[None]:
    """While inside: ``input_dir/name`` holds ``images`` fresh images and no cache of that name exists (one left
    by an earlier run would leave nothing to encode); both are removed after."""
    folder = input_dir / name
    cache = node_module.resolve_cache(name)  # models/streamcache/<name>
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    try:
        write_image_folder(folder, images, size, seed)
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def _builtin_encode(nodes_dataset: ModuleType, name: str, vae: Any, clip: Any) -> None:
    """ComfyUI's ``LoadImageTextDataSetFromFolder`` → ``MakeTrainingDataset`` on the folder ``name``."""
    loaded = nodes_dataset.LoadImageTextDataSetFromFolderNode.execute(name)
    pics, texts = loaded.result if hasattr(loaded, "result") else loaded
    nodes_dataset.MakeTrainingDataset.execute(pics, [vae], [clip], texts)


WARMUP_IMAGES = 4
"""Images of the untimed warm-up: one batch of ours (batch 4), four single images of the built-in."""


def _warm_up(spec: VaeSpec, vae: Any, clip: Any, encode_node: Any, nodes_dataset: ModuleType, input_dir: Path,
             images: int, inputs: dict[str, Any], device: Any) -> None:
    """Ours and the built-in once each, untimed, on ``images`` images of the row's size in a folder and cache of
    their own (removed after): every kernel the timed pair runs has run once before either is timed."""
    import torch

    name = f"bench_gpu_{spec.name}_warmup"
    with _scratch_folder(input_dir, sys.modules[encode_node.__module__], name, images, spec.size, seed=1), \
            torch.inference_mode():
        encode_node.execute(vae=vae, clip=clip, folder=name, cache=name, **inputs)
        _builtin_encode(nodes_dataset, name, vae, clip)
    _sync(device)


def _line(fig: EncodeFigures) -> str:
    if fig.error:
        return f"{fig.id}: FAILED {fig.error[:200]}"
    ours = fig.images / fig.ours_s if fig.ours_s else 0.0
    builtin = fig.images / fig.builtin_s if fig.builtin_s else 0.0
    free = (f", free after: ours {fig.ours_free_gib:.1f} GiB, built-in {fig.builtin_free_gib:.1f} GiB"
            if fig.ours_free_gib is not None and fig.builtin_free_gib is not None else "")
    release = (f"; release: ours {fig.ours_release_s:.2f} s (inside its run), built-in {fig.builtin_release_s:.2f} s"
               " (after)" if fig.ours_release_s is not None and fig.builtin_release_s is not None else "")
    return f"{fig.id}: ours {ours:.2f} images/s, built-in {builtin:.2f} images/s{free}{release}"
