"""Small image+caption folders in the kohya layout, generated with Pillow only (usable by every suite).

Layout written by :func:`make_kohya_folder` (the defaults)::

    root/
      10_red/    img_000.png + img_000.txt, ...   (repeat count 10, 64×64 and 96×64 images)
      2_blue/    img_000.jpg + img_000.txt, ...   (repeat count 2, 64×96 and 64×64 images)

Captions: some identical across images (to exercise content-keyed de-duplication of conditionings), and one
multi-line caption (to exercise caption variants / newline handling). Pixel content is deterministic per
image so content keys are stable across runs, and differs between images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["DEFAULT_SUBSETS", "KohyaFolder", "KohyaImage", "Subset", "make_kohya_folder"]

SHARED_CAPTION = "a photo of a tiny test pattern"
MULTILINE_CAPTION = "first caption variant, a square\nsecond caption variant, a box"


@dataclass(frozen=True)
class KohyaImage:
    """One generated image and its caption."""

    path: Path
    """Image file."""
    caption: str
    """Exact text written to the ``.txt`` file next to the image."""
    repeats: int
    """Repeat count of the subset folder (the ``N`` of ``N_name``)."""
    size: tuple[int, int]
    """(width, height) in pixels."""


@dataclass(frozen=True)
class KohyaFolder:
    """A generated dataset folder."""

    root: Path
    images: tuple[KohyaImage, ...]

    @property
    def sizes(self) -> set[tuple[int, int]]:
        return {img.size for img in self.images}

    @property
    def captions(self) -> list[str]:
        return [img.caption for img in self.images]


@dataclass(frozen=True)
class Subset:
    """One ``N_name`` folder to generate."""

    repeats: int
    name: str
    sizes: tuple[tuple[int, int], ...]
    """One image per entry, (width, height)."""
    ext: str = "png"


DEFAULT_SUBSETS: tuple[Subset, ...] = (
    Subset(10, "red", ((64, 64), (96, 64), (64, 64)), "png"),
    Subset(2, "blue", ((64, 96), (64, 64)), "jpg"),
)


def _pattern(size: tuple[int, int], seed: int) -> Image.Image:
    """A deterministic picture that differs per seed: a background colour plus a few rectangles."""
    w, h = size
    colour = ((seed * 67) % 256, (seed * 131 + 40) % 256, (seed * 29 + 90) % 256)
    img = Image.new("RGB", size, colour)
    draw = ImageDraw.Draw(img)
    for i in range(3):
        x0 = (seed * 13 + i * 17) % max(1, w - 8)
        y0 = (seed * 7 + i * 23) % max(1, h - 8)
        fill = ((colour[0] + 85 * (i + 1)) % 256, (colour[1] + 50 * i) % 256, (255 - colour[2]) % 256)
        draw.rectangle([x0, y0, x0 + w // 4, y0 + h // 4], fill=fill)
    return img


def make_kohya_folder(root: str | Path, subsets: Sequence[Subset] = DEFAULT_SUBSETS) -> KohyaFolder:
    """Write a kohya-layout folder under ``root`` and describe what was written.

    Captions: the first image of every subset gets :data:`SHARED_CAPTION` (identical captions across
    folders), the second image of the first subset gets :data:`MULTILINE_CAPTION`, the others a unique line.
    """
    root = Path(root)
    images: list[KohyaImage] = []
    seed = 0
    for s_index, subset in enumerate(subsets):
        folder = root / f"{subset.repeats}_{subset.name}"
        folder.mkdir(parents=True, exist_ok=True)
        for i, size in enumerate(subset.sizes):
            seed += 1
            path = folder / f"img_{i:03d}.{subset.ext}"
            img = _pattern(size, seed)
            if subset.ext == "jpg":
                img.save(path, quality=95)
            else:
                img.save(path)
            if i == 0:
                caption = SHARED_CAPTION
            elif i == 1 and s_index == 0:
                caption = MULTILINE_CAPTION
            else:
                caption = f"{subset.name} pattern number {i}, {size[0]}x{size[1]}"
            path.with_suffix(".txt").write_text(caption, encoding="utf-8")
            images.append(KohyaImage(path, caption, subset.repeats, size))
    return KohyaFolder(root, tuple(images))
