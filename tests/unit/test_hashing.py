"""xxhash helpers: stable, dtype-agnostic, length-prefixed."""

from __future__ import annotations

import torch
import xxhash

from dataset_cache.hashing import checksum64, tensor_bytes, tensor_checksum


def test_checksum64_is_xxh3_64_hex():
    assert checksum64(b"abc") == xxhash.xxh3_64_hexdigest(b"abc") and len(checksum64(b"")) == 16


def test_tensor_checksum_over_stored_bytes_for_every_dtype():
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        t = torch.arange(6).reshape(2, 3).to(dt)
        assert bytes(tensor_bytes(t)) == t.contiguous().view(torch.uint8).numpy().tobytes()
        assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())  # same values, same bytes (C order)
    assert tensor_checksum(torch.empty(0, 3)) == checksum64(b"")
    assert len(bytes(tensor_bytes(torch.tensor(1.5)))) == 4
