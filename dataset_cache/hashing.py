"""xxhash helpers: row checksums, content keys and file hashes.

One module owns every hash the cache writes so that a reader in another language can reproduce them from the
spec (docs/FORMAT.md): xxh3-64 over the exact stored bytes for integrity (fast enough to check on every read,
~30 GB/s), xxh3-128 for content keys (collision-safe at any realistic cache size).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import xxhash

__all__ = [
    "checksum64",
    "tensor_bytes",
    "tensor_checksum",
    "content_key",
    "hash_file",
]

_FILE_CHUNK = 4 << 20


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
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Return the xxh3-64 (16 hex digits) of a tensor's stored bytes, as written in a shard's checksum list."""
    return checksum64(tensor_bytes(tensor))


def content_key(*parts: bytes | str) -> str:
    """Return an xxh3-128 content key (32 lowercase hex digits) of ``parts``.

    Each part is length-prefixed before hashing, so ``("ab", "c")`` and ``("a", "bc")`` give different keys.
    Strings are encoded as UTF-8.
    """
    h = xxhash.xxh3_128()
    for part in parts:
        b = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def hash_file(path: str | os.PathLike, *, chunk_bytes: int = _FILE_CHUNK) -> str:
    """Return the xxh3-128 (32 hex digits) of a file's bytes, read in chunks (constant memory)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                break
            h.update(block)
    return h.hexdigest()
