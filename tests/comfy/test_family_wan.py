"""WAN 2.1 (text-to-video) trains from a cache: 5-D latents ``[1, 16, 1, h, w]`` from a video VAE.

The diffusion model is a tiny WAN 2.1 t2v built with ComfyUI's own classes and read by ``UNETLoader``; the
latents come from a tiny WAN 2.1 VAE through ``VAEEncode``. UMT5-XXL, WAN's text encoder, is fixed-size in
ComfyUI (~5 GB even in fp8), so the conditionings here are random tensors of its output shape (``[1, 512,
4096]``, as ComfyUI pads WAN prompts): the training side of the family, which is what the pack adds.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.tiny_families import save_wan21_t2v, save_wan21_vae

TRAIN = {
    "batch_size": 1, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def wan(comfy_nodes: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    import folder_paths

    folder = tmp_path_factory.mktemp("wan_models")
    vae_path = save_wan21_vae(folder / "vae")
    unet_path = save_wan21_t2v(folder / "diffusion_models")
    folder_paths.add_model_folder_path("vae", str(vae_path.parent))
    folder_paths.add_model_folder_path("diffusion_models", str(unet_path.parent))
    (vae,) = comfy_nodes.VAELoader().load_vae(vae_path.name)
    (model,) = comfy_nodes.UNETLoader().load_unet(unet_path.name, "default")
    assert type(model.model).__name__ == "WAN21"
    return model, vae


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, wan: tuple, tmp_path_factory: pytest.TempPathFactory) -> Any:
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    handles = _module(pack, "nodes.handles")
    _, vae = wan
    root = tmp_path_factory.mktemp("wan_cache") / "cache"
    gen = torch.Generator().manual_seed(0)
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, (h, w) in enumerate([(64, 64)] * 3 + [(64, 96)]):
            (latent,) = comfy_nodes.VAEEncode().encode(vae, torch.rand(1, h, w, 3, generator=gen))
            assert latent["samples"].shape == (1, 16, 1, h // 8, w // 8)
            cond = [[torch.randn(1, 512, 4096, generator=gen) * 0.1, {}]]
            writer.add(f"{i:032x}", latent, kind="latent")
            writer.add(f"{i + 100:032x}", cond, kind="conditioning")
            samples.append(sample_cls(f"{i:032x}", (f"{i + 100:032x}",), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return handles.StreamDatasetHandle(str(root), "train")


@pytest.mark.parametrize("batch_size", [1, 2])
def test_wan21_trains_from_video_latents_and_every_lora_key_applies(
        pack: ModuleType, wan: tuple, dataset: Any, batch_size: int, caplog: pytest.LogCaptureFixture) -> None:
    import comfy.lora

    node = _module(pack, "nodes.train_lora").TrainLoRA
    model, _ = wan
    with torch.inference_mode():
        lora, loss_map, steps = node.execute(model, dataset, **{**TRAIN, "batch_size": batch_size}).result
    losses = loss_map["loss"]
    assert steps == TRAIN["steps"] and len(losses) == TRAIN["steps"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert "lora key not loaded" not in caplog.text
    trained_layers = {k.rsplit(".lora_", 1)[0] for k in lora if ".lora_" in k}
    assert trained_layers and len(patches) >= len(trained_layers)
