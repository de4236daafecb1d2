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
    assert ids[start + len(CLIPS):] == ["flip", "shuffle_variants", "keep_tokens", "empty_caption", "masks",
                                        "missing_caption", "extra_resolutions", "tag_dropout", "wildcards",
                                        "clips_per_video", "keep_tokens_separator", "caption_extension",
                                        "secondary_separator", "reference_folder"]
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
            str(cache_root / f"wan_clips_{folder}"), "default"), **options).result[:3]
    assert steps == 3 and len(loss_map["loss"]) == 3
    assert all(torch.isfinite(torch.tensor(loss_map["loss"]))) and lora


# ------------------------------------------------------------------------------------------------ issue #27, 11-16


@pytest.mark.parametrize("fps", [1e-7, 4.9e-7, float("nan")])
def test_an_fps_near_zero_or_nan_is_refused_naming_fps_before_any_model_loads(
        mod: ModuleType, wan_vae: tuple, tiny_models: TinyModels, clip_folder: tuple[str, Path], fps: float) -> None:
    """ComfyUI's own check takes them (above its minimum 0; NaN passes every comparison): the node names fps and
    what it takes, where a rate near 0 once divided by zero deep in the plan."""
    folder, _root = clip_folder
    prompt = _prompt(folder, f"cache_fps_{folder}", wan_vae[0], tiny_models.name("clip"), **{**CLIPS, "fps": fps})
    with pytest.raises(ValueError, match=r"^fps (1e-07|4.9e-07|nan): use 0 \(each video keeps its own frame rate\) "
                                         r"or a rate from 0.01 to 1000 frames a second$"):
        Run(mod, prompt).lazy()


BASE = {"resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
        "batch_size": 2, "on_failure": "skip"}


@pytest.mark.parametrize(("inputs", "message"), [
    ({"frame_count": 0}, "frame_count 0: use a whole number from 1 to 4097"),
    ({"frame_count": 4098}, "frame_count 4098: use a whole number from 1 to 4097"),
    ({"frame_count": 9.0}, "frame_count 9.0: use a whole number"),
    ({"frame_step": 0}, "frame_step 0: use a whole number from 1 to 4097"),
    ({"frame_step": 10**12}, "frame_step 1000000000000: use a whole number"),
    ({"fps": float("inf")}, "fps inf: use 0"), ({"fps": -1.0}, "fps -1.0: use 0"),
    ({"fps": 1000.5}, "fps 1000.5: use 0"), ({"fps": 0.005}, "fps 0.005: use 0"), ({"fps": 5e-324}, "fps 5e-324"),
])
def test_every_clip_number_out_of_range_is_refused_naming_its_input(mod: ModuleType, inputs: dict[str, Any],
                                                                     message: str) -> None:
    """The audit of #27 item 11: each numeric clip input, at NaN, infinity, a tiny positive or a huge value."""
    with pytest.raises(ValueError, match=re.escape(message)):
        mod._settings(**BASE, **inputs)
    edges = mod._settings(**BASE, frame_count=4097, frame_step=4097, fps=0.01)  # the limits themselves are taken
    assert (edges.video.frames, edges.video.every, edges.video.fps) == (4097, 4097, 0.01)


def test_clips_that_give_fewer_frames_than_asked_are_named_in_the_report(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, comfy_folders: Path) -> None:
    """A 3-frame video at frame_count 9 gives one frame, a 12-frame .frames folder at 13 gives 9, and at fps 0.5
    every video gives one: the node's report names each with the frames it gave of those asked."""
    import folder_paths

    vae_name, vae = wan_vae
    root = Path(folder_paths.get_input_directory()) / "clips_short"
    make_video(root / "three.mp4", 3, width=64, height=64)
    make_frames_folder(root / "twelve.frames", 12, width=64, height=64)
    make_video(root / "long.mp4", 20, width=64, height=64)
    try:
        nine = _prompt("clips_short", "cache_clips_short", vae_name, tiny_models.name("clip"), **CLIPS)
        handle, report, _asked = Run(mod, nine).queue(vae, clip)
        assert "1 clip(s) give fewer frames than the 9 asked" in report
        assert "three.mp4: 1 of 9 frames (it has 3 frames; 3 rounded down to 1 + 4·m for the VAE)" in report
        assert _shapes(handle)["three.mp4"] == (1, 16, 1, 8, 8) and "long.mp4:" not in report
        thirteen = _prompt("clips_short", "cache_clips_short", vae_name, tiny_models.name("clip"),
                           **{**CLIPS, "frame_count": 13})
        _handle, report, _asked = Run(mod, thirteen).queue(vae, clip)
        assert "twelve.frames: 9 of 13 frames (it has 12 frames; 12 rounded down to 1 + 4·m for the VAE)" in report
        slow = _prompt("clips_short", "cache_clips_short", vae_name, tiny_models.name("clip"),
                       **{**CLIPS, "fps": 0.5})
        _handle, report, _asked = Run(mod, slow).queue(vae, clip)
        assert "2 clip(s) give fewer frames than the 9 asked" in report
        assert "long.mp4: 1 of 9 frames (it has 20 frames at 8 fps, 2 at fps 0.5" in report
        assert "three.mp4: 1 of 9 frames (it has 3 frames at 8 fps, 1 at fps 0.5)" in report
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_truncated_videos_are_left_out_and_named_though_their_sampled_frames_decode(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, comfy_folders: Path) -> None:
    import folder_paths

    from support.clips import truncate

    vae_name, vae = wan_vae
    root = Path(folder_paths.get_input_directory()) / "clips_truncated"
    truncate(make_video(root / "cut.webm", 30, width=64, height=64))
    truncate(make_video(root / "cut.mp4", 30, width=64, height=64, faststart=True))
    make_video(root / "ok.mp4", 12, width=64, height=64)
    try:
        prompt = _prompt("clips_truncated", "cache_clips_truncated", vae_name, tiny_models.name("clip"),
                         **{**CLIPS, "frame_count": 5})
        handle, report, _asked = Run(mod, prompt).queue(vae, clip)
        assert "2 failed, 2 samples skipped" in report
        assert list(_shapes(handle)) == ["ok.mp4"]
        fields = _fields(mod, prompt, vae, clip)
        reasons = dict(f.split(": ", 1) for f in fields["failures"])
        assert "truncated" in reasons["cut.webm"] and "header claims" in reasons["cut.webm"]
        assert re.match(r"video holds \d+ of the 30 frames its header claims: the file is truncated",
                        reasons["cut.mp4"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _fields(mod: ModuleType, prompt: dict[str, Any], vae: Any, clip: Any) -> dict[str, Any]:
    """The node's structured report (``streamcache_report``) of a run of ``prompt``."""
    run = Run(mod, prompt)
    got: dict[str, Any] = {}
    while wanted := [w for w in run.lazy(**got) if w not in got]:
        got.update({w: {"vae": vae, "clip": clip}[w] for w in wanted})
    out = run.node.execute(vae=got.get("vae"), clip=got.get("clip"), **run.inputs)
    (fields,) = out.ui.as_dict()["streamcache_report"]
    return fields


def test_the_log_and_the_node_say_the_same_source_counts(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, clip_folder: tuple[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """The node plans before it runs (to decide which model to load) and each plan saves the sources record; the
    console log once said "0 new, 9 unchanged" where the node said "9 new"."""
    import logging

    vae_name, vae = wan_vae
    folder, root = clip_folder
    files = sum(1 for p in root.rglob("*") if p.is_file())  # 2 videos, 11 frames, 1 image, 4 captions
    prompt = _prompt(folder, f"cache_log_{folder}", vae_name, tiny_models.name("clip"), **CLIPS)
    with caplog.at_level(logging.INFO, logger="dataset_cache.encode"):
        _handle, report, asked = Run(mod, prompt).queue(vae, clip)
    assert sorted(asked) == ["clip", "vae"]  # it planned before loading, and again with each model
    (line,) = [ln for ln in report.splitlines() if ln.startswith("sources:")]
    assert line == f"sources: {files} new, 0 changed, 0 unchanged, 0 removed"
    logged = [ln for ln in caplog.text.splitlines() if "sources:" in ln]
    assert logged and all(line in ln for ln in logged), logged


def test_a_frames_folder_is_not_offered_as_a_dataset_folder_and_is_refused_by_name(
        pack: ModuleType, mod: ModuleType, wan_vae: tuple, tiny_models: TinyModels,
        clip_folder: tuple[str, Path]) -> None:
    inputs = importlib.import_module(f"{pack.__name__}.nodes.inputs")
    folder, _root = clip_folder
    offered = inputs.input_folders()
    assert folder in offered and f"{folder}/jump.frames" not in offered
    for typed in (f"{folder}/jump.frames", f"{folder}/jump.frames/"):
        prompt = _prompt(typed, f"cache_frames_{folder}", wan_vae[0], tiny_models.name("clip"), **CLIPS)
        with pytest.raises(ValueError, match=rf"folder '{re.escape(typed)}' is a clip .* not a dataset folder: "
                                             rf"pick the folder that holds it \('{folder}'\)"):
            Run(mod, prompt).lazy()


def test_a_new_dataset_name_and_a_frame_count_taking_the_same_frames_load_and_encode_nothing(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, clip_folder: tuple[str, Path]) -> None:
    """A second dataset of a cache reuses the encoder identities the cache recorded (no 5.4 GB UMT5 loaded just to
    fingerprint it), and frame_count 10, which takes the same 9 frames as 9 with WAN's VAE, re-encodes no clip."""
    vae_name, vae = wan_vae
    folder, _root = clip_folder
    cache = f"cache_reuse_{folder}"
    _handle, report, _asked = Run(mod, _prompt(folder, cache, vae_name, tiny_models.name("clip"), **CLIPS)).queue(
        vae, clip)
    assert _encoded(report) == (4, 4)
    other = _prompt(folder, cache, vae_name, tiny_models.name("clip"), **CLIPS)
    other["10"]["inputs"]["dataset_name"] = "second"
    run = Run(mod, other)
    assert run.lazy() == []  # no encoder requested: the cache knows both
    _handle, report = run.execute()
    assert _encoded(report) == (0, 0) and "VAE not loaded" in report and "text encoder not loaded" in report
    ten = _prompt(folder, cache, vae_name, tiny_models.name("clip"), **{**CLIPS, "frame_count": 10})
    run = Run(mod, ten)
    assert run.lazy() == []
    _handle, report = run.execute()
    assert _encoded(report) == (0, 0) and "frame count 10 is taken as 9" in report


def test_clips_per_video_encodes_each_window_with_the_video_vae_loading_only_it(
        mod: ModuleType, wan_vae: tuple, clip: Any, tiny_models: TinyModels, clip_folder: tuple[str, Path]) -> None:
    """Two clips per video after one: only the second windows are encoded (the VAE alone is asked for), each a
    sample; the frame folder's second window (frames 6-10 of 11) is the VAE's encode of exactly those frames."""
    vae_name, vae = wan_vae
    folder, _root = clip_folder
    one = _prompt(folder, f"cache_{folder}", vae_name, tiny_models.name("clip"), **{**CLIPS, "frame_count": 5})
    Run(mod, one).queue(vae, clip)
    two = _prompt(folder, f"cache_{folder}", vae_name, tiny_models.name("clip"),
                  **{**CLIPS, "frame_count": 5, "clips_per_video": 2})
    handle, report, asked = Run(mod, two).queue(vae, clip)
    assert asked == ["vae"] and _encoded(report) == (3, 0), report
    reader, samples = handle.open()
    try:
        jump = [s for s in samples if s.source == "jump.frames"]
        assert len(jump) == 2 and len([s for s in samples if s.source == "walk.mp4"]) == 2
        assert reader.datasets()["default"].info["settings"]["video"]["clips"] == 2
        second = reader.read([jump[1].latent])[0]["samples"]
    finally:
        reader.close()
    frames = torch.stack([torch.from_numpy(frame_array(i, 64, 64)).float() / 255 for i in range(6, 11)])
    torch.testing.assert_close(second, vae.encode(frames).to(second.dtype), rtol=1e-3, atol=1e-4)
    uniform = _prompt(folder, f"cache_{folder}", vae_name, tiny_models.name("clip"),
                      **{**CLIPS, "frame_sampling": "uniform", "clips_per_video": 2})
    with pytest.raises(ValueError, match="clips_per_video 2 takes several windows"):
        Run(mod, uniform).lazy()
