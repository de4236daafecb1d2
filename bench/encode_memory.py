"""Benchmark: memory of a Flux-shaped Encode Dataset then Train LoRA on the CPU (#15 item 6).

Runs under ComfyUI's python (CPU, ``args.cpu = True``) with the real nodes and tiny random-weight models read by
ComfyUI's own loaders: a 16-channel TAESD (the shape of TAEF1, Flux's tiny VAE; Flux latents ``[1, 16, h/8, w/8]``),
the tiny CLIP-L of ``tests/support/tiny_models`` (CLIP-L is Flux's small text encoder, at its real size: ComfyUI
fixes it) and the tiny Flux diffusion model of ``tests/support/tiny_families``. Flux's T5-XXL (4.9 GB in fp8,
9.5 GB in fp16) is not run: nothing here can build it smaller. Per phase it reports the resident set (``VmRSS``)
after the phase and the phase's peak (``VmHWM``, reset between phases through ``/proc/self/clear_refs``), and which
models ComfyUI's model management lists as loaded, and where, when the encode ends and at training's first step.

    scripts/bench-comfy encode-memory                      # 8 images of 1024 px
    scripts/bench-comfy encode-memory --images 4 --size 512
    scripts/bench-comfy encode-memory --write              # rewrite its docs/BENCHMARKS.md part

Run through ``bench/run_comfyui.py`` (what ``scripts/bench-comfy`` does), which registers ``support`` (tests/support)
and keeps the pack root off ``sys.path``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .comfyui import comfy_nodes as comfyui_nodes
from .comfyui import comfy_setup

__all__ = ["run", "render", "main", "Phases"]

ROOT = Path(__file__).resolve().parents[1]

START, END = "<!-- bench-encode-memory:start -->", "<!-- bench-encode-memory:end -->"


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field in MiB."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) / 1024 if match else float("nan")


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Phases:
    """Collects (phase, RSS after, peak during) rows; each phase starts with the peak reset."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, float]] = []
        self.resettable = _reset_peak()
        self.t = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.rows.append((name, _status("VmRSS"), _status("VmHWM"), now - self.t))
        _reset_peak()
        self.t = time.perf_counter()


def _loaded() -> list[str]:
    import comfy.model_management

    return [f"{type(lm.model.model).__name__} on {lm.device}" for lm in comfy.model_management.current_loaded_models
            if lm.model is not None]


def _param_mib(module: Any) -> float:
    return sum(p.numel() * p.element_size() for p in module.state_dict().values()) / 2**20


def _images(folder: Path, n: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for i in range(n):
        base = rng.integers(0, 255, (size // 16, size // 16, 3), dtype=np.uint8)
        Image.fromarray(base).resize((size, size), Image.Resampling.BILINEAR).save(folder / f"img_{i:03d}.png")
        (folder / f"img_{i:03d}.txt").write_text(f"a photo of thing {i}, studio light", encoding="utf-8")


def run(images: int, size: int, batch: int, steps: int) -> dict[str, Any]:
    """Encode ``images`` of ``size`` px, then train ``steps`` steps, with the peak memory of each phase; its
    ComfyUI folders (models, images, cache: about 20 MiB) are removed after."""
    work = Path(tempfile.mkdtemp(prefix="bench_encode_memory_"))
    try:
        return _measure(work, images, size, batch, steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, images: int, size: int, batch: int, steps: int) -> dict[str, Any]:
    """:func:`run` in the folder ``work``."""
    (work / "models" / "streamcache").mkdir(parents=True)
    phases = Phases()
    install = comfy_setup(work)  # ComfyUI on the CPU, its folders private to ``work``
    import torch

    tiny, vae_file, unet_file, pack = _prepare(install, work, images, size)
    comfy_nodes = comfyui_nodes()

    phases.done("ComfyUI and the pack imported")

    (vae,) = comfy_nodes.VAELoader().load_vae(vae_file.name)
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny.name("clip"), "flux")
    sizes = {"VAE (16-ch TAESD)": _param_mib(vae.first_stage_model),
             "CLIP-L (Flux's clip_l)": _param_mib(clip.cond_stage_model)}
    phases.done("VAE and CLIP-L loaded (ComfyUI loaders)")

    handle, report = _encode(pack, vae, clip, vae_file.name, tiny.name("clip"), size, batch)
    loaded_after_encode = _loaded()
    phases.done(f"Encode Dataset: {images} images of {size} px, batch {batch}")

    (model,) = comfy_nodes.UNETLoader().load_unet(unet_file.name, "default")
    sizes["Flux diffusion model (tiny)"] = _param_mib(model.model.diffusion_model)
    phases.done("tiny Flux diffusion model loaded")

    at_first_step = _train(pack, model, handle, work / "models" / "streamcache" / "flux_train", steps)
    phases.done(f"Train LoRA: {steps} steps, batch 1 (encoders still referenced by the graph)")
    return {"rows": phases.rows, "resettable": phases.resettable, "sizes": sizes, "report": report.splitlines()[0],
            "after_encode": loaded_after_encode, "at_first_step": at_first_step, "images": images, "size": size,
            "comfy": (install.path / "comfyui_version.py").read_text().split('"')[1], "torch": torch.__version__}


def _prepare(install: Any, work: Path, images: int, size: int) -> tuple[Any, Path, Path, Any]:
    """The tiny models made and registered, the images written, the pack imported: (tiny models, VAE file,
    diffusion model file, the pack)."""
    import folder_paths
    from support.pack import import_pack
    from support.tiny_families import FAMILIES, save_family_model, save_taesd16
    from support.tiny_models import ensure_tiny_models

    tiny = ensure_tiny_models(install.path, install.python)
    folder_paths.models_dir = str(work / "models")
    for name in ("text_encoders", "vae"):
        folder_paths.add_model_folder_path(name, str(tiny.root / name), is_default=True)
    vae_file = save_taesd16(work / "vae")
    unet_file = save_family_model(FAMILIES["flux"], work / "diffusion_models")
    folder_paths.add_model_folder_path("vae", str(work / "vae"))
    folder_paths.add_model_folder_path("diffusion_models", str(work / "diffusion_models"))
    _images(work / "input" / "flux_set", images, size)
    import nodes  # noqa: F401 - ComfyUI's nodes, then the pack, as ComfyUI imports them

    pack = import_pack()
    import comfy_api.latest  # noqa: F401 - what the encode needs, imported within the first phase
    import comfy_execution.graph  # noqa: F401

    return tiny, vae_file, unet_file, pack


def _encode(pack: Any, vae: Any, clip: Any, vae_name: str, clip_name: str, size: int, batch: int) -> tuple[Any, str]:
    """Our Encode Dataset node on ``input/flux_set``, as ComfyUI runs it in a prompt: (the handle, its report)."""
    import torch
    from comfy_api.latest import io
    from comfy_execution.graph import DynamicPrompt

    encode = sys.modules[f"{pack.__name__}.nodes.encode_dataset"]
    inputs = {"folder": "flux_set", "cache": "flux_set", "dataset_name": "default", "resolution": size,
              "bucket_step": 64, "crop": "center", "caption_prefix": "", "caption_suffix": "", "batch_size": batch,
              "on_failure": "skip"}
    prompt = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
              "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": clip_name, "type": "flux",
                                                           "device": "default"}},
              "10": {"class_type": "StreamCache_EncodeDataset", "inputs": {**inputs, "vae": ["1", 0],
                                                                           "clip": ["2", 0]}}}
    node = encode.EncodeDataset.PREPARE_CLASS_CLONE(
        {"hidden_inputs": {io.Hidden.dynprompt: DynamicPrompt(prompt), io.Hidden.unique_id: "10"}})
    with torch.inference_mode():
        handle, report = node.execute(vae=vae, clip=clip, **inputs).result
    return handle, report


def _train(pack: Any, model: Any, handle: Any, cache: Path, steps: int) -> list[str]:
    """Train LoRA on the encoded latents (written to ``cache`` with T5-shaped conditionings); the models loaded at
    the first step."""
    import torch

    training = sys.modules[f"{pack.__name__}.nodes.training"]
    handles = sys.modules[f"{pack.__name__}.nodes.handles"]
    at_first_step: list[str] = []

    def on_step(step: Any) -> None:
        if step.step == 1:
            at_first_step.extend(_loaded())

    _training_cache(pack, handle, cache)
    reader, samples = handles.StreamDatasetHandle(str(cache), "default").open()
    try:
        settings = training.TrainSettings(steps=steps, batch_size=1, rank=4, learning_rate=1e-4, training_dtype="fp32",
                                          lora_dtype="fp32", gradient_checkpointing=True, seed=1)
        with torch.inference_mode():
            training.train_lora(model, reader, samples, settings, on_step=on_step)
    finally:
        reader.close()
    return at_first_step


def _training_cache(pack: Any, handle: Any, cache: Path) -> None:
    """The encoded latents, each with a conditioning of T5-XXL's shape, written as a training cache."""
    import torch
    from support.tiny_families import FAMILIES

    # CLIP-L alone gives [1, 77, 768]; Flux's model needs T5-XXL's [1, 256, 4096] too, which is not run here: the
    # training cache holds the encoded latents with conditionings of T5's shape (as tests/comfy/test_families.py)
    writer_mod = sys.modules[f"{pack.__name__}.dataset_cache.format.writer"]
    dataset_mod = sys.modules[f"{pack.__name__}.dataset_cache.dataset"]
    encoded_reader, encoded = handle.open()
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode(), writer_mod.CacheWriter(cache) as writer:
        rows = []
        for i, s in enumerate(encoded):
            writer.add(s.latent, encoded_reader.read([s.latent])[0], kind="latent")
            writer.add(f"{i:032x}", FAMILIES["flux"].conditioning(gen, 256), kind="conditioning")
            rows.append(dataset_mod.Sample(s.latent, (f"{i:032x}",), source=s.source))
        writer.set_dataset("default", rows)
    encoded_reader.close()


def render(res: dict[str, Any]) -> str:
    lines = [START, "",
             f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: ComfyUI {res['comfy']}, torch "
             f"{res['torch']}, CPU (`scripts/bench-comfy encode-memory --images {res['images']} "
             f"--size {res['size']}`). "
             "Peak = the phase's `VmHWM`" + ("" if res["resettable"] else " (not resettable here: process peak)")
             + ".", "",
             "| phase | RSS after (MiB) | peak in the phase (MiB) | seconds |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {rss:.0f} | {peak:.0f} | {secs:.1f} |" for name, rss, peak, secs in res["rows"]]
    lines += ["", "Model weights (fp32/fp16 as stored by ComfyUI): " + ", ".join(
        f"{k} {v:.0f} MiB" for k, v in res["sizes"].items()) + ".", "",
        f"Loaded models (ComfyUI's `current_loaded_models`) when the encode ended: {', '.join(res['after_encode'])}; "
        f"at training's first step: {', '.join(res['at_first_step'])}.", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    a = parser.parse_args(argv)
    text = render(run(a.images, a.size, a.batch, a.steps))
    print(text)
    if a.write:
        doc = ROOT / "docs" / "BENCHMARKS.md"
        old = doc.read_text(encoding="utf-8")
        if START not in old or END not in old:
            raise SystemExit(f"{doc}: no {START} ... {END} section to replace")
        doc.write_text(old[:old.index(START)] + text + old[old.index(END) + len(END):], encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
