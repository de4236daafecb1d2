"""Encode then train: which models ComfyUI's model management holds when training starts (#15 item 6).

Loading and unloading is ComfyUI's business (``comfy.model_management.current_loaded_models``); the pack's part is
to hand the encoders back after Encode Dataset and to ask for the whole device when training starts. Both are
shown with the real nodes and the tiny SD1.5 set (TAESD, CLIP-L, UNet). The suite runs ComfyUI on the CPU, where
"loaded" costs no extra memory (a model's load and offload device are the same RAM) and ComfyUI itself frees
nothing; the accelerator branch of the release is shown on real encoders marked as loaded on ``cuda``.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image
from support.tiny_models import TinyModels

from .test_encode_dataset import Run, _encoded, _prompt


def _loaded() -> list[Any]:
    import comfy.model_management

    return [lm.model for lm in comfy.model_management.current_loaded_models if lm.model is not None]


def _is_loaded(patcher: Any) -> bool:
    return any(m.clone_base_uuid == patcher.clone_base_uuid for m in _loaded())


@pytest.fixture
def image_folder(comfy_folders: Path, request: pytest.FixtureRequest) -> Any:
    import folder_paths

    folder = Path(folder_paths.get_input_directory()) / f"memory_{request.node.name[:40]}"
    folder.mkdir()
    gen = torch.Generator().manual_seed(9)
    for i in range(3):
        arr = (torch.rand(64, 64, 3, generator=gen) * 255).to(torch.uint8)
        Image.fromarray(arr.numpy()).save(folder / f"img_{i}.png")
        (folder / f"img_{i}.txt").write_text(f"memory test {i}", encoding="utf-8")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_training_starts_with_the_device_to_itself_after_encode_dataset(
        pack: ModuleType, comfy_nodes: ModuleType, tiny_models: TinyModels, image_folder: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Encode Dataset (TAESD + CLIP-L, loaded through ComfyUI) then Train LoRA: at the first step the training
    clone is the model loaded on the training device, every other loaded model sits on the CPU, and the trainer
    asked ComfyUI for the whole device (``memory_required=1e20``: ComfyUI unloads every other model from a GPU)."""
    import comfy.model_management

    encode = importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")
    training = importlib.import_module(f"{pack.__name__}.nodes.training")
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    (model,) = comfy_nodes.UNETLoader().load_unet(tiny_models.name("unet"), "default")
    run = Run(encode, _prompt(image_folder.name, f"memory_{image_folder.name}", tiny_models.name("vae"),
                              tiny_models.name("clip")))
    handle, report, _ = run.queue(vae, clip)
    assert _encoded(report) == (3, 3)
    # ComfyUI's model management loaded both encoders for the encode (their load device here is the CPU)
    assert _is_loaded(vae.patcher) and _is_loaded(clip.patcher)

    requests: list[tuple[list[Any], float]] = []
    load_models_gpu = comfy.model_management.load_models_gpu

    def spy(models: list[Any], memory_required: float = 0, *args: Any, **kwargs: Any) -> Any:
        requests.append((list(models), memory_required))
        return load_models_gpu(models, memory_required, *args, **kwargs)

    monkeypatch.setattr(comfy.model_management, "load_models_gpu", spy)
    at_first_step: list[tuple[Any, Any]] = []

    def on_step(report: Any) -> None:
        if report.step == 1:
            at_first_step.extend((lm.model, lm.device) for lm in comfy.model_management.current_loaded_models)

    reader, samples = handle.open()
    try:
        settings = training.TrainSettings(steps=2, batch_size=1, rank=4, learning_rate=1e-3, training_dtype="fp32",
                                          lora_dtype="fp32", gradient_checkpointing=False, seed=3)
        with torch.inference_mode():
            result = training.train_lora(model, reader, samples, settings, on_step=on_step)
    finally:
        reader.close()
    assert len(result.losses) == 2
    (clone, memory_required), = [(m[0], mem) for m, mem in requests if len(m) == 1 and m[0].model is not model.model]
    assert memory_required >= 1e20  # "free every other model on this device first"
    device = clone.load_device
    assert any(m is clone and d == device for m, d in at_first_step), "the training clone is not loaded"
    others = [(type(m.model).__name__, d) for m, d in at_first_step if m is not clone]
    assert all(d.type == "cpu" for _, d in others), others
    assert not _is_loaded(clone)  # the clone is unloaded when training ends


def test_encode_dataset_unloads_encoders_loaded_on_an_accelerator(
        pack: ModuleType, comfy_nodes: ModuleType, tiny_models: TinyModels) -> None:
    """The release Encode Dataset runs after its encode: encoders whose load device is not the CPU are unloaded
    from ComfyUI's loaded-model list (a real tiny VAE and CLIP, loaded by ComfyUI, their patchers' load device
    set to ``cuda`` after loading: nothing runs on it); encoders on the CPU stay, since unloading frees nothing."""
    import comfy.model_management

    encode = importlib.import_module(f"{pack.__name__}.nodes.encoders")
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    with torch.inference_mode():
        vae.encode(torch.rand(1, 64, 64, 3))
        clip.encode_from_tokens_scheduled(clip.tokenize("a photo"))
    assert _is_loaded(vae.patcher) and _is_loaded(clip.patcher)

    encode.release(vae, clip)  # on the CPU: left alone
    assert _is_loaded(vae.patcher) and _is_loaded(clip.patcher)

    for patcher in (vae.patcher, clip.patcher):
        patcher.load_device = torch.device("cuda", 0)
    try:
        encode.release(vae, clip)
    finally:
        for patcher in (vae.patcher, clip.patcher):
            patcher.load_device = torch.device("cpu")
    assert not _is_loaded(vae.patcher) and not _is_loaded(clip.patcher)
    comfy.model_management.cleanup_models_gc()
