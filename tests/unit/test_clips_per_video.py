"""Several clips from one video (``clips_per_video``, musubi-tuner's uniform frame extraction): windows of the frames
``first``/``every_k`` take, spread from the start of the video to its end, each a sample with its own latent, the
video's captions shared. Frame folders stand in for videos (no PyAV needed); a video test runs where PyAV is.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import _output_settings, plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.format.reader import open_cache
from dataset_cache.frames import MAX_CLIPS_PER_VIDEO, FrameSettings
from dataset_cache.video import has_av
from support.clips import make_frames_folder, make_video
from support.fake_encoders import FakeEncoders, age

BUCKET = BucketConfig(resolution=64, step=16, min_side=32)


def _settings(**video: Any) -> EncodeSettings:
    return EncodeSettings(bucket=BUCKET, batch_size=2, video=FrameSettings(**{"stride": 4, **video}))


def _plan(folder: Path, cache: Path, settings: EncodeSettings) -> Any:
    return plan_encode(folder, cache, dataset="ds", settings=settings, vae_fingerprint="vae-1",
                       text_fingerprint="te-1")


@pytest.mark.parametrize(("settings", "total", "expected"), [
    ({"frames": 5, "clips": 3}, 20, ((0, 1, 2, 3, 4), (8, 9, 10, 11, 12), (15, 16, 17, 18, 19))),
    ({"frames": 5, "clips": 4}, 20, tuple(tuple(range(s, s + 5)) for s in (0, 5, 10, 15))),  # end to end
    ({"frames": 5, "clips": 3}, 7, ((0, 1, 2, 3, 4), (1, 2, 3, 4, 5), (2, 3, 4, 5, 6))),  # overlapping
    ({"frames": 5, "clips": 3}, 5, ((0, 1, 2, 3, 4),)),  # one window's worth: one clip
    ({"frames": 9, "clips": 3}, 4, ((0, 1, 2, 3),)),  # shorter than a window: one short clip, as before
    ({"frames": 3, "sampling": "every_k", "every": 2, "clips": 4}, 20,
     ((0, 2, 4), (5, 7, 9), (10, 12, 14), (15, 17, 19))),
])
def test_windows_spread_from_the_start_to_the_end(settings: dict[str, Any], total: int,
                                                  expected: tuple[tuple[int, ...], ...]) -> None:
    frames = FrameSettings(**{"stride": 1, **settings})
    windows = frames.windows(total)
    assert windows == expected
    assert windows[0] == frames.indices(total)  # the first is the one clip of clips_per_video 1
    assert windows[-1][-1] == max(max(w) for w in windows)


def test_windows_follow_the_resampled_rate_and_one_clip_is_the_old_clip() -> None:
    half = FrameSettings(frames=3, fps=8.0, clips=2, stride=1)  # 30 frames at 24 fps: 10 at 8 fps
    assert half.windows(30, Fraction(24)) == ((0, 3, 6), (21, 24, 27))
    for total in (1, 5, 17, 100):
        for kw in ({"frames": 9}, {"frames": 9, "sampling": "uniform"}, {"frames": 5, "sampling": "every_k",
                                                                         "every": 3}):
            one = FrameSettings(stride=4, **kw)  # type: ignore[arg-type]
            assert one.windows(total) == (one.indices(total),)


@pytest.mark.parametrize("bad", [0, MAX_CLIPS_PER_VIDEO + 1, 2.0, True, "3"])
def test_a_bad_count_is_refused_naming_the_input(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"clips_per_video must be an int from 1 to {MAX_CLIPS_PER_VIDEO}"):
        FrameSettings(clips=bad)


def test_uniform_sampling_is_refused_with_several_clips() -> None:
    with pytest.raises(ValueError, match="clips_per_video 2 takes several windows.*uniform spreads one clip"):
        FrameSettings(sampling="uniform", clips=2)


def test_settings_describe_clips_only_when_set_so_old_datasets_stay_current() -> None:
    assert "clips" not in _settings(frames=9).describe()["video"]
    assert _settings(frames=9, clips=3).describe()["video"]["clips"] == 3
    assert _output_settings(_settings(frames=9).describe())["video"] == FrameSettings(frames=9).describe()


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_frames_folder(root / "3_takes" / "long.frames", 21)
    (root / "3_takes" / "long.txt").write_text("a long take", encoding="utf-8")
    make_frames_folder(root / "short.frames", 7)
    (root / "short.txt").write_text("a short take", encoding="utf-8")
    age(root)
    return root


def test_each_window_is_a_sample_and_raising_the_count_encodes_only_new_windows(folder: Path,
                                                                                 tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    one = _plan(folder, cache, _settings(frames=5))
    run_encode(one, **FakeEncoders().kw())
    settings = _settings(frames=5, clips=3)
    plan = _plan(folder, cache, settings)
    assert not plan.missing_conditionings  # captions are the clips' own, already encoded
    assert len(plan.missing_clips) == 4  # long: 2 new windows (its first is kept); short: 2 (overlapping)
    (note,) = [n for n in plan.notes if "clips_per_video" in n]
    assert note.startswith("1 video(s) are too short for clips_per_video 3 clips end to end") and \
        "short.frames: 3 clip(s) of 5 frames from its 7, overlapping" in note
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert report.encoded_latents == 4 and report.encoded_conditionings == 0
    with open_cache(cache) as reader:
        samples = reader.dataset("ds")
    long = [s for s in samples if s.source == "3_takes/long.frames"]
    assert len(long) == 3 and len({s.latent for s in long}) == 3
    assert {s.repeats for s in long} == {3} and len({s.captions for s in long}) == 1
    assert {s.latent for s in one.samples} <= {s.latent for s in samples}
    assert sorted(tuple(round(float(v) * 255 / 10) for v in px) for px in enc.clip_pixels) == [
        (1, 2, 3, 4, 5), (2, 3, 4, 5, 6), (8, 9, 10, 11, 12), (16, 17, 18, 19, 20)]
    assert _plan(folder, cache, settings).up_to_date


@pytest.mark.skipif(not has_av(), reason="PyAV (av) is not installed in this Python")
def test_a_video_gives_its_windows_with_a_mirror_each(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_video(root / "walk.mp4", 24)
    (root / "walk.txt").write_text("a walk", encoding="utf-8")
    age(root)
    settings = _settings(frames=5, clips=2)
    settings = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32, flip="random"),
                              batch_size=2, video=settings.video)
    plan = _plan(root, tmp_path / "cache", settings)
    assert [s.source for s in plan.samples] == ["walk.mp4", "walk.mp4"] and not plan.failures
    assert len({s.latent for s in plan.samples} | {s.mirror for s in plan.samples}) == 4
    jobs = sorted(job.clip.indices for job in plan.missing_clips if job.clip is not None)
    assert jobs == [(0, 1, 2, 3, 4)] * 2 + [(19, 20, 21, 22, 23)] * 2  # each window and its mirror


def test_extra_resolutions_give_each_clip_window_at_each_resolution_encoding_only_the_new(folder: Path,
                                                                                          tmp_path: Path) -> None:
    """A second resolution: every clip window also at it (its own bucket and latent, the same frames), captions
    shared, nothing of the first resolution encoded again; the first resolution's keys are what they were."""
    cache = tmp_path / "cache"
    one = _settings(frames=5, clips=2)
    run_encode(_plan(folder, cache, one), **FakeEncoders().kw())
    two = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32, upscale=True), batch_size=2,
                         video=one.video, extra_resolutions=(96,))
    first = _plan(folder, cache, EncodeSettings(bucket=two.bucket, batch_size=2, video=one.video))
    plan = _plan(folder, cache, two)
    assert not plan.missing_conditionings and len(plan.missing_clips) == 4  # 2 clips × 2 windows, at 96 only
    assert {s.latent for s in first.samples} <= {s.latent for s in plan.samples}
    assert len(plan.samples) == 2 * len(first.samples) == 8
    enc = FakeEncoders()
    run_encode(plan, **enc.kw())
    # (frames, height, width, channels): only the new size, the 64×48 frames in 96's 4:3-ish bucket (area ≤ 96²)
    assert {shape[1:3] for shape in enc.clips} == {(80, 112)}
    assert {first.settings.bucket.plan(64, 48).bucket} != {(112, 80)}
    assert _plan(folder, cache, two).up_to_date
