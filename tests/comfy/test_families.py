"""The family matrix, training side: every model family ComfyUI trains, trained by the pack from a cache.

For each family of :data:`support.tiny_families.FAMILIES` a tiny diffusion model built with ComfyUI's classes is
read by ``UNETLoader`` (so ComfyUI's own detection names the family), a cache holds latents of the family's
shape (5-D for video VAEs) in two buckets and conditionings of the shapes and keys its text encoders return, and
Train LoRA runs 2 steps at batch 1 and 2. The LoRA must load with every key applied (ComfyUI logs ``lora key
not loaded`` for each one it cannot place) and a 1-step KSampler run with it must give a finite latent.
LLM text encoders (Qwen-Image, Lumina 2) give captions of different lengths, so their batches of 2 hold rows
that cannot be joined; the trainer must run them as ComfyUI's sampler would, separately.
The encoder side of each family needs its full-size text encoder and is not run here (README, "Model families").
"""

from __future__ import annotations

import gc
import importlib
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from support.tiny_families import FAMILIES, Family, save_family_model

TRAIN = {
    "batch_size": 1, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}
TOKENS = (7, 12, 12, 20)  # caption lengths where the encoder does not pad (LLM encoders)


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request: pytest.FixtureRequest, comfy_nodes: ModuleType, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Family, Any]]:
    import folder_paths

    fam = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"family_{fam.name}")
    path = save_family_model(fam, folder)
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    (model,) = comfy_nodes.UNETLoader().load_unet(path.name, "default")
    assert type(model.model).__name__ == fam.model_class
    yield fam, model
    del model
    gc.collect()
    path.unlink()  # the heavy families' files are hundreds of MB


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, family: tuple[Family, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Four samples: three of the family's 64×64 latent shape and one a third wider (a second bucket)."""
    fam, _ = family
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    handles = _module(pack, "nodes.handles")
    root = tmp_path_factory.mktemp(f"cache_{fam.name}") / "cache"
    gen = torch.Generator().manual_seed(0)
    wide = (*fam.latent[:-1], fam.latent[-1] * 3 // 2)
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, (shape, tokens) in enumerate(zip((fam.latent, fam.latent, fam.latent, wide), TOKENS)):
            writer.add(f"{i:032x}", {"samples": torch.randn(shape, generator=gen)}, kind="latent")
            writer.add(f"{i + 100:032x}", fam.conditioning(gen, tokens), kind="conditioning")
            samples.append(sample_cls(f"{i:032x}", (f"{i + 100:032x}",), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return handles.StreamDatasetHandle(str(root), "train")


@pytest.mark.parametrize("batch_size", [1, 2])
def test_family_trains_and_its_lora_applies_with_every_key(
        pack: ModuleType, comfy_nodes: ModuleType, family: tuple[Family, Any], dataset: Any, batch_size: int,
        caplog: pytest.LogCaptureFixture) -> None:
    import comfy.lora

    fam, model = family
    node = _module(pack, "nodes.train_lora").TrainLoRA
    options = {**TRAIN, **fam.train, "batch_size": batch_size}
    with torch.inference_mode():
        lora, loss_map, steps = node.execute(model, dataset, **options).result
    losses = loss_map["loss"]
    assert steps == TRAIN["steps"] and len(losses) == TRAIN["steps"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert "lora key not loaded" not in caplog.text
    trained = {k.rsplit(".lora_", 1)[0] for k in lora if ".lora_" in k}
    assert trained and len(patches) >= len(trained)

    train_nodes = _module(pack, "nodes.lora_training").nodes_train_module()
    with torch.inference_mode():
        (with_lora,) = train_nodes.LoraModelLoader.execute(model, lora, 1.0).result
        cond = fam.conditioning(torch.Generator().manual_seed(1), 9)
        (out,) = comfy_nodes.KSampler().sample(with_lora, 0, 1, 1.0, "euler", "simple", cond, cond,
                                              {"samples": torch.zeros(fam.latent)})
    assert out["samples"].shape == fam.latent and torch.isfinite(out["samples"]).all()
