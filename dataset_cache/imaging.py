"""Image decoding for the encoder path: header-only sizes, and decode → orient → RGB → resize → crop → tensor.

Sizes come from a file's header (:func:`read_image_size`) or from a whole file's bytes already read to hash it
(:func:`image_size_from_bytes`, with a Pillow-free parser for plain PNGs), both as :func:`load_image` sees them.

Two rules keep scanning and decoding consistent, which matters because the bucket (and so the key) is chosen from
the size the scanner reports while the pixels come from the decoder:

* Orientation comes from the EXIF orientation tag only, read by :func:`exif_orientation` from the header before
  any pixel is decoded (PNG eXIf chunks after the image data and XMP orientation are ignored by both paths).
  Orientations 5–8 swap width and height in :func:`read_image_size` and are applied by :func:`load_image`.
* Only the formats a dataset folder may hold are opened (PNG, JPEG, WebP, BMP, TIFF), whatever the file is
  named, so a renamed EPS or PDF can never reach an external decoder.

Alpha is dropped (``convert("RGB")``, as kohya and ComfyUI's image loaders do); 16-bit grayscale is scaled to
8 bits rather than clipped. :func:`load_image` is safe to run on several threads (Pillow releases the GIL while
decoding and resampling).
"""

from __future__ import annotations

import io
import os
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, PngImagePlugin

from .errors import SourceError

if TYPE_CHECKING:
    from .buckets import CropPlan

__all__ = [
    "OPEN_FORMATS",
    "RESIZE_METHODS",
    "exif_orientation",
    "read_image_size",
    "image_size_from_bytes",
    "decode_image",
    "apply_plan",
    "load_image",
    "MASK_MODES",
    "has_alpha",
    "load_mask",
]

OPEN_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "DIB", "TIFF")
"""Pillow format names :func:`Image.open` may pick (camera JPEGs that Pillow reports as MPO open through JPEG)."""

RESIZE_METHODS: Mapping[str, Image.Resampling] = {
    "lanczos": Image.Resampling.LANCZOS,
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
    "nearest": Image.Resampling.NEAREST,
}
"""Names accepted as a resize method; the name (not the enum value) goes into latent keys."""

_ORIENTATION_TAG = 0x0112
_TRANSPOSE: Mapping[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def exif_orientation(img: Image.Image) -> int:
    """Return the EXIF orientation (1–8) of an opened, not yet decoded image; 1 when absent or invalid.

    Reads only what the header already holds: for PNG the eXIf chunk seen before the image data (Pillow's own
    ``PngImageFile.getexif`` would decode every pixel to look for a later chunk).
    """
    try:
        if img.format == "PNG":
            raw = img.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = img.getexif()
        value = exif.get(_ORIENTATION_TAG, 1)
    except Exception:  # a malformed EXIF block must not make an otherwise good image unreadable
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _open(path: str | os.PathLike[str], name: str | None = None) -> Image.Image:
    try:
        return Image.open(path, formats=OPEN_FORMATS)
    except Exception as exc:  # Pillow raises many types for hostile input; all mean "not a usable image"
        raise SourceError(name or str(path), f"not a readable image ({type(exc).__name__}: {exc})") from exc


def read_image_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return ``(width, height)`` as :func:`load_image` will see it, reading the header only.

    Raises:
        SourceError: the file is not a readable PNG/JPEG/WebP/BMP/TIFF or claims a zero size.
    """
    with _open(path) as img:
        width, height = img.size
        if exif_orientation(img) >= 5:
            width, height = height, width
    if width <= 0 or height <= 0:
        raise SourceError(str(path), f"image header claims an empty size {width}x{height}")
    return width, height


def image_size_from_bytes(raw: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of the image whose whole file is ``raw``, as :func:`read_image_size` reports it for that
    file; ``None`` when its header is unreadable. Validation hashes a new image from these very bytes, so its size
    costs no second open; a plain PNG skips Pillow's header parser (:func:`_png_size`)."""
    dims = _png_size(raw)
    if dims is None:
        try:
            dims = read_image_size(io.BytesIO(raw))  # type: ignore[arg-type]  # Pillow reads file objects
        except SourceError:
            pass
    return dims


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MODES = frozenset({(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (8, 2), (16, 2), (1, 3), (2, 3), (4, 3), (8, 3),
                        (8, 4), (16, 4), (8, 6), (16, 6)})  # (bit depth, colour type) pairs Pillow opens
_PNG_CID = re.compile(rb"\w\w\w\w")  # Pillow's test of a chunk type
_PNG_MIN_LENGTH = {b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9, b"PLTE": 0, b"tEXt": 0}
_PNG_PILLOW_CHUNKS = frozenset({b"IHDR", b"IDAT", b"IEND", b"PLTE", b"tRNS", b"gAMA", b"cHRM", b"sRGB", b"pHYs",
                                b"tEXt", b"zTXt", b"iTXt", b"eXIf", b"acTL", b"fcTL", b"fdAT", b"iCCP"})


def _png_size(raw: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of a plain PNG exactly as :func:`read_image_size` reports it, parsed without
    Pillow (whose pure-Python PNG header parser was half the cost of hashing a new dataset); ``None`` for anything
    not plain — an EXIF block (orientation), an animation, a chunk Pillow parses in ways this does not repeat, a
    bad checksum, a size over Pillow's decompression-bomb limit, a truncated header — which then goes to Pillow.
    """
    if not raw.startswith(_PNG_SIGNATURE) or len(raw) < 33 or raw[12:16] != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", raw, 16)
    if struct.unpack_from(">I", raw, 8)[0] < 13 or raw[27] != 0 or (raw[24], raw[25]) not in _PNG_MODES:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if width <= 0 or height <= 0 or (limit is not None and width * height > limit):
        return None
    text = 0
    pos = 8
    while pos + 12 <= len(raw):
        length, cid = struct.unpack_from(">I", raw, pos)[0], raw[pos + 4:pos + 8]
        if cid == b"IDAT":
            return width, height
        end = pos + 8 + length
        if not _PNG_CID.match(cid) or end + 4 > len(raw):
            return None
        if cid in _PNG_PILLOW_CHUNKS and (cid != b"IHDR" or pos != 8):
            if cid not in _PNG_MIN_LENGTH or length < _PNG_MIN_LENGTH[cid]:
                return None
            if cid == b"tEXt":
                key, _, value = raw[pos + 8:end].partition(b"\0")
                text += len(value)
                if key == b"exif" or text > PngImagePlugin.MAX_TEXT_MEMORY:
                    return None
        if zlib.crc32(raw[pos + 4:end]) != struct.unpack_from(">I", raw, end)[0]:
            return None
        pos = end + 4
    return None


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit grayscale: scale to 8 bits; a plain convert would clip everything above 255 to white.
        arr = np.asarray(img, dtype=np.float32)
        peak = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        gray = np.clip(np.rint(arr * (255.0 / peak)), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    return img.convert("RGB")


def _decode(path: str | os.PathLike[str], convert: Callable[[Image.Image], Image.Image], *, what: str = "image",
            name: str | None = None) -> Image.Image:
    """Decode a file fully, EXIF orientation applied, then ``convert`` it (to RGB, or to a mask's channel).

    Raises:
        SourceError: the file is unreadable, truncated or corrupt (names ``name``, default the path).
    """
    where = name or str(path)
    with _open(path, where) as img:
        orientation = exif_orientation(img)
        try:
            img.load()
        except Exception as exc:
            raise SourceError(where, f"{what} data is truncated or corrupt ({type(exc).__name__}: {exc})") from exc
        out = convert(img.transpose(_TRANSPOSE[orientation]) if orientation in _TRANSPOSE else img)
        return img.copy() if out is img else out  # closing the file must not close the returned image


def decode_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode an image fully: EXIF orientation applied, converted to RGB.

    Raises:
        SourceError: the file is unreadable, truncated or corrupt (names the file).
    """
    return _decode(path, _to_rgb)


def apply_plan(img: Image.Image, plan: CropPlan, *, path: str = "<image>") -> Image.Image:
    """Resize ``img`` to ``plan.resize``, crop ``plan.crop`` and flip when ``plan.flip``.

    Raises:
        SourceError: the decoded size differs from the size the plan was made for (the file changed after the
            scan, or it was scanned by another version).
    """
    if img.size != tuple(plan.source):
        raise SourceError(
            path,
            f"decoded size {img.size[0]}x{img.size[1]} differs from the scanned size "
            f"{plan.source[0]}x{plan.source[1]}; the file changed since the scan — scan the folder again",
        )
    method = RESIZE_METHODS[plan.method]
    width, height = plan.resize
    if img.size != (width, height):
        img = img.resize((width, height), resample=method)
    left, top, right, bottom = plan.crop
    if (left, top, right, bottom) != (0, 0, width, height):
        img = img.crop((left, top, right, bottom))
    if plan.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return img


MASK_MODES = ("none", "masklabel", "alpha")
"""Where a loss mask comes from: nowhere; a ``<stem>-masklabel.<ext>`` file beside the image (OneTrainer / kohya),
its gray level the weight (white = full); or the image's own alpha channel (opaque = full weight)."""

MASK_ASPECT_TOLERANCE = 0.01
"""Relative difference of aspect ratio between a mask file and its image above which the mask is refused (a mask
of another image, or cropped); a mask of the same shape at another size is resized to the image's size."""


def mask_aspect_problem(mask_size: tuple[int, int], image_size: tuple[int, int]) -> str | None:
    """What is wrong with a mask of ``mask_size`` for an image of ``image_size`` (``None``: nothing)."""
    (mw, mh), (iw, ih) = mask_size, image_size
    if mw <= 0 or mh <= 0:
        return f"mask claims an empty size {mw}x{mh}"
    if abs(mw * ih - mh * iw) > MASK_ASPECT_TOLERANCE * mh * iw:
        return (f"mask is {mw}x{mh} but its image is {iw}x{ih}: another aspect ratio, so it cannot be the image's "
                "mask; save the mask at the image's size")
    return None


def has_alpha(path: str | os.PathLike[str]) -> bool:
    """Whether the image has an alpha channel (or a transparent palette entry), from its header only: what
    ``masks="alpha"`` can take a mask from. A JPEG never has one.

    Raises:
        SourceError: the file is not a readable PNG/JPEG/WebP/BMP/TIFF.
    """
    with _open(path) as img:
        return "A" in img.getbands() or "transparency" in img.info


def _alpha(img: Image.Image) -> Image.Image:
    """The alpha channel as the mask (an image without one: full weight everywhere)."""
    if "A" in img.getbands() or "transparency" in img.info:
        return img.convert("RGBA").getchannel("A")
    return Image.new("L", img.size, 255)


def _gray(img: Image.Image) -> Image.Image:
    """A mask file's gray level (16-bit gray scaled to 8 bits as for images)."""
    return img if img.mode == "L" else _to_rgb(img).convert("L")


def load_mask(path: str | os.PathLike[str], mode: str, plan: CropPlan, factor: int, *,
              name: str | None = None) -> torch.Tensor:
    """Return a loss mask at latent resolution: uint8 ``[1, 1, h, w]`` (255 = full weight, 0 = the floor).

    Steps: decode (EXIF orientation applied); take the gray level (``masklabel``) or the alpha channel
    (``alpha``; an image without alpha gives full weight everywhere); resize a mask file to its image's size
    when it differs (same aspect ratio only); apply the image's crop plan (resize, crop, flip); crop to multiples
    of ``factor`` as ComfyUI's VAE crops the pixels it encodes (centred); average each ``factor × factor`` cell
    and round. Needs no VAE.

    Args:
        path: the mask file, or the image for ``alpha``.
        mode: ``"masklabel"`` or ``"alpha"``.
        plan: the crop plan of the latent the mask belongs to.
        factor: the VAE's spatial compression.
        name: the file to name in errors (default ``path``).

    Raises:
        SourceError: unreadable or corrupt, or of another aspect ratio than the image.
    """
    where = name or str(path)
    if mode not in ("masklabel", "alpha"):
        raise ValueError(f"mask mode must be 'masklabel' or 'alpha', got {mode!r}")
    gray = _decode(path, _alpha if mode == "alpha" else _gray, what="mask", name=where)
    source = (int(plan.source[0]), int(plan.source[1]))
    if gray.size != source:
        problem = mask_aspect_problem(gray.size, source)
        if problem:
            raise SourceError(where, problem)
        gray = gray.resize(source, resample=Image.Resampling.BILINEAR)
    arr = np.asarray(apply_plan(gray, plan, path=where), dtype=np.uint32)
    height, width = arr.shape
    h, w = height // factor, width // factor
    if h < 1 or w < 1:
        raise SourceError(where, f"the bucket {width}x{height} is smaller than the VAE's factor {factor}")
    top, left = (height % factor) // 2, (width % factor) // 2
    cells = arr[top:top + h * factor, left:left + w * factor].reshape(h, factor, w, factor).sum(axis=(1, 3))
    n = factor * factor
    out = (cells + n // 2) // n  # exact integer rounding: the same on every machine
    return torch.from_numpy(out.astype(np.uint8)).reshape(1, 1, h, w)


def load_image(path: str | os.PathLike[str], plan: CropPlan) -> torch.Tensor:
    """Return the pixels the VAE should encode: float32 ``[H, W, 3]`` in 0..1 (one row of ComfyUI ``IMAGE``).

    Args:
        path: the image file.
        plan: the crop plan from :meth:`BucketConfig.plan` for this image's scanned size.

    Raises:
        SourceError: the file is unreadable, corrupt, or no longer matches the plan.
    """
    img = apply_plan(decode_image(path), plan, path=str(path))
    arr = np.array(img, dtype=np.uint8)  # a writable copy torch can own
    return torch.from_numpy(arr).to(torch.float32).div_(255.0)
