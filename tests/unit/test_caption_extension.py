"""``caption_extension``: captions read from ``<stem>.caption`` (kohya's ``caption_extension``) instead of ``.txt``,
through the listing, the sources record and the encode plan."""

from __future__ import annotations

import os
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
from dataset_cache.format.reader import open_cache
from dataset_cache.keys import conditioning_key
from dataset_cache.listing import check_caption_extension, list_folder
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)
CAPTION = replace(BASE, caption_extension=".caption")


def _folder(root: Path) -> Path:
    """Three images: ``a`` with a ``.txt`` and a ``.caption`` caption, ``b`` with a ``.caption`` one only (written
    ``.CAPTION``), ``c`` with a ``.txt`` one only."""
    root.mkdir()
    for i, stem in enumerate(("a", "b", "c")):
        arr = np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(arr, "RGB").save(root / f"{stem}.png")
    (root / "a.txt").write_text("tags of a", encoding="utf-8")
    (root / "a.caption").write_text("a sentence about a", encoding="utf-8")
    (root / "b.CAPTION").write_text("a sentence about b", encoding="utf-8")
    (root / "c.txt").write_text("tags of c", encoding="utf-8")
    age(root)
    return root


def _captions(cache: Path) -> dict[str, Any]:
    """Each source's caption keys, as the texts they key."""
    with open_cache(cache) as reader:
        return {s.source: s.captions for s in reader.dataset("ds")}


def _keys(*texts: str) -> tuple[str, ...]:
    return tuple(conditioning_key(text, "te-1") for text in texts)


def test_the_listing_pairs_each_image_with_the_named_extensions_caption(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "data")
    by_txt = {i.relpath: i.caption_relpath for i in list_folder(folder).images}
    assert by_txt == {"a.png": "a.txt", "b.png": None, "c.png": "c.txt"}
    by_caption = {i.relpath: i.caption_relpath for i in list_folder(folder, caption_extension=".caption").images}
    assert by_caption == {"a.png": "a.caption", "b.png": "b.CAPTION", "c.png": None}
    assert {i.relpath: i.caption_relpath for i in list_folder(folder, caption_extension="CAPTION").images} == by_caption


@pytest.mark.parametrize(("given", "expected"), [(".txt", ".txt"), ("caption", ".caption"), (" .Caption ", ".caption"),
                                                 (".tags-v2", ".tags-v2")])
def test_an_extension_is_lowercased_and_given_its_dot(given: str, expected: str) -> None:
    assert check_caption_extension(given) == expected


@pytest.mark.parametrize(("given", "message"), [
    ("", "caption_extension must be a file extension such as '.txt' or '.caption'"),
    ("../x", "caption_extension must be a file extension"),
    (".a b", "caption_extension must be a file extension"),
    (".x" * 10, "caption_extension must be a file extension"),
    (None, "caption_extension must be a file extension"),
    (".PNG", "caption_extension '.png' is the extension of images, videos or clip folders"),
    (".mp4", "caption_extension '.mp4' is the extension of images, videos or clip folders"),
    (".frames", "caption_extension '.frames' is the extension of images, videos or clip folders"),
])
def test_a_bad_extension_is_refused_naming_the_field(given: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_caption_extension(given)
    with pytest.raises(ValueError, match="caption_extension"):
        list_folder(os.curdir, caption_extension=given)


def test_settings_hold_the_extension_as_the_listing_compares_it() -> None:
    with pytest.raises(ValueError, match="EncodeSettings.caption_extension must be lowercase with its dot, such as "
                                         "'.caption'"):
        replace(BASE, caption_extension="Caption")
    assert "caption_extension" not in BASE.describe()  # a dataset encoded with .txt describes what it did before
    assert CAPTION.describe()["caption_extension"] == ".caption"


def test_an_encode_reads_the_named_captions_and_switching_encodes_only_new_texts(tmp_path: Path) -> None:
    """With ``.caption`` the cache holds those captions (``c``, without one, the empty caption); switching back to
    ``.txt`` re-reads the captions (their files are other sources) and encodes only the texts not yet cached, never
    a latent again."""
    folder, cache = _folder(tmp_path / "data"), tmp_path / "cache"
    enc = FakeEncoders()
    run_encode(plan_encode(folder, cache, dataset="ds", settings=CAPTION, vae_fingerprint="vae-1",
                           text_fingerprint="te-1"), **enc.kw())
    assert _captions(cache) == {"a.png": _keys("a sentence about a"), "b.png": _keys("a sentence about b"),
                                "c.png": _keys("")}
    again = FakeEncoders()
    plan = plan_encode(folder, cache, dataset="ds", settings=BASE, vae_fingerprint="vae-1", text_fingerprint="te-1")
    run_encode(plan, **again.kw())
    assert _captions(cache) == {"a.png": _keys("tags of a"), "b.png": _keys(""), "c.png": _keys("tags of c")}
    assert enc.images == 3 and again.images == 0
    assert sorted(again.texts) == ["tags of a", "tags of c"]
