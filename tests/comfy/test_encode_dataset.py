"""Node "Encode Dataset" in-process with the real tiny TAESD + CLIP-L from ComfyUI's own loaders.

``check_lazy_status`` and ``execute`` are called on the class clone ComfyUI itself makes for a run
(``PREPARE_CLASS_CLONE`` with the hidden ``dynprompt`` / ``unique_id``), over a prompt in API format whose VAE and
CLIP come from ``VAELoader`` / ``CLIPLoader`` nodes, so the upstream-identity scheme sees what it sees in a server.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.datasets import make_kohya_folder
from support.tiny_models import TinyModels

NODE_ID = "10"
SETTINGS = {"resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
            "batch_size": 2, "on_failure": "skip"}


@pytest.fixture(scope="module")
def mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")


@pytest.fixture(scope="module")
def record_mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.encoder_record")


@pytest.fixture(scope="module")
def encoders_mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.encoders")


@pytest.fixture(scope="module")
def encoders(comfy_nodes: ModuleType, tiny_models: TinyModels) -> tuple[Any, Any]:
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    return vae, clip


@pytest.fixture
def input_dir(comfy_folders: Path) -> Path:
    import folder_paths

    return Path(folder_paths.get_input_directory())


@pytest.fixture
def names(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A folder name and a cache name unique to the test."""
    base = re.sub(r"\W+", "_", request.node.name)[:60]
    return f"ds_{base}", f"cache_{base}"


def _prompt(folder: str, cache: str, vae_name: str, clip_name: str, **settings: Any) -> dict[str, Any]:
    inputs = {"folder": folder, "cache": cache, "dataset_name": "default", **SETTINGS, **settings,
              "vae": ["1", 0], "clip": ["2", 0]}
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": clip_name, "type": "stable_diffusion",
                                                     "device": "default"}},
        NODE_ID: {"class_type": "StreamCache_EncodeDataset", "inputs": inputs},
    }


class Run:
    """One queued run of the node: the class clone ComfyUI makes, and its constant inputs."""

    def __init__(self, mod: ModuleType, prompt: dict[str, Any]) -> None:
        from comfy_api.latest import io
        from comfy_execution.graph import DynamicPrompt

        self.node = mod.EncodeDataset.PREPARE_CLASS_CLONE(
            {"hidden_inputs": {io.Hidden.dynprompt: DynamicPrompt(prompt), io.Hidden.unique_id: NODE_ID}})
        self.inputs = {k: v for k, v in prompt[NODE_ID]["inputs"].items() if k not in ("vae", "clip")}

    def lazy(self, vae: Any = None, clip: Any = None) -> list[str]:
        return sorted(self.node.check_lazy_status(vae=vae, clip=clip, **self.inputs))

    def execute(self, vae: Any = None, clip: Any = None) -> tuple[Any, str]:
        out = self.node.execute(vae=vae, clip=clip, **self.inputs)
        handle, report = out.result
        assert out.ui.as_dict()["text"] == (report,)
        (fields,) = out.ui.as_dict()["streamcache_report"]
        assert f"dataset {fields['dataset']!r}: {fields['samples']} samples" in report or fields["sourceless"]
        return handle, report

    def fingerprint(self) -> Any:
        return self.node.fingerprint_inputs(**self.inputs)

    def queue(self, vae: Any, clip: Any) -> tuple[Any, str, list[str]]:
        """What ComfyUI does: ask check_lazy_status until satisfied, 'load' what it asks for, execute."""
        got: dict[str, Any] = {}
        asked: list[str] = []
        while wanted := [w for w in self.lazy(**got) if w not in got]:
            asked += wanted
            got.update({w: {"vae": vae, "clip": clip}[w] for w in wanted})
        handle, report = self.execute(**got)
        return handle, report, asked


def _encoded(report: str) -> tuple[int, int]:
    m = re.search(r"encoded (\d+) latents and (\d+) conditionings", report)
    assert m, report
    return int(m.group(1)), int(m.group(2))


@pytest.fixture
def kohya(input_dir: Path, names: tuple[str, str]) -> Iterator[Any]:
    folder = make_kohya_folder(input_dir / names[0])
    yield folder
    shutil.rmtree(folder.root, ignore_errors=True)


def test_encode_then_warm_rerun_loads_nothing(mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels,
                                              names: tuple[str, str], cache_root: Path,
                                              monkeypatch: pytest.MonkeyPatch, record_mod: ModuleType) -> None:
    vae, clip = encoders
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    run = Run(mod, prompt)
    assert run.lazy() == ["clip", "vae"]  # nothing recorded yet: both are needed
    handle, report, asked = run.queue(vae, clip)
    assert sorted(asked) == ["clip", "vae"]
    # 5 images; captions: one shared by two images, two variants of one caption, two unique lines
    assert _encoded(report) == (5, 5)
    assert "sources: 10 new, 0 changed, 0 unchanged" in report  # 5 images + 5 captions, counted once
    assert handle.cache_root == str(cache_root / names[1]) and handle.name == "default"
    reader, samples = handle.open()
    try:
        assert len(samples) == 5
        assert sum(len(s.captions) for s in samples) == 6
        latent = reader.read([samples[0].latent])[0]
        assert latent["samples"].shape[:2] == (1, 4)
        cond = reader.read([samples[0].captions[0]])[0]
        assert cond[0][0].shape == (1, 77, 768) and cond[0][1]["pooled_output"].shape == (1, 768)
    finally:
        reader.close()

    again = Run(mod, prompt)  # a new queue of the same graph
    assert again.lazy() == []  # the recorded fingerprints are assumed: no loader has to run
    handle2, report2, asked2 = again.queue(vae, clip)
    assert asked2 == [] and handle2 == handle
    assert _encoded(report2) == (0, 0)
    assert "VAE not loaded" in report2 and "text encoder not loaded" in report2
    monkeypatch.setenv(record_mod.TRUST_UPSTREAM_ENV, "0")  # the escape hatch: always look at the real encoders
    assert Run(mod, prompt).lazy() == ["clip", "vae"]


def test_changed_caption_line_and_new_image_encode_only_those(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    vae, clip = encoders
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    Run(mod, prompt).queue(vae, clip)
    multi = next(img for img in kohya.images if "\n" in img.caption)
    first, _second = multi.caption.split("\n")
    multi.path.with_suffix(".txt").write_text(f"{first}\nan edited second line", encoding="utf-8")
    new = kohya.images[0].path.with_name("img_009.png")
    from PIL import Image

    Image.new("RGB", (64, 64), (12, 200, 99)).save(new)
    new.with_suffix(".txt").write_text("a brand new caption", encoding="utf-8")

    import comfy.utils

    updates: list[tuple[int, int]] = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda value, total, preview, node_id=None:
                        updates.append((value, total)))
    run = Run(mod, prompt)
    assert run.lazy() == ["clip", "vae"]
    _handle, report, _asked = run.queue(vae, clip)
    assert _encoded(report) == (1, 2)  # the new image; the edited line and the new caption
    assert (0, 3) in updates and (3, 3) in updates  # ComfyUI's progress bar, counted in entries
    assert "2 new, 1 changed" in report, report  # source files: the image and its caption; the edited caption
    assert Run(mod, prompt).lazy() == []


def test_caption_only_change_loads_only_the_text_encoder(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str]) -> None:
    vae, clip = encoders
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    Run(mod, prompt).queue(vae, clip)
    kohya.images[-1].path.with_suffix(".txt").write_text("a rewritten caption", encoding="utf-8")
    _handle, report, asked = Run(mod, prompt).queue(vae, clip)
    assert asked == ["clip"]
    assert _encoded(report) == (0, 1)
    prefixed = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"),
                       caption_prefix="ohwx, ")
    _handle, report, asked = Run(mod, prefixed).queue(vae, clip)
    assert asked == ["clip"] and _encoded(report) == (0, 5)  # every distinct caption text is new


def test_other_vae_file_is_requested_then_recorded(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        comfy_nodes: ModuleType, tmp_path: Path) -> None:
    import folder_paths

    vae, clip = encoders
    Run(mod, _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))).queue(vae, clip)
    extra = tmp_path / "vae"
    extra.mkdir()
    shutil.copy(tiny_models.vae, extra / "same_weights_other_name.safetensors")
    folder_paths.add_model_folder_path("vae", str(extra))
    prompt = _prompt(names[0], names[1], "same_weights_other_name.safetensors", tiny_models.name("clip"))
    run = Run(mod, prompt)
    assert run.lazy() == ["vae"]  # unknown upstream identity: the VAE must be looked at; the CLIP is known
    (vae2,) = comfy_nodes.VAELoader().load_vae("same_weights_other_name.safetensors")
    _handle, report, asked = run.queue(vae2, clip)
    assert asked == ["vae"] and _encoded(report) == (0, 0)  # same weights, same fingerprint: all latents reused
    assert Run(mod, prompt).lazy() == []  # now recorded
    os.utime(extra / "same_weights_other_name.safetensors", ns=(1, 1))  # edited in place: identity changes
    assert Run(mod, prompt).lazy() == ["vae"]


def test_fingerprint_inputs_follows_the_folder_not_our_own_writes(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str]) -> None:
    vae, clip = encoders
    run = Run(mod, _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip")))
    before = run.fingerprint()
    run.queue(vae, clip)
    assert run.fingerprint() == before  # the encode itself changed the cache, which must not count
    assert run.fingerprint() == before
    kohya.images[0].path.with_suffix(".txt").write_text("changed", encoding="utf-8")
    changed = run.fingerprint()
    assert changed != before
    run.queue(vae, clip)
    assert run.fingerprint() == changed


def test_captions_of_another_extension_are_read_and_fingerprinted(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str]) -> None:
    """caption_extension ".caption": an image's ``.caption`` file is its caption and its ``.txt`` file is not read
    (the first image's ``.caption`` repeats its ``.txt`` text: the same caption key as the ``.txt`` run; the others
    have none: the empty caption), the node's fingerprint follows the ``.caption`` files, not the ``.txt`` ones; a
    bad extension is refused naming the input, before any model loads."""
    vae, clip = encoders
    first = kohya.images[0]
    first.path.with_suffix(".caption").write_text(first.caption, encoding="utf-8")

    def captions(handle: Any) -> dict[str, tuple[str, ...]]:
        reader, samples = handle.open()
        reader.close()
        return {s.source: s.captions for s in samples}

    models = (tiny_models.name("vae"), tiny_models.name("clip"))
    plain, _, _ = Run(mod, _prompt(names[0], names[1], *models)).queue(vae, clip)
    run = Run(mod, _prompt(names[0], names[1], *models, dataset_name="captions", caption_extension=".caption"))
    other, _, _ = run.queue(vae, clip)
    by_txt, by_caption = captions(plain), captions(other)
    first_source = next(s for s in by_txt if s.endswith(first.path.name))
    assert by_caption[first_source] == by_txt[first_source]
    empty = {c for s, c in by_caption.items() if s != first_source}
    assert len(empty) == 1 and not empty & {c for s, c in by_txt.items() if s != first_source}
    before = run.fingerprint()
    first.path.with_suffix(".txt").write_text("changed, not read", encoding="utf-8")
    assert run.fingerprint() == before
    first.path.with_suffix(".caption").write_text("another sentence", encoding="utf-8")
    assert run.fingerprint() != before
    bad = Run(mod, _prompt(names[0], names[1], *models, caption_extension=".png"))
    with pytest.raises(ValueError, match="caption_extension '.png' is the extension of images"):
        bad.lazy()


def test_interrupt_keeps_finished_batches(mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels,
                                          names: tuple[str, str]) -> None:
    import comfy.model_management as mm

    vae, clip = encoders
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), batch_size=1)
    calls = []
    real_encode = vae.encode

    class InterruptingVAE:
        def __getattr__(self, name: str) -> Any:
            return getattr(vae, name)

        def encode(self, pixels: torch.Tensor) -> torch.Tensor:
            calls.append(pixels.shape[0])
            latents = real_encode(pixels)
            mm.interrupt_current_processing(True)  # Cancel pressed as the first latent batch finishes
            return latents

    run = Run(mod, prompt)
    with pytest.raises(mm.InterruptProcessingException):
        run.queue(InterruptingVAE(), clip)
    assert not mm.processing_interrupted()  # ComfyUI's flag was consumed: the interrupt is recorded once
    assert calls == [1]
    _handle, report, _asked = Run(mod, prompt).queue(vae, clip)
    assert _encoded(report) == (4, 0)  # the finished latent and every conditioning were kept


def test_failures_skip_or_stop(mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels,
                               names: tuple[str, str]) -> None:
    from comfyui_streamcache.dataset_cache.errors import SourceError

    vae, clip = encoders
    bad_png = kohya.images[0].path.with_name("broken.png")
    bad_png.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    bad_caption = kohya.images[1].path.with_suffix(".txt")
    bad_caption.write_bytes(b"caf\xe9 latin-1 caption")
    stop = Run(mod, _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"),
                            on_failure="stop"))
    assert stop.lazy() == []  # nothing is loaded for a run that is going to stop
    with pytest.raises(SourceError, match=r"broken\.png"):
        stop.execute()
    skip = Run(mod, _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip")))
    _handle, report, _asked = skip.queue(vae, clip)
    assert "2 failed" in report and "skipped" in report
    assert _encoded(report)[0] == 4  # 5 images, one left out for its caption; broken.png failed


def test_bad_folders_are_named(mod: ModuleType, input_dir: Path, names: tuple[str, str], tiny_models: TinyModels,
                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    node = mod.EncodeDataset
    assert "must not contain '..'" in node.validate_inputs(cache="../c")
    assert node.validate_inputs(cache="c") is True and node.validate_inputs(cache=None) is True
    base = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    # the folder and the dataset name are checked when the node starts, before any model is asked for
    for inputs, message in (({"folder": "../secrets"}, "folder '../secrets' must not contain '..'"),
                            ({"folder": str(tmp_path)}, "outside ComfyUI's input directory"),
                            ({"folder": mod.NO_FOLDER_YET}, "folder: ComfyUI's input directory .* has no folder"),
                            ({"dataset_name": " "}, "dataset_name is empty")):
        run = Run(mod, base)
        run.inputs.update(inputs)
        with pytest.raises(ValueError, match=message):
            run.lazy()
    with pytest.raises(ValueError, match="must not contain '..'"):
        Run(mod, base).node.execute(**{**Run(mod, base).inputs, "folder": "a/../../b"})
    with pytest.raises(ValueError, match="does not exist"):
        Run(mod, base).lazy()
    (input_dir / names[0]).mkdir()
    (input_dir / names[0] / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match="no images found"):
        Run(mod, base).lazy()
    monkeypatch.setenv(mod.ALLOW_ABSOLUTE_ENV, "1")
    outside = make_kohya_folder(tmp_path / "outside")
    assert Run(mod, _prompt(str(outside.root), names[1], tiny_models.name("vae"),
                            tiny_models.name("clip"))).lazy() == ["clip", "vae"]
    shutil.rmtree(input_dir / names[0])


def test_a_full_disk_is_named_and_a_rerun_encodes_only_the_rest(mod: ModuleType, encoders: tuple, kohya: Any,
                                                                tiny_models: TinyModels, names: tuple[str, str],
                                                                cache_root: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from comfyui_streamcache.dataset_cache.format.reader import open_cache
    from support.faults import FaultInjector

    vae, clip = encoders
    root = cache_root / names[1]
    root.mkdir(parents=True)
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    faults = FaultInjector(root, monkeypatch)
    writes: list[int] = []

    def full_after_three_writes(op: str, path: str) -> int | None:  # the recovery log's first batches fit
        if op == "write":
            writes.append(1)
            return errno.ENOSPC if len(writes) > 3 else None
        return None

    with faults.active(rule=full_after_three_writes), pytest.raises(OSError) as info:
        Run(mod, prompt).queue(vae, clip)
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert f"the disk holding the cache {root} is full" in message and "Everything committed" in message
    with open_cache(root, strict=False) as reader:  # whatever was published is intact
        assert reader.verify() == []
    _handle, report, _asked = Run(mod, prompt).queue(vae, clip)
    latents, conds = _encoded(report)
    assert latents + conds < 10  # entries written before the disk filled (the recovery log's) are not redone
    with open_cache(root) as reader:
        assert len(reader.dataset("default")) == 5 and reader.verify() == []


def _latent_shapes(handle: Any) -> set[tuple[int, ...]]:
    """The distinct latent shapes of a stored dataset, from shard headers."""
    reader, samples = handle.open()
    try:
        return {tuple(reader.tensor_shapes(s.latent)["samples"]) for s in samples}
    finally:
        reader.close()


def test_small_images_are_not_upscaled_unless_asked_and_old_prompts_run_without_the_input(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str]) -> None:
    vae, clip = encoders
    schema = {i.id: i for i in mod.EncodeDataset.define_schema().inputs}
    assert schema["upscale"].default is False and schema["upscale"].optional and schema["upscale"].advanced
    assert {k for k, i in schema.items() if i.advanced} == {"caption_suffix", "batch_size", "on_failure", "upscale",
                                                            "frame_step", "fps", "shuffle_variants", "keep_tokens",
                                                            "empty_caption", "tag_dropout", "wildcards",
                                                            "keep_tokens_separator", "caption_extension",
                                                            "secondary_separator"}
    old = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), resolution=512,
                  bucket_step=32)
    assert "upscale" not in old["10"]["inputs"]  # as a workflow saved before the input existed
    handle, report, _ = Run(mod, old).queue(vae, clip)
    shapes = _latent_shapes(handle)
    assert max(h * w for _, _, h, w in shapes) <= (96 // 8) * (96 // 8)  # the folder's images are 64-96 px
    up = _prompt(names[0], names[1] + "_up", tiny_models.name("vae"), tiny_models.name("clip"), resolution=512,
                 bucket_step=32, upscale=True)
    handle, _, _ = Run(mod, up).queue(vae, clip)
    shapes = _latent_shapes(handle)
    assert min(h * w for _, _, h, w in shapes) > (96 // 8) * (96 // 8)  # covered buckets of area up to 512²


def test_a_bucket_step_larger_than_the_resolution_says_what_is_allowed(mod: ModuleType, kohya: Any,
                                                                       tiny_models: TinyModels,
                                                                       names: tuple[str, str]) -> None:
    import inspect

    # not in validate_inputs: an input named there loses ComfyUI's own min/max check
    assert {"resolution", "bucket_step"}.isdisjoint(inspect.signature(mod.EncodeDataset.validate_inputs).parameters)
    bad = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), resolution=64,
                  bucket_step=512)
    with pytest.raises(ValueError, match=r"bucket_step 512 is larger than resolution 64, so no bucket fits: use a "
                                         r"bucket_step from 8 to 64 \(a multiple of 8\), or raise the resolution"):
        Run(mod, bad).lazy()  # before any model is asked for
    with pytest.raises(ValueError, match="use a multiple of 8"):
        mod._settings(resolution=512, bucket_step=12, crop="center", caption_prefix="", caption_suffix="",
                      batch_size=1, on_failure="skip")


def test_a_caption_longer_than_225_tokens_is_encoded_in_three_windows_and_the_report_says_so(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        encoders_mod: ModuleType) -> None:
    vae, clip = encoders
    long_caption = ", ".join(f"tag{i}" for i in range(300))  # ~900 CLIP tokens, under the character limit
    kohya.images[0].path.with_suffix(".txt").write_text(long_caption, encoding="utf-8")
    assert len(clip.tokenize(long_caption)["l"]) > encoders_mod.MAX_TOKEN_WINDOWS  # ComfyUI encodes every window
    handle, report, _ = Run(mod, _prompt(names[0], names[1], tiny_models.name("vae"),
                                         tiny_models.name("clip"))).queue(vae, clip)
    assert "caption line(s) were longer than 225 tokens and were encoded cut to that length" in report
    reader, samples = handle.open()
    try:
        source = kohya.images[0].path.relative_to(kohya.root).as_posix()
        (sample,) = [s for s in samples if s.source == source]
        cond = reader.read([sample.captions[0]])[0]
    finally:
        reader.close()
    assert cond[0][0].shape == (1, 77 * encoders_mod.MAX_TOKEN_WINDOWS, 768)


def _half_mask(path: Path, size: tuple[int, int], *, left: bool) -> None:
    from PIL import Image

    img = Image.new("L", size, 0)
    half = (0, 0, size[0] // 2, size[1]) if left else (size[0] // 2, 0, size[0], size[1])
    img.paste(255, half)
    img.save(path)


def test_masks_are_made_at_the_real_vaes_latent_size_and_a_mask_edit_loads_no_model(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        cache_root: Path, record_mod: ModuleType) -> None:
    from comfyui_streamcache.dataset_cache.format.reader import open_cache

    vae, clip = encoders
    img = next(i for i in kohya.images if i.size[0] == i.size[1])
    mask_path = img.path.with_name(img.path.stem + "-masklabel.png")
    _half_mask(mask_path, img.size, left=True)
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), masks="masklabel",
                     flip="random", empty_caption=True, shuffle_variants=2, keep_tokens=1)
    _handle, report, asked = Run(mod, prompt).queue(vae, clip)
    assert sorted(asked) == ["clip", "vae"]
    assert "variants:" in report and "masks: 1 made" in report and "empty caption: encoded" in report, report
    root = cache_root / names[1]
    with open_cache(root) as reader:
        samples = {s.source: s for s in reader.dataset("default")}
        rel = img.path.relative_to(kohya.root).as_posix()
        sample = samples[rel]
        assert mask_path.name not in {Path(s).name for s in samples}  # a mask file is never a sample
        assert all(s.mirror is not None and s.empty_caption is not None for s in samples.values())
        latent, mirror, mask = reader.read([sample.latent, sample.mirror, sample.mask])
    lat = latent["samples"]
    factor = vae.spacial_compression_encode()
    m = mask["mask"]
    assert m.dtype == torch.uint8 and tuple(m.shape) == (1, 1, *lat.shape[-2:])  # the real VAE's latent size
    w = m.shape[-1]
    assert (m[..., : w // 2] == 255).all() and (m[..., w // 2:] == 0).all()
    assert mirror["samples"].shape == lat.shape and not torch.equal(mirror["samples"], lat)
    info = record_mod.read_state(root).datasets["default"].info
    assert info[record_mod.RECORD_KEY][record_mod.FACTOR_KEY] == {record_mod.vae_fingerprint(vae): factor}

    # the mask edited: ComfyUI's node cache sees it, the mask alone is made, neither the VAE nor CLIP is asked for
    before = Run(mod, prompt).fingerprint()
    _half_mask(mask_path, img.size, left=False)
    run = Run(mod, prompt)
    assert run.fingerprint() != before
    assert run.lazy() == []
    _handle, report, asked = run.queue(vae, clip)
    assert asked == [] and _encoded(report) == (0, 0) and "made 1 masks" in report, report
    assert "VAE not loaded" in report
    with open_cache(root) as reader:
        after = {s.source: s for s in reader.dataset("default")}[rel]
        (mask,) = reader.read([after.mask])
    assert after.latent == sample.latent and after.mirror == sample.mirror and after.mask != sample.mask
    assert (mask["mask"][..., : w // 2] == 0).all() and (mask["mask"][..., w // 2:] == 255).all()


def test_missing_caption_captions_kohya_folders_by_name_loading_only_the_text_encoder(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        comfy_nodes: ModuleType) -> None:
    """An image of a kohya ``<repeats>_<name>`` folder without a caption file trains with the empty prompt, and the
    report says how kohya would caption it; ``missing_caption`` 'folder name' then encodes the folder's name as
    its caption (one conditioning), without loading the VAE; an old prompt without the input is the default."""
    vae, clip = encoders
    img = kohya.images[-1]
    img.path.with_suffix(".txt").unlink()
    rel = img.path.relative_to(kohya.root).as_posix()
    folder_name = rel.split("/")[0].split("_", 1)[1]
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    assert "missing_caption" not in prompt[NODE_ID]["inputs"]  # as a workflow saved before the input existed
    _handle, report, _ = Run(mod, prompt).queue(vae, clip)
    assert (f"1 source(s) in kohya <repeats>_<name> folders have no caption file and train with the empty prompt "
            f"({rel!r}); missing_caption 'folder name' captions them with their folder's name") in report, report

    named = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"),
                    missing_caption="folder name")
    _handle, report, asked = Run(mod, named).queue(vae, clip)
    assert asked == ["clip"] and _encoded(report) == (0, 1), report
    handle, _, _ = Run(mod, named).queue(vae, clip)
    reader, samples = handle.open()
    try:
        (sample,) = [s for s in samples if s.source == rel]
        assert reader.datasets()["default"].info["settings"]["missing_caption"] == "folder name"
        (cond,) = reader.read([sample.captions[0]])
    finally:
        reader.close()
    with torch.inference_mode():  # the same text through the same encoder, alone in its batch: the same numbers
        (expected,) = comfy_nodes.CLIPTextEncode().encode(clip, folder_name)
    assert torch.equal(cond[0][0], expected[0][0])


def test_extra_resolutions_encode_each_image_again_loading_only_the_vae(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str]) -> None:
    """A second resolution encodes each image's latent at it (its own buckets) and no caption: only the VAE is
    asked for; the dataset holds a sample per image and resolution. A piece that is no resolution is refused.
    (With upscale off, the images smaller than 128 would keep their own size there: one sample, no new latent.)"""
    vae, clip = encoders
    prompt = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), upscale=True)
    handle, _report, _ = Run(mod, prompt).queue(vae, clip)
    reader, one = handle.open()
    reader.close()
    two = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), upscale=True,
                  extra_resolutions="128")  # upscaled: the folder's 64-96 px images reach the 128 buckets
    handle, report, asked = Run(mod, two).queue(vae, clip)
    assert asked == ["vae"] and _encoded(report) == (len(one), 0), report
    reader, samples = handle.open()
    try:
        assert len(samples) == 2 * len(one) and {s.latent for s in one} < {s.latent for s in samples}
        areas = {s.source: sorted(int(h) * int(w) for *_, h, w in [reader.tensor_shapes(x.latent)["samples"]
                                                                   for x in samples if x.source == s.source])
                 for s in samples}
    finally:
        reader.close()
    assert all(len(a) == 2 and a[0] < a[1] for a in areas.values()), areas
    bad = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), extra_resolutions="128, x")
    with pytest.raises(ValueError, match=r"extra_resolutions: 'x' is not a resolution; write resolutions from 64"):
        Run(mod, bad).lazy()


def test_tag_dropout_and_wildcards_encode_only_captions_through_the_node(
        mod: ModuleType, encoders: tuple, kohya: Any, tiny_models: TinyModels, names: tuple[str, str],
        comfy_nodes: ModuleType, pack: ModuleType) -> None:
    """A caption with a wildcard, after a plain run: turning wildcards and tag dropout on loads only CLIP, and the
    sample holds the dropout versions of each combination, each encoded as CLIPTextEncode encodes it. The
    frontend's float (0.25000000000000006) is the rate 0.25. Dropout without shuffles is refused naming both, a
    comma as keep_tokens_separator naming the input."""
    vae, clip = encoders
    img = kohya.images[0]
    img.path.with_suffix(".txt").write_text("ohwx, {red|blue} ball, shiny", encoding="utf-8")
    rel = img.path.relative_to(kohya.root).as_posix()
    base = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"))
    Run(mod, base).queue(vae, clip)
    drawn = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), shuffle_variants=4,
                    keep_tokens=1, tag_dropout=0.25000000000000006, wildcards=True)
    handle, report, asked = Run(mod, drawn).queue(vae, clip)
    assert asked == ["clip"] and _encoded(report)[0] == 0, report
    assert "with tag dropout 0.25" in report and "each combination of a caption line's" in report, report
    reader, samples = handle.open()
    try:
        (sample,) = [s for s in samples if s.source == rel]
        info = reader.datasets()["default"].info["settings"]
        assert info["tag_dropout"] == 0.25 and info["wildcards"] is True
        assert len(sample.captions) == 2 * 4  # two combinations × four versions, repeats kept
        first = reader.read([sample.captions[0]])[0]
    finally:
        reader.close()
    drop_tags = importlib.import_module(f"{pack.__name__}.dataset_cache.captions").drop_tags
    with torch.inference_mode():  # the same text through the same encoder, alone in its batch: the same numbers
        (expected,) = comfy_nodes.CLIPTextEncode().encode(clip, drop_tags("ohwx, red ball, shiny", 4, 1, 0.25)[0])
    assert torch.equal(first[0][0], expected[0][0])
    bad = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), tag_dropout=0.1)
    with pytest.raises(ValueError, match="tag_dropout 0.1 leaves tags out .* shuffle_variants is 0"):
        Run(mod, bad).lazy()
    comma = _prompt(names[0], names[1], tiny_models.name("vae"), tiny_models.name("clip"), keep_tokens_separator=",")
    with pytest.raises(ValueError, match="keep_tokens_separator ',': use a few characters that are no comma"):
        Run(mod, comma).lazy()
