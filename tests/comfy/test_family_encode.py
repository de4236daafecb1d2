"""The family matrix, encoding side: Encode Dataset with a tiny VAE of each family's latent shape.

ComfyUI's ``VAELoader`` reads each tiny VAE (TAESD for the 4-channel families, a 16-channel TAESD, the shape of
TAEF1/TAESD3, for SD3, Flux and Lumina 2, a tiny WAN 2.1 VAE for WAN and Qwen-Image), the node encodes two images,
and every cached latent must have the family's shape and equal the VAE's own encode of that image. Captions go
through the tiny CLIP-L of :mod:`support.tiny_models`, which is SD1.5's real text encoder; for every other family
the real text encoders are gigabytes (ComfyUI fixes their size), so only the VAE side is shown, and the matrix
cell says so.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image
from support.matrix import Cell, matrix  # noqa: F401 (the fixture)
from support.tiny_families import FAMILIES, save_taesd16, save_wan21_vae
from support.tiny_models import TinyModels

from .test_encode_dataset import Run, _encoded, _prompt

VAE_NAMES = {"taesd": "TAESD", "taesd16": "16-ch TAESD", "wan21": "WAN 2.1 VAE"}


@pytest.fixture(scope="module")
def vaes(comfy_nodes: ModuleType, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, tuple[str, Any]]:
    """Kind → (file name, ComfyUI ``VAE``), each read by ComfyUI's own ``VAELoader``."""
    import folder_paths

    folder = tmp_path_factory.mktemp("family_vaes")
    files = {"taesd": tiny_models.name("vae"), "taesd16": save_taesd16(folder).name,
             "wan21": save_wan21_vae(folder).name}
    folder_paths.add_model_folder_path("vae", str(folder))
    return {kind: (name, comfy_nodes.VAELoader().load_vae(name)[0]) for kind, name in files.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_encode_dataset_gives_the_familys_latents(
        name: str, pack: ModuleType, comfy_nodes: ModuleType, vaes: dict[str, tuple[str, Any]],
        tiny_models: TinyModels, comfy_folders: Path, matrix: Callable[..., Cell]) -> None:
    import folder_paths

    fam = FAMILIES[name]
    cell = matrix(fam.name, "encode")
    vae_name, vae = vaes[fam.vae]
    cell.note(f"Encode Dataset with a tiny {VAE_NAMES[fam.vae]}")
    mod = importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")
    folder = Path(folder_paths.get_input_directory()) / f"family_encode_{name}"
    refs = folder.with_name(folder.name + "_references")  # an edit model's: the images the dataset's edit
    edit = "reference_latents" in str(fam.conditioning(torch.Generator(), 4)[0][1])
    folder.mkdir()
    try:
        gen = torch.Generator().manual_seed(4)
        pixels, ref_pixels = {}, {}
        for i in range(2):
            arr = (torch.rand(64, 64, 3, generator=gen) * 255).to(torch.uint8)
            Image.fromarray(arr.numpy()).save(folder / f"img_{i}.png")
            (folder / f"img_{i}.txt").write_text(f"a photo number {i}", encoding="utf-8")
            pixels[f"img_{i}.png"] = arr.float()[None] / 255
            if edit:
                refs.mkdir(exist_ok=True)
                arr = (torch.rand(64, 64, 3, generator=gen) * 255).to(torch.uint8)
                Image.fromarray(arr.numpy()).save(refs / f"img_{i}.png")
                ref_pixels[f"img_{i}.png"] = arr.float()[None] / 255
        (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
        options = {"reference_folder": refs.name} if edit else {}
        run = Run(mod, _prompt(folder.name, f"family_encode_{name}", vae_name, tiny_models.name("clip"), **options))
        handle, report, _ = run.queue(vae, clip)
        assert _encoded(report) == (2 + len(ref_pixels), 2), report
        reader, samples = handle.open()
        try:
            assert len(samples) == 2
            for s in samples:
                wanted = [(s.latent, pixels[s.source])]
                if edit:
                    wanted.append((s.reference, ref_pixels[s.source]))
                for key, image in wanted:
                    latent = reader.read([key])[0]["samples"]
                    assert tuple(latent.shape) == fam.latent, (latent.shape, fam.latent)
                    with torch.inference_mode():
                        alone = vae.encode(image)
                    torch.testing.assert_close(latent, alone.to(latent.dtype), rtol=1e-3, atol=1e-4)
                (cond,) = reader.read([s.captions[0]])
                assert cond[0][0].shape == (1, 77, 768) and torch.isfinite(cond[0][0]).all()
        finally:
            reader.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(refs, ignore_errors=True)
    shape = list(fam.latent)
    if fam.text_encoders == "CLIP-L":
        cell.passed(f"images and captions (tiny {VAE_NAMES[fam.vae]} + CLIP-L): latents {shape} = the VAE's own "
                    "encode, conditionings [1, 77, 768]")
    else:
        extra = f"; reference images (reference_folder): latents {shape} = the VAE's own encode" if edit else ""
        cell.passed(f"VAE only (tiny {VAE_NAMES[fam.vae]}): latents {shape} = the VAE's own encode; text not run "
                    f"({fam.text_encoders}){extra}")
