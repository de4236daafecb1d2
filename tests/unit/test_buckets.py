"""Tests of dataset_cache.buckets: bucket generation, aspect assignment, crop plans."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_cache.buckets import PIXEL_RULES, BucketConfig, CropPlan, make_buckets, nearest_bucket

KOHYA_512 = (
    (256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640), (448, 576), (512, 512),
    (576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (896, 256), (960, 256), (1024, 256),
)


def test_buckets_match_kohya_for_512() -> None:
    # kohya make_bucket_resolutions((512, 512), 256, 1024, 64)
    assert make_buckets(512, step=64, min_side=256, max_side=1024) == KOHYA_512


@pytest.mark.parametrize("resolution,step", [(512, 64), (768, 64), (1024, 64), (1024, 32), (640, 16)])
def test_bucket_invariants(resolution: int, step: int) -> None:
    buckets = make_buckets(resolution, step=step, min_side=256)
    assert buckets == tuple(sorted(set(buckets)))
    square = resolution // step * step
    assert (square, square) in buckets
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= resolution * resolution
        assert 256 <= min(w, h) and max(w, h) <= 2 * resolution
        assert (h, w) in buckets


def test_max_aspect_drops_elongated_buckets() -> None:
    buckets = make_buckets(512, min_side=256, max_side=1024, max_aspect=2.0)
    assert all(max(b) <= 2 * min(b) for b in buckets)
    assert (832, 256) not in buckets and (640, 384) in buckets


def test_nearest_bucket_by_aspect() -> None:
    assert nearest_bucket(1000, 1000, KOHYA_512) == (512, 512)
    assert nearest_bucket(1600, 960, KOHYA_512) == (640, 384)
    assert nearest_bucket(960, 1600, KOHYA_512) == (384, 640)
    assert nearest_bucket(10000, 10, KOHYA_512) == (1024, 256)  # beyond the widest: clamps to it


@given(st.integers(1, 5000), st.integers(1, 5000))
@settings(max_examples=300, deadline=None)
def test_assignment_is_symmetric_under_transpose(w: int, h: int) -> None:
    cfg = BucketConfig(resolution=512)
    bw, bh = cfg.assign(w, h)
    tw, th = cfg.assign(h, w)
    # log distance is symmetric, so the transposed image lands as close to its bucket (the mirrored bucket,
    # unless an exact tie broke the other way)
    d1 = abs(math.log(bw / bh) - math.log(w / h))
    d2 = abs(math.log(th / tw) - math.log(w / h))
    assert math.isclose(d1, d2, abs_tol=1e-12)
    assert (tw, th) == (bh, bw) or not math.isclose(d1, 0.0)


@given(st.integers(1, 6000), st.integers(1, 6000), st.sampled_from(["center", "random"]), st.text(max_size=8))
@settings(max_examples=300, deadline=None)
def test_plan_invariants(w: int, h: int, crop: str, token: str) -> None:
    cfg = BucketConfig(resolution=512, crop=crop, seed=7)
    plan = cfg.plan(w, h, token=token)
    bw, bh = plan.bucket
    rw, rh = plan.resize
    left, top, right, bottom = plan.crop
    assert plan.source == (w, h)
    assert plan.bucket in cfg.buckets
    assert rw >= bw and rh >= bh
    assert (right - left, bottom - top) == (bw, bh)
    assert 0 <= left and 0 <= top and right <= rw and bottom <= rh
    assert rw == bw or rh == bh  # resize just covers the bucket
    # aspect kept within rounding of one pixel
    assert abs(rw * h - rh * w) <= max(w, h)
    assert cfg.plan(w, h, token=token) == plan  # deterministic


def test_center_crop_is_centered() -> None:
    plan = BucketConfig(resolution=512).plan(1000, 500)
    assert plan.bucket == (704, 320)
    assert plan.resize == (704, 352) or plan.resize[1] == 320
    left, top, right, bottom = plan.crop
    rw, rh = plan.resize
    assert left == (rw - 704) // 2 and top == (rh - 320) // 2


def test_random_crop_is_seeded_by_seed_and_token() -> None:
    cfg = BucketConfig(resolution=512, crop="random", seed=1)
    plans = {cfg.plan(1000, 333, token=f"img{i}").crop for i in range(20)}
    assert len(plans) > 1  # crops vary between images
    assert cfg.plan(1000, 333, token="img0") == cfg.plan(1000, 333, token="img0")
    other_seed = BucketConfig(resolution=512, crop="random", seed=2)
    assert any(other_seed.plan(1000, 333, token=f"img{i}").crop != cfg.plan(1000, 333, token=f"img{i}").crop
               for i in range(20))


def test_fixed_size_disables_bucketing() -> None:
    cfg = BucketConfig(fixed=(512, 768))
    assert cfg.buckets == ((512, 768),)
    plan = cfg.plan(2000, 1000)
    assert plan.bucket == (512, 768) and plan.resize == (1536, 768)
    assert plan.crop == (512, 0, 1024, 768)


def test_key_fields_carry_every_pixel_setting() -> None:
    plan = BucketConfig(resolution=512, flip=True, method="bicubic").plan(800, 600)
    fields = plan.key_fields()
    assert fields == {
        "bucket": list(plan.bucket), "resize": list(plan.resize), "crop": list(plan.crop), "flip": True,
        "method": "bicubic", "rules": PIXEL_RULES,
    }
    assert isinstance(plan, CropPlan)


def test_describe_is_plain_json() -> None:
    import json

    cfg = BucketConfig(resolution=768, max_aspect=3.0, fixed=None, crop="random", seed=3)
    assert json.loads(json.dumps(cfg.describe()))["resolution"] == 768


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"crop": "top"}, "crop must be one of"),
        ({"method": "cubic"}, "resize method must be one of"),
        ({"max_aspect": 0.5}, "max_aspect must be >= 1.0"),
        ({"fixed": (500, 512)}, "fixed size .* multiples of step"),
        ({"min_side": 250}, "multiples of step"),
        ({"resolution": 128}, "outside \\[min_side=256"),
        ({"step": 0}, "step must be a positive int"),
    ],
)
def test_invalid_configs_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketConfig(**kwargs)


def test_nearest_bucket_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        nearest_bucket(0, 10, KOHYA_512)


# ------------------------------------------------------------------------------------------ no upscale
def test_without_upscale_a_small_image_keeps_its_size_rounded_down_to_the_step() -> None:
    up = BucketConfig(resolution=8192, step=16, min_side=256)
    keep = BucketConfig(resolution=8192, step=16, min_side=256, upscale=False)
    big = up.plan(64, 48)
    assert big.bucket[0] * big.bucket[1] > 4096 * 4096  # the old default: a 64 px image becomes a huge bucket
    small = keep.plan(70, 50)
    assert small.bucket == (64, 48) and small.resize[0] <= 70 and small.resize[1] <= 50
    with pytest.raises(ValueError, match="the image is 5x5, smaller than one bucket step"):
        keep.plan(5, 5)  # under one step: refused (the plan names the file), never blown up
    large = keep.plan(20000, 10000)  # larger than its bucket: bucketed as always
    assert large == up.plan(20000, 10000)
    assert keep.describe()["upscale"] is False and up.describe()["upscale"] is True
    assert small.key_fields() != up.plan(70, 50).key_fields()  # the setting reaches the latent key


@given(w=st.integers(16, 3000), h=st.integers(16, 3000), res=st.sampled_from([256, 512, 1024, 8192]))
def test_without_upscale_no_image_is_ever_enlarged(w: int, h: int, res: int) -> None:
    plan = BucketConfig(resolution=res, step=16, min_side=16, upscale=False).plan(w, h)
    assert plan.resize[0] <= w and plan.resize[1] <= h
    assert plan.bucket[0] % 16 == 0 and plan.bucket[1] % 16 == 0
    assert plan.bucket[0] * plan.bucket[1] <= max(res * res, 16 * 16)


@pytest.mark.parametrize("crop", ["center", "random"])
@pytest.mark.parametrize("flip", ["none", "always"])
def test_fit_plan_fits_a_companion_image_into_the_plans_bucket(crop: str, flip: str) -> None:
    config = BucketConfig(resolution=256, step=32, min_side=64, crop=crop, seed=3, flip=flip)
    plan = config.plan(300, 200, token="img")
    assert config.fit_plan(plan, 300, 200, token="img") == plan  # the same size: the very same pixels
    other = config.fit_plan(plan, 1000, 500, token="img")
    rw, rh = other.resize
    left, top, right, bottom = other.crop
    assert other.bucket == plan.bucket and (right - left, bottom - top) == plan.bucket
    assert rw >= plan.bucket[0] and rh >= plan.bucket[1] and right <= rw and bottom <= rh
    assert other.flip == plan.flip and other.method == plan.method
    small = BucketConfig(resolution=256, step=32, min_side=64, upscale=False)
    tiny = small.plan(100, 70)
    assert tiny.bucket == (96, 64) and small.fit_plan(tiny, 50, 40).bucket == (96, 64)  # a smaller one is upscaled
