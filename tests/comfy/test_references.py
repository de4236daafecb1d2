"""Edit models' reference images through the real ComfyUI: Encode Dataset's ``reference_folder`` encodes each
image's reference with the connected VAE (its own encode, at its image's bucket; only what changed, without the text
encoder), and Train LoRA gives a sample's cached reference to the model exactly as ComfyUI's ReferenceLatent node
does (tiny Flux Kontext: the same losses and LoRA as a cache whose conditionings hold the node's output)."""

from __future__ import annotations

import gc
import importlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image
from support.tiny_families import FAMILIES, save_family_model, save_taesd16
from support.tiny_models import TinyModels

from .test_encode_dataset import Run, _encoded, _prompt
from .test_families import TRAIN


def _pixels(path: Path, size: tuple[int, int], seed: int) -> torch.Tensor:
    arr = (torch.rand(size[1], size[0], 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8)
    Image.fromarray(arr.numpy()).save(path)
    return arr.float()[None] / 255


@pytest.fixture
def folders(comfy_folders: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    import folder_paths

    base = Path(folder_paths.get_input_directory()) / f"edit_{request.node.name[:40]}"
    data, refs = base.with_name(base.name + "_data"), base.with_name(base.name + "_refs")
    data.mkdir()
    refs.mkdir()
    yield data, refs
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(refs, ignore_errors=True)


def test_encode_dataset_encodes_each_reference_with_the_vae_once(
        pack: ModuleType, comfy_nodes: ModuleType, tiny_models: TinyModels, folders: tuple[Path, Path],
        tmp_path: Path) -> None:
    import folder_paths

    data, refs = folders
    folder_paths.add_model_folder_path("vae", str(tmp_path))
    vae_name = save_taesd16(tmp_path).name
    (vae,) = comfy_nodes.VAELoader().load_vae(vae_name)
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    mod = importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")
    for i, stem in enumerate("ab"):
        _pixels(data / f"{stem}.png", (64, 64), i)
        (data / f"{stem}.txt").write_text(f"make it {stem}", encoding="utf-8")
    ref_a = _pixels(refs / "a.png", (64, 64), 10)
    _pixels(refs / "b.png", (96, 64), 11)  # another size: fitted to b's bucket
    run = Run(mod, _prompt(data.name, f"cache_{data.name}", vae_name, tiny_models.name("clip"),
                           reference_folder=refs.name))
    handle, report, asked = run.queue(vae, clip)
    assert sorted(asked) == ["clip", "vae"] and _encoded(report) == (4, 2), report
    assert "reference images: 2 encoded, 2 in the dataset (2 of 2 samples with one)" in report
    reader, samples = handle.open()
    try:
        by_source = {s.source: s for s in samples}
        lat_a, got_a, lat_b, got_b = (v["samples"] for v in reader.read(
            [by_source["a.png"].latent, by_source["a.png"].reference, by_source["b.png"].latent,
             by_source["b.png"].reference]))
    finally:
        reader.close()
    with torch.inference_mode():
        alone = vae.encode(ref_a)
    torch.testing.assert_close(got_a, alone.to(got_a.dtype), rtol=1e-3, atol=1e-4)  # the VAE's own encode
    assert got_a.shape == lat_a.shape == got_b.shape == lat_b.shape == (1, 16, 8, 8)
    assert not torch.equal(got_a, lat_a)

    again = Run(mod, _prompt(data.name, f"cache_{data.name}", vae_name, tiny_models.name("clip"),
                             reference_folder=refs.name))
    before = run.fingerprint()
    assert again.lazy() == [] and again.fingerprint() == before  # nothing changed: nothing loads
    _pixels(refs / "a.png", (64, 64), 99)
    assert again.fingerprint() != before  # an edited reference makes the node run again
    assert again.lazy() == ["vae"]  # the reference alone: the text encoder stays unloaded
    _handle, report, asked = again.queue(vae, None)
    assert asked == ["vae"] and _encoded(report) == (1, 0), report


@pytest.fixture(scope="module")
def kontext(comfy_nodes: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import folder_paths

    fam = FAMILIES["flux_kontext"]
    folder = tmp_path_factory.mktemp("kontext")
    path = save_family_model(fam, folder)
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    (model,) = comfy_nodes.UNETLoader().load_unet(path.name, "default")
    yield model
    del model
    gc.collect()


def _cache(pack: ModuleType, root: Path, latents: list[torch.Tensor], conditionings: list[list],
           references: list[torch.Tensor] | None) -> tuple[Any, list[Any]]:
    """A cache of one sample per latent; each sample's reference a latent entry of its own when given."""
    writer_mod = importlib.import_module(f"{pack.__name__}.dataset_cache.format.writer")
    sample_cls = importlib.import_module(f"{pack.__name__}.dataset_cache.dataset").Sample
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, (latent, cond) in enumerate(zip(latents, conditionings)):
            writer.add(f"{i:032x}", {"samples": latent}, kind="latent")
            writer.add(f"{i + 100:032x}", cond, kind="conditioning")
            ref = None
            if references is not None:
                ref = f"{i + 200:032x}"
                writer.add(ref, {"samples": references[i]}, kind="latent")
            samples.append(sample_cls(f"{i:032x}", (f"{i + 100:032x}",), source=f"img{i}.png", reference=ref))
        writer.set_dataset("train", samples)
    handle = importlib.import_module(f"{pack.__name__}.nodes.handles").StreamDatasetHandle(str(root), "train")
    return handle.open()


def test_a_cached_reference_trains_as_comfyuis_reference_latent_node(
        pack: ModuleType, kontext: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from comfy_extras.nodes_edit_model import ReferenceLatent

    fam = FAMILIES["flux_kontext"]
    training = importlib.import_module(f"{pack.__name__}.nodes.training")
    gen = torch.Generator().manual_seed(5)
    latents = [torch.randn(fam.latent, generator=gen) for _ in range(2)]
    references = [torch.randn(fam.latent, generator=gen) for _ in range(2)]
    plain = [[[c[0][0], {k: v for k, v in c[0][1].items() if k != "reference_latents"}]]
             for c in (fam.conditioning(gen, 12) for _ in range(2))]
    # ComfyUI's own node sets each caption's reference (what a graph with "Set Reference Latent" trains)
    theirs = [ReferenceLatent.execute(conditioning=c, latent={"samples": r}).result[0]
              for c, r in zip(plain, references)]
    settings = training.TrainSettings(**{**{k: v for k, v in {**TRAIN, **fam.train}.items()
                                            if k in training.TrainSettings.__dataclass_fields__},
                                         "batch_size": 2, "steps": 2, "optimizer": "SGD", "learning_rate": 0.5})
    results = []
    probe = importlib.import_module(f"{pack.__name__}.nodes.training.probe")
    for name, conds, refs in (("node", theirs, None), ("cache", plain, references)):
        reader, samples = _cache(pack, tmp_path / name, latents, conds, refs)
        try:
            # the memory plan measures a batch with the sample's reference: an edit model reads it as more tokens
            _shape, probed = probe.probe_inputs(reader, samples, [fam.latent[1:]] * 2, 2)
            assert torch.equal(probed[0][1]["reference_latents"][-1], references[0])
            with caplog.at_level("WARNING"), torch.inference_mode():
                caplog.clear()
                results.append(training.train_lora(kontext, reader, samples, settings))
            assert "memory probe failed" not in caplog.text
        finally:
            reader.close()
    node, cache = results
    assert not any("reference" in n for n in cache.notes)  # Flux Kontext reads them
    assert node.losses == cache.losses and len(cache.losses) == 2
    assert list(node.lora) == list(cache.lora)
    for key in node.lora:
        assert torch.equal(node.lora[key], cache.lora[key]), key
    # and the reference matters: without it the model computes something else
    reader, samples = _cache(pack, tmp_path / "none", latents, plain, None)
    try:
        with torch.inference_mode():
            without = training.train_lora(kontext, reader, samples, settings)
    finally:
        reader.close()
    assert without.losses[0] != cache.losses[0]


def test_a_model_that_reads_no_reference_says_so(pack: ModuleType, models: tuple[Any, Any, Any],
                                                 tmp_path: Path) -> None:
    """SD1.5 has no reference input: the references are passed and ignored, and the summary's notes say so."""
    model = models[0]
    training = importlib.import_module(f"{pack.__name__}.nodes.training")
    gen = torch.Generator().manual_seed(6)
    latents = [torch.randn(1, 4, 8, 8, generator=gen) for _ in range(2)]
    conds = [[[torch.randn(1, 77, 768, generator=gen), {}]] for _ in range(2)]
    reader, samples = _cache(pack, tmp_path / "sd15", latents, conds, [torch.randn(1, 4, 8, 8) for _ in range(2)])
    settings = training.TrainSettings(**{**{k: v for k, v in TRAIN.items()
                                            if k in training.TrainSettings.__dataclass_fields__}, "steps": 1})
    try:
        with torch.inference_mode():
            result = training.train_lora(model, reader, samples, settings)
    finally:
        reader.close()
    (note,) = [n for n in result.notes if "reference" in n]
    assert note.startswith("2 sample(s) have a reference image") and "reads no reference latents" in note
    assert result.rows.describe() == "rows: 1 trained, 1 with a reference image"  # batch 1, 1 step


def test_the_reference_input_lists_input_folders_and_refuses_a_path_out_of_them(
        pack: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dropdown led by ``none`` (the input directory's folders, like ``folder``); a text field while absolute
    folders are allowed; a value leaving the input directory refused naming the input, before any plan."""
    import folder_paths
    from comfy_api.latest import io

    mod = importlib.import_module(f"{pack.__name__}.nodes.encode_dataset")
    base = tmp_path / "input"
    (base / "before").mkdir(parents=True)
    (base / "after").mkdir()
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(base))
    monkeypatch.delenv(mod.ALLOW_ABSOLUTE_ENV, raising=False)

    def reference_input() -> Any:
        (found,) = [i for i in mod.EncodeDataset.define_schema().inputs if i.id == "reference_folder"]
        return found

    found = reference_input()
    assert isinstance(found, io.Combo.Input) and found.options == ["none", "after", "before"]
    assert found.default == "none" and found.optional
    settings = dict(resolution=64, bucket_step=32, crop="center", caption_prefix="", caption_suffix="", batch_size=2,
                    on_failure="skip")
    assert mod._settings(**settings).reference_folder == ""  # an old prompt: no references
    assert mod._settings(**settings, reference_folder="none").reference_folder == ""
    assert mod._settings(**settings, reference_folder="before").reference_folder == str(base / "before")
    for bad in ("../elsewhere", str(tmp_path)):
        with pytest.raises(ValueError, match="reference_folder: "):
            mod._settings(**settings, reference_folder=bad)
    monkeypatch.setenv(mod.ALLOW_ABSOLUTE_ENV, "1")
    found = reference_input()
    assert isinstance(found, io.String.Input) and found.default == ""
    assert mod._settings(**settings, reference_folder=str(tmp_path)).reference_folder == str(tmp_path)
