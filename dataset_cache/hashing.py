"""Row checksums: xxh3-64 over the exact stored bytes of a tensor (fast enough to check on every read).

Content keys and file hashes (xxh3-128) are :mod:`dataset_cache.keys`'s; both are specified in docs/FORMAT.md so a
reader in another language can reproduce them.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

__all__ = ["checksum64", "tensor_bytes", "tensor_checksum", "is_lower_hex"]


def checksum64(data: Any) -> str:
    """Return the xxh3-64 of ``data`` (any bytes-like / buffer object) as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Return the raw bytes of a CPU tensor in C order, without copying when it is already contiguous.

    Works for every dtype, including ones numpy lacks (bfloat16, float8): the tensor is reinterpreted as
    ``uint8`` first. 0-d and empty tensors are handled.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data.cast("B")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Return the xxh3-64 (16 hex digits) of a tensor's stored bytes, as written in a shard's checksum list."""
    return checksum64(tensor_bytes(tensor))


def is_lower_hex(text: str) -> bool:
    """Whether ``text`` is bytes written as lowercase hex: an even number of the digits ``0-9a-f`` (checksums and
    keys are written so).

    ``bytes.fromhex`` refuses any other character; that it also skips whitespace shows in the length, that it
    takes ``A-F`` in the lowercase copy. An order of magnitude faster than a regex over the kilobytes of checksums
    in each shard header at open.
    """
    try:
        return 2 * len(bytes.fromhex(text)) == len(text) and text == text.lower()
    except ValueError:
        return False
