"""Multi-resolution datasets (``EncodeSettings.extra_resolutions``): every image encoded at each resolution, a
sample per distinct crop plan, each resolution's latents content-keyed as a dataset of that resolution alone keys
them, so adding a resolution encodes only its latents.

Encoders are the counting fakes of ``support.fake_encoders``; folders are small and written here with Pillow.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import MAX_EXTRA_RESOLUTIONS, EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.errors import DatasetFolderError
from dataset_cache.format.reader import open_cache
from support.fake_encoders import FakeEncoders, age

BASE = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2, mask_factor=8)
SIZES = {"a": (128, 128), "b": (160, 96), "c": (48, 48)}  # c is smaller than every bucket above 48


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB").save(path)


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    for i, (stem, size) in enumerate(SIZES.items()):
        _image(root / f"{stem}.png", size, i)
        (root / f"{stem}.txt").write_text(f"a photo of {stem}", encoding="utf-8")
    age(root)
    return root


def _plan(folder: Path, cache: Path, settings: EncodeSettings) -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1", text_fingerprint="t")


def _buckets(plan: Any) -> dict[str, list[tuple[int, int]]]:
    """Each source's latent buckets, in sample order."""
    jobs = {job.key: job for jobs in plan.missing_latents.values() for job in jobs}
    out: dict[str, list[tuple[int, int]]] = {}
    for s in plan.samples:
        out.setdefault(s.source, []).append(jobs[s.latent].plan.bucket)
    return out


def test_each_image_is_a_sample_at_each_resolution_with_that_resolutions_buckets(folder: Path,
                                                                               tmp_path: Path) -> None:
    settings = replace(BASE, extra_resolutions=(96, 128))
    plan = _plan(folder, tmp_path / "cache", settings)
    buckets = _buckets(plan)
    for source in ("a.png", "b.png"):
        sides = [w * h for w, h in buckets[source]]
        assert len(sides) == 3 and sides == sorted(sides) and sides[0] <= 64 * 64 < sides[1] <= 96 * 96 < sides[2]
    assert buckets["a.png"] == [(64, 64), (96, 96), (128, 128)]
    # each resolution's buckets are those a dataset of that resolution alone plans: the same latent keys
    for config in settings.bucket_configs():
        alone = _plan(folder, tmp_path / "cache", replace(BASE, bucket=config))
        assert {s.latent for s in alone.samples} <= {s.latent for s in plan.samples}
    # captions are one image's, shared by its resolutions; none is counted as skipped
    a = [s for s in plan.samples if s.source == "a.png"]
    assert len({s.captions for s in a}) == 1 and plan.skipped == 0


def test_a_plan_two_resolutions_share_is_one_sample(folder: Path, tmp_path: Path) -> None:
    """Upscale off: the 48² image keeps its own size at 64 and at 96, one sample; at 128 too."""
    settings = replace(BASE, bucket=replace(BASE.bucket, upscale=False), extra_resolutions=(96, 128))
    buckets = _buckets(_plan(folder, tmp_path / "cache", settings))
    assert buckets["c.png"] == [(48, 48)]
    assert buckets["a.png"] == [(64, 64), (96, 96), (128, 128)]


def test_adding_a_resolution_encodes_only_its_latents(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    enc = FakeEncoders()
    run_encode(_plan(folder, cache, BASE), **enc.kw())
    assert enc.images == 3
    settings = replace(BASE, extra_resolutions=(96,))
    enc = FakeEncoders()
    report = run_encode(_plan(folder, cache, settings), **enc.kw())
    assert enc.images == 3 and enc.texts == [] and report.encoded_conditionings == 0
    with open_cache(cache) as reader:
        stored = reader.dataset("ds")
        info = reader.datasets()["ds"].info
        shapes = {s.source: [tuple(reader.tensor_shapes(x.latent)["samples"]) for x in stored if x.source == s.source]
                  for s in stored}
    assert len(stored) == 6 and report.samples == 6
    assert info["settings"]["extra_resolutions"] == [96]
    assert shapes["a.png"] == [(1, 4, 8, 8), (1, 4, 12, 12)]  # the fakes' latents: 8× average-pooled
    again = _plan(folder, cache, settings)
    assert again.up_to_date and again.dataset_current


def test_datasets_of_one_resolution_stay_current_and_a_sourceless_one_refuses_more(folder: Path,
                                                                                  tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run_encode(_plan(folder, cache, BASE), **FakeEncoders().kw())
    with open_cache(cache) as reader:
        assert "extra_resolutions" not in reader.datasets()["ds"].info["settings"]
    folder.rename(tmp_path / "gone")
    assert _plan(folder, cache, BASE).sourceless
    with pytest.raises(DatasetFolderError, match="encoded with other"):
        _plan(folder, cache, replace(BASE, extra_resolutions=(96,)))


def test_a_config_at_another_resolution_scales_its_side_limits() -> None:
    config = BucketConfig(resolution=512, step=64, min_side=256, max_side=1024)
    at = config.at_resolution(1024)
    assert (at.resolution, at.min_side, at.max_side, at.step) == (1024, 512, 2048, 64)
    assert config.at_resolution(128).min_side == 64  # at least one step
    with pytest.raises(ValueError, match="fixed bucket size"):
        BucketConfig(fixed=(512, 512), step=64).at_resolution(768)


@pytest.mark.parametrize(("extra", "error", "match"), [
    ((64,), ValueError, "repeats a resolution"),
    ((96, 96), ValueError, "repeats a resolution"),
    ((8,), ValueError, "below the bucket step"),
    (tuple(range(96, 96 + 16 * (MAX_EXTRA_RESOLUTIONS + 1), 16)), ValueError, f"at most {MAX_EXTRA_RESOLUTIONS}"),
    ([96], TypeError, "tuple of ints"),
    ((96.0,), TypeError, "tuple of ints"),
])
def test_bad_extra_resolutions_are_refused_naming_the_setting(extra: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        replace(BASE, extra_resolutions=extra)


def test_a_fixed_size_has_no_extra_resolution() -> None:
    with pytest.raises(ValueError, match="needs bucketing"):
        EncodeSettings(bucket=BucketConfig(fixed=(64, 64), step=16), extra_resolutions=(96,))
