"""Tests of the encode side of training-time variety (issue #16): tag shuffles, the empty caption, flip modes
as variants and loss masks, each an entry of its own key, encoded once and only when its source changes.

Encoders are the counting fakes of ``support.fake_encoders`` (latent = 8x average-pooled image, so the VAE's
spatial factor is 8); folders are small and written here with Pillow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.captions import shuffle_tags, tag_orders
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode, samples_digest
from dataset_cache.encode_run import run_encode
from dataset_cache.errors import DatasetFolderError, SourceError
from dataset_cache.format.reader import open_cache
from dataset_cache.keys import conditioning_key
from dataset_cache.listing import list_folder
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)
CAPTIONS = {"a": "ohwx, red, round, shiny", "b": "ohwx, blue, square", "c": "ohwx, green, tall, thin, matte"}


def _image(path: Path, size: tuple[int, int], seed: int, mode: str = "RGB") -> None:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    Image.fromarray(arr, mode).save(path)


def _half_mask(path: Path, size: tuple[int, int], *, left_white: bool = True) -> None:
    arr = np.zeros((size[1], size[0]), dtype=np.uint8)
    if left_white:
        arr[:, : size[0] // 2] = 255
    else:
        arr[:, size[0] // 2:] = 255
    Image.fromarray(arr, "L").save(path)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    for i, (stem, caption) in enumerate(CAPTIONS.items()):
        _image(root / f"{stem}.png", (64, 64), i)
        (root / f"{stem}.txt").write_text(caption, encoding="utf-8")
    age(root)
    return root


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _plan(folder: Path, cache: Path, settings: EncodeSettings = BASE, *, text: str = "te-1") -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1",
                       text_fingerprint=text)


def _build(folder: Path, cache: Path, settings: EncodeSettings = BASE, *, text: str = "te-1"
           ) -> tuple[Any, FakeEncoders]:
    enc = FakeEncoders()
    return run_encode(_plan(folder, cache, settings, text=text), **enc.kw()), enc


def _stored(cache: Path) -> list[Any]:
    with open_cache(cache) as reader:
        return reader.dataset("ds")


# ------------------------------------------------------------------------------------------ empty caption

def test_enabling_the_empty_caption_encodes_one_conditioning_per_encoder_then_none(folder: Path,
                                                                                   cache: Path) -> None:
    _build(folder, cache, replace(BASE, caption_prefix="trigger, "))
    settings = replace(BASE, empty_caption=True, caption_prefix="trigger, ")
    report, enc = _build(folder, cache, settings)
    assert enc.texts == [""] and enc.images == 0  # "" itself: no prefix/suffix; no latent
    assert report.encoded_conditionings == 1 and report.encoded_empty_caption
    key = conditioning_key("", "te-1")
    assert all(s.empty_caption == key for s in _stored(cache))
    assert report.variants["empty_caption"] == 1 and "empty caption: encoded" in report.summary()
    again = _plan(folder, cache, settings)
    assert again.up_to_date and again.empty_caption == key
    # another text encoder: its own empty caption (and its captions), once
    report, enc = _build(folder, cache, settings, text="te-2")
    assert enc.texts.count("") == 1
    assert {s.empty_caption for s in _stored(cache)} == {conditioning_key("", "te-2")}


# ------------------------------------------------------------------------------------------ tag shuffles

def test_shuffle_keeps_tokens_and_tags_and_is_deterministic() -> None:
    line = "ohwx, a, b, c, d, e, f"
    texts = shuffle_tags(line, 16, keep_tokens=2)
    assert len(texts) == 16
    for t in texts:
        tags = t.split(", ")
        assert tags[:2] == ["ohwx", "a"] and sorted(tags[2:]) == ["b", "c", "d", "e", "f"]
    assert len(set(texts)) > 4  # really shuffled
    assert shuffle_tags(line, 16, keep_tokens=2) == texts
    assert shuffle_tags(line, 4, keep_tokens=2) == texts[:4]  # variant i depends on (line, i) alone
    assert shuffle_tags(" ohwx ,a,, b ", 1, keep_tokens=3) == ("ohwx, a, b",)  # stripped, empty tags dropped
    # the same in another process with another hash seed (no use of Python's salted hash)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from dataset_cache.captions import shuffle_tags; "
            f"print(repr(shuffle_tags({line!r}, 16, keep_tokens=2)))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[2])], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == repr(texts)


def _old_shuffle(line: str, variants: int, keep_tokens: int) -> tuple[str, ...]:
    """The generator of #16 (before #27): draw i with the seed xxh64("<i>\\0<line>"), duplicates and the line's own
    order allowed. Kept here to show that lines it served well keep their texts (and conditionings)."""
    import random

    import xxhash

    tags = [t for t in (part.strip() for part in line.split(",")) if t]
    fixed, rest = tags[:keep_tokens], tags[keep_tokens:]
    out = []
    for i in range(variants):
        order = list(rest)
        random.Random(xxhash.xxh64_intdigest(f"{i}\0{line}".encode())).shuffle(order)
        out.append(", ".join(fixed + order))
    return tuple(out)


def test_shuffle_variants_are_distinct_orders_and_never_the_lines_own_where_the_tags_allow() -> None:
    """#27 item 2: variants were drawn independently: "ohwx, red square, blue sky, outdoors" (keep 1, 2 variants)
    gave one text twice though 6 orders exist, and "ohwx, cat, sitting" gave its own order twice (never shuffled)."""
    line = "ohwx, red square, blue sky, outdoors"
    texts = shuffle_tags(line, 2, keep_tokens=1)
    assert len(set(texts)) == 2 and line not in texts and all(t.startswith("ohwx, ") for t in texts)
    assert set(shuffle_tags("ohwx, cat, sitting", 2, keep_tokens=1)) == {"ohwx, sitting, cat", "ohwx, cat, sitting"}
    assert shuffle_tags("a, b, c, d", 24)[-1] == "a, b, c, d"  # all 24 orders: the line's own last
    assert len(set(shuffle_tags("a, b, c, d", 24))) == 24 and "a, b, c, d" not in shuffle_tags("a, b, c, d", 23)
    assert sorted(shuffle_tags("a, a, b", 5)) == ["a, a, b", "a, b, a", "b, a, a"]  # repeated tags: 3 orders
    assert shuffle_tags("ohwx, cat", 4, keep_tokens=1) == ("ohwx, cat",)  # nothing to shuffle: the line once
    for n_tags in range(1, 7):
        for variants in (1, 2, 5, 6, 64):
            line = ", ".join(f"t{i}" for i in range(n_tags))
            orders = tag_orders(line, 0)
            texts = shuffle_tags(line, variants)
            assert len(texts) == len(set(texts)) == min(variants, orders)
            if orders - 1 >= variants:
                assert line not in texts


def test_lines_the_old_generator_served_well_keep_their_texts() -> None:
    """Caches encoded before #27 re-encode only the lines whose old shuffles repeated or were the line itself."""
    kept = changed = 0
    for n in range(3, 9):
        for k in range(20):
            line = ", ".join(f"tag{k}x{i}" for i in range(n))
            old = _old_shuffle(line, 4, 1)
            if len(set(old)) == 4 and line not in old:
                assert shuffle_tags(line, 4, keep_tokens=1) == old
                kept += 1
            else:
                assert shuffle_tags(line, 4, keep_tokens=1) != old
                changed += 1
    assert kept and changed  # both kinds were seen


def test_the_report_says_which_lines_cannot_be_shuffled_and_why(folder: Path, cache: Path) -> None:
    """#27 items 2 and 4: keep_tokens >= the tags used to turn shuffling off silently, and keep_tokens without
    shuffling was ignored silently; the plan's notes (the encode report's NOTE lines) now say both."""
    (folder / "a.txt").write_text("ohwx, cat", encoding="utf-8")  # keep_tokens 1: nothing left to shuffle
    (folder / "b.txt").write_text("solo", encoding="utf-8")  # one tag
    (folder / "c.txt").write_text("ohwx, red, round\nohwx, green, tall, thin", encoding="utf-8")  # 2 orders; 6
    notes = _plan(folder, cache, replace(BASE, shuffle_variants=3, keep_tokens=1)).notes
    assert ("1 caption line(s) cannot be shuffled: keep_tokens 1 keeps all their tags in place (or all but one), so "
            "they train unshuffled (e.g. 'ohwx, cat'); lower keep_tokens") in notes
    assert ("1 caption line(s) cannot be shuffled: they have one comma-separated tag (or only the same tag repeated), "
            "so they train unshuffled (e.g. 'solo')") in notes
    assert ("1 caption line(s) have fewer tag orders than shuffle_variants 3 asks for (e.g. 'ohwx, red, round': 2 "
            "orders): each gives every order it has, its own among them") in notes
    assert ("keep_tokens 2 has no effect: shuffle_variants is 0, so no tags are shuffled (set shuffle_variants to "
            "shuffle the tags after the first keep_tokens)") in _plan(folder, cache, replace(BASE, keep_tokens=2)).notes
    report, _ = _build(folder, cache, replace(BASE, shuffle_variants=3, keep_tokens=1))
    assert "NOTE: 1 caption line(s) cannot be shuffled: keep_tokens 1" in report.summary()
    assert not [n for n in _plan(folder, cache).notes if "shuffle" in n or "keep_tokens" in n]


def test_shuffle_encodes_n_variants_per_line_and_only_a_changed_lines(folder: Path, cache: Path) -> None:
    settings = replace(BASE, shuffle_variants=3, keep_tokens=1, caption_prefix="pre ")
    report, enc = _build(folder, cache, settings)
    expected = {settings.caption_text(t) for line in CAPTIONS.values() for t in shuffle_tags(line, 3, 1)}
    assert set(enc.texts) == expected and len(enc.texts) == len(expected)
    assert all(t.startswith("pre ohwx, ") for t in enc.texts)  # keep_tokens, then the prefix
    originals = {settings.caption_text(line) for line in CAPTIONS.values()}
    stored = {s.source: s for s in _stored(cache)}
    for stem, line in CAPTIONS.items():
        want = tuple(dict.fromkeys(conditioning_key(settings.caption_text(t), "te-1")
                                   for t in shuffle_tags(line, 3, 1)))
        assert stored[f"{stem}.png"].captions == want
    assert not any(conditioning_key(t, "te-1") in {k for s in stored.values() for k in s.captions}
                   for t in originals - expected)  # the unshuffled line is not a variant
    assert report.variants["shuffle_variants"] == 3 and "tag shuffles" in report.summary()
    # edit one caption: only its variants are encoded, no latent
    (folder / "b.txt").write_text("ohwx, blue, square, striped", encoding="utf-8")
    report, enc = _build(folder, cache, settings)
    assert enc.images == 0 and 1 <= len(enc.texts) <= 3
    assert set(enc.texts) == {settings.caption_text(t) for t in shuffle_tags("ohwx, blue, square, striped", 3, 1)}
    assert _plan(folder, cache, settings).up_to_date


def test_switching_shuffle_on_reencodes_no_latent_and_old_lines_stay_keyed(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    report, enc = _build(folder, cache, replace(BASE, shuffle_variants=2))
    assert enc.images == 0 and report.encoded_latents == 0 and report.encoded_conditionings > 0


# ------------------------------------------------------------------------------------------ flips

def test_flip_none_to_random_encodes_only_the_mirrors(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    before = {s.source: s for s in _stored(cache)}
    rand = replace(BASE, bucket=replace(BASE.bucket, flip="random"))
    plan = _plan(folder, cache, rand)
    assert plan.latent_count == 3 and not plan.missing_conditionings
    assert all(j.mirror for jobs in plan.missing_latents.values() for j in jobs)
    report, enc = run_encode(plan, **(enc := FakeEncoders()).kw()), enc
    assert enc.images == 3 and enc.texts == [] and report.encoded_mirrors == 3
    after = {s.source: s for s in _stored(cache)}
    assert all(after[k].latent == before[k].latent for k in before)  # the unflipped latents keep their keys
    # the mirrors are exactly the latents flip=always gives, so a switch to always encodes nothing
    always = replace(BASE, bucket=replace(BASE.bucket, flip="always"))
    assert {s.latent for s in _plan(folder, cache, always).samples} == {s.mirror for s in after.values()}
    assert _plan(folder, cache, always).latent_count == 0
    # #27 item 9: the report of flip=always had no variants line
    assert "variants: flip always: all 3 samples stored mirrored (training never sees the originals)" in \
        run_encode(_plan(folder, cache, always), **FakeEncoders().kw()).summary()
    with open_cache(cache) as reader:
        s = after["a.png"]
        lat, mir = reader.read([s.latent, s.mirror])
    assert torch.allclose(lat["samples"].flip(-1), mir["samples"], atol=1e-6)  # really the mirror image
    assert report.variants["mirrors"] == 3


def test_bool_flip_is_taken_as_a_mode_and_described_as_before() -> None:
    assert BucketConfig(flip=True).flip == "always" and BucketConfig(flip=False) == BucketConfig()
    assert BucketConfig(flip=True).describe()["flip"] is True and BucketConfig().describe()["flip"] is False
    assert BucketConfig(flip="random").describe()["flip"] == "random"
    plan = BucketConfig(resolution=64, step=16, min_side=32, flip="random").plan(64, 64)
    assert plan.flip is False and BucketConfig(flip="random").mirror_plan(plan).flip is True
    with pytest.raises(ValueError, match="flip"):
        BucketConfig(flip="sometimes")


# ------------------------------------------------------------------------------------------ masks

def test_masks_are_cached_at_latent_resolution_and_a_mask_edit_encodes_only_the_mask(folder: Path,
                                                                                     cache: Path) -> None:
    _half_mask(folder / "a-masklabel.png", (64, 64))
    _half_mask(folder / "b-masklabel.png", (128, 128), left_white=False)  # same shape, another size: resized
    age(folder)
    settings = replace(BASE, masks="masklabel")
    plan = _plan(folder, cache, settings)
    assert len(plan.missing_masks) == 2 and plan.images_without_mask == 1 and plan.latent_count == 3
    assert any("1 image(s) have no mask file" in n for n in plan.notes)
    report, enc = run_encode(plan, **(enc := FakeEncoders()).kw()), enc
    assert report.encoded_masks == 2 and report.variants["masked_samples"] == 2
    stored = {s.source: s for s in _stored(cache)}
    assert stored["c.png"].mask is None
    with open_cache(cache) as reader:
        lat, mask_a, mask_b = reader.read([stored["a.png"].latent, stored["a.png"].mask, stored["b.png"].mask])
    m = mask_a["mask"]
    assert m.dtype == torch.uint8 and tuple(m.shape) == (1, 1, *lat["samples"].shape[-2:])
    w = m.shape[-1]
    assert (m[..., : w // 2] == 255).all() and (m[..., w // 2:] == 0).all()
    # resized from 128x128: the cells beside the edge are blurred a little by the resize, the rest exact
    b = mask_b["mask"][0, 0].int()
    assert (b[:, : w // 2 - 1] == 0).all() and (b[:, w // 2 + 1:] == 255).all()
    assert (b[:, w // 2 - 1] < 32).all() and (b[:, w // 2] > 223).all()
    warm = _plan(folder, cache, settings)  # mask files are trusted by their stat, like images: none is opened
    assert warm.up_to_date and warm.validation.hashed == 0 and warm.validation.unchanged == (
        "a-masklabel.png", "a.png", "a.txt", "b-masklabel.png", "b.png", "b.txt", "c.png", "c.txt")
    # a mask edit: one mask, no latent, no conditioning, no VAE needed
    _half_mask(folder / "a-masklabel.png", (64, 64), left_white=False)
    plan = _plan(folder, cache, settings)
    assert plan.latent_count == 0 and not plan.missing_conditionings and len(plan.missing_masks) == 1
    assert not plan.needs_vae and not plan.needs_text_encoder
    report = run_encode(plan, encode_images=None, encode_texts=None)
    assert report.encoded_masks == 1 and report.encoded_latents == 0
    after = {s.source: s for s in _stored(cache)}
    assert after["a.png"].latent == stored["a.png"].latent and after["a.png"].mask != stored["a.png"].mask
    assert after["b.png"].mask == stored["b.png"].mask


def test_unknown_factor_asks_for_the_vae(folder: Path, cache: Path) -> None:
    _half_mask(folder / "a-masklabel.png", (64, 64))
    _build(folder, cache)
    plan = _plan(folder, cache, replace(BASE, masks="masklabel", mask_factor=None))
    assert plan.latent_count == 0 and plan.missing_masks and plan.needs_vae
    with pytest.raises(ValueError, match="spatial compression"):
        run_encode(plan, **FakeEncoders().kw())


def test_mask_files_never_become_samples(folder: Path, cache: Path) -> None:
    _half_mask(folder / "a-masklabel.png", (64, 64))
    _half_mask(folder / "zzz-MaskLabel.png", (64, 64))  # no image zzz.*: unused
    listing = list_folder(folder)
    assert [i.relpath for i in listing.images] == ["a.png", "b.png", "c.png"]
    assert listing.mask_of == {"a.png": "a-masklabel.png"} and listing.unused_masks == ("zzz-MaskLabel.png",)
    for mode in ("none", "masklabel", "alpha"):
        plan = _plan(folder, cache, replace(BASE, masks=mode))
        assert sorted(s.source for s in plan.samples) == ["a.png", "b.png", "c.png"]
    plan = _plan(folder, cache, replace(BASE, masks="masklabel"))
    assert plan.unused_masks == 1 and any("belong to no image" in n for n in plan.notes)
    assert any("masks is none" in n for n in _plan(folder, cache).notes)


def test_mask_files_of_clips_are_unused_and_never_frames(tmp_path: Path) -> None:
    root = tmp_path / "clips"
    (root / "jump.frames").mkdir(parents=True)
    for i in range(2):
        _image(root / "jump.frames" / f"{i:04d}.png", (32, 32), i)
        _half_mask(root / "jump.frames" / f"{i:04d}-masklabel.png", (32, 32))
    (root / "walk.mp4").write_bytes(b"listing opens no file")
    _half_mask(root / "walk-masklabel.png", (32, 32))
    listing = list_folder(root)
    assert [i.relpath for i in listing.images] == ["jump.frames/0000.png", "jump.frames/0001.png", "walk.mp4"]
    assert listing.mask_of == {} and len(listing.unused_masks) == 3
    assert {m[0] for m in listing.masks} == set(listing.unused_masks)


def test_alpha_masks(folder: Path, cache: Path) -> None:
    arr = np.full((64, 64, 4), 200, dtype=np.uint8)
    arr[:32, :, 3] = 0  # top half transparent, bottom opaque
    arr[32:, :, 3] = 255
    Image.fromarray(arr, "RGBA").save(folder / "a.png")
    (folder / "c.png").unlink()
    _image(folder / "c.jpg", (64, 64), 2)
    report, _ = _build(folder, cache, replace(BASE, masks="alpha"))
    stored = {s.source: s for s in _stored(cache)}
    with open_cache(cache) as reader:
        (mask,) = reader.read([stored["a.png"].mask])
    h = mask["mask"].shape[-2]
    assert (mask["mask"][..., : h // 2, :] == 0).all() and (mask["mask"][..., h // 2:, :] == 255).all()
    # #27 item 3: images without alpha (an RGB PNG, a JPEG) used to get an all-255 mask and count as "masked";
    # they get no mask (trained as with masks none), and the report names them
    assert stored["b.png"].mask is None and stored["c.jpg"].mask is None
    summary = report.summary()
    assert "masks: 1 made, 1 in the dataset (1 of 3 samples masked)" in summary
    assert "NOTE: 2 image(s) have no alpha channel (e.g. JPEGs) and train unmasked, as with masks none: b.png, " \
           "c.jpg" in summary
    assert _plan(folder, cache, replace(BASE, masks="alpha")).up_to_date  # and a warm plan stays current


def test_hostile_masks_are_refused_by_name(folder: Path, cache: Path, tmp_path: Path) -> None:
    (folder / "a-masklabel.png").write_bytes(b"not a png at all")
    _half_mask(folder / "b-masklabel.png", (64, 32))  # another aspect ratio
    outside = tmp_path / "outside.png"
    _half_mask(outside, (64, 64))
    os.symlink(outside, folder / "c-masklabel.png")
    settings = replace(BASE, masks="masklabel")
    plan = _plan(folder, cache, settings)
    reasons = {f.relpath: f.reason for f in plan.failures}
    assert "not a readable image" in reasons["a-masklabel.png"]
    assert "aspect ratio" in reasons["b-masklabel.png"] and "64x32" in reasons["b-masklabel.png"]
    assert "outside the dataset folder" in reasons["c-masklabel.png"]
    assert "c.png" in reasons and plan.samples == ()
    with pytest.raises(DatasetFolderError):
        run_encode(plan, **FakeEncoders().kw())  # nothing left to train on: said, never a crash
    with pytest.raises(SourceError, match="masklabel"):
        run_encode(_plan(folder, cache, replace(settings, failure_policy="stop")), **FakeEncoders().kw())
    # without masks, the mask files are ignored (the outside link is still refused, as any link is)
    plan = _plan(folder, cache)
    assert len(plan.samples) == 3


def test_a_mask_corrupt_after_its_header_is_a_named_encode_failure(folder: Path, cache: Path) -> None:
    _half_mask(folder / "a-masklabel.png", (64, 64))
    data = (folder / "a-masklabel.png").read_bytes()
    (folder / "a-masklabel.png").write_bytes(data[: len(data) // 2])  # header intact, pixels cut
    report, enc = _build(folder, cache, replace(BASE, masks="masklabel"))
    assert any(f.relpath == "a-masklabel.png" for f in report.failures)
    assert sorted(s.source for s in _stored(cache)) == ["b.png", "c.png"] and report.skipped == 1


# ------------------------------------------------------------------------------------------ old datasets

def test_datasets_encoded_without_variants_stay_current(folder: Path, cache: Path) -> None:
    _build(folder, cache, EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32, flip=False),
                                         batch_size=2))
    with open_cache(cache) as reader:
        info = reader.datasets()["ds"].info
    assert not {"shuffle_variants", "keep_tokens", "empty_caption", "masks"} & set(info["settings"])
    assert info["settings"]["bucket"]["flip"] is False
    plan = _plan(folder, cache, BASE)  # the defaults of every new setting
    assert plan.up_to_date and plan.dataset_current and samples_digest(plan.samples) == info["samples_digest"]
    report, enc = _build(folder, cache, BASE)
    assert enc.calls == 0 and report.encoded == 0
    with open_cache(cache) as reader:
        assert reader.datasets()["ds"].info == info  # not even rewritten
    assert all(s.mirror is None and s.mask is None and s.empty_caption is None for s in plan.samples)
    # a sourceless dataset refuses settings it was not built with, accepts those it was
    folder.rename(folder.parent / "gone")
    assert _plan(folder, cache, BASE).sourceless
    for changed in (replace(BASE, empty_caption=True), replace(BASE, shuffle_variants=2),
                    replace(BASE, masks="alpha"), replace(BASE, bucket=replace(BASE.bucket, flip="random"))):
        with pytest.raises(DatasetFolderError, match="encoded with other"):
            _plan(folder, cache, changed)
    assert _plan(folder, cache, replace(BASE, keep_tokens=3)).sourceless  # no effect without shuffling


def test_lines_times_shuffles_above_the_variant_limit_leave_the_image_out_by_name(folder: Path, cache: Path) -> None:
    """5 lines × 64 shuffles would be 320 encodes for one image: above MAX_CAPTION_VARIANTS, the image is a failure
    naming both numbers; 4 lines × 64 (256) still plan."""
    from dataset_cache.captions import MAX_CAPTION_VARIANTS, MAX_SHUFFLE_VARIANTS

    tags = ", ".join(f"tag{i}" for i in range(12))
    (folder / "a.txt").write_text("\n".join(f"{tags}, line{j}" for j in range(5)), encoding="utf-8")
    (folder / "b.txt").write_text("\n".join(f"{tags}, line{j}" for j in range(4)), encoding="utf-8")
    settings = replace(BASE, shuffle_variants=MAX_SHUFFLE_VARIANTS)
    plan = _plan(folder, cache, settings)
    assert [f.relpath for f in plan.failures] == ["a.png"]
    assert f"5 lines × {MAX_SHUFFLE_VARIANTS} tag shuffles = 320 caption variants, above the limit of " \
           f"{MAX_CAPTION_VARIANTS}" in plan.failures[0].reason
    b = next(s for s in plan.samples if s.source == "b.png")
    assert len(b.captions) == 4 * MAX_SHUFFLE_VARIANTS


def test_variants_survive_the_folder_going_away_and_clean(folder: Path, cache: Path) -> None:
    """Sourceless training keeps every variant: with the folder gone, the plan serves the stored dataset (mirrors,
    masks, shuffles, the empty caption), needs no encoder, and clean finds nothing of it unreferenced; asking for
    other variant settings then is refused naming them (they cannot be encoded without the folder)."""
    import shutil

    from dataset_cache.clean import preview_clean

    _half_mask(folder / "a-masklabel.png", (64, 64))
    age(folder)
    settings = replace(BASE, bucket=replace(BASE.bucket, flip="random"), shuffle_variants=2, keep_tokens=1,
                       empty_caption=True, masks="masklabel")
    _build(folder, cache, settings)
    stored = _stored(cache)
    assert all(s.mirror and s.empty_caption for s in stored) and any(s.mask for s in stored)
    shutil.rmtree(folder)
    plan = _plan(folder, cache, settings)
    assert plan.sourceless and plan.up_to_date and not plan.needs_vae and not plan.needs_text_encoder
    assert list(plan.samples) == stored
    report = run_encode(plan, encode_images=None, encode_texts=None)
    assert report.samples == len(stored) and _stored(cache) == stored
    assert preview_clean(cache).unreferenced == ()
    with pytest.raises(DatasetFolderError, match="shuffle_variants"):
        _plan(folder, cache, replace(settings, shuffle_variants=3))
    with pytest.raises(DatasetFolderError, match="empty_caption"):
        _plan(folder, cache, replace(settings, empty_caption=False))
