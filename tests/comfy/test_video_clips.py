"""Encode Dataset on a folder of clips (videos and ``.frames`` folders) with a tiny WAN 2.1 VAE from ComfyUI's
own ``VAELoader``, then Train LoRA on a tiny WAN 2.1 from ``UNETLoader``.

The clips are generated at test time (PyAV for videos, Pillow for frames). Text side: ComfyUI fixes WAN's text
encoder (UMT5-XXL, gigabytes), so as in ``test_families.py`` the conditionings WAN trains on are tensors of UMT5's
shape; the node's own conditionings here come from the tiny CLIP-L.
"""

from __future__ import annotations

import importlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image
from support.clips import frame_array, make_frames_folder, make_video
from support.tiny_families import FAMILIES, save_family_model
from support.tiny_models import TinyModels

from .test_encode_dataset import Run, _encoded, _prompt

CLIPS = {"frame_count": 9, "frame_sampling": "first", "frame_step": 2, "fps": 0.0}


@pytest.fixture(scope="module")
def mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")


@pytest.fixture(scope="module")
def clip(comfy_nodes: ModuleType, tiny_models: TinyModels) -> Any:
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    return clip


@pytest.fixture
def clip_folder(comfy_folders: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """A folder of two videos, one frame folder (with captions) and one still image."""
    import folder_paths

    name = "clips_" + re.sub(r"\W+", "_", request.node.name)[:50]
    root = Path(folder_paths.get_input_directory()) / name
    make_video(root / "walk.mp4", 12, width=64, height=64)
    (root / "walk.txt").write_text("a person walking", encoding="utf-8")
    make_video(root / "wave.webm", 10, width=64, height=64)
    (root / "wave.txt").write_text("a hand waving", encoding="utf-8")
    make_frames_folder(root / "jump.frames", 11, width=64, height=64, pad=3)
    (root / "jump.txt").write_text("a jump", encoding="utf-8")
    Image.new("RGB", (64, 64), (200, 10, 10)).save(root / "still.png")
    (root / "still.txt").write_text("a red square", encoding="utf-8")
    yield name, root
    shutil.rmtree(root, ignore_errors=True)


def _shapes(handle: Any) -> dict[str, tuple[int, ...]]:
    reader, samples = handle.open()
    try:
        return {s.source: tuple(reader.tensor_shapes(s.latent)["samples"]) for s in samples}
    finally:
        reader.close()


def test_clips_encode_with_a_video_vae_in_frame_buckets_and_warm_reruns_load_nothing(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, clip_folder: tuple[str, Path]) -> None:
    vae_name, vae = wan_vae
    assert vae.temporal_compression_decode() == 4  # what the node reads: WAN takes 1 + 4m frames
    folder, root = clip_folder
    prompt = _prompt(folder, f"cache_{folder}", vae_name, tiny_models.name("clip"), **CLIPS)
    handle, report, asked = Run(mod, prompt).queue(vae, clip)
    assert sorted(asked) == ["clip", "vae"]
    assert _encoded(report) == (4, 4), report
    # 9 frames → 3 latent frames; wave.webm has 10 frames (9 used), jump 11 → 9; the image is one frame
    assert _shapes(handle) == {"walk.mp4": (1, 16, 3, 8, 8), "wave.webm": (1, 16, 3, 8, 8),
                               "jump.frames": (1, 16, 3, 8, 8), "still.png": (1, 16, 1, 8, 8)}

    # the frame folder's latent is the VAE's encode of exactly its first 9 frames
    reader, samples = handle.open()
    try:
        (jump,) = [s for s in samples if s.source == "jump.frames"]
        latent = reader.read([jump.latent])[0]["samples"]
    finally:
        reader.close()
    frames = torch.stack([torch.from_numpy(frame_array(i, 64, 64)).float() / 255 for i in range(9)])
    torch.testing.assert_close(latent, vae.encode(frames).to(latent.dtype), rtol=1e-3, atol=1e-4)

    again = Run(mod, prompt)
    assert again.lazy() == []  # the VAE's fingerprint and temporal compression are recorded: no loader runs
    _handle, report, asked = again.queue(vae, clip)
    assert asked == [] and _encoded(report) == (0, 0)

    # a frame count the VAE cannot take exactly is rounded down, and the report says so; only clips re-encode
    odd = _prompt(folder, f"cache_{folder}", vae_name, tiny_models.name("clip"), **{**CLIPS, "frame_count": 7})
    handle, report, _asked = Run(mod, odd).queue(vae, clip)
    assert _encoded(report) == (3, 0), report
    assert "frame count 7 is taken as 5" in report
    assert _shapes(handle)["walk.mp4"] == (1, 16, 2, 8, 8)


def test_an_image_vae_refuses_clips_by_name_and_encodes_the_images(
        mod: ModuleType, comfy_nodes: ModuleType, clip: Any, tiny_models: TinyModels,
        clip_folder: tuple[str, Path]) -> None:
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    folder, _root = clip_folder
    prompt = _prompt(folder, f"cache_img_{folder}", tiny_models.name("vae"), tiny_models.name("clip"))
    handle, report, _asked = Run(mod, prompt).queue(vae, clip)
    assert _encoded(report) == (1, 1), report
    assert "3 failed" in report and "VAE encodes still images only" in report
    assert list(_shapes(handle)) == ["still.png"]
    again = Run(mod, prompt)
    assert again.lazy() == []  # the image VAE's "no clips" is recorded too: a warm re-run loads nothing


def test_old_prompts_without_the_frame_inputs_run_as_before(mod: ModuleType, tiny_models: TinyModels) -> None:
    schema = {i.id: i for i in mod.EncodeDataset.define_schema().inputs}
    for name in CLIPS:
        assert schema[name].optional, name
    ids = [i.id for i in mod.EncodeDataset.define_schema().inputs]
    start = ids.index("frame_count")
    assert ids[start:start + len(CLIPS)] == list(CLIPS)  # appended (saved workflows' widget values are positional)
    # only inputs added later follow them (#16's variant inputs), so old widget values keep their positions
    assert ids[start + len(CLIPS):] == ["flip", "shuffle_variants", "keep_tokens", "empty_caption", "masks"]
    settings = mod._settings(resolution=64, bucket_step=32, crop="center", caption_prefix="", caption_suffix="",
                             batch_size=2, on_failure="skip")
    assert settings.video.frames == 17 and settings.video.sampling == "first" and settings.video.stride is None


def test_a_clip_dataset_trains_a_tiny_wan(pack: ModuleType, mod: ModuleType, wan_vae: tuple, clip: Any,
                                         comfy_nodes: ModuleType, tiny_models: TinyModels, cache_root: Path,
                                         clip_folder: tuple[str, Path], tmp_path: Path) -> None:
    """Encode Dataset's clip latents, with conditionings of UMT5's shape, train a tiny WAN 2.1 through Train LoRA
    (two frame buckets: 9-frame clips and a one-frame image)."""
    import folder_paths

    vae_name, vae = wan_vae
    folder, _root = clip_folder
    prompt = _prompt(folder, f"cache_train_{folder}", vae_name, tiny_models.name("clip"), **CLIPS)
    handle, _report, _asked = Run(mod, prompt).queue(vae, clip)
    reader, samples = handle.open()
    try:
        latents = [reader.read([s.latent])[0] for s in samples]
    finally:
        reader.close()
    gen = torch.Generator().manual_seed(3)
    umt5 = [[[torch.randn(1, 512, 4096, generator=gen) * 0.1, {}]] for _ in latents]
    save = importlib.import_module(f"{pack.__name__}.nodes.save_cache")
    with torch.inference_mode():
        save.save_lists(latents, umt5, cache_root / f"wan_clips_{folder}", "default")
    path = save_family_model(FAMILIES["wan21"], tmp_path / "dm")
    folder_paths.add_model_folder_path("diffusion_models", str(path.parent))
    (model,) = comfy_nodes.UNETLoader().load_unet(path.name, "default")
    handles = importlib.import_module(f"{pack.__name__}.nodes.handles")
    node = importlib.import_module(f"{pack.__name__}.nodes.train_lora").TrainLoRA
    options = {"batch_size": 2, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 1e-3, "rank": 4,
               "optimizer": "AdamW", "loss_function": "MSE", "seed": 1, "training_dtype": "fp32",
               "lora_dtype": "fp32", "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1,
               "offloading": False, "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0}
    with torch.inference_mode():
        lora, loss_map, steps = node.execute(model, handles.StreamDatasetHandle(
            str(cache_root / f"wan_clips_{folder}"), "default"), **options).result
    assert steps == 3 and len(loss_map["loss"]) == 3
    assert all(torch.isfinite(torch.tensor(loss_map["loss"]))) and lora
