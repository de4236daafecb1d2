"""Clips as samples (dataset_cache.video, .scan, .encode_plan, .incremental): frame sampling, scanning videos and
``.frames`` folders, keys, hostile inputs, and the incremental guarantees for clips.

Clips are generated at test time: ``.frames`` folders with Pillow, videos with PyAV (tests that need a video are
skipped where PyAV is missing; ComfyUI installs it). Encoders are the counting fakes of ``support.fake_encoders``.
"""

from __future__ import annotations

import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.errors import DatasetFolderError, SourceError
from dataset_cache.format.reader import open_cache
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.listing import list_folder
from dataset_cache.scan import scan_folder
from dataset_cache.keys import latent_key
from dataset_cache.frames import (MAX_CLIP_FRAMES, MIN_FPS, FrameSettings, clip_folder_of, frame_order,
                                  legacy_clip_key_fields)
from dataset_cache.video import has_av, load_clip, probe_video
from support.clips import level, make_frames_folder, make_video, truncate
from support.fake_encoders import FakeEncoders, age

needs_av = pytest.mark.skipif(not has_av(), reason="PyAV (av) is not installed in this Python")
BUCKET = BucketConfig(resolution=64, step=16, min_side=32)


def _settings(**video: Any) -> EncodeSettings:
    return EncodeSettings(bucket=BUCKET, batch_size=2, video=FrameSettings(**{"stride": 4, **video}))


def _plan(folder: Path, cache: Path, settings: EncodeSettings, vae: str = "vae-1") -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint=vae, text_fingerprint="te-1")


def _levels(frames: torch.Tensor) -> list[int]:
    """Which generated frame each decoded row is (frames are flat grey levels of 10 * i)."""
    return [round(float(v) * 255 / 10) for v in frames]


# ------------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize(("settings", "total", "expected"), [
    ({"frames": 5}, 20, (0, 1, 2, 3, 4)),
    ({"frames": 5, "sampling": "every_k", "every": 3}, 20, (0, 3, 6, 9, 12)),
    ({"frames": 5, "sampling": "uniform"}, 9, (0, 2, 4, 6, 8)),
    ({"frames": 3, "sampling": "uniform"}, 10, (0, 5, 9)),  # exact rounding of i * 9 / 2
    ({"frames": 1, "sampling": "uniform"}, 10, (5,)),  # the middle frame, as ComfyUI's Sample Video Frame
    ({"frames": 9}, 4, (0, 1, 2, 3)),  # a short clip gives what it has (stride 1)
    ({"frames": 9, "stride": 4}, 7, (0, 1, 2, 3, 4)),  # ... rounded down to 1 + 4m
    ({"frames": 10, "stride": 4}, 20, tuple(range(9))),  # the setting too
    ({"frames": 9, "sampling": "every_k", "every": 4, "stride": 4}, 20, (0, 4, 8, 12, 16)),
])
def test_frame_indices(settings: dict[str, Any], total: int, expected: tuple[int, ...]) -> None:
    assert FrameSettings(**{"stride": 1, **settings}).indices(total) == expected


def test_fps_resamples_a_video_before_sampling() -> None:
    half = FrameSettings(frames=4, fps=12, stride=1)
    assert half.indices(20, Fraction(24)) == (0, 2, 4, 6)  # 24 fps taken at 12: every other frame
    assert half.indices(20, None) == (0, 1, 2, 3)  # no rate (a frame folder): as it is
    assert FrameSettings(frames=4, fps=48, stride=1).indices(20, Fraction(24)) == (0, 0, 1, 1)
    ntsc = FrameSettings(frames=3, fps=10, stride=1).indices(100, Fraction(30000, 1001))
    assert ntsc == (0, 2, 5)  # floor(j * 29.97 / 10)
    short = FrameSettings(frames=9, fps=4, stride=4).indices(8, Fraction(8))  # 8 frames at 8 fps = 4 at 4 fps
    assert short == (0,)  # 4 resampled frames round down to 1 for stride 4


@pytest.mark.parametrize("bad", [
    {"frames": 0}, {"frames": MAX_CLIP_FRAMES + 1}, {"frames": 10**18}, {"frames": 2.5}, {"sampling": "random"},
    {"every": 0}, {"every": 10**12}, {"fps": -1.0}, {"fps": float("nan")}, {"fps": float("inf")}, {"fps": 1e9},
    {"stride": -1}, {"stride": 10**6}, {"frames": True},
])
def test_hostile_frame_settings_are_refused_naming_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="frame|fps|stride"):
        FrameSettings(**bad)


@pytest.mark.parametrize("fps", [5e-324, 1e-7, 4.9e-7, 0.009, float("nan"), 1000.5])
def test_an_fps_near_zero_is_refused_naming_fps_and_the_range(fps: float) -> None:
    """fps between 0 and 5e-7 used to pass and then divide by zero while planning, naming nothing."""
    with pytest.raises(ValueError, match=r"fps must be 0 \(each video's own rate\) or a rate from 0.01 to 1000"):
        FrameSettings(fps=fps)


def test_the_lowest_fps_resamples_without_dividing_by_zero() -> None:
    slow = FrameSettings(frames=5, fps=MIN_FPS, stride=1)
    assert slow.indices(100_000, Fraction(30)) == (0, 3000, 6000, 9000, 12000)  # a frame every 100 s
    assert slow.indices(20, Fraction(30)) == (0,)


def test_a_clip_claiming_a_huge_frame_count_costs_only_the_sampled_indices() -> None:
    settings = FrameSettings(frames=MAX_CLIP_FRAMES, sampling="uniform", stride=4)
    indices = settings.indices(2**62)
    assert len(indices) == MAX_CLIP_FRAMES and indices[0] == 0 and indices[-1] == 2**62 - 1
    assert FrameSettings(frames=5, sampling="every_k", every=MAX_CLIP_FRAMES, stride=1).indices(10) == (0,)


def test_frame_order_is_natural_and_stable() -> None:
    names = ["10.png", "2.png", "1.png", "frame_011.png", "frame_9.png", "a.png"]
    assert sorted(names, key=frame_order) == ["1.png", "2.png", "10.png", "a.png", "frame_9.png", "frame_011.png"]
    assert clip_folder_of("x/walk.frames/001.png") == "x/walk.frames"
    assert clip_folder_of("walk.FRAMES/001.png") == "walk.FRAMES"
    assert clip_folder_of("x/walk/001.png") is None and clip_folder_of(".frames/1.png") is None


# ------------------------------------------------------------------------------------------------ scanning


def test_scan_finds_videos_and_frame_folders_with_captions_beside_them(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_frames_folder(root / "3_moves" / "jump.frames", 12)
    (root / "3_moves" / "jump.txt").write_text("a jump\nleaping", encoding="utf-8")
    (root / "3_moves" / "jump.frames" / "notes.txt").write_text("ignored", encoding="utf-8")
    make_frames_folder(root / "3_moves" / "jump.frames" / "nested", 2)  # not walked: a clip holds frames only
    make_frames_folder(root / "2_x.frames", 3)  # a clip folder's name never sets repeats
    Image.new("RGB", (64, 64)).save(root / "still.png")
    scan = scan_folder(root)
    assert [i.relpath for i in scan.images] == ["still.png"]
    assert [(c.relpath, c.kind, c.frame_count, c.repeats, c.captions) for c in scan.clips] == [
        ("2_x.frames", "frames", 3, 1, ("",)),
        ("3_moves/jump.frames", "frames", 12, 3, ("a jump", "leaping")),
    ]
    jump = scan.clips[1]
    assert [f.relpath.rpartition("/")[2] for f in jump.frames][:3] == ["0.png", "1.png", "2.png"]
    assert jump.frames[10].relpath.endswith("/10.png") and (jump.width, jump.height) == (64, 48)
    assert scan.sample_count() == 3


def test_a_clip_with_frames_of_different_sizes_is_left_out_by_name(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_frames_folder(root / "odd.frames", 3)
    Image.new("RGB", (32, 32)).save(root / "odd.frames" / "2.png")
    make_frames_folder(root / "ok.frames", 3)
    scan = scan_folder(root)
    assert [c.relpath for c in scan.clips] == ["ok.frames"]
    (failure,) = scan.failures
    assert failure.relpath == "odd.frames" and "differ in size" in failure.reason and "2.png is 32x32" in failure.reason


def test_a_clip_with_a_corrupt_frame_is_left_out_naming_the_frame(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_frames_folder(root / "bad.frames", 3)
    (root / "bad.frames" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    Image.new("RGB", (64, 64)).save(root / "still.png")
    scan = scan_folder(root)
    assert scan.clips == ()
    reasons = {f.relpath: f.reason for f in scan.failures}
    assert "bad.frames/1.png" in reasons and "clip left out: its frame 1.png" in reasons["bad.frames"]


@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_links_out_of_the_folder_are_not_followed_for_clips(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    make_frames_folder(outside / "secret.frames", 3)
    (outside / "secret.txt").write_text("secret", encoding="utf-8")
    root = tmp_path / "data"
    make_frames_folder(root / "ok.frames", 3)
    os.symlink(outside / "secret.frames", root / "leak.frames")
    os.symlink(outside / "secret.txt", root / "ok.txt")  # the caption of a clip folder, linked out
    (root / "still.txt").write_text("x", encoding="utf-8")
    Image.new("RGB", (64, 64)).save(root / "still.png")
    listing = list_folder(root)
    assert not any(i.relpath.startswith(("leak.frames", "ok.frames")) for i in listing.images)
    reasons = {f.relpath: f.reason for f in listing.failures}
    assert "outside the dataset folder" in reasons["leak.frames"] and "outside the dataset folder" in reasons["ok.txt"]
    assert "left out: its caption ok.txt" in reasons["ok.frames"]
    assert [c.relpath for c in scan_folder(listing).clips] == []


@needs_av
def test_videos_are_probed_from_headers(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_video(root / "a.mp4", 10, fps=8)
    make_video(root / "b.webm", 6, width=32, height=32, fps=12)
    (root / "b.txt").write_text("bee", encoding="utf-8")
    scan = scan_folder(root)
    assert [(c.relpath, c.kind, c.width, c.height, c.frame_count, c.rate, c.captions) for c in scan.clips] == [
        ("a.mp4", "video", 64, 48, 10, Fraction(8), ("",)),
        ("b.webm", "video", 32, 32, 6, Fraction(12), ("bee",)),
    ]


@needs_av
def test_a_corrupt_or_renamed_video_is_a_failure_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root).mkdir()
    (root / "noise.mp4").write_bytes(os.urandom(4096))
    Image.new("RGB", (64, 64)).save(root / "picture.png")
    os.rename(root / "picture.png", root / "picture.mov")  # a PNG named .mov: no video demuxer takes it
    make_video(root / "ok.mp4", 5)
    scan = scan_folder(root)
    assert [c.relpath for c in scan.clips] == ["ok.mp4"]
    reasons = {f.relpath: f.reason for f in scan.failures}
    assert set(reasons) == {"noise.mp4", "picture.mov"}
    assert "not a readable video" in reasons["noise.mp4"]
    assert "not a readable video" in reasons["picture.mov"] or "not an MP4" in reasons["picture.mov"]


@needs_av
def test_a_truncated_video_is_a_failure_naming_it(tmp_path: Path) -> None:
    path = make_video(tmp_path / "long.mp4", 30)
    data = path.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) * 2 // 3])  # PyAV writes the MP4 index last: it is cut off
    with pytest.raises(SourceError) as caught:
        probe_video(str(cut))
    assert caught.value.path == str(cut) and "truncated" in caught.value.reason


@needs_av
def test_a_video_that_decodes_fewer_frames_than_it_claims_fails_naming_it(tmp_path: Path) -> None:
    path = make_video(tmp_path / "short.mp4", 12)
    out = torch.empty((2, 48, 80, 3))
    plan = BUCKET.plan(64, 48)
    load_clip(str(path), (0, 11), plan, out, name=str(path))  # the last frame is there
    assert _levels(out[:, 0, 0, 0]) == [0, 11]
    with pytest.raises(SourceError, match="ends before frame 31") as caught:  # as if its header claimed 30
        load_clip(str(path), (0, 30), plan, out, name=str(path))
    assert caught.value.path == str(path)


def test_no_clip_and_no_image_is_a_clear_folder_error(tmp_path: Path) -> None:
    (tmp_path / "empty.frames").mkdir()
    with pytest.raises(DatasetFolderError, match="no images found.*frames"):
        scan_folder(tmp_path)


# ------------------------------------------------------------------------------------------------ planning, encoding


@pytest.fixture()
def clips(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_frames_folder(root / "jump.frames", 11)
    (root / "jump.txt").write_text("a jump", encoding="utf-8")
    make_frames_folder(root / "sit.frames", 6)
    (root / "sit.txt").write_text("sitting down", encoding="utf-8")
    Image.new("RGB", (64, 64), (250, 0, 0)).save(root / "still.png")
    (root / "still.txt").write_text("a red square", encoding="utf-8")
    if has_av():
        make_video(root / "walk.mp4", 20)
        (root / "walk.txt").write_text("a walk", encoding="utf-8")
    age(root)
    return root


def test_clips_encode_sampled_frames_in_frame_buckets(clips: Path, tmp_path: Path) -> None:
    settings = _settings(frames=9, sampling="every_k", every=2)
    plan = _plan(clips, tmp_path / "cache", settings)
    assert plan.needs_vae and not plan.failures
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    n = 4 if has_av() else 3
    assert report.encoded_latents == n and report.encoded_conditionings == n and report.samples == n
    by_frames = sorted(enc.clips)
    # jump: 11 frames every 2nd → 6 → 5 (1 + 4m); sit: 6 → 3 → 1; walk: 20 → 9 (0, 2, ..., 16)
    assert by_frames == sorted([(5, 48, 80, 3), (1, 48, 80, 3)] + ([(9, 48, 80, 3)] if has_av() else []))
    decoded = {tuple(_levels(px)) for px in enc.clip_pixels}
    assert (0, 2, 4, 6, 8) in decoded and (0,) in decoded
    if has_av():
        assert any(len(d) == 9 and max(abs(a - b) for a, b in zip(d, range(0, 18, 2))) <= 1 for d in decoded)
    with open_cache(tmp_path / "cache") as reader:
        shapes = {s.source: tuple(reader.tensor_shapes(s.latent)["samples"]) for s in reader.dataset("ds")}
    assert shapes["jump.frames"] == (1, 4, 2, 6, 10) and shapes["sit.frames"] == (1, 4, 1, 6, 10)
    assert shapes["still.png"] == (1, 4, 8, 8)
    again = _plan(clips, tmp_path / "cache", settings)
    assert again.up_to_date and not again.needs_vae


def test_a_clip_is_keyed_by_the_frames_it_takes_not_the_settings_that_chose_them(clips: Path,
                                                                                  tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run_encode(_plan(clips, cache, _settings(frames=9)), **FakeEncoders().kw())
    # other frames: the clips are encoded again, no image and no caption
    variants = [_settings(frames=5), _settings(frames=9, sampling="uniform"),
                _settings(frames=9, fps=4.0) if has_av() else _settings(frames=9, sampling="every_k", every=2)]
    for settings in variants:
        plan = _plan(clips, cache, settings)
        assert not plan.missing_latents and not plan.missing_conditionings, settings  # images and captions kept
        assert plan.missing_clips, settings
    # the same frames: 10, 11 and 12 round down to 9 for WAN's stride of 4 (and every_k 1 is "first")
    for settings in (_settings(frames=10), _settings(frames=12), _settings(frames=9, sampling="every_k", every=1)):
        plan = _plan(clips, cache, settings)
        assert not plan.needs_vae and not plan.missing_clips, settings
    unknown = _plan(clips, cache, _settings(frames=9, stride=None))  # the VAE not loaded: keys unresolved
    assert unknown.needs_vae and len(unknown.missing_clips) == (3 if has_av() else 2)
    with pytest.raises(ValueError, match="temporal compression"):
        run_encode(unknown, **FakeEncoders().kw())


def test_clip_keys_of_earlier_builds_are_still_the_same_keys() -> None:
    """Pinned: the keys builds before the frames-taken key gave two clips (computed by commit 0fa201d)."""
    plan = BUCKET.plan(64, 48)
    five = FrameSettings(frames=5, stride=4)
    uniform = FrameSettings(frames=9, sampling="uniform", fps=12.0, stride=4)
    at_24 = uniform.indices(20, Fraction(24))
    assert at_24 == (0, 2, 4, 6, 10, 12, 14, 16, 18)
    assert latent_key("0f" * 16, plan.key_fields(), "vae-1", extra=legacy_clip_key_fields(
        five, "frames", five.indices(20))) == "0916b767bf85565114a44dfd78050e68"
    assert latent_key("0f" * 16, plan.key_fields(), "vae-1", extra=legacy_clip_key_fields(
        uniform, "video", at_24)) == "20844375613b68d50f6e70b704205ac3"


def test_a_cache_of_an_earlier_build_keeps_its_clips_for_unchanged_settings(clips: Path, tmp_path: Path) -> None:
    """Clips stored under the keys earlier builds gave them (settings in the key) are found, not encoded again;
    a setting that takes the same frames as the old one encodes once, under the frames-taken key."""
    cache = tmp_path / "cache"
    settings = _settings(frames=9)
    plan = _plan(clips, cache, settings)
    legacy = {job.key: latent_key(job.source_hash, job.plan.key_fields(), "vae-1", extra=legacy_clip_key_fields(
        settings.video, "video" if job.relpath.endswith(".mp4") else "frames", job.clip.indices))
        for job in plan.missing_clips if job.clip is not None}
    _store_as_earlier_build(plan, legacy)
    again = _plan(clips, cache, settings)
    assert not again.needs_vae and not again.missing_clips and again.dataset_current
    assert {s.latent for s in again.samples} >= set(legacy.values())
    ten = _plan(clips, cache, _settings(frames=10))  # same frames, but the old key named frame_count 9
    assert {j.relpath for j in ten.missing_clips} == {j.relpath for j in plan.missing_clips}
    run_encode(ten, **FakeEncoders().kw())
    assert not _plan(clips, cache, _settings(frames=10)).missing_clips
    assert not _plan(clips, cache, _settings(frames=11)).missing_clips  # now shared by every count giving 9


def _store_as_earlier_build(plan: Any, legacy: dict[str, str]) -> None:
    """Encode ``plan`` as an earlier build stored it: each clip under its old key (``legacy``: new -> old)."""
    import dataclasses

    jobs = tuple(dataclasses.replace(j, key=legacy[j.key]) for j in plan.missing_clips)
    samples = tuple(dataclasses.replace(s, latent=legacy.get(s.latent, s.latent)) for s in plan.samples)
    report = run_encode(dataclasses.replace(plan, missing_clips=jobs, samples=samples), **FakeEncoders().kw())
    assert report.encoded_latents == len(plan.missing_clips) + sum(map(len, plan.missing_latents.values()))


# ------------------------------------------------------------------------------------------------ frames taken


def test_clips_that_give_fewer_frames_than_asked_are_named_with_what_they_gave(tmp_path: Path) -> None:
    """A 3-frame clip at frame_count 9 becomes one frame, a 12-frame one at 13 becomes 9, and at fps 0.5 a
    video becomes one frame: each is kept (in a bucket of its own) and named with the frames it gave."""
    root = tmp_path / "data"
    make_frames_folder(root / "three.frames", 3)
    make_frames_folder(root / "twelve.frames", 12)
    make_frames_folder(root / "long.frames", 20)
    plan = _plan(root, tmp_path / "cache", _settings(frames=9))
    assert plan.short_clips == ("three.frames: 1 of 9 frames (it has 3 frames; 3 rounded down to 1 + 4·m for the "
                                "VAE)",)
    assert ("1 clip(s) give fewer frames than the 9 asked; each trains with the frames it gives, in the bucket of "
            "that frame count: three.frames: 1 of 9") in " ".join(plan.notes)
    report = run_encode(plan, **FakeEncoders().kw())
    assert "three.frames: 1 of 9 frames" in report.summary() and "long.frames" not in report.summary()
    assert report.short_clips == plan.short_clips
    thirteen = _plan(root, tmp_path / "cache", _settings(frames=13))
    assert [c.partition(":")[0] for c in thirteen.short_clips] == ["three.frames", "twelve.frames"]
    assert thirteen.short_clips[1] == ("twelve.frames: 9 of 13 frames (it has 12 frames; 12 rounded down to "
                                       "1 + 4·m for the VAE)")
    stepped = _plan(root, tmp_path / "cache", _settings(frames=9, sampling="every_k", every=3))
    assert "long.frames: 5 of 9 frames (it has 20 frames; every 3-th of them gives 7; 7 rounded down" \
        in " ".join(stepped.short_clips)


@needs_av
def test_at_a_low_fps_every_video_that_becomes_one_frame_is_named(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_video(root / "walk.mp4", 12, fps=8)
    make_frames_folder(root / "jump.frames", 9)  # no frame rate: taken as it is
    plan = _plan(root, tmp_path / "cache", _settings(frames=9, fps=0.5))
    assert plan.short_clips == ("walk.mp4: 1 of 9 frames (it has 12 frames at 8 fps, 1 at fps 0.5)",)


# ------------------------------------------------------------------------------------------------ truncated videos


@needs_av
def test_a_truncated_webm_is_left_out_named_although_its_sampled_frames_decode(tmp_path: Path) -> None:
    """A WebM/Matroska header holds no frame count: the frames are counted when planning, and their end is checked
    against the track's duration."""
    root = tmp_path / "data"
    truncate(make_video(root / "cut.webm", 30))
    make_video(root / "ok.webm", 30)
    import av

    with av.open(str(root / "cut.webm")) as container:  # the 5 frames sampled come before the damage
        assert sum(1 for _ in container.decode(video=0)) >= 5
    plan = _plan(root, tmp_path / "cache", _settings(frames=5))
    (failure,) = plan.failures
    assert failure.relpath == "cut.webm" and "header claims" in failure.reason and "truncated" in failure.reason
    report = run_encode(plan, **FakeEncoders().kw())
    assert report.samples == 1 and "cut.webm" in report.summary()


@needs_av
def test_a_truncated_mp4_whose_index_comes_first_is_left_out_named_when_encoding(tmp_path: Path) -> None:
    """An MP4 with its index first (web layout) opens and decodes its first frames when cut: the encode walks
    every packet and compares their count with the header's."""
    root = tmp_path / "data"
    truncate(make_video(root / "cut.mp4", 30, faststart=True))
    make_video(root / "ok.mp4", 30, faststart=True)
    plan = _plan(root, tmp_path / "cache", _settings(frames=5))
    assert not plan.failures and len(plan.missing_clips) == 2  # the header is whole: it claims 30 frames
    report = run_encode(plan, **FakeEncoders().kw())
    reasons = {f.relpath: f.reason for f in report.failures}
    assert set(reasons) == {"cut.mp4"} and "of the 30 frames its header claims" in reasons["cut.mp4"]
    assert "truncated" in reasons["cut.mp4"] and report.samples == 1
    with open_cache(tmp_path / "cache") as reader:
        assert [s.source for s in reader.dataset("ds")] == ["ok.mp4"]


def test_an_image_vae_leaves_clips_out_by_name(clips: Path, tmp_path: Path) -> None:
    plan = _plan(clips, tmp_path / "cache", _settings(stride=0))
    assert {f.relpath for f in plan.failures} >= {"jump.frames", "sit.frames"}
    assert all("still images only" in f.reason for f in plan.failures)
    report = run_encode(plan, **FakeEncoders().kw())
    assert report.samples == 1 and report.skipped == len(plan.failures)


def test_a_clip_over_the_pixel_limit_is_left_out_before_decoding(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_frames_folder(root / "big.frames", 1, width=16, height=16)
    Image.new("RGB", (64, 64)).save(root / "still.png")
    big = EncodeSettings(bucket=BucketConfig(resolution=8192, step=64, min_side=64),
                         video=FrameSettings(frames=9, stride=4))
    for i in range(1, 9):  # 9 tiny frames upscaled to an 8192² bucket: 9 × 768 MiB of float32 pixels
        Image.new("RGB", (16, 16)).save(root / "big.frames" / f"{i}.png")
    plan = _plan(root, tmp_path / "cache", big)
    (failure,) = plan.failures
    assert failure.relpath == "big.frames" and "GiB of pixels" in failure.reason and not plan.missing_clips


def test_one_clip_edited_re_encodes_exactly_that_clip(clips: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    settings = _settings(frames=5)
    run_encode(_plan(clips, cache, settings), **FakeEncoders().kw())
    Image.new("RGB", (64, 48), (1, 2, 3)).save(clips / "jump.frames" / "3.png")  # one frame of one clip
    plan = _plan(clips, cache, settings)
    assert [j.relpath for j in plan.missing_clips] == ["jump.frames"]
    assert not plan.missing_latents and not plan.missing_conditionings
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert report.encoded_latents == 1 and report.encoded_conditionings == 0 and enc.texts == []
    assert len(enc.clips) == 1 and _levels(enc.clip_pixels[0])[3] == 0  # the edited frame is the one encoded
    if has_av():
        make_video(clips / "walk.mp4", 20, fps=12)  # re-timed: other bytes
        plan = _plan(clips, cache, settings)
        assert [j.relpath for j in plan.missing_clips] == ["walk.mp4"] and not plan.missing_conditionings


def test_a_caption_edited_encodes_only_its_conditioning(clips: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    settings = _settings(frames=5)
    run_encode(_plan(clips, cache, settings), **FakeEncoders().kw())
    (clips / "jump.txt").write_text("a high jump", encoding="utf-8")
    plan = _plan(clips, cache, settings)
    assert not plan.needs_vae and list(plan.missing_conditionings.values()) == ["a high jump"]
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert enc.texts == ["a high jump"] and enc.clips == [] and enc.images == 0
    assert report.encoded_latents == 0 and report.encoded_conditionings == 1


def test_a_moved_clip_folder_keeps_its_latent(clips: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    settings = _settings(frames=5)
    run_encode(_plan(clips, cache, settings), **FakeEncoders().kw())
    (clips / "sub").mkdir()
    os.rename(clips / "jump.frames", clips / "sub" / "jump.frames")
    os.rename(clips / "jump.txt", clips / "sub" / "jump.txt")
    plan = _plan(clips, cache, settings)
    assert not plan.needs_vae and not plan.missing_conditionings and not plan.dataset_current


def test_a_frame_edited_after_planning_is_never_stored_under_the_old_key(clips: Path, tmp_path: Path) -> None:
    plan = _plan(clips, tmp_path / "cache", _settings(frames=5))
    Image.new("RGB", (64, 48), (9, 9, 9)).save(clips / "jump.frames" / "2.png")
    report = run_encode(plan, **FakeEncoders().kw())
    failed = {f.relpath: f.reason for f in report.failures}
    assert "changed after the folder was scanned" in failed["jump.frames"]
    with open_cache(tmp_path / "cache") as reader:
        assert "jump.frames" not in {s.source for s in reader.dataset("ds")}


def test_stop_policy_raises_on_a_bad_clip_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_frames_folder(root / "ok.frames", 3)
    make_frames_folder(root / "bad.frames", 3)
    (root / "bad.frames" / "0.png").write_bytes(b"garbage")
    settings = EncodeSettings(bucket=BUCKET, failure_policy="stop", video=FrameSettings(frames=1, stride=4))
    plan = _plan(root, tmp_path / "cache", settings)
    with pytest.raises(SourceError, match="0.png"):
        run_encode(plan, **FakeEncoders().kw())


def test_settings_describe_frame_settings_and_old_datasets_read_as_defaults() -> None:
    from dataset_cache.encode_plan import _output_settings

    described = _settings(frames=9).describe()
    assert described["video"] == {"frames": 9, "sampling": "first", "every": 1, "fps": 0.0}
    old = {k: v for k, v in EncodeSettings(bucket=BUCKET).describe().items() if k != "video"}
    assert _output_settings(old)["video"] == FrameSettings().describe()
    assert level(3) == 30


def test_without_pyav_a_video_is_a_failure_naming_it_and_frame_folders_still_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))
    make_frames_folder(root / "ok.frames", 2)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError, as where it is missing
    scan = scan_folder(root)
    assert [c.relpath for c in scan.clips] == ["ok.frames"]
    (failure,) = scan.failures
    assert failure.relpath == "clip.mp4" and failure.path == str(root / "clip.mp4")
    assert "PyAV" in failure.reason and "pip install av" in failure.reason


@needs_av
@pytest.mark.parametrize("layout", ["live", "longer audio"])
def test_a_whole_video_whose_header_says_less_or_more_than_its_frames_is_never_refused(tmp_path: Path,
                                                                                   layout: str) -> None:
    """No false alarm: a WebM written live has no duration to compare with; a Matroska file whose audio runs a
    second past its video has a longer segment, but its video track's own duration is what counts."""
    import av
    import numpy as np

    path = tmp_path / ("live.webm" if layout == "live" else "audio.mkv")
    with av.open(str(path), "w", options={"live": "1"} if layout == "live" else {}) as container:
        video = container.add_stream("libvpx" if layout == "live" else "mpeg4", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=48000) if layout != "live" else None
        for i in range(16):  # 2 s of video
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:  # 3 s of silence
            for j in range(3 * 48000 // 1024):
                samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                samples.sample_rate, samples.pts = 48000, j * 1024
                for packet in audio.encode(samples):
                    container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    assert probe_video(str(path)).frames == 16
    out = torch.empty((2, 48, 80, 3))
    load_clip(str(path), (0, 15), BUCKET.plan(64, 48), out, name=str(path))
    assert _levels(out[:, 0, 0, 0])[0] == 0


@needs_av
@pytest.mark.parametrize(("tag", "refused"), [("30", False), ("12abc", False), ("40", True), ("9" * 5000, True)])
def test_a_matroska_frame_count_tag_is_checked_and_a_hostile_one_never_crashes(tmp_path: Path, tag: str,
                                                                               refused: bool) -> None:
    """mkvmerge writes a track's frame count as a NUMBER_OF_FRAMES tag: it is what the header claims."""
    import av
    import numpy as np

    path = tmp_path / "tagged.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.metadata["NUMBER_OF_FRAMES"] = tag
        for _ in range(30):
            frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if refused:
        with pytest.raises(SourceError, match=r"video holds 30 of the \d+ frames its header claims"):
            probe_video(str(path))
    else:
        assert probe_video(str(path)).frames == 30


@pytest.mark.parametrize(("value", "seconds"), [
    ("00:00:03.750000000", Fraction(15, 4)), ("1:02:03", Fraction(3723)), ("9" * 400 + ":00:00", None),
    ("00:00:03.75x", None), ("", None), (None, None), ("-1:00:00", None),
])
def test_a_duration_tag_is_read_within_bounds(value: Any, seconds: Fraction | None) -> None:
    from dataset_cache.video import _tag_seconds

    assert _tag_seconds(value) == seconds
