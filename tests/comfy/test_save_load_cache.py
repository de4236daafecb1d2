"""Nodes "Save Streamable Cache" and "Load Lazy Cache" in-process.

Lists come from ComfyUI's real ``MakeTrainingDataset`` (tiny TAESD + CLIP-L); ComfyUI-format dataset folders from
its real ``SaveTrainingDataset``.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.tiny_models import TinyModels


@pytest.fixture(scope="module")
def save_mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.save_cache")


@pytest.fixture(scope="module")
def load_mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.load_cache")


@pytest.fixture(scope="module")
def lib(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.dataset_cache")


@pytest.fixture(scope="module")
def comfy_dataset_nodes(comfy_folders: Path) -> ModuleType:
    return importlib.import_module("comfy_extras.nodes_dataset")


@pytest.fixture(scope="module")
def made(comfy_dataset_nodes: ModuleType, comfy_nodes: ModuleType, tiny_models: TinyModels) -> tuple[list, list]:
    """What MakeTrainingDataset gives for three images (two sizes) and two distinct captions."""
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    gen = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 64, 64, 3, generator=gen), torch.rand(1, 64, 96, 3, generator=gen),
              torch.rand(1, 64, 64, 3, generator=gen)]
    out = comfy_dataset_nodes.MakeTrainingDataset.execute(images=images, vae=[vae], clip=[clip],
                                                          texts=["a cat", "a dog", "a cat"])
    latents, conditioning = out.result
    return latents, conditioning


def _writer(pack: ModuleType) -> Any:
    return importlib.import_module(f"{pack.__name__}.dataset_cache.format.writer").CacheWriter


def _save(save_mod: ModuleType, **inputs: Any) -> tuple[Any, str]:
    """Call the node the way ComfyUI calls an is_input_list node: every input a list."""
    listed = {k: (v if isinstance(v, list) else [v]) for k, v in inputs.items()}
    out = save_mod.SaveCache.execute(**listed)
    (handle,) = out.result
    return handle, out.ui.as_dict()["text"][0]


def _make_cache(pack: ModuleType, root: Path, name: str = "default") -> tuple[list, dict[str, Any]]:
    """A cache with 4 samples in two latent shapes (interleaved) and shared captions."""
    from comfyui_streamcache.dataset_cache.dataset import Sample

    values: dict[str, Any] = {}
    samples = []
    with _writer(pack)(root) as w:
        for i in range(4):
            shape = (1, 4, 8, 8) if i % 2 == 0 else (1, 4, 8, 12)
            lat = {"samples": torch.full(shape, float(i))}
            cond = [[torch.full((1, 77, 768), float(i % 2)), {"pooled_output": torch.zeros(1, 768)}]]
            lk, ck = f"{i:032x}", f"{100 + i % 2:032x}"
            w.add(lk, lat, kind="latent")
            w.add(ck, cond, kind="conditioning")
            values[lk], values[ck] = lat, cond
            samples.append(Sample(lk, (ck,), repeats=1 + i, source=f"img{i}.png"))
        w.set_dataset(name, samples, info={"vae_fingerprint": "v", "text_fingerprint": "t"})
    return samples, values


# ------------------------------------------------------------------------------------------------ SaveCache


def test_save_lists_from_make_training_dataset(save_mod: ModuleType, made: tuple, cache_root: Path) -> None:
    latents, conditioning = made
    before = save_mod.SaveCache.fingerprint_inputs(cache=["saved_lists"], dataset_name=["default"])
    handle, text = _save(save_mod, cache="saved_lists", dataset_name="default", latents=latents,
                         conditioning=conditioning)
    # the node's own write does not count as a change of the cache (ComfyUI keeps its output, and downstream's)
    assert save_mod.SaveCache.fingerprint_inputs(cache=["saved_lists"], dataset_name=["default"]) == before
    assert handle.cache_root == str(cache_root / "saved_lists") and handle.name == "default"
    assert "3 samples" in text and "stored 5 new entries" in text  # 3 latents + 2 distinct captions
    reader, samples = handle.open()
    try:
        assert len(samples) == 3 and samples[0].captions == samples[2].captions
        got = reader.read([s.latent for s in samples])
        for g, want in zip(got, latents):
            assert torch.equal(g["samples"], want["samples"])
        cond = reader.read([samples[1].captions[0]])[0]
        assert torch.equal(cond[0][0], conditioning[1][0][0])
        assert torch.equal(cond[0][1]["pooled_output"], conditioning[1][0][1]["pooled_output"])
    finally:
        reader.close()
    from comfyui_streamcache.nodes.fingerprints import cache_identity

    state = cache_identity(cache_root / "saved_lists", "default")
    _handle, again = _save(save_mod, cache="saved_lists", dataset_name="default", latents=latents,
                           conditioning=conditioning)
    assert "stored 0 new entries" in again
    assert cache_identity(cache_root / "saved_lists", "default") == state  # saving the same again writes nothing


def test_save_splits_batches_and_shares_one_conditioning(save_mod: ModuleType, made: tuple) -> None:
    _latents, conditioning = made
    batch = {"samples": torch.randn(3, 4, 8, 8)}
    handle, text = _save(save_mod, cache="saved_batch", dataset_name="b", latents=[batch],
                         conditioning=[conditioning[0]])
    reader, samples = handle.open()
    try:
        assert len(samples) == 3 and len({s.captions for s in samples}) == 1
        rows = reader.read([s.latent for s in samples])
        for i, row in enumerate(rows):
            assert torch.equal(row["samples"], batch["samples"][i:i + 1])
    finally:
        reader.close()


def test_save_copies_a_dataset_self_contained_in_bucket_order(save_mod: ModuleType, pack: ModuleType,
                                                              cache_root: Path, lib: ModuleType) -> None:
    from comfyui_streamcache.dataset_cache.format.reader import open_cache
    from comfyui_streamcache.nodes.handles import StreamDatasetHandle

    src = cache_root / "copy_source"
    samples, values = _make_cache(pack, src)
    handle, text = _save(save_mod, dataset=StreamDatasetHandle(str(src), "default"), cache="copy_target",
                         dataset_name="copied")
    assert "copied 6 entries" in text and "compacted" in text
    shutil.rmtree(src)  # the copy must not need its source
    reader, got = handle.open()
    try:
        assert got == samples
        assert reader.datasets()["copied"].info["copied_from"]["dataset"] == "default"
        for key, value in zip([s.latent for s in samples], reader.read([s.latent for s in samples])):
            assert torch.equal(value["samples"], values[key]["samples"])
        shapes = [tuple(reader.tensor_shapes(k)["samples"]) for k in reader.keys() if reader.kind(k) == "latent"]
        assert len(set(shapes)) == 2 and shapes[:2] == [shapes[0]] * 2  # the source interleaves the buckets
    finally:
        reader.close()
    assert open_cache(cache_root / "copy_target").stats()["shards"] == 1


def test_save_bad_inputs(save_mod: ModuleType, made: tuple) -> None:
    from comfyui_streamcache.dataset_cache.errors import UnstorableValueError
    from comfyui_streamcache.nodes.handles import StreamDatasetHandle

    latents, conditioning = made
    with pytest.raises(ValueError, match="3 latents but 2 conditionings"):
        _save(save_mod, cache="bad", dataset_name="d", latents=latents, conditioning=conditioning[:2])
    with pytest.raises(ValueError, match="not both"):
        _save(save_mod, cache="bad", dataset_name="d", latents=latents, conditioning=conditioning,
              dataset=StreamDatasetHandle("/nowhere", "default"))
    with pytest.raises(ValueError, match="nothing to save"):
        _save(save_mod, cache="bad", dataset_name="d")
    hooked = [[conditioning[0][0][0], {"pooled_output": conditioning[0][0][1]["pooled_output"],
                                        "hooks": object()}]]
    with pytest.raises(UnstorableValueError, match=r"conditioning\[0\].*hooks"):
        _save(save_mod, cache="bad", dataset_name="d", latents=latents[:1], conditioning=[hooked])
    with pytest.raises(ValueError, match="no StreamCache cache"):
        _save(save_mod, cache="bad", dataset_name="d", dataset=StreamDatasetHandle("/nowhere", "default"))
    node = save_mod.SaveCache
    assert "must not contain '..'" in node.validate_inputs(cache=["../escape"])
    assert node.validate_inputs(cache=["ok"]) is True and node.validate_inputs(cache=[None]) is True
    with pytest.raises(ValueError, match="dataset_name is empty"):
        _save(save_mod, cache="ok", dataset_name=" ", latents=latents, conditioning=conditioning)


# ------------------------------------------------------------------------------------------------ LoadLazyCache


def test_load_lists_caches_and_reads_no_tensor_bytes(load_mod: ModuleType, pack: ModuleType, cache_root: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    shard_files = importlib.import_module(f"{pack.__name__}.dataset_cache.format.shard_files")
    _make_cache(pack, cache_root / "group" / "lazy_one")
    assert "group/lazy_one" in load_mod.list_caches()
    schema = load_mod.LoadLazyCache.define_schema()
    assert "group/lazy_one" in schema.inputs[0].options

    reads: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        reads.append("tensor read")
        raise AssertionError("Load Lazy Cache read tensor bytes")

    monkeypatch.setattr(shard_files.ShardFiles, "read", refuse)  # every batch read of tensor bytes goes here
    counted = {"n": 0}
    real_preadv = os.preadv

    def preadv(*args: Any) -> int:
        counted["n"] += 1
        return real_preadv(*args)

    monkeypatch.setattr(os, "preadv", preadv)
    out = load_mod.LoadLazyCache.execute(cache="group/lazy_one", dataset_name="default")
    handle, info = out.result
    assert reads == [] and counted["n"] == 0
    assert handle.cache_root == str(cache_root / "group" / "lazy_one") and handle.name == "default"
    assert "samples: 4 (10 with repeats)" in info
    assert "1x4x8x8 ×2" in info and "1x4x8x12 ×2" in info
    assert "vae_fingerprint: v" in info
    assert out.ui.as_dict()["text"] == (info,)
    (fields,) = out.ui.as_dict()["streamcache_info"]
    assert fields["samples"] == 4 and fields["buckets"] == {"1x4x8x12": 2, "1x4x8x8": 2} and not fields["problems"]


def test_load_fingerprint_follows_the_cache(load_mod: ModuleType, pack: ModuleType, cache_root: Path) -> None:
    _make_cache(pack, cache_root / "fp_cache")
    node = load_mod.LoadLazyCache
    first = node.fingerprint_inputs(cache="fp_cache", dataset_name="default")
    assert node.fingerprint_inputs(cache="fp_cache", dataset_name="default") == first
    with _writer(pack)(cache_root / "fp_cache") as w:
        w.add("f" * 32, {"samples": torch.ones(1, 4, 8, 8)}, kind="latent")
    assert node.fingerprint_inputs(cache="fp_cache", dataset_name="default") != first


def test_load_bad_inputs(load_mod: ModuleType, pack: ModuleType, cache_root: Path) -> None:
    from comfyui_streamcache.dataset_cache.errors import CacheCorruptError

    node = load_mod.LoadLazyCache
    assert "cache 'nope': unknown cache" in node.validate_inputs(cache="nope")
    assert "must not contain '..'" in node.validate_inputs(cache="../../etc")
    assert "without '..'" in node.validate_inputs(cache="comfy:../x")
    assert "not a ComfyUI SaveTrainingDataset folder" in node.validate_inputs(cache="comfy:nothing")
    assert node.validate_inputs(cache=None) is True
    with pytest.raises(ValueError, match="cache 'nope': unknown cache"):
        node.execute(cache="nope", dataset_name="default")
    _make_cache(pack, cache_root / "broken_cache")
    with pytest.raises(ValueError, match="dataset_name: dataset 'other' is not in the cache"):
        node.execute(cache="broken_cache", dataset_name="other")
    shard = next((cache_root / "broken_cache" / "shards").glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CacheCorruptError, match=shard.name):
        node.execute(cache="broken_cache", dataset_name="default")


def test_load_converts_a_comfyui_dataset_once(load_mod: ModuleType, comfy_dataset_nodes: ModuleType, made: tuple,
                                             cache_root: Path) -> None:
    import folder_paths

    latents, conditioning = made
    comfy_dataset_nodes.SaveTrainingDataset.execute(latents=latents, conditioning=conditioning,
                                                    folder_name=["training_dataset"], shard_size=[2])
    assert "comfy:training_dataset" in load_mod.list_comfy_datasets()
    node = load_mod.LoadLazyCache
    assert node.validate_inputs(cache="comfy:training_dataset") is True
    handle, info = node.execute(cache="comfy:training_dataset", dataset_name="default").result
    assert handle.cache_root == str(cache_root / load_mod.CONVERTED_FOLDER / "training_dataset")
    assert "samples: 3" in info and "(just now)" in info
    reader, samples = handle.open()
    try:
        assert torch.equal(reader.read([samples[1].latent])[0]["samples"], latents[1]["samples"])
    finally:
        reader.close()
    fp = node.fingerprint_inputs(cache="comfy:training_dataset", dataset_name="default")
    _handle, again = node.execute(cache="comfy:training_dataset", dataset_name="default").result
    assert "(earlier)" in again
    assert node.fingerprint_inputs(cache="comfy:training_dataset", dataset_name="default") == fp
    comfy_dataset_nodes.SaveTrainingDataset.execute(latents=latents[:2], conditioning=conditioning[:2],
                                                    folder_name=["training_dataset"], shard_size=[2])
    out_dir = Path(folder_paths.get_output_directory()) / "training_dataset"
    future = os.stat(out_dir / "metadata.json").st_mtime_ns + 5 * 10**9  # mtime resolution can be coarse
    os.utime(out_dir / "metadata.json", ns=(future, future))
    assert node.fingerprint_inputs(cache="comfy:training_dataset", dataset_name="default") != fp
    _handle, third = node.execute(cache="comfy:training_dataset", dataset_name="default").result
    assert "samples: 2" in third and "(just now)" in third
