"""Encoder fingerprints from real ComfyUI objects, and upstream identities of prompt graphs."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.tiny_models import TinyModels


@pytest.fixture(scope="module")
def fp(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.fingerprints")


@pytest.fixture(scope="module")
def clip(comfy_nodes: ModuleType, tiny_models: TinyModels) -> Any:
    return comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")[0]


@pytest.fixture(scope="module")
def vae(comfy_nodes: ModuleType, tiny_models: TinyModels) -> Any:
    return comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))[0]


def _lora_for(clip: Any, rank: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A real kohya-style LoRA state dict for the first q_proj of CLIP-L (what LoraLoader reads from a file)."""
    gen = torch.Generator().manual_seed(seed)
    key = "clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    out_f, in_f = clip.cond_stage_model.state_dict()[key].shape
    name = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    return {f"{name}.lora_up.weight": torch.randn(out_f, rank, generator=gen),
            f"{name}.lora_down.weight": torch.randn(rank, in_f, generator=gen),
            f"{name}.alpha": torch.tensor(float(rank))}


def _with_lora(clip: Any, lora: dict[str, torch.Tensor], strength: float) -> Any:
    import comfy.sd

    _model, patched = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)
    return patched


def test_deterministic_and_cheap(fp: ModuleType, clip: Any, vae: Any, comfy_nodes: ModuleType,
                                 tiny_models: TinyModels) -> None:
    start = time.perf_counter()
    first = fp.clip_fingerprint(clip)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"CLIP-L fingerprint took {elapsed:.2f}s"
    assert fp.clip_fingerprint(clip) == first
    reloaded = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")[0]
    assert fp.clip_fingerprint(reloaded) == first  # a second load of the same file
    assert fp.vae_fingerprint(vae) == fp.vae_fingerprint(comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))[0])
    assert fp.vae_fingerprint(vae) != first
    assert len(first) == 32 and int(first, 16) >= 0


def test_changes_with_weights(fp: ModuleType, comfy_nodes: ModuleType, tiny_models: TinyModels, vae: Any) -> None:
    other = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))[0]
    before = fp.vae_fingerprint(other)
    assert before == fp.vae_fingerprint(vae)
    weights = other.first_stage_model.state_dict()
    big = max(weights, key=lambda k: weights[k].numel())
    with torch.no_grad():
        weights[big].mul_(1.01)  # a fine-tune touches every element of a tensor
    assert fp.vae_fingerprint(other) != before


def test_changes_with_lora_and_strength_not_with_clone(fp: ModuleType, clip: Any) -> None:
    base = fp.clip_fingerprint(clip)
    assert fp.clip_fingerprint(clip.clone()) == base
    lora = _lora_for(clip)
    full = fp.clip_fingerprint(_with_lora(clip, lora, 1.0))
    half = fp.clip_fingerprint(_with_lora(clip, lora, 0.5))
    other = fp.clip_fingerprint(_with_lora(clip, _lora_for(clip, seed=1), 1.0))
    assert len({base, full, half, other}) == 4
    assert fp.clip_fingerprint(_with_lora(clip, lora, 1.0)) == full  # the same LoRA file loaded again
    assert fp.clip_fingerprint(clip) == base  # the base object is untouched


def test_same_when_patches_are_applied_in_place(fp: ModuleType, clip: Any) -> None:
    patched = _with_lora(clip, _lora_for(clip), 1.0)
    before = fp.clip_fingerprint(patched)
    patched.encode_from_tokens_scheduled(patched.tokenize("loads and patches the weights"))
    assert patched.patcher.backup, "the LoRA was not applied in place: the test checks nothing"
    assert fp.clip_fingerprint(patched) == before  # base weights are hashed from ComfyUI's backups


def test_changes_with_clip_skip(fp: ModuleType, clip: Any) -> None:
    skipped = clip.clone()
    skipped.clip_layer(-2)
    assert fp.clip_fingerprint(skipped) != fp.clip_fingerprint(clip)


def test_tensor_digest_is_device_and_layout_independent(fp: ModuleType) -> None:
    t = torch.randn(300, 200)
    assert fp.tensor_digest(t) == fp.tensor_digest(t.clone())
    assert fp.tensor_digest(t.t().contiguous().t()) == fp.tensor_digest(t)  # non-contiguous copy, same values
    assert fp.tensor_digest(t.to(torch.bfloat16)) != fp.tensor_digest(t)
    assert fp.tensor_digest(t.reshape(200, 300)) != fp.tensor_digest(t)
    if torch.cuda.is_available():
        assert fp.tensor_digest(t.cuda()) == fp.tensor_digest(t)


def _graph(vae_name: str, strength: float = 1.0) -> dict[str, Any]:
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "tiny_sd15.safetensors"}},
        "3": {"class_type": "LoraLoader", "inputs": {"model": ["2", 0], "clip": ["2", 1], "lora_name": "x.safetensors",
                                                     "strength_model": 1.0, "strength_clip": strength}},
        "9": {"class_type": "StreamCache_EncodeDataset", "inputs": {"vae": ["1", 0], "clip": ["3", 1],
                                                                    "folder": "f"}},
    }


def test_upstream_identity(fp: ModuleType, tiny_models: TinyModels, tmp_path: Path) -> None:
    import folder_paths
    from comfy_execution.graph import DynamicPrompt

    def ident(graph: dict[str, Any], name: str) -> str | None:
        return fp.upstream_identity(DynamicPrompt(graph), "9", name)

    folder = tmp_path / "vae"
    folder.mkdir()
    shutil.copy(tiny_models.vae, folder / "copy.safetensors")
    folder_paths.add_model_folder_path("vae", str(folder))
    base = ident(_graph("copy.safetensors"), "vae")
    assert base is not None and base == ident(_graph("copy.safetensors"), "vae")
    assert ident(_graph(tiny_models.name("vae")), "vae") != base
    os.utime(folder / "copy.safetensors", ns=(10**9, 10**9))  # same name, file edited
    assert ident(_graph("copy.safetensors"), "vae") != base
    assert ident(_graph("x", 0.5), "clip") != ident(_graph("x", 1.0), "clip")  # a constant two links up
    assert ident(_graph("x"), "folder") is None  # a widget, not a link
    assert fp.upstream_identity(None, "9", "vae") is None
    assert ident(_graph("x"), "missing") is None
    cyclic = {"9": {"class_type": "X", "inputs": {"vae": ["5", 0]}},
              "5": {"class_type": "Y", "inputs": {"a": ["5", 0]}}}
    assert ident(cyclic, "vae") is not None  # a malformed graph does not hang or raise
