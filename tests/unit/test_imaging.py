"""Tests of dataset_cache.imaging: header sizes, decode, orientation, resize/crop to a plan, errors."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dataset_cache.buckets import BucketConfig, CropPlan
from dataset_cache.errors import SourceError
from dataset_cache.imaging import decode_image, exif_orientation, load_image, read_image_size

CFG = BucketConfig(resolution=64, step=16, min_side=32, max_side=128)


def _save(path: Path, img: Image.Image, fmt: str, orientation: int | None = None) -> Path:
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    img.save(path, fmt, **kwargs)
    return path


def _marked(size: tuple[int, int]) -> Image.Image:
    """Black image with a white top-left quadrant: shows where orientation moved it."""
    img = Image.new("RGB", size, "black")
    img.paste((255, 255, 255), (0, 0, size[0] // 2, size[1] // 2))
    return img


def _plan(path: Path) -> CropPlan:
    w, h = read_image_size(path)
    return CFG.plan(w, h)


@pytest.mark.parametrize("fmt,ext", [("PNG", "png"), ("JPEG", "jpg"), ("WEBP", "webp"), ("BMP", "bmp"),
                                     ("TIFF", "tif")])
def test_load_image_returns_comfy_layout(tmp_path: Path, fmt: str, ext: str) -> None:
    p = _save(tmp_path / f"i.{ext}", _marked((96, 48)), fmt)
    plan = _plan(p)
    t = load_image(p, plan)
    assert t.dtype == torch.float32 and t.shape == (plan.bucket[1], plan.bucket[0], 3)
    assert 0.0 <= float(t.min()) and float(t.max()) <= 1.0
    assert t.is_contiguous()


def test_pixels_follow_the_plan(tmp_path: Path) -> None:
    p = _save(tmp_path / "i.png", _marked((64, 64)), "PNG")
    plan = CropPlan(source=(64, 64), bucket=(32, 32), resize=(64, 64), crop=(0, 0, 32, 32), method="nearest")
    t = load_image(p, plan)
    assert torch.all(t == 1.0)  # the white quadrant, untouched
    flipped = CropPlan(source=(64, 64), bucket=(64, 32), resize=(64, 64), crop=(0, 0, 64, 32), flip=True,
                       method="nearest")
    t = load_image(p, flipped)
    assert float(t[0, 0, 0]) == 0.0 and float(t[0, -1, 0]) == 1.0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_consistently(tmp_path: Path, orientation: int) -> None:
    p = _save(tmp_path / "o.jpg", _marked((64, 32)), "JPEG", orientation)
    with Image.open(p) as img:
        assert exif_orientation(img) == orientation
    w, h = read_image_size(p)
    assert (w, h) == ((32, 64) if orientation >= 5 else (64, 32))
    decoded = decode_image(p)
    assert decoded.size == (w, h)
    ref = Image.open(p)
    from PIL import ImageOps

    expected = np.asarray(ImageOps.exif_transpose(ref).convert("RGB"))
    assert np.array_equal(np.asarray(decoded), expected)  # same result as Pillow's own exif_transpose
    t = load_image(p, CFG.plan(w, h))
    assert t.shape[:2] == (CFG.plan(w, h).bucket[1], CFG.plan(w, h).bucket[0])


def test_png_exif_orientation_is_read_without_decoding(tmp_path: Path) -> None:
    p = _save(tmp_path / "o.png", _marked((64, 32)), "PNG", 6)
    assert read_image_size(p) == (32, 64)
    assert decode_image(p).size == (32, 64)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK", "1", "I;16"])
def test_modes_convert_to_rgb(tmp_path: Path, mode: str) -> None:
    if mode == "I;16":
        img = Image.fromarray(np.full((16, 16), 65535, dtype=np.uint16))
    else:
        img = Image.new("RGB", (16, 16), "white").convert(mode)
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    p = _save(tmp_path / f"m.{'tif' if fmt == 'TIFF' else 'png'}", img, fmt)
    decoded = decode_image(p)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded).min() >= 250  # white stays white (16-bit scaled, not clipped)


def test_truncated_image_raises_source_error_naming_the_file(tmp_path: Path) -> None:
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buf, "PNG")
    p = tmp_path / "truncated.png"
    p.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    assert read_image_size(p) == (64, 64)  # the header is intact
    with pytest.raises(SourceError, match="truncated.png: image data is truncated or corrupt"):
        load_image(p, CFG.plan(64, 64))


def test_garbage_and_foreign_formats_raise_source_error(tmp_path: Path) -> None:
    p = tmp_path / "garbage.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(SourceError, match="garbage.png: not a readable image"):
        read_image_size(p)
    gif = tmp_path / "gif.png"
    Image.new("P", (8, 8)).save(gif, "GIF")
    with pytest.raises(SourceError, match="gif.png: not a readable image"):
        decode_image(gif)
    with pytest.raises(SourceError, match="missing.png"):
        read_image_size(tmp_path / "missing.png")


def test_plan_for_another_size_is_refused(tmp_path: Path) -> None:
    p = _save(tmp_path / "i.png", _marked((64, 32)), "PNG")
    with pytest.raises(SourceError, match="differs from the scanned size 32x64.*scan the folder again"):
        load_image(p, CFG.plan(32, 64))


def test_source_error_is_a_value_error() -> None:
    assert issubclass(SourceError, ValueError)


def test_load_mask_averages_cells_after_comfyuis_centred_crop_to_the_factor(tmp_path: Path) -> None:
    from dataset_cache.imaging import load_mask

    arr = np.zeros((64, 72), dtype=np.uint8)
    arr[:, 4:20] = 255  # exactly the first 16-px column of cells once 72 px are centre-cropped to 64 (offset 4)
    arr[:8, 20:36] = 255  # half of the first cell of the second column
    path = tmp_path / "m.png"
    Image.fromarray(arr, "L").save(path)
    plan = CropPlan(source=(72, 64), bucket=(72, 64), resize=(72, 64), crop=(0, 0, 72, 64))
    mask = load_mask(path, "masklabel", plan, 16)
    assert mask.dtype == torch.uint8 and tuple(mask.shape) == (1, 1, 4, 4)
    assert mask[0, 0, :, 0].tolist() == [255] * 4 and mask[0, 0, 0, 1].item() == 128  # 127.5 rounds half up
    assert mask[0, 0, 1:, 1:].sum().item() == 0
    flipped = load_mask(path, "masklabel", CropPlan((72, 64), (72, 64), (72, 64), (0, 0, 72, 64), flip=True), 16)
    assert torch.equal(flipped, mask.flip(-1))
