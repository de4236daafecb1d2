"""Counting, deterministic pure-torch stand-ins for a VAE and a text encoder, for library tests of encoding."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xxhash

__all__ = ["OLD_NS", "FakeEncoders", "age"]

OLD_NS = 1_600_000_000 * 10**9  # files dated long before any scan are trusted by stat (never "racy")


class FakeEncoders:
    """Counting, deterministic pure-torch stand-ins for a VAE and a text encoder."""

    def __init__(self, *, delay: float = 0.0, fail_after: int | None = None) -> None:
        self.delay = delay
        self.fail_after = fail_after
        self.calls = 0
        self.images = 0
        self.batch_sizes: list[int] = []  # images per encode_images call
        self.texts: list[str] = []
        self.threads: set[int] = set()
        self.clips: list[tuple[int, ...]] = []  # shape of each clip given to encode_clip
        self.clip_pixels: list[torch.Tensor] = []  # each clip's first pixel of every frame (what was decoded)

    def _call(self) -> None:
        self.threads.add(threading.get_ident())
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("fake encoder failure")
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)

    def encode_images(self, batch: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        assert batch.dtype == torch.float32 and batch.ndim == 4 and batch.shape[-1] == 3
        self._call()
        self.images += batch.shape[0]
        self.batch_sizes.append(batch.shape[0])
        x = F.avg_pool2d(batch.permute(0, 3, 1, 2), 8)
        lat = torch.cat([x, x.mean(1, keepdim=True)], 1)
        return [{"samples": lat[i:i + 1]} for i in range(batch.shape[0])]

    def encode_texts(self, texts: list[str]) -> list[Any]:
        self._call()
        self.texts += texts
        out = []
        for t in texts:
            g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(t.encode()) >> 1)
            cond = torch.randn(1, 77, 768, generator=g)
            out.append([[cond, {"pooled_output": cond[:, 0].clone()}]])
        return out

    def encode_clip(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """A video VAE stand-in: ``[T, H, W, 3]`` → ``{"samples": [1, 4, 1 + (T - 1) // 4, H/8, W/8]}``."""
        assert frames.dtype == torch.float32 and frames.ndim == 4 and frames.shape[-1] == 3
        self._call()
        self.clips.append(tuple(frames.shape))
        self.clip_pixels.append(frames[:, 0, 0, 0].clone())
        x = F.avg_pool2d(frames.permute(0, 3, 1, 2), 8)  # [T, 3, h, w]
        x = torch.cat([x, x.mean(1, keepdim=True)], 1)  # [T, 4, h, w]
        keep = x[::4]  # 1 + (T - 1) // 4 latent frames
        return {"samples": keep.permute(1, 0, 2, 3)[None].contiguous()}

    def kw(self) -> dict[str, Any]:
        return {"encode_images": self.encode_images, "encode_texts": self.encode_texts,
                "encode_clips": self.encode_clip}


def age(root: Path) -> None:
    """Date every file under ``root`` long ago, so validation trusts their stat (see ``OLD_NS``)."""
    for p in root.rglob("*"):
        if p.is_file():
            os.utime(p, ns=(OLD_NS, OLD_NS))
