"""Node "Cache Info" called directly: reports a cache, or says there is none, and refuses escapes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.paths import PACK_ROOT


@pytest.fixture
def node(pack: ModuleType) -> type:
    return pack.nodes.cache_info.CacheInfo


def test_missing_cache_is_reported_not_raised(node: type, cache_root: Path) -> None:
    out = node.execute(cache="nothing_here")
    expected = f"no cache at {cache_root / 'nothing_here'}"
    assert out.result == (expected,)
    assert out.ui.as_dict()["text"] == (expected,)
    assert out.ui.as_dict()["streamcache_info"] == [{"kind": "cache", "root": str(cache_root / "nothing_here"),
                                                     "exists": False, "problems": []}]


def test_escape_is_refused_at_validation_and_execution(node: type, cache_root: Path) -> None:
    message = node.validate_inputs(cache="../../etc")
    assert isinstance(message, str) and "must not contain '..'" in message
    assert node.validate_inputs(cache="fine") is True
    assert node.validate_inputs(cache=None) is True  # linked input: known only at run time
    with pytest.raises(ValueError, match="outside the StreamCache folders"):
        node.execute(cache="/etc")


def test_always_rereads(node: type) -> None:
    value = node.fingerprint_inputs(cache="x")
    assert value != value  # NaN: never equal, so ComfyUI never serves a stale report


_HAS_FORMAT = all((PACK_ROOT / "dataset_cache" / "format" / f).is_file() for f in ("reader.py", "writer.py"))


@pytest.mark.skipif(not _HAS_FORMAT, reason="dataset_cache/format/{reader,writer}.py not written yet")
def test_real_cache_is_described(node: type, pack: ModuleType, cache_root: Path) -> None:
    from importlib import import_module

    writer_mod = import_module(f"{pack.__name__}.dataset_cache.format.writer")
    path = cache_root / "info_test"
    with writer_mod.CacheWriter(path) as writer:
        for i in range(3):
            key = hashlib.md5(str(i).encode()).hexdigest()
            writer.add(key, {"samples": torch.full((1, 4, 8, 8), float(i))}, kind="latent")
    (report,) = node.execute(cache="info_test").result
    assert report.startswith(f"StreamCache cache at {path}")
    assert "entries: 3" in report


def test_folder_without_manifest_is_not_a_cache(node: type, cache_root: Path) -> None:
    (cache_root / "just_images").mkdir()
    (cache_root / "just_images" / "a.png").write_bytes(b"")
    (report,) = node.execute(cache="just_images").result
    assert report == f"no cache at {cache_root / 'just_images'}"


def test_variants_are_reported_per_dataset(node: type, cache_root: Path) -> None:
    """The golden cache with a version-2 dataset: one mirror, one mask, the empty caption and two caption
    variants, each role with its entries and bytes (item 7 of #16)."""
    import shutil

    shutil.copytree(PACK_ROOT / "tests" / "unit" / "format" / "data" / "v1-variants", cache_root / "variants")
    out = node.execute(cache="variants")
    (report,) = out.result
    info = out.ui.as_dict()["streamcache_info"][0]["variants"]["variants"]
    assert info["samples"] == 2
    assert {r: (info[r]["entries"], info[r]["missing"]) for r in ("latents", "mirrors", "masks", "captions",
                                                                  "empty_caption")} == {
        "latents": (2, 0), "mirrors": (1, 0), "masks": (1, 0), "captions": (2, 0), "empty_caption": (1, 0)}
    assert info["mirrors"]["bytes"] == 2 * 3 * 4 * 2  # one [1, 2, 3, 4] fp16 latent
    assert info["masks"]["bytes"] == 3 * 4  # one [1, 1, 3, 4] uint8 mask
    assert "dataset 'variants': 2 samples" in report
    assert "mirrors: 1 entry, 48 B" in report and "masks: 1 entry, 12 B" in report
    assert "empty caption: 1 entry" in report
