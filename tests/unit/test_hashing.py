"""xxhash helpers: stable, dtype-agnostic, length-prefixed."""

from __future__ import annotations

import re

import pytest
import torch
import xxhash

from dataset_cache.hashing import checksum64, is_lower_hex, tensor_bytes, tensor_checksum


def test_checksum64_is_xxh3_64_hex():
    assert checksum64(b"abc") == xxhash.xxh3_64_hexdigest(b"abc") and len(checksum64(b"")) == 16


def test_tensor_checksum_over_stored_bytes_for_every_dtype():
    for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        t = torch.arange(6).reshape(2, 3).to(dt)
        assert bytes(tensor_bytes(t)) == t.contiguous().view(torch.uint8).numpy().tobytes()
        assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())  # same values, same bytes (C order)
    assert tensor_checksum(torch.empty(0, 3)) == checksum64(b"")
    assert len(bytes(tensor_bytes(torch.tensor(1.5)))) == 4


@pytest.mark.parametrize("text, ok", [
    ("", True), ("0123456789abcdef", True), ("00ff" * 1000, True),
    ("0123456789abcdeF", False), ("ABCD", False), ("abc", False), ("ab cd", False), ("ab\ncd", False),
    ("abcg", False), ("ab-c", False), ("ab\u00e9c", False), ("\u0661\u0662", False), (" abcd", False),
])
def test_is_lower_hex_accepts_exactly_bytes_in_lowercase_hex(text: str, ok: bool) -> None:
    assert is_lower_hex(text) is ok
    assert ok is (re.fullmatch("([0-9a-f]{2})*", text) is not None)
