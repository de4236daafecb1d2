"""``missing_caption``: what a source without a caption file is captioned with (``dataset_cache.missing_captions``),
and its place in the content-addressed encode: a changed setting encodes only the new caption texts, never a latent.

Encoders are the counting fakes of ``support.fake_encoders``; folders are small and written here with Pillow.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.errors import DatasetFolderError
from dataset_cache.format.reader import open_cache
from dataset_cache.keys import conditioning_key
from dataset_cache.missing_captions import fill_missing_captions, missing_caption_line
from dataset_cache.scan import scan_folder
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)


def _image(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB").save(path)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """A kohya DreamBooth-style folder: ``10_ohwx woman/`` with an uncaptioned image, one with a caption and one
    with an empty caption file; ``2_style/`` with an uncaptioned image; ``loose.png`` at the top, uncaptioned."""
    root = tmp_path / "data"
    _image(root / "10_ohwx woman" / "a.png", 0)
    _image(root / "10_ohwx woman" / "b.png", 1)
    (root / "10_ohwx woman" / "b.txt").write_text("a photo of ohwx woman smiling", encoding="utf-8")
    _image(root / "10_ohwx woman" / "c.png", 2)
    (root / "10_ohwx woman" / "c.txt").write_text("", encoding="utf-8")
    _image(root / "2_style" / "deep" / "red car.png", 3)
    _image(root / "loose.png", 4)
    age(root)
    return root


def _plan(folder: Path, cache: Path, settings: EncodeSettings) -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1",
                       text_fingerprint="te-1")


def _captions(plan: Any) -> dict[str, tuple[str, ...]]:
    return {s.source: s.captions for s in plan.samples}


@pytest.mark.parametrize(("relpath", "mode", "line"), [
    ("10_ohwx woman/a.png", "folder name", "ohwx woman"),
    ("2_style/deep/red car.png", "folder name", "style"),  # the repeats folder, at any depth below it
    ("loose.png", "folder name", None),  # in no repeats folder
    ("photos/a.png", "folder name", None),  # a folder not named <repeats>_<name>
    ("10_ohwx woman/a.png", "file name", "a"),
    ("2_style/deep/red car.png", "file name", "red car"),
    ("clips/walk.frames", "file name", "walk"),
    ("clips/walk.mp4", "file name", "walk"),
    ("10_ohwx woman/a.png", "empty", None),
])
def test_the_line_of_a_source_without_a_caption_file(relpath: str, mode: str, line: str | None) -> None:
    assert missing_caption_line(relpath, mode) == line


def test_only_missing_caption_files_are_filled_in(folder: Path) -> None:
    scan = scan_folder(folder)
    filled, notes = fill_missing_captions(scan, "folder name")
    got = {i.relpath: i.captions for i in filled.images}
    assert got == {"10_ohwx woman/a.png": ("ohwx woman",), "10_ohwx woman/b.png": ("a photo of ohwx woman smiling",),
                   "10_ohwx woman/c.png": ("",),  # an empty caption file was written on purpose
                   "2_style/deep/red car.png": ("style",), "loose.png": ("",)}
    assert notes == ("1 source(s) without a caption file are in no kohya <repeats>_<name> folder, so "
                     "missing_caption 'folder name' leaves them the empty prompt ('loose.png')",)
    with pytest.raises(ValueError, match="missing_caption must be one of empty, folder name, file name"):
        fill_missing_captions(scan, "folder")


def test_the_default_keeps_the_empty_prompt_and_points_kohya_folders_to_the_setting(folder: Path,
                                                                                 tmp_path: Path) -> None:
    plan = _plan(folder, tmp_path / "cache", BASE)
    assert _captions(plan)["10_ohwx woman/a.png"] == (conditioning_key("", "te-1"),)
    (note,) = [n for n in plan.notes if "kohya" in n]
    assert note == ("2 source(s) in kohya <repeats>_<name> folders have no caption file and train with the empty "
                    "prompt ('10_ohwx woman/a.png', '2_style/deep/red car.png'); missing_caption 'folder name' "
                    "captions them with their folder's name, as kohya does")


def test_a_changed_setting_encodes_the_new_captions_only_and_prefix_and_suffix_apply(folder: Path,
                                                                                   tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    enc = FakeEncoders()
    run_encode(_plan(folder, cache, BASE), **enc.kw())
    assert enc.images == 5
    settings = replace(BASE, missing_caption="folder name", caption_suffix=", photo")
    enc = FakeEncoders()
    report = run_encode(_plan(folder, cache, settings), **enc.kw())
    assert enc.images == 0 and report.encoded_latents == 0  # the latents are the same entries
    assert sorted(enc.texts) == sorted({"ohwx woman, photo", "a photo of ohwx woman smiling, photo", ", photo",
                                        "style, photo"})
    with open_cache(cache) as reader:
        stored = {s.source: s.captions for s in reader.dataset("ds")}
        assert reader.datasets()["ds"].info["settings"]["missing_caption"] == "folder name"
    assert stored["10_ohwx woman/a.png"] == (conditioning_key("ohwx woman, photo", "te-1"),)
    assert stored["loose.png"] == (conditioning_key(", photo", "te-1"),)
    again = _plan(folder, cache, settings)
    assert again.up_to_date and again.dataset_current
    # file names: only the sources without a caption file change again
    enc = FakeEncoders()
    run_encode(_plan(folder, cache, replace(BASE, missing_caption="file name")), **enc.kw())
    assert enc.images == 0 and sorted(enc.texts) == ["a", "loose", "red car"]


def test_datasets_encoded_before_the_setting_stay_current_and_a_sourceless_one_refuses_another(
        folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run_encode(_plan(folder, cache, BASE), **FakeEncoders().kw())
    with open_cache(cache) as reader:
        assert "missing_caption" not in reader.datasets()["ds"].info["settings"]  # the default is not written
    folder.rename(tmp_path / "gone")
    assert _plan(folder, cache, BASE).sourceless
    with pytest.raises(DatasetFolderError, match="encoded with other"):
        _plan(folder, cache, replace(BASE, missing_caption="folder name"))


def test_an_unknown_mode_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="EncodeSettings.missing_caption must be one of"):
        replace(BASE, missing_caption="filename")
