"""Encode Dataset's reference images (edit models: Flux Kontext, Qwen-Image-Edit): a second folder whose images are
found by their training image's name, encoded at its bucket and crop, mirrored with it, keyed by content (an edited
reference re-encodes that reference alone), named in the report when missing or unused, and refused by name when
they cannot be told apart or the folders nest.

Encoders are the counting fakes of ``support.fake_encoders`` (latent = 8x average-pooled image).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dataset_cache import clean
from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_plan import plan_encode, reference_record_path
from dataset_cache.encode_run import run_encode
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.errors import DatasetFolderError
from dataset_cache.format.dataset_file import DATASET_VERSION_REFERENCES
from dataset_cache.format.reader import open_cache
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)


def _image(path: Path, size: tuple[int, int], seed: int) -> np.ndarray:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr, "RGB").save(path)
    return arr


@pytest.fixture()
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """``data``: a, b, c (64×64) with captions; ``refs``: a.png (64×64), b.jpg (96×64), no c."""
    data, refs = tmp_path / "data", tmp_path / "refs"
    data.mkdir()
    refs.mkdir()
    for i, stem in enumerate("abc"):
        _image(data / f"{stem}.png", (64, 64), i)
        (data / f"{stem}.txt").write_text(f"make it {stem}", encoding="utf-8")
    _image(refs / "a.png", (64, 64), 10)
    _image(refs / "b.jpg", (96, 64), 11)
    age(data)
    age(refs)
    return data, refs


def _settings(refs: Path, base: EncodeSettings = BASE) -> EncodeSettings:
    return replace(base, reference_folder=str(refs))


def _plan(data: Path, cache: Path, settings: EncodeSettings) -> Any:
    return plan_encode(data, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1", text_fingerprint="te-1")


def _build(data: Path, cache: Path, settings: EncodeSettings) -> tuple[Any, FakeEncoders]:
    enc = FakeEncoders()
    return run_encode(_plan(data, cache, settings), **enc.kw()), enc


def _stored(cache: Path) -> dict[str, Any]:
    with open_cache(cache) as reader:
        return {s.source: s for s in reader.dataset("ds")}


def test_each_image_gets_its_reference_at_its_own_latent_size(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    report, enc = _build(data, cache, _settings(refs))
    assert enc.images == 3 + 2 and report.encoded_references == 2
    stored = _stored(cache)
    assert stored["c.png"].reference is None and stored["a.png"].reference_mirror is None
    with open_cache(cache) as reader:
        for name in ("a.png", "b.png"):
            lat, ref = reader.read([stored[name].latent, stored[name].reference])
            assert ref["samples"].shape == lat["samples"].shape  # b.jpg (96×64) was fitted to b.png's bucket
        # a.png's reference has its image's size: the same crop, so its latent is the fake VAE's of its pixels
        (ref_a,) = reader.read([stored["a.png"].reference])
        pixels = torch.from_numpy(np.asarray(Image.open(refs / "a.png"), dtype=np.float32) / 255)
        want = torch.nn.functional.avg_pool2d(pixels.permute(2, 0, 1)[None], 8)
        assert torch.allclose(ref_a["samples"][:, :3], want, atol=1e-6)
        record = reader.datasets()["ds"]
    assert record.info["settings"]["reference_folder"] == str(refs)
    raw = next((cache / "datasets").iterdir()).read_text()
    assert f'"version":{DATASET_VERSION_REFERENCES}' in raw
    assert "reference images: 2 encoded, 2 in the dataset (2 of 3 samples with one)" in report.summary()
    plan = _plan(data, cache, _settings(refs))
    assert plan.up_to_date and not plan.needs_vae
    assert any("1 image(s) have no reference image" in n and "c.png" in n for n in plan.notes)


def test_an_edited_reference_encodes_that_reference_alone(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    _build(data, cache, _settings(refs))
    before = _stored(cache)
    _image(refs / "a.png", (64, 64), 99)
    plan = _plan(data, cache, _settings(refs))
    assert plan.latent_count == 1 and not plan.missing_conditionings
    assert all(j.reference for jobs in plan.missing_latents.values() for j in jobs)
    assert (plan.new, plan.changed) == (0, 0)  # the dataset folder's own counts: nothing changed there
    report, enc = run_encode(plan, **(enc := FakeEncoders()).kw()), enc
    assert enc.images == 1 and enc.texts == [] and report.encoded_references == 1
    after = _stored(cache)
    assert after["a.png"].reference != before["a.png"].reference
    assert {k: (v.latent, v.captions) for k, v in after.items()} == {k: (v.latent, v.captions)
                                                                     for k, v in before.items()}
    assert after["b.png"].reference == before["b.png"].reference
    # a new reference for c: one latent more, no text
    _image(refs / "c.webp", (64, 64), 12)
    assert _plan(data, cache, _settings(refs)).latent_count == 1


def test_turning_references_on_and_off_encodes_only_references(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    _build(data, cache, BASE)
    plan = _plan(data, cache, _settings(refs))
    assert plan.latent_count == 2 and not plan.missing_conditionings and not plan.dataset_current
    run_encode(plan, **FakeEncoders().kw())
    off = _plan(data, cache, BASE)
    assert off.latent_count == 0 and all(s.reference is None for s in off.samples) and not off.dataset_current


def test_mirrors_pair_with_mirrored_references(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    settings = _settings(refs, replace(BASE, bucket=replace(BASE.bucket, flip="random")))
    report, enc = _build(data, cache, settings)
    assert enc.images == 3 * 2 + 2 * 2 and report.encoded_references == 4 and report.encoded_mirrors == 3
    assert "mirrors: 3 encoded, 3 in the dataset" in report.summary()
    assert "reference images: 4 encoded, 4 in the dataset (2 of 3 samples with one)" in report.summary()
    stored = _stored(cache)
    assert stored["c.png"].reference_mirror is None
    with open_cache(cache) as reader:
        ref, mirrored = reader.read([stored["a.png"].reference, stored["a.png"].reference_mirror])
    assert torch.allclose(ref["samples"].flip(-1), mirrored["samples"], atol=1e-6)


def test_flip_always_stores_the_reference_mirrored_too(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    plain = _plan(data, cache, _settings(refs))
    always = _plan(data, cache, _settings(refs, replace(BASE, bucket=replace(BASE.bucket, flip="always"))))
    jobs = {j.key: j for js in always.missing_latents.values() for j in js}
    a = next(s for s in always.samples if s.source == "a.png")
    assert jobs[a.reference].plan.flip and jobs[a.latent].plan.flip
    assert a.reference not in {s.reference for s in plain.samples}


def test_a_random_crop_crops_a_same_size_reference_as_its_image(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    _image(data / "wide.png", (160, 64), 5)
    _image(refs / "wide.png", (160, 64), 6)
    age(data)
    age(refs)
    settings = _settings(refs, replace(BASE, bucket=replace(BASE.bucket, crop="random", seed=7)))
    plan = _plan(data, tmp_path / "cache", settings)
    jobs = {j.key: j for js in plan.missing_latents.values() for j in js}
    wide = next(s for s in plan.samples if s.source == "wide.png")
    assert jobs[wide.latent].plan.crop != (0, 0, *jobs[wide.latent].plan.bucket)  # really a random crop
    assert jobs[wide.reference].plan == jobs[wide.latent].plan


def test_kohya_subfolders_find_references_mirrored_or_at_the_top(tmp_path: Path) -> None:
    data, refs = tmp_path / "data", tmp_path / "refs"
    (data / "2_cats").mkdir(parents=True)
    (refs / "2_cats").mkdir(parents=True)
    for stem in ("x", "y"):
        _image(data / "2_cats" / f"{stem}.png", (64, 64), ord(stem))
    _image(refs / "2_cats" / "x.png", (64, 64), 1)
    _image(refs / "y.png", (64, 64), 2)
    plan = _plan(data, tmp_path / "cache", _settings(refs))
    jobs = {j.key: j for js in plan.missing_latents.values() for j in js}
    got = {s.source: jobs[s.reference].path for s in plan.samples}
    assert got == {"2_cats/x.png": str(refs / "2_cats" / "x.png"), "2_cats/y.png": str(refs / "y.png")}


def test_two_references_of_one_name_leave_the_image_out_by_name(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    _image(refs / "a.jpg", (64, 64), 13)
    plan = _plan(data, tmp_path / "cache", _settings(refs))
    assert {s.source for s in plan.samples} == {"b.png", "c.png"}
    (failure,) = [f for f in plan.failures if f.relpath == "a.png"]
    assert "2 reference images have its name" in failure.reason and "refs/a.jpg" in failure.reason


def test_a_bad_caption_file_in_the_reference_folder_is_not_a_reference(folders: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    data, refs = folders
    (refs / "a.txt").write_bytes(b"\xff\xfe not utf-8 \xc3")  # the reference folder's captions are not read
    plan = _plan(data, tmp_path / "cache", _settings(refs))
    assert {s.source for s in plan.samples} == {"a.png", "b.png", "c.png"} and plan.failures == ()
    assert next(s for s in plan.samples if s.source == "a.png").reference is not None


def test_unused_references_are_noted(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    _image(refs / "zzz.png", (64, 64), 14)
    plan = _plan(data, tmp_path / "cache", _settings(refs))
    assert any("1 reference image(s) are the reference of no image" in n and "refs/zzz.png" in n for n in plan.notes)


def test_a_reference_folder_without_images_is_refused_by_name(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, _refs = folders
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not an image", encoding="utf-8")
    with pytest.raises(DatasetFolderError, match="reference_folder holds no image"):
        _plan(data, tmp_path / "cache", _settings(empty))


@pytest.mark.parametrize("where", ["missing", "same", "inside", "outside"])
def test_a_reference_folder_nested_with_the_dataset_or_missing_is_refused(folders: tuple[Path, Path],
                                                                         tmp_path: Path, where: str) -> None:
    data, _refs = folders
    target = {"missing": tmp_path / "nope", "same": data, "inside": data / "refs", "outside": tmp_path}[where]
    if where == "inside":
        target.mkdir()
    cache = tmp_path / "elsewhere" / "cache"
    with pytest.raises(DatasetFolderError, match="reference_folder"):
        _plan(data, cache, _settings(target))
    assert not reference_record_path(cache, "ds").exists()  # nothing written for a refused folder


def test_an_unreadable_reference_leaves_its_image_out_by_name(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    (refs / "b.jpg").unlink()
    os.symlink(tmp_path / "data" / "b.png", refs / "b.jpg")  # a link out of the reference folder is never read
    plan = _plan(data, tmp_path / "cache", _settings(refs))
    assert {s.source for s in plan.samples} == {"a.png", "c.png"}  # never trained without the image it edits
    assert any(f.relpath == "refs/b.jpg" for f in plan.failures)
    (left_out,) = [f for f in plan.failures if f.relpath == "b.png"]
    assert "its reference refs/b.jpg cannot be read" in left_out.reason


def test_a_reference_corrupt_after_its_header_is_a_named_encode_failure(folders: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """The reference decodes only when encoded: a cut file fails there, named; its image is left out of the
    dataset (never trained without the image it edits), the others are stored and the cache verifies."""
    data, refs = folders
    raw = (refs / "a.png").read_bytes()
    (refs / "a.png").write_bytes(raw[: len(raw) // 2])  # header intact, pixels cut
    age(refs)
    cache = tmp_path / "cache"
    report, _enc = _build(data, cache, _settings(refs))
    (failure,) = report.failures
    assert failure.relpath == "refs/a.png" and failure.path == str(refs / "a.png")
    assert sorted(_stored(cache)) == ["b.png", "c.png"] and report.skipped == 1
    with open_cache(cache) as reader:
        assert reader.verify() == []


def test_references_survive_the_folder_going_away_and_clean(folders: tuple[Path, Path], tmp_path: Path) -> None:
    data, refs = folders
    cache = tmp_path / "cache"
    _build(data, cache, _settings(refs))
    before = _stored(cache)
    record = reference_record_path(cache, "ds")
    assert record.is_file()
    clean(cache)
    assert record.is_file()  # the reference folder's record is the dataset's: clean keeps it
    gone = data.rename(tmp_path / "moved")
    plan = _plan(data, cache, _settings(refs))
    assert plan.sourceless and {s.source: s for s in plan.samples} == before
    with pytest.raises(DatasetFolderError, match="references"):
        _plan(data, cache, BASE)  # encoded with references: served only as it was
    assert gone.exists()
