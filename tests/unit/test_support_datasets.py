"""The kohya-layout generator in tests/support produces what the other tests rely on."""

from __future__ import annotations

from pathlib import Path

from PIL import Image
from support.datasets import MULTILINE_CAPTION, SHARED_CAPTION, make_kohya_folder


def test_layout_repeats_captions_and_sizes(tmp_path: Path) -> None:
    folder = make_kohya_folder(tmp_path / "set")
    subdirs = sorted(p.name for p in folder.root.iterdir())
    assert subdirs == ["10_red", "2_blue"]
    assert len(folder.sizes) >= 2, "at least two aspect ratios"
    assert folder.captions.count(SHARED_CAPTION) >= 2, "some identical captions"
    assert MULTILINE_CAPTION in folder.captions and "\n" in MULTILINE_CAPTION
    for img in folder.images:
        assert img.path.with_suffix(".txt").read_text(encoding="utf-8") == img.caption
        assert int(img.path.parent.name.split("_")[0]) == img.repeats
        with Image.open(img.path) as im:
            assert im.size == img.size


def test_deterministic_and_distinct(tmp_path: Path) -> None:
    a = make_kohya_folder(tmp_path / "a")
    b = make_kohya_folder(tmp_path / "b")
    bytes_a = [p.path.read_bytes() for p in a.images]
    assert bytes_a == [p.path.read_bytes() for p in b.images]
    assert len(set(bytes_a)) == len(bytes_a)
