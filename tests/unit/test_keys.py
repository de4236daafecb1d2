"""Tests of dataset_cache.keys: canonical encoding, latent and conditioning keys, file hashing."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import xxhash
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.keys import (
    KEY_SCHEMA,
    canonical_bytes,
    conditioning_key,
    content_key,
    fingerprint,
    hash_bytes,
    hash_file,
    is_key,
    latent_key,
)
from dataset_cache.scan import scan_folder

VAE = fingerprint("a" * 32, dtype="bf16")
TE = fingerprint("b" * 32, patches=[("c" * 32, 0.8)], dtype="fp16")


def _png(color: str, size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def _latent_keys(root: Path, cfg: BucketConfig, vae: str = VAE) -> dict[str, str]:
    out = {}
    for img in scan_folder(root).images:
        digest = hash_file(img.path)
        plan = cfg.plan(img.width, img.height, token=digest)
        out[img.relpath] = latent_key(digest, plan.key_fields(), vae)
    return out


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "5_a").mkdir(parents=True)
    (root / "1_b/deep").mkdir(parents=True)
    (root / "5_a/x.png").write_bytes(_png("red"))
    (root / "1_b/deep/copy_of_x.png").write_bytes(_png("red"))
    (root / "5_a/y.png").write_bytes(_png("blue"))
    (root / "5_a/x.txt").write_text("shared line\nonly in x\n")
    (root / "5_a/y.txt").write_text("only in y\nshared line\n")
    return root


def test_identical_images_at_different_paths_share_a_latent_key(folder: Path) -> None:
    keys = _latent_keys(folder, BucketConfig(resolution=256, min_side=64, step=64))
    assert keys["5_a/x.png"] == keys["1_b/deep/copy_of_x.png"]
    assert keys["5_a/x.png"] != keys["5_a/y.png"]
    assert all(is_key(k) for k in keys.values())


def test_identical_caption_lines_share_a_conditioning_key(folder: Path) -> None:
    imgs = {i.relpath: i for i in scan_folder(folder).images}
    kx = [conditioning_key(c, TE) for c in imgs["5_a/x.png"].captions]
    ky = [conditioning_key(c, TE) for c in imgs["5_a/y.png"].captions]
    assert kx[0] == ky[1]
    assert len(set(kx + ky)) == 3


@pytest.mark.parametrize(
    "cfg",
    [
        BucketConfig(resolution=256, min_side=64, flip=True),
        BucketConfig(resolution=256, min_side=64, method="bicubic"),
        BucketConfig(resolution=192, min_side=64),
        BucketConfig(resolution=256, min_side=64, fixed=(128, 128)),
    ],
)
def test_any_pixel_setting_changes_the_latent_key(folder: Path, cfg: BucketConfig) -> None:
    base = _latent_keys(folder, BucketConfig(resolution=256, min_side=64))
    assert _latent_keys(folder, cfg)["5_a/x.png"] != base["5_a/x.png"]


def test_random_crop_position_changes_the_latent_key() -> None:
    digest = "0" * 32
    cfg = BucketConfig(resolution=512, crop="random")
    crops = {}
    for seed in range(10):
        plan = BucketConfig(resolution=512, crop="random", seed=seed).plan(1000, 333, token=digest)
        crops[plan.crop] = latent_key(digest, plan.key_fields(), VAE)
    assert len(set(crops.values())) == len(crops) > 1
    assert cfg.plan(1000, 333, token=digest) == cfg.plan(1000, 333, token=digest)


def test_fingerprints_and_settings_change_keys() -> None:
    digest = "1" * 32
    pixels = BucketConfig(resolution=512).plan(512, 512).key_fields()
    assert latent_key(digest, pixels, VAE) != latent_key(digest, pixels, fingerprint("a" * 32, dtype="fp32"))
    assert latent_key(digest, pixels, VAE) != latent_key(digest, pixels, VAE, extra={"alpha": "mask"})
    assert conditioning_key("x", TE) != conditioning_key("x", fingerprint("b" * 32, dtype="fp16"))
    assert conditioning_key("x", TE) != conditioning_key("x", TE, settings={"max_length": 77})
    assert conditioning_key("x", TE) != conditioning_key("x ", TE)
    lora_a = fingerprint("b" * 32, patches=[("c" * 32, 0.8)])
    lora_b = fingerprint("b" * 32, patches=[("c" * 32, 0.9)])
    assert lora_a != lora_b


def test_keys_are_stable_across_releases() -> None:
    # A changed value here means every existing cache would be re-encoded: bump KEY_SCHEMA on purpose instead.
    assert KEY_SCHEMA == 1
    assert canonical_bytes("conditioning", {"text": "a", "encoder": "e", "settings": {}}) == (
        b'[1,"conditioning",{"encoder":"e","settings":{},"text":"a"}]'
    )
    assert conditioning_key("a", "e") == xxhash.xxh3_128_hexdigest(
        b'[1,"conditioning",{"encoder":"e","settings":{},"text":"a"}]'
    )


def test_field_boundaries_cannot_collide() -> None:
    assert content_key("k", {"a": "xy", "b": "z"}) != content_key("k", {"a": "x", "b": "yz"})
    assert content_key("k", {"a": ["x", "y"]}) != content_key("k", {"a": ["x,y"]})
    assert content_key("k", {"a": 'x","b":"y'}) != content_key("k", {"a": "x", "b": "y"})
    assert content_key("k", {"a": 1}) != content_key("k", {"a": "1"})
    assert content_key("k", {"a": 1}) != content_key("k", {"a": True})
    assert content_key("k", {"a": 1}) != content_key("k", {"a": 1.0})
    assert content_key("latent", {"a": 1}) != content_key("conditioning", {"a": 1})
    # captions whose concatenation with the fingerprint is the same
    assert conditioning_key("ab", "cd") != conditioning_key("abc", "d")
    assert canonical_bytes("k", {"b": 1, "a": 2}) == canonical_bytes("k", {"a": 2, "b": 1})
    assert canonical_bytes("k", {"t": (1, 2)}) == canonical_bytes("k", {"t": [1, 2]})


def test_unicode_captions_are_keyed_exactly() -> None:
    assert conditioning_key("café", TE) != conditioning_key("cafe\u0301", TE)  # NFC vs NFD stay distinct
    assert is_key(conditioning_key("日本語\n\x00", TE))


@pytest.mark.parametrize(
    "fields,error,match",
    [
        ({"a": float("nan")}, ValueError, "non-finite float"),
        ({"a": {1: 2}}, TypeError, "str dict keys"),
        ({"a": object()}, TypeError, "cannot be part of a key"),
        ({"a": b"bytes"}, TypeError, "cannot be part of a key"),
    ],
)
def test_non_canonical_values_are_refused(fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        content_key("k", fields)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="source_hash must be a 32-char"):
        latent_key("not-a-hash", {}, VAE)
    with pytest.raises(ValueError, match="vae_fingerprint must be a non-empty"):
        latent_key("0" * 32, {}, "")
    with pytest.raises(TypeError, match="caption text must be str"):
        conditioning_key(None, TE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights must be a non-empty"):
        fingerprint("")


def test_hash_file_streams_and_matches_one_shot(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # > 2 MiB: several chunks
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert hash_file(str(p)) == hash_bytes(data) == xxhash.xxh3_128_hexdigest(data)
    assert hash_file(str(p), chunk_bytes=1000) == hash_bytes(data)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert hash_file(str(empty)) == hash_bytes(b"")
    assert is_key(hash_file(str(p)))
    with pytest.raises(FileNotFoundError):
        hash_file(str(tmp_path / "missing"))


def test_is_key() -> None:
    assert is_key("0123456789abcdef" * 2)
    assert not is_key("0123456789ABCDEF" * 2)
    assert not is_key("0" * 31)
    assert not is_key(None)


def test_hash_file_without_readv(tmp_path: Path, monkeypatch) -> None:
    """The Windows path (no os.readv) gives the same digests."""
    from dataset_cache import keys as keys_mod

    data = b"x" * 3000
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    monkeypatch.setattr(keys_mod, "_readv", None)
    assert hash_file(p, chunk_bytes=1024) == hash_bytes(data)


def test_plan_keys_are_exactly_the_reference_keys() -> None:
    """PlanKeys (the planner's fast path) gives the keys latent_key / conditioning_key give, for every kind of text."""
    from dataset_cache.keys import PlanKeys

    keys = PlanKeys(VAE, TE)
    cfgs = [BucketConfig(resolution=256, min_side=64), BucketConfig(resolution=256, min_side=64, flip=True)]
    for i in range(40):
        digest = hash_bytes(str(i).encode())
        plan = cfgs[i % 2].plan(40 + i, 30 + 2 * i, token=digest)
        assert keys.latent(digest, plan) == latent_key(digest, plan.key_fields(), VAE)
    for text in ["a photo", "", 'say "hi"', "back\\slash", "tab\there", "é ü ß", "日本語", "emoji 🙂", "a" * 3000,
                 "line\nbreak", "\x00nul", "a photo"]:
        assert keys.conditioning(text) == conditioning_key(text, TE), repr(text[:20])
