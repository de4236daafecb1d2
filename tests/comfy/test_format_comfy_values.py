"""Real ComfyUI outputs round-trip through the cache format exactly (values, dtypes, shapes, list vs tuple)."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.tiny_models import TinyModels


def _same(a: object, b: object, where: str = "value") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b or (a != a and b != b), where


@pytest.fixture(scope="module")
def fmt(pack: ModuleType) -> tuple[ModuleType, ModuleType]:
    return (import_module(f"{pack.__name__}.dataset_cache.format.writer"),
            import_module(f"{pack.__name__}.dataset_cache.format.reader"))


def test_clip_text_encode_and_vae_latents_round_trip(comfy_nodes: ModuleType, tiny_models: TinyModels,
                                                     fmt: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:
    writer_mod, reader_mod = fmt
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, "a photo of sks dog")
    assert cond[0][0].shape == (1, 77, 768) and cond[0][1]["pooled_output"].shape == (1, 768)
    image = torch.rand(2, 64, 64, 3)
    (latent,) = comfy_nodes.VAEEncode().encode(vae, image)
    latent = dict(latent)
    latent["noise_mask"] = torch.ones(2, 1, 64, 64)
    latent["batch_index"] = [0, 1]
    extras = {"floats": (1.0, float("inf"), -0.0), "nested": {"$odd": [None, True, 3]},
              "zero_d": torch.tensor(2.5, dtype=torch.bfloat16),
              "fp8": torch.randn(3, 4).to(torch.float8_e4m3fn)}
    values = {"cond": cond, "latent": latent, "extras": extras}
    with writer_mod.CacheWriter(tmp_path) as w:
        for key, value in values.items():
            w.add(key, value, kind=key, name=key)
    reader = reader_mod.open_cache(tmp_path)
    got = reader.read(list(values))
    for (key, value), back in zip(values.items(), got):
        _same(value, back, key)
    lazy = reader.get("cond")
    assert lazy[0][0].shape == (1, 77, 768) and lazy[0][0].dtype == cond[0][0].dtype
    _same(cond, reader.materialize(lazy), "materialized cond")
    assert reader.verify() == []


def test_hook_objects_are_refused_with_their_path(comfy_nodes: ModuleType, tiny_models: TinyModels,
                                                  fmt: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:
    import comfy.hooks

    writer_mod, _ = fmt
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, "x")
    cond = [[cond[0][0], {**cond[0][1], "hooks": comfy.hooks.HookGroup()}]]
    with writer_mod.CacheWriter(tmp_path) as w:
        with pytest.raises(TypeError, match=r"conditioning\[0\]\[1\]\['hooks'\]: HookGroup is not storable"):
            w.add("k", cond, kind="conditioning", name="conditioning")
