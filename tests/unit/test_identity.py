"""What tells two machines' copies of a cache or a model file apart (``dataset_cache.identity``): copies agree, and
a changed sample, stored tensor or file end does not — including changes that keep every key and every size."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dataset_cache.dataset import Sample
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.identity import EDGE_BYTES, cache_fingerprint, file_edges


def _write(root: Path, seed: int, repeats: int = 1, extra: bool = False) -> Path:
    g = torch.Generator().manual_seed(seed)
    with CacheWriter(root) as w:
        for i in range(4):
            w.add(f"lat{i}", {"samples": torch.randn(1, 4, 8, 8, generator=g)}, kind="latent")
            w.add(f"cap{i}", [[torch.randn(1, 6, 32, generator=g), {}]], kind="conditioning")
        samples = [Sample(f"lat{i}", (f"cap{i}",), repeats, f"{i}.png") for i in range(4)]
        w.set_dataset("train", samples)
        if extra:
            w.set_dataset("more", samples[:2])
    return root


def _fingerprint(root: Path) -> str:
    with open_cache(root) as reader:
        return cache_fingerprint(reader)


def test_a_copied_cache_fingerprints_alike_and_a_changed_one_does_not(tmp_path: Path) -> None:
    original = _write(tmp_path / "a", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    mine = _fingerprint(original)
    assert len(mine) == 32 and _fingerprint(copy) == mine
    # the same keys, shapes and sizes with other values: only the stored checksums tell
    assert _fingerprint(_write(tmp_path / "other-values", seed=2)) != mine
    assert _fingerprint(_write(tmp_path / "other-repeats", seed=1, repeats=2)) != mine
    assert _fingerprint(_write(tmp_path / "another-dataset", seed=1, extra=True)) != mine
    assert _fingerprint(_write(tmp_path / "again", seed=1)) == mine  # written again alike: the same content


def test_a_file_is_told_by_its_ends(tmp_path: Path) -> None:
    big = tmp_path / "model.safetensors"
    data = bytearray(torch.arange(3 * EDGE_BYTES, dtype=torch.uint8).numpy().tobytes())
    big.write_bytes(bytes(data))
    mine = file_edges(big)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(big, copy)
    assert file_edges(copy) == mine == file_edges(big, big.stat().st_size)
    for where in (0, len(data) - 1):  # a changed first or last byte
        changed = bytearray(data)
        changed[where] ^= 0xFF
        copy.write_bytes(bytes(changed))
        assert file_edges(copy) != mine
    middle = bytearray(data)
    middle[len(data) // 2] ^= 0xFF  # between the ends: not read, by design (the module docstring says why)
    copy.write_bytes(bytes(middle))
    assert file_edges(copy) == mine
    small = tmp_path / "small.bin"
    small.write_bytes(b"abc")
    other = tmp_path / "other.bin"
    other.write_bytes(b"abd")
    assert file_edges(small) != file_edges(other)
