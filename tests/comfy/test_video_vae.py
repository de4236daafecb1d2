"""Encode Dataset with a video VAE (a tiny WAN 2.1 VAE read by ComfyUI's own ``VAELoader``).

A video VAE reads a batch of images as the frames of one clip, so a batched encode returns one latent for the
whole batch. Each image must be encoded on its own, giving ``[1, 16, 1, h/8, w/8]`` latents that match an
encode of that image alone.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from PIL import Image
from support.tiny_models import TinyModels

from .test_encode_dataset import Run, _encoded, _prompt


@pytest.fixture(scope="module")
def mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")


def test_a_video_vae_encodes_each_image_on_its_own(mod: ModuleType, wan_vae: tuple, comfy_nodes: ModuleType,
                                                     tiny_models: TinyModels, comfy_folders: Path) -> None:
    import folder_paths

    vae_name, vae = wan_vae
    assert vae.latent_dim == 3 and not vae.not_video  # what ComfyUI says of a video VAE
    folder = Path(folder_paths.get_input_directory()) / "video_vae_src"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    pixels = {}
    for i in range(3):  # three images of one bucket: one batch of the encode
        arr = (torch.rand(64, 64, 3, generator=gen) * 255).to(torch.uint8)
        Image.fromarray(arr.numpy()).save(folder / f"img_{i}.png")
        (folder / f"img_{i}.txt").write_text(f"caption {i}", encoding="utf-8")
        pixels[f"img_{i}.png"] = arr.float()[None] / 255
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    run = Run(mod, _prompt("video_vae_src", "video_vae", vae_name, tiny_models.name("clip"), batch_size=4))
    handle, report, _ = run.queue(vae, clip)
    assert _encoded(report) == (3, 3)
    reader, samples = handle.open()
    try:
        assert len(samples) == 3
        for s in samples:
            latent = reader.read([s.latent])[0]["samples"]
            assert latent.shape == (1, 16, 1, 8, 8)
            alone = vae.encode(pixels[s.source])
            torch.testing.assert_close(latent, alone.to(latent.dtype), rtol=1e-3, atol=1e-4)
    finally:
        reader.close()


def test_wan_latents_from_comfyuis_own_make_training_dataset_save_and_train(
        pack: ModuleType, wan_vae: tuple, comfy_nodes: ModuleType, tiny_models: TinyModels, cache_root: Path,
        tmp_path: Path) -> None:
    """ComfyUI's Make Training Dataset → Save Streamable Cache → Train LoRA on a tiny WAN 2.1 (the path the
    issue found refused: 5-D latents)."""
    import folder_paths
    from comfy_extras.nodes_dataset import MakeTrainingDataset
    from support.tiny_families import FAMILIES, save_family_model

    _, vae = wan_vae
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    gen = torch.Generator().manual_seed(2)
    images = [torch.rand(1, 64, 64, 3, generator=gen) for _ in range(3)]
    with torch.inference_mode():
        latents, _clip_conds = MakeTrainingDataset.execute(images=images, vae=[vae], clip=[clip],
                                                           texts=["a", "b", "c"]).result
    assert [lat["samples"].shape for lat in latents] == [(1, 16, 1, 8, 8)] * 3
    umt5 = [[[torch.randn(1, 512, 4096, generator=gen) * 0.1, {}]] for _ in latents]  # WAN's text encoder shape
    save = importlib.import_module(f"{pack.__name__}.nodes.save_cache")
    with torch.inference_mode():
        save.save_lists(latents, umt5, cache_root / "wan_from_builtin", "default")
    handles = importlib.import_module(f"{pack.__name__}.nodes.handles")
    family = FAMILIES["wan21"]
    path = save_family_model(family, tmp_path / "dm")
    folder_paths.add_model_folder_path("diffusion_models", str(path.parent))
    (model,) = comfy_nodes.UNETLoader().load_unet(path.name, "default")
    node = importlib.import_module(f"{pack.__name__}.nodes.train_lora").TrainLoRA
    options = {"batch_size": 2, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 1e-3, "rank": 4,
               "optimizer": "AdamW", "loss_function": "MSE", "seed": 1, "training_dtype": "fp32",
               "lora_dtype": "fp32", "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1,
               "offloading": False, "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0}
    with torch.inference_mode():
        lora, loss_map, steps = node.execute(model, handles.StreamDatasetHandle(
            str(cache_root / "wan_from_builtin"), "default"), **options).result[:3]
    assert steps == 2 and all(torch.isfinite(torch.tensor(loss_map["loss"]))) and lora
