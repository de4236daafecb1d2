"""WAN 2.1 over HTTP on the session's real server: an image folder and a clip folder, each encoded by Encode
Dataset with a tiny WAN VAE, trained into a LoRA on a tiny WAN 2.1, saved by Save LoRA Weights, loaded by
ComfyUI's LoraLoaderModelOnly and sampled by KSampler, then decoded by the WAN VAE.

Text side: ComfyUI fixes WAN's text encoder (UMT5-XXL, 4096 wide, gigabytes) and WAN's text width, so no small
text encoder can feed it. As in the family matrix, the conditionings WAN trains and samples on are tensors of
UMT5's shape (``[1, 512, 4096]``): the test stores them in the cache as a second dataset that names the latents
Encode Dataset made (its own conditionings come from the tiny CLIP-L and are not used by WAN), and gives the
sampler the same kind of tensor through ComfyUI's own Load Training Dataset node (a ``shard_*.pkl`` file written
here). Everything else — loaders, Encode Dataset, Load Lazy Cache, Train LoRA, Save LoRA, Load LoRA, KSampler,
VAE Decode — is the real thing, queued over HTTP.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support.client import ComfyClient, PromptError
from support.clips import make_frames_folder, make_video
from support.comfy_env import ComfyInstall
from support.examples import run_example, run_prompt, train_inputs
from support.server import ComfyServer
from support.tiny_models import TinyModels
from support.tiny_wan import ensure_wan_models

from dataset_cache.dataset import Sample
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.keys import content_key
from dataset_cache.lock import WRITE_LOCK, CacheLock
from dataset_cache.video import has_av

STEPS = 3
TRAIN = train_inputs(steps=STEPS, seed=7)


@pytest.fixture(scope="module")
def wan(comfy_install: ComfyInstall, tiny_models: TinyModels) -> tuple[str, str]:
    return ensure_wan_models(tiny_models.root, comfy_install.path, comfy_install.python)


def _umt5(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 512, 4096, generator=gen) * 0.1, {}]]


def _image_folder(root: Path) -> None:
    for i, color in enumerate(((200, 20, 20), (20, 200, 20), (20, 20, 200))):
        Image.new("RGB", (64, 64), color).save(root / f"img_{i}.png")
        (root / f"img_{i}.txt").write_text(f"a square, colour {i}", encoding="utf-8")


def _clip_folder(root: Path) -> None:
    make_frames_folder(root / "jump.frames", 7, width=64, height=64)
    (root / "jump.txt").write_text("a jump", encoding="utf-8")
    if has_av():  # the server has PyAV (ComfyUI requires it); this process writes the videos with it
        make_video(root / "walk.mp4", 9, width=64, height=64)
        (root / "walk.txt").write_text("a walk", encoding="utf-8")
        make_video(root / "wave.webm", 6, width=64, height=64)
        (root / "wave.txt").write_text("a wave", encoding="utf-8")
    else:
        make_frames_folder(root / "walk.frames", 9, width=64, height=64)
        (root / "walk.txt").write_text("a walk", encoding="utf-8")


def _encode(client: ComfyClient, tiny_models: TinyModels, wan: tuple[str, str], folder: str, cache: str,
            **settings: Any) -> dict[str, Any]:
    prompt = _encode_prompt(tiny_models, wan, folder, cache, **settings)
    result, errors = run_prompt(client, prompt)
    assert result is not None and result.status == "success" and not errors, errors
    (report,) = result.outputs["3"]["streamcache_report"]
    return report


def _encode_prompt(tiny_models: TinyModels, wan: tuple[str, str], folder: str, cache: str,
                   **settings: Any) -> dict[str, Any]:
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": wan[0]}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": tiny_models.name("clip"),
                                                     "type": "stable_diffusion", "device": "default"}},
        "3": {"class_type": "StreamCache_EncodeDataset", "inputs": {
            "folder": folder, "cache": cache, "dataset": "default", "vae": ["1", 0], "clip": ["2", 0],
            "resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
            "batch_size": 4, "on_failure": "stop", "frame_count": 5, "frame_sampling": "first", **settings}},
    }


def _wan_dataset(root: Path) -> dict[str, tuple[int, ...]]:
    """Add dataset ``wan`` to the cache: Encode Dataset's latents, each with a UMT5-shaped conditioning.
    Returns each source's latent shape."""
    with open_cache(root) as reader:
        samples = reader.dataset("default")
        shapes = {s.source: tuple(reader.tensor_shapes(s.latent)["samples"]) for s in samples}
    with CacheLock(root, WRITE_LOCK, purpose="test"), CacheWriter(root, create=False) as writer:
        wan = []
        for i, s in enumerate(samples):
            key = content_key("test-umt5-shaped-conditioning", {"seed": i})
            if not writer.has(key):
                writer.add(key, _umt5(i), kind="conditioning")
            wan.append(Sample(s.latent, (key,), s.repeats, s.source))
        writer.set_dataset("wan", wan, info={"note": "tests/e2e/test_wan_flow.py: UMT5-shaped conditionings"})
    return shapes


def _train_and_sample(client: ComfyClient, server: ComfyServer, wan: tuple[str, str], cache: str, case: str,
                      frames: int) -> Any:
    text = server.output_dir / f"wan_text_{case}"
    text.mkdir(parents=True, exist_ok=True)
    torch.save({"latents": [{"samples": torch.zeros(1, 16, 1, 8, 8)}], "conditioning": [_umt5(99)]},
               text / "shard_00000.pkl")
    prompt = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": wan[0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": wan[1], "weight_dtype": "default"}},
        "5": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"name": cache, "dataset": "wan"}},
        "6": {"class_type": "StreamCache_TrainLoRA", "inputs": {"model": ["3", 0], "dataset": ["5", 0], **TRAIN}},
        "7": {"class_type": "SaveLoRA", "inputs": {"lora": ["6", 0], "prefix": f"loras/wan_e2e_{case}",
                                                   "steps": ["6", 2]}},
        "8": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["3", 0], "lora_name": "not yet saved",
                                                              "strength_model": 1.0}},
        "9": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": f"wan_text_{case}"}},
        "10": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": frames,
                                                                   "batch_size": 1}},
        "11": {"class_type": "KSampler", "inputs": {
            "model": ["8", 0], "seed": 1, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "normal",
            "positive": ["9", 1], "negative": ["9", 1], "latent_image": ["10", 0], "denoise": 1.0}},
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["1", 0]}},
        "13": {"class_type": "SaveImage", "inputs": {"images": ["12", 0], "filename_prefix": f"wan_e2e_{case}"}},
    }
    return run_example(client, prompt, timeout=900)


@pytest.mark.parametrize("case", ["image", "video"])
def test_wan_encode_train_save_load_and_sample_over_http(case: str, comfy_server: ComfyServer,
                                                          tiny_models: TinyModels, wan: tuple[str, str]) -> None:
    client = comfy_server.client()
    folder, cache = f"wan_{case}_src", f"wan_{case}_cache"
    root = comfy_server.input_dir / folder
    root.mkdir(parents=True, exist_ok=True)
    (_image_folder if case == "image" else _clip_folder)(root)
    report = _encode(client, tiny_models, wan, folder, cache)
    n = 3 if case == "image" or has_av() else 2
    assert report["samples"] == n and report["failed"] == 0 and report["encoded_latents"] == n

    shapes = _wan_dataset(comfy_server.streamcache_dir / cache)
    if case == "image":
        assert set(shapes.values()) == {(1, 16, 1, 8, 8)}  # a still image is a one-frame clip to WAN's VAE
    else:  # 5 frames → 2 latent frames; a 6-frame video gives 5; jump 7 → 5
        expected = {"jump.frames": (1, 16, 2, 8, 8)}
        if has_av():
            expected |= {"walk.mp4": (1, 16, 2, 8, 8), "wave.webm": (1, 16, 2, 8, 8)}
        else:
            expected |= {"walk.frames": (1, 16, 2, 8, 8)}
        assert shapes == expected

    run = _train_and_sample(client, comfy_server, wan, cache, case, 1 if case == "image" else 5)
    assert all(r.status == "success" for r in run.results)
    losses = run.outputs()["6"]["loss"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    (saved,) = run.new_loras
    assert saved.startswith(f"wan_e2e_{case}_{STEPS}_steps_")
    from safetensors.torch import load_file

    lora = load_file(str(comfy_server.output_dir / "loras" / saved))
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    assert any("blocks.0" in k for k in lora)  # WAN's transformer block, not an SD UNet's
    images = run.outputs()["13"]["images"]
    assert len(images) == (1 if case == "image" else 5)  # VAE Decode gives back the sampled frames
    assert run.deferred == ["13"]  # the sampling branch waited for the LoRA file


def test_clip_folders_re_encode_only_what_changed_over_http(comfy_server: ComfyServer, tiny_models: TinyModels,
                                                           wan: tuple[str, str]) -> None:
    """One frame of one clip edited → that clip's latent only; one caption edited → its conditioning only."""
    client = comfy_server.client()
    folder, cache = "wan_incremental_src", "wan_incremental_cache"
    root = comfy_server.input_dir / folder
    root.mkdir(parents=True, exist_ok=True)
    _clip_folder(root)
    first = _encode(client, tiny_models, wan, folder, cache)
    assert (first["encoded_latents"], first["encoded_conditionings"]) == (first["samples"], first["samples"])

    Image.new("RGB", (64, 64), (1, 2, 3)).save(root / "jump.frames" / "2.png")
    edited = _encode(client, tiny_models, wan, folder, cache)
    assert (edited["encoded_latents"], edited["encoded_conditionings"]) == (1, 0)
    assert edited["changed"] == 1 and edited["vae_loaded"] and not edited["clip_loaded"]

    (root / "walk.txt").write_text("a slow walk", encoding="utf-8")
    caption = _encode(client, tiny_models, wan, folder, cache)
    assert (caption["encoded_latents"], caption["encoded_conditionings"]) == (0, 1)
    assert caption["clip_loaded"] and not caption["vae_loaded"]  # the clips' keys need no VAE: none is loaded


@pytest.mark.parametrize("fps", [1e-7, float("nan")])
def test_an_fps_near_zero_or_nan_is_refused_over_http_naming_fps(fps: float, comfy_server: ComfyServer,
                                                                tiny_models: TinyModels, wan: tuple[str, str]) -> None:
    """Both pass ComfyUI's own check of the input (minimum 0; NaN, which an API prompt's JSON may carry, passes
    every comparison); a rate near 0 once failed with ZeroDivisionError deep in the plan, naming nothing."""
    client = comfy_server.client()
    root = comfy_server.input_dir / "wan_fps_src"
    if not root.exists():
        root.mkdir(parents=True)
        _clip_folder(root)
    with pytest.raises(PromptError) as info:
        client.run(_encode_prompt(tiny_models, wan, "wan_fps_src", "wan_fps_cache", fps=fps))
    text = json.dumps(info.value.details)
    assert f"fps {fps!r}: use 0 (each video keeps its own frame rate) or a rate from 0.01 to 1000 frames a second" \
        in text, text
    assert "ZeroDivisionError" not in text
    alive = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "still_alive"}}})
    assert alive.status == "success"  # the server still runs prompts
