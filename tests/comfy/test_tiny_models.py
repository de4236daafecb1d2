"""The generated tiny models load with ComfyUI's own loaders, completely, and run the basic nodes."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from support.tiny_models import TinyModels


def _file_keys(path: object, prefix: str = "") -> set[str]:
    with safe_open(str(path), "pt") as f:
        return {k[len(prefix):] for k in f.keys() if k.startswith(prefix)}


def test_unet_loader_loads_every_key(comfy_nodes: ModuleType, tiny_models: TinyModels) -> None:
    (model,) = comfy_nodes.UNETLoader().load_unet(tiny_models.name("unet"), "default")
    assert type(model.model).__name__ == "BaseModel"
    assert set(model.model.diffusion_model.state_dict()) == _file_keys(tiny_models.unet)


def test_clip_loader_loads_every_key(comfy_nodes: ModuleType, tiny_models: TinyModels) -> None:
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    assert set(clip.cond_stage_model.clip_l.transformer.state_dict()) == _file_keys(tiny_models.clip)


def test_vae_loader_gives_taesd_with_every_key(comfy_nodes: ModuleType, tiny_models: TinyModels) -> None:
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    assert type(vae.first_stage_model).__name__ == "TAESD"
    assert set(vae.first_stage_model.state_dict()) == _file_keys(tiny_models.vae)


def test_checkpoint_holds_all_three(comfy_nodes: ModuleType, tiny_models: TinyModels) -> None:
    model, clip, vae = comfy_nodes.CheckpointLoaderSimple().load_checkpoint(tiny_models.name("checkpoint"))[:3]
    ckpt = tiny_models.checkpoint
    assert set(model.model.diffusion_model.state_dict()) == _file_keys(ckpt, "model.diffusion_model.")
    clip_keys = set(clip.cond_stage_model.clip_l.transformer.state_dict()) - {"text_projection.weight"}
    assert clip_keys == _file_keys(ckpt, "cond_stage_model.transformer.")  # SD1.5 files carry no projection
    assert set(vae.first_stage_model.state_dict()) == _file_keys(ckpt, "first_stage_model.")
    with safe_open(str(tiny_models.unet), "pt") as f:
        expected = f.get_tensor("out.2.weight")
    assert torch.equal(model.model.diffusion_model.state_dict()["out.2.weight"].float(), expected.float())


@pytest.fixture(scope="module")
def checkpoint(comfy_nodes: ModuleType, tiny_models: TinyModels) -> tuple:
    return comfy_nodes.CheckpointLoaderSimple().load_checkpoint(tiny_models.name("checkpoint"))[:3]


def test_clip_text_encode_shapes(comfy_nodes: ModuleType, checkpoint: tuple) -> None:
    (conditioning,) = comfy_nodes.CLIPTextEncode().encode(checkpoint[1], "a photo of a tiny test pattern")
    cond, extra = conditioning[0]
    assert cond.shape == (1, 77, 768)
    assert extra["pooled_output"].shape == (1, 768)
    assert torch.isfinite(cond).all()


def test_vae_encode_64px_image(comfy_nodes: ModuleType, checkpoint: tuple) -> None:
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    (latent,) = comfy_nodes.VAEEncode().encode(checkpoint[2], image)
    assert latent["samples"].shape == (1, 4, 8, 8)
    assert torch.isfinite(latent["samples"]).all()
