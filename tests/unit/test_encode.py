"""Tests of dataset_cache.encode_plan and dataset_cache.encode_run: encode only what is missing, resumably.

Every test counts encoder calls with a pure-torch fake encoder (latent = 8x downsampled image plus its channel
mean, ``{"samples": Tensor[1, 4, h/8, w/8]}``; conditioning = a tensor seeded by a hash of the text) on folders
generated with Pillow (``support.datasets``: two kohya subsets, three bucket shapes, a caption shared across
folders and a multi-line caption). The default folder has 5 images and 5 distinct caption lines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from dataset_cache.buckets import BucketConfig
from dataset_cache.errors import CacheLinkError, DatasetFolderError, SourceError, UnstorableValueError
from dataset_cache.format.layout import CacheNestingError
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode, sources_record_path
from dataset_cache.encode_run import run_encode
from dataset_cache.lock import WRITE_LOCK, CacheLock
from support.datasets import make_kohya_folder
from support.fake_encoders import OLD_NS, FakeEncoders, age as _age
from support.paths import TESTS_DIR

SETTINGS = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2)
N_IMAGES, N_TEXTS = 5, 5  # of make_kohya_folder's default layout


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    make_kohya_folder(tmp_path / "data")
    _age(tmp_path / "data")
    return tmp_path / "data"


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _plan(folder: Path, cache: Path, *, dataset: str = "ds", settings: EncodeSettings = SETTINGS,
          vae: str = "vae-1", text: str = "te-1") -> Any:
    return plan_encode(folder, cache, dataset=dataset, settings=settings, vae_fingerprint=vae,
                       text_fingerprint=text)


def _build(folder: Path, cache: Path, enc: FakeEncoders | None = None, **kw: Any) -> Any:
    enc = enc or FakeEncoders()
    return run_encode(_plan(folder, cache, **kw), **enc.kw())


def _assert_complete(cache: Path, dataset: str = "ds", samples: int = N_IMAGES) -> None:
    reader = open_cache(cache)
    assert reader.verify() == []
    got = reader.dataset(dataset)
    assert len(got) == samples
    values = reader.read([k for s in got for k in (s.latent, *s.captions)])
    assert all(v is not None for v in values)


# ------------------------------------------------------------------------------------------ plan

def test_first_build_encodes_everything_and_stores_the_dataset(folder: Path, cache: Path) -> None:
    plan = _plan(folder, cache)
    assert plan.needs_vae and plan.needs_text_encoder
    assert (plan.new, plan.changed, plan.unchanged, plan.removed) == (10, 0, 0, 0)
    assert plan.latent_count == N_IMAGES and len(plan.missing_conditionings) == N_TEXTS
    assert set(plan.missing_latents) == {(48, 80), (64, 64), (80, 48)}  # grouped by bucket
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert (report.encoded_latents, report.encoded_conditionings, report.reused) == (N_IMAGES, N_TEXTS, 0)
    assert enc.images == N_IMAGES and len(enc.texts) == N_TEXTS
    assert not report.stopped and report.bytes_written > 0 and report.samples == N_IMAGES
    _assert_complete(cache)
    reader = open_cache(cache)
    samples = {s.source: s for s in reader.dataset("ds")}
    assert samples["10_red/img_000.png"].repeats == 10 and samples["2_blue/img_000.jpg"].repeats == 2
    assert samples["10_red/img_000.png"].captions == samples["2_blue/img_000.jpg"].captions  # shared caption
    assert len(samples["10_red/img_001.png"].captions) == 2  # multi-line caption: two variants
    latent = reader.get(samples["10_red/img_001.png"].latent)
    assert latent["samples"].shape == (1, 4, 6, 10)  # a 96x64 image: the 80x48 bucket
    info = reader.datasets()["ds"].info
    assert info["vae_fingerprint"] == "vae-1" and info["settings"]["bucket"]["resolution"] == 64
    assert reader.stats()["shards"] == 1  # per-batch shards were compacted
    assert "5 samples" in report.summary() and "encoded 5 latents" in report.summary()


def test_encode_runs_under_inference_mode_as_comfyui_executes_nodes(folder: Path, cache: Path) -> None:
    """ComfyUI runs every node under torch.inference_mode, which does not follow into the decode threads."""
    enc = FakeEncoders()
    with torch.inference_mode():
        report = run_encode(_plan(folder, cache), **enc.kw())
    assert report.encoded_latents == N_IMAGES and not report.failures
    _assert_complete(cache)


def test_plan_saves_the_sources_record_before_encoding(folder: Path, cache: Path) -> None:
    plan = _plan(folder, cache)
    assert sources_record_path(cache, "ds").is_file()
    with pytest.raises(RuntimeError, match="fake encoder failure"):
        run_encode(plan, **FakeEncoders(fail_after=0).kw())
    again = _plan(folder, cache)
    assert again.validation is not None and again.validation.hashed == 0  # nothing re-hashed after the crash
    assert again.latent_count == N_IMAGES


def test_unchanged_folder_encodes_nothing_and_needs_no_encoder(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    plan = _plan(folder, cache)
    assert not plan.needs_vae and not plan.needs_text_encoder and plan.up_to_date
    assert (plan.new, plan.changed, plan.unchanged, plan.removed) == (0, 0, 10, 0)
    report = run_encode(plan, encode_images=None, encode_texts=None)
    assert report.encoded == 0 and report.reused == N_IMAGES + N_TEXTS
    _assert_complete(cache)


def _count_caption_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every ``.txt`` file opened through ``open`` or ``os.open`` from now on."""
    import builtins

    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def counting_open(file: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).lower().endswith(".txt"):
            opened.append(os.fspath(file))
        return real_open(file, *args, **kw)

    def counting_os_open(path: Any, *args: Any, **kw: Any) -> int:
        if os.fspath(path).lower().endswith(".txt"):
            opened.append(os.fspath(path))
        return real_os_open(path, *args, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    return opened


def test_unchanged_folder_plan_opens_no_caption_and_an_edited_one_is_read(folder: Path, cache: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _build(folder, cache)
    first = _plan(folder, cache)
    opened = _count_caption_opens(monkeypatch)
    plan = _plan(folder, cache)
    assert opened == [] and plan.up_to_date
    assert plan.samples == first.samples  # captions from the record: the same samples as when read
    cap = folder / "10_red" / "img_001.txt"
    cap.write_text("first caption variant, a square\nan edited second line")
    os.utime(cap, ns=(OLD_NS + 10**9, OLD_NS + 10**9))  # dated in the past: not re-hashed as "racy" next time
    edited = _plan(folder, cache)
    assert opened == [str(cap)]  # read once: hashed and parsed from the same bytes
    assert list(edited.missing_conditionings.values()) == ["an edited second line"] and edited.changed == 1
    opened.clear()
    again = _plan(folder, cache)
    assert opened == [] and again.missing_conditionings == edited.missing_conditionings


def test_version_1_sources_record_reads_captions_once_then_never(folder: Path, cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _build(folder, cache)
    path = sources_record_path(cache, "ds")
    doc = json.loads(path.read_text())
    del doc["captions"]
    doc["version"] = 1
    path.write_text(json.dumps(doc))
    opened = _count_caption_opens(monkeypatch)
    plan = _plan(folder, cache)
    assert plan.up_to_date and sorted(opened) == sorted(map(str, folder.rglob("*.txt")))  # each once, stored
    assert json.loads(path.read_text())["version"] == 2  # and the upgraded record was saved
    opened.clear()
    assert _plan(folder, cache).up_to_date and opened == []


def test_editing_one_caption_line_encodes_one_conditioning(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    (folder / "10_red" / "img_001.txt").write_text("first caption variant, a square\nan edited second line")
    plan = _plan(folder, cache)
    assert not plan.needs_vae and plan.needs_text_encoder and plan.changed == 1
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert enc.texts == ["an edited second line"] and enc.images == 0
    assert report.encoded_conditionings == 1 and report.encoded_latents == 0
    _assert_complete(cache)


def test_adding_one_image_encodes_its_latent_and_only_its_new_captions(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "10_red" / "new.png")
    (folder / "10_red" / "new.txt").write_text("a photo of a tiny test pattern\na brand new line\n")
    enc = FakeEncoders()
    report = _build(folder, cache, enc)
    assert enc.images == 1 and enc.texts == ["a brand new line"]
    assert report.new == 2 and report.encoded == 2
    _assert_complete(cache, samples=N_IMAGES + 1)


def test_touching_every_file_encodes_nothing(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    for p in folder.rglob("*"):
        if p.is_file():
            os.utime(p)  # now: re-hashed, same content
    plan = _plan(folder, cache)
    assert plan.validation is not None and len(plan.validation.refreshed) == 10
    enc = FakeEncoders()
    assert run_encode(plan, **enc.kw()).encoded == 0 and enc.calls == 0


def test_new_vae_fingerprint_re_encodes_every_latent_and_no_conditioning(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    plan = _plan(folder, cache, vae="vae-2")
    assert plan.needs_vae and not plan.needs_text_encoder
    enc = FakeEncoders()
    report = run_encode(plan, **enc.kw())
    assert (enc.images, len(enc.texts)) == (N_IMAGES, 0) and report.encoded_latents == N_IMAGES


def test_moved_image_reuses_its_latent(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    (folder / "3_copy").mkdir()
    for name in ("img_000.png", "img_000.txt"):
        shutil.copy2(folder / "10_red" / name, folder / "3_copy" / name)
    enc = FakeEncoders()
    report = _build(folder, cache, enc)
    assert enc.calls == 0 and report.samples == N_IMAGES + 1


def test_caption_shared_by_100_images_is_encoded_once(tmp_path: Path, cache: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(100):
        Image.new("RGB", (64, 64), (i, 2 * i, 255 - i)).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text("one caption for all")
    enc = FakeEncoders()
    report = _build(folder, cache, enc, settings=EncodeSettings(bucket=SETTINGS.bucket, batch_size=16))
    assert enc.texts == ["one caption for all"] and enc.images == 100
    assert report.encoded_latents == 100 and report.encoded_conditionings == 1
    _assert_complete(cache, samples=100)


def test_trigger_word_suffix_encodes_each_distinct_line_once(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    enc = FakeEncoders()
    settings = EncodeSettings(bucket=SETTINGS.bucket, batch_size=2, caption_suffix=", ohwx")
    report = _build(folder, cache, enc, settings=settings)
    assert enc.images == 0 and len(enc.texts) == N_TEXTS and all(t.endswith(", ohwx") for t in enc.texts)
    assert report.encoded_conditionings == N_TEXTS
    assert settings.caption_text("a cat") == "a cat, ohwx"
    assert EncodeSettings(caption_prefix="ohwx, ").caption_text("") == "ohwx,"


# ------------------------------------------------------------------------------------------ source counts


def _counts(x: Any) -> tuple[int, int, int, int]:
    return x.new, x.changed, x.unchanged, x.removed


def test_a_second_plan_before_the_encode_counts_what_the_first_counted(folder: Path, cache: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The node plans two or three times per run and each plan saves the sources record: the plan the encode
    runs must still count the files new (the log and the node's text once said "0 new, 10 unchanged")."""
    first = _plan(folder, cache)
    second = _plan(folder, cache)
    assert _counts(first) == _counts(second) == (10, 0, 0, 0)
    with caplog.at_level(logging.INFO, logger="dataset_cache.encode"):
        report = run_encode(second, **FakeEncoders().kw())
    assert "sources: 10 new, 0 changed, 0 unchanged, 0 removed" in report.summary()
    assert "sources: 10 new, 0 changed, 0 unchanged, 0 removed" in caplog.text  # the log line is the same
    assert _counts(_plan(folder, cache)) == (0, 0, 10, 0)  # the dataset is stored: those are its sources now


def test_after_a_cancelled_first_encode_the_next_run_still_counts_the_files_new(folder: Path, cache: Path) -> None:
    enc = FakeEncoders()
    first = run_encode(_plan(folder, cache), **enc.kw(), should_stop=lambda: enc.calls >= 4)
    assert first.stopped and _counts(first) == (10, 0, 0, 0)
    again = _plan(folder, cache)
    assert _counts(again) == (10, 0, 0, 0) and again.latent_count > 0  # not "0 new, 10 unchanged"
    report = run_encode(again, **FakeEncoders().kw())
    assert not report.stopped and _counts(report) == (10, 0, 0, 0)
    assert _counts(_plan(folder, cache)) == (0, 0, 10, 0)


def test_changes_count_against_the_stored_dataset_until_it_is_stored_again(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    (folder / "10_red" / "img_000.txt").write_text("an edited caption", encoding="utf-8")
    Image.new("RGB", (64, 64)).save(folder / "10_red" / "new.png")
    (folder / "2_blue" / "img_000.txt").unlink()
    assert _counts(_plan(folder, cache)) == _counts(_plan(folder, cache)) == (1, 1, 8, 1)
    (folder / "10_red" / "new.png").unlink()  # added, then removed before any encode: nothing to count
    plan = _plan(folder, cache)
    assert _counts(plan) == (0, 1, 8, 1)
    assert _counts(run_encode(plan, **FakeEncoders().kw())) == (0, 1, 8, 1)
    assert _counts(_plan(folder, cache)) == (0, 0, 9, 0)


def test_a_frames_folder_given_as_the_dataset_folder_is_refused_naming_it(tmp_path: Path, cache: Path) -> None:
    from support.clips import make_frames_folder

    clip = make_frames_folder(tmp_path / "data" / "jump.frames", 3)
    with pytest.raises(DatasetFolderError, match="is a clip .*not a dataset folder; give the folder that holds it"
                       ) as caught:
        _plan(clip, cache)
    assert caught.value.path == str(clip)
    assert _plan(tmp_path / "data", cache).samples[0].source == "jump.frames"  # the folder that holds it


# ------------------------------------------------------------------------------------------ interruption

def test_should_stop_after_k_batches_then_rerun_encodes_exactly_the_rest(folder: Path, cache: Path) -> None:
    enc = FakeEncoders()
    calls: list[int] = []
    progress: list[tuple[int, int]] = []
    main = threading.get_ident()

    def should_stop() -> bool:
        calls.append(threading.get_ident())
        return enc.calls >= 4

    first = run_encode(_plan(folder, cache), **enc.kw(), should_stop=should_stop,
                       progress=lambda d, t: progress.append((d, t, threading.get_ident())))  # type: ignore[arg-type]
    assert first.stopped and 0 < first.encoded < N_IMAGES + N_TEXTS
    assert "STOPPED" in first.summary()
    assert set(calls) == {main} and {p[2] for p in progress} == {main}  # callbacks on the calling thread only
    assert progress[0][:2] == (0, N_IMAGES + N_TEXTS) and progress[-1][0] == first.encoded
    assert "ds" not in open_cache(cache).datasets()
    assert open_cache(cache).verify() == []
    enc2 = FakeEncoders()
    second = run_encode(_plan(folder, cache), **enc2.kw())
    assert second.encoded == N_IMAGES + N_TEXTS - first.encoded
    assert not set(enc.texts) & set(enc2.texts)
    _assert_complete(cache)


def test_encoder_exception_after_k_batches_then_rerun_encodes_exactly_the_rest(folder: Path, cache: Path) -> None:
    enc = FakeEncoders(fail_after=5)
    with pytest.raises(RuntimeError, match="fake encoder failure"):
        run_encode(_plan(folder, cache), **enc.kw())
    committed = len(open_cache(cache))
    assert committed == N_TEXTS + 3  # 3 text batches + 2 image batches (1 + 2 images) were committed
    assert open_cache(cache).verify() == []
    enc2 = FakeEncoders()
    report = run_encode(_plan(folder, cache), **enc2.kw())
    assert report.encoded == N_IMAGES + N_TEXTS - committed and enc2.images == N_IMAGES - 3
    _assert_complete(cache)


def _contents(cache: Path) -> dict[str, Any]:
    reader = open_cache(cache)
    keys = sorted(reader.keys())
    return dict(zip(keys, reader.read(keys)))


def test_background_commits_store_exactly_what_foreground_commits_store(folder: Path, tmp_path: Path) -> None:
    reports, contents = [], []
    for background in (True, False):
        cache = tmp_path / f"cache-{background}"
        reports.append(run_encode(_plan(folder, cache), **FakeEncoders().kw(), background_commits=background))
        contents.append(_contents(cache))
        _assert_complete(cache)
    assert [(r.encoded_latents, r.encoded_conditionings, r.samples) for r in reports] == [
        (N_IMAGES, N_TEXTS, N_IMAGES)] * 2
    assert contents[0].keys() == contents[1].keys()
    for key, value in contents[0].items():
        other = contents[1][key]
        flat = [value["samples"]] if isinstance(value, dict) else [value[0][0], value[0][1]["pooled_output"]]
        flat2 = [other["samples"]] if isinstance(other, dict) else [other[0][0], other[0][1]["pooled_output"]]
        assert all(torch.equal(a, b) for a, b in zip(flat, flat2, strict=True)), key


@pytest.mark.parametrize("background", [True, False])
def test_commits_run_beside_the_encoder_only_in_the_background(folder: Path, cache: Path, monkeypatch,
                                                               background: bool) -> None:
    adders: set[str] = set()
    add = CacheWriter.add

    def spy(self, *args, **kwargs):
        adders.add(threading.current_thread().name)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(CacheWriter, "add", spy)
    before = set(threading.enumerate())
    enc = FakeEncoders()
    run_encode(_plan(folder, cache), **enc.kw(), background_commits=background)
    assert enc.threads == {threading.get_ident()}  # the encoders always run on the calling thread
    if background:
        assert adders and all(name.startswith("encode-commit") for name in adders)
    else:
        assert adders == {threading.current_thread().name}
    assert set(threading.enumerate()) == before  # the committer (and the decode pool) ended
    _assert_complete(cache)


class _HookGroup:  # stands in for a ComfyUI hook object an encoder might leave in a conditioning
    pass


def test_an_unstorable_batch_fails_the_encode_naming_it_and_keeps_the_batches_before(folder: Path,
                                                                                       cache: Path) -> None:
    enc = FakeEncoders()
    calls = 0

    def encode_texts(texts: list[str]) -> list[Any]:
        nonlocal calls
        calls += 1
        out = enc.encode_texts(texts)
        if calls == 2:  # the second batch holds something the cache cannot store
            out[0][0][1]["hooks"] = _HookGroup()
        return out

    before = set(threading.enumerate())
    with pytest.raises(UnstorableValueError, match=r"conditioning\[0\]\[1\]\['hooks'\]: _HookGroup"):
        run_encode(_plan(folder, cache), encode_images=enc.encode_images, encode_texts=encode_texts)
    assert set(threading.enumerate()) == before
    reader = open_cache(cache)
    assert len(reader) == SETTINGS.batch_size and reader.verify() == []  # the first text batch was kept
    report = run_encode(_plan(folder, cache), **FakeEncoders().kw())
    assert report.encoded == N_IMAGES + N_TEXTS - SETTINGS.batch_size
    _assert_complete(cache)


_WORKER = r"""
import json, logging, sys, time
sys.path.insert(0, {tests!r})
from support.pack import import_library
import_library()
import importlib.util
spec = importlib.util.spec_from_file_location("ti", {module!r})
ti = importlib.util.module_from_spec(spec); spec.loader.exec_module(ti)
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
logging.basicConfig(level=logging.WARNING)
folder, cache, dataset, delay, marker = sys.argv[1:6]
enc = ti.FakeEncoders(delay=float(delay))
plan = plan_encode(folder, cache, dataset=dataset, settings=ti.SETTINGS, vae_fingerprint="vae-1",
                   text_fingerprint="te-1")
def progress(done, total):
    with open(marker, "a") as f:
        f.write(f"{{done}}\n")
r = run_encode(plan, **enc.kw(), progress=progress)
print(json.dumps({{"encoded": r.encoded, "samples": r.samples, "calls": enc.calls}}))
"""


def _worker(folder: Path, cache: Path, dataset: str, delay: float, marker: Path) -> subprocess.Popen[str]:
    code = _WORKER.format(tests=str(TESTS_DIR), module=__file__)
    return subprocess.Popen([sys.executable, "-c", code, str(folder), str(cache), dataset, str(delay), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(marker: Path, lines: int, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists() and len(marker.read_text().split()) >= lines:
            return
        if proc.poll() is not None:
            pytest.fail(f"worker exited early: {proc.communicate()}")
        time.sleep(0.02)
    pytest.fail("worker made no progress")


def test_kill_9_mid_encode_then_rerun_encodes_exactly_the_rest(folder: Path, cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "progress.txt"
    proc = _worker(folder, cache, "ds", 0.3, marker)
    try:
        _wait_for(marker, 4, proc)  # the (0, total) call + 3 checkpointed batches
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    checkpointed = int(marker.read_text().split()[-1])  # entries reported done before the kill
    assert checkpointed >= N_TEXTS
    reader = open_cache(cache)  # the published state (checkpoints live in the writer's recovery log) opens
    assert reader.verify() == [] and len(reader) <= checkpointed
    assert [p.name for p in cache.glob("wal-*.log")]  # the dead writer's log
    CacheWriter(cache).close()  # the next writer publishes what the dead one checkpointed, then drops the log
    assert not list(cache.glob("wal-*.log"))
    reader = open_cache(cache)
    committed = len(reader)
    assert checkpointed <= committed < N_IMAGES + N_TEXTS and reader.verify() == []
    enc = FakeEncoders()
    report = run_encode(_plan(folder, cache), **enc.kw())
    assert report.encoded == N_IMAGES + N_TEXTS - committed
    _assert_complete(cache)
    assert not [p for p in (cache / "shards").iterdir() if p.name.endswith(".tmp")]  # compaction removed orphans


def test_kill_9_mid_encode_then_rerun_recovers_the_log_itself(folder: Path, cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "progress.txt"
    proc = _worker(folder, cache, "ds", 0.3, marker)
    try:
        _wait_for(marker, 5, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    checkpointed = int(marker.read_text().split()[-1])
    enc = FakeEncoders()
    report = run_encode(_plan(folder, cache), **enc.kw())  # plan and encode see the recovered entries
    assert report.encoded <= N_IMAGES + N_TEXTS - checkpointed
    assert report.encoded + report.reused == N_IMAGES + N_TEXTS
    _assert_complete(cache)
    assert not list(cache.glob("wal-*.log"))


def test_two_processes_encoding_one_cache_take_turns(folder: Path, cache: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "a.txt"
    proc = _worker(folder, cache, "a", 0.3, marker)  # the other process: slow, holds the write lock ~2 s
    try:
        _wait_for(marker, 1, proc)  # progress(0, total) is called once it holds the lock
        enc = FakeEncoders()
        with caplog.at_level(logging.WARNING, "dataset_cache.encode"):
            mine = run_encode(_plan(folder, cache, dataset="b"), **enc.kw())
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    theirs = json.loads(out.strip().splitlines()[-1])
    assert "another process is encoding into this cache" in caplog.text  # this one waited, saying so
    assert theirs["encoded"] == N_IMAGES + N_TEXTS and mine.encoded == 0 and enc.calls == 0  # nothing twice
    assert theirs["samples"] == mine.samples == N_IMAGES
    _assert_complete(cache, "a")
    _assert_complete(cache, "b")


def test_waiting_for_the_write_lock_logs_and_honours_should_stop(folder: Path, cache: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    plan = _plan(folder, cache)
    polls: list[int] = []
    with CacheLock(cache, WRITE_LOCK, purpose="test"), caplog.at_level(logging.WARNING, "dataset_cache.encode"):
        report = run_encode(plan, **FakeEncoders().kw(), should_stop=lambda: bool(polls.append(1)) or len(polls) > 1)
    assert report.stopped and report.encoded == 0
    assert "another process is encoding into this cache" in caplog.text


# ------------------------------------------------------------------------------------------ failures

def _corrupt(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)


def _truncate(path: Path) -> None:
    """A valid header but cut pixel data: readable size, undecodable image."""
    torch.manual_seed(0)
    noise = (torch.rand(64, 64, 3) * 255).to(torch.uint8).numpy()
    Image.fromarray(noise).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [_corrupt, _truncate])
def test_unreadable_image_is_skipped_and_counted(folder: Path, cache: Path, damage: Any) -> None:
    bad = folder / "10_red" / "img_002.png"
    damage(bad)
    enc = FakeEncoders()
    report = _build(folder, cache, enc)
    assert report.failed == 1 and report.skipped == 1 and report.samples == N_IMAGES - 1
    assert report.failures[0].relpath == "10_red/img_002.png" and "1 failed" in report.summary()
    assert enc.images == N_IMAGES - 1
    _assert_complete(cache, samples=N_IMAGES - 1)


@pytest.mark.parametrize("damage", [_corrupt, _truncate])
def test_unreadable_image_with_stop_policy_raises_naming_it(folder: Path, cache: Path, damage: Any) -> None:
    damage(folder / "10_red" / "img_002.png")
    settings = EncodeSettings(bucket=SETTINGS.bucket, batch_size=2, failure_policy="stop")
    with pytest.raises(SourceError, match=r"img_002\.png"):
        _build(folder, cache, settings=settings)


def test_non_utf8_caption_is_reported(folder: Path, cache: Path) -> None:
    (folder / "2_blue" / "img_001.txt").write_bytes(b"caf\xe9 au lait")
    report = _build(folder, cache)
    assert [f.relpath for f in report.failures] == ["2_blue/img_001.txt"]
    assert "not valid UTF-8" in report.failures[0].reason and report.skipped == 1
    settings = EncodeSettings(bucket=SETTINGS.bucket, failure_policy="stop")
    with pytest.raises(SourceError, match=r"img_001\.txt.*UTF-8"):
        _build(folder, cache, settings=settings)


def test_image_edited_after_planning_is_never_stored_under_the_old_key(folder: Path, cache: Path) -> None:
    plan = _plan(folder, cache)
    Image.new("RGB", (64, 64), (9, 9, 9)).save(folder / "10_red" / "img_000.png")
    report = run_encode(plan, **FakeEncoders().kw())
    assert report.failed == 1 and "changed after the folder was scanned" in report.failures[0].reason
    report = _build(folder, cache)  # the next run picks the new content up under its own key
    assert report.failed == 0 and report.encoded_latents == 1


def test_missing_encoder_and_wrong_result_count_are_errors(folder: Path, cache: Path) -> None:
    plan = _plan(folder, cache)
    with pytest.raises(ValueError, match="encode_images is None"):
        run_encode(plan, encode_images=None, encode_texts=FakeEncoders().encode_texts)
    with pytest.raises(ValueError, match="one conditioning per text"):
        run_encode(plan, encode_images=FakeEncoders().encode_images, encode_texts=lambda texts: [])


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="failure_policy"):
        EncodeSettings(failure_policy="ignore")
    with pytest.raises(ValueError, match="batch_size"):
        EncodeSettings(batch_size=0)
    with pytest.raises(TypeError, match="caption_prefix"):
        EncodeSettings(caption_prefix=None)  # type: ignore[arg-type]
    assert sources_record_path("/c", "a b").name != sources_record_path("/c", "a_b").name


# ------------------------------------------------------------------------------------------ sourceless

def test_deleting_the_source_folder_keeps_the_dataset_readable(folder: Path, cache: Path) -> None:
    _build(folder, cache)
    before = open_cache(cache).dataset("ds")
    shutil.rmtree(folder)
    _assert_complete(cache)
    plan = _plan(folder, cache)
    assert plan.sourceless and plan.removed == 10 and not plan.needs_vae and not plan.needs_text_encoder
    report = run_encode(plan, encode_images=None, encode_texts=None)
    assert report.sourceless and report.samples == N_IMAGES and "gone" in report.summary()
    assert open_cache(cache).dataset("ds") == before
    with pytest.raises(DatasetFolderError, match="holds no dataset 'other'"):
        _plan(folder, cache, dataset="other")
    with pytest.raises(DatasetFolderError, match="encoded with other vae_fingerprint than requested"):
        _plan(folder, cache, vae="vae-2")  # cached latents of another VAE must not be trained on


def test_min_commit_seconds_commits_less_often_and_still_keeps_finished_work(folder: Path, cache: Path) -> None:
    with pytest.raises(RuntimeError, match="fake encoder failure"):
        run_encode(_plan(folder, cache), **FakeEncoders(fail_after=5).kw(), min_commit_seconds=3600)
    reader = open_cache(cache)
    assert len(reader) == N_TEXTS + 3  # an exception still commits every finished batch
    report = run_encode(_plan(folder, cache), **FakeEncoders().kw(), min_commit_seconds=3600)
    assert report.encoded == N_IMAGES - 3
    _assert_complete(cache)


def test_batches_are_checkpointed_into_one_shard_not_one_shard_each(folder: Path, cache: Path) -> None:
    with pytest.raises(RuntimeError, match="fake encoder failure"):
        run_encode(_plan(folder, cache), **FakeEncoders(fail_after=5).kw())
    reader = open_cache(cache)
    assert len(reader) == N_TEXTS + 3  # 5 checkpointed batches, published by the commit after the exception...
    assert reader.stats()["shards"] == 1  # ...as one shard, not one per batch
    assert not list(cache.glob("wal-*.log"))  # published: the recovery log is gone


def test_sync_seconds_zero_fsyncs_the_log_at_every_checkpoint(folder: Path, cache: Path) -> None:
    enc = FakeEncoders()
    every = run_encode(_plan(folder, cache), **enc.kw(), sync_seconds=0)
    assert every.log_syncs == enc.calls > 1  # one fsync per checkpointed batch
    shutil.rmtree(cache)
    rare = run_encode(_plan(folder, cache), **FakeEncoders().kw(), sync_seconds=3600)
    assert rare.log_syncs == 1  # once before the images (the VAE may load slowly); the final commit does the rest
    _assert_complete(cache)


def test_plan_keys_equal_the_keys_module(folder: Path, cache: Path) -> None:
    """The plan splices hashes and texts into cached canonical bytes; the keys must be exactly keys.py's."""
    from dataset_cache.keys import conditioning_key, hash_file, latent_key

    (folder / "10_red" / "img_002.txt").write_text('quotes " and \\ backslash\ncafé ünïcode\n\ttab\x7f')
    settings = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32, crop="random", seed=3))
    plan = _plan(folder, cache, settings=settings)
    jobs = {j.relpath: j for js in plan.missing_latents.values() for j in js}
    for sample in plan.samples:
        assert sample.source is not None
        path = folder / sample.source
        job = jobs[sample.source]
        assert job.source_hash == hash_file(path)
        assert sample.latent == latent_key(job.source_hash, job.plan.key_fields(), "vae-1")
        assert sample.latent == latent_key(job.source_hash, settings.bucket.plan(*job.plan.source,
                                                                                 token=job.source_hash).key_fields(),
                                           "vae-1")
    texts = plan.missing_conditionings
    assert 'quotes " and \\ backslash' in texts.values() and "café ünïcode" in texts.values()
    for key, text in texts.items():
        assert key == conditioning_key(text, "te-1")


# ------------------------------------------------------------------------------------- cache location
def test_a_linked_sources_folder_is_refused_before_the_record_is_written(folder: Path, cache: Path,
                                                                          tmp_path: Path) -> None:
    _build(folder, cache)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(cache / "sources")
    (cache / "sources").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CacheLinkError, match="sources is a symbolic link"):
        _plan(folder, cache)
    assert list(outside.iterdir()) == []


def test_a_linked_sources_record_is_never_read_through(folder: Path, cache: Path, tmp_path: Path) -> None:
    _build(folder, cache)
    record = sources_record_path(cache, "ds")
    elsewhere = tmp_path / "record-elsewhere.json"
    os.replace(record, elsewhere)
    record.symlink_to(elsewhere)
    with pytest.raises(CacheLinkError, match=record.name):
        _plan(folder, cache)
    assert record.is_symlink() and elsewhere.is_file()


@pytest.mark.parametrize("inner", ["shards", "datasets/x", "sources", "elsewhere/deeper"])
def test_no_encode_plans_a_cache_inside_a_cache(folder: Path, cache: Path, inner: str) -> None:
    _build(folder, cache)
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    with pytest.raises(CacheNestingError, match="inside the cache"):
        _plan(folder, cache / inner)
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == before
    assert open_cache(cache).verify() == []


def test_an_encode_whose_compaction_cannot_read_a_shard_keeps_it_and_says_so(folder: Path, cache: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from support.faults import FaultInjector

    _build(folder, cache)
    with open_cache(cache) as reader:
        (victim,) = [sh.path for sh in reader.shards]
    (folder / "10_red" / "img_000.txt").write_text("an edited caption", encoding="utf-8")
    faults = FaultInjector(victim, monkeypatch)
    with faults.active(rule=lambda op, path: errno.EACCES if op == "open" else None):
        report = _build(folder, cache)  # entries of the unreadable shard count as absent: encoded again
    assert victim.is_file()
    assert "cache: 1 cache file(s) could not be read and were left untouched" in report.summary()
    _assert_complete(cache)


def test_images_per_call_keeps_a_vae_call_s_pixels_bounded() -> None:
    from dataset_cache.encode_run import MAX_PIXEL_BATCH_BYTES, images_per_call

    assert images_per_call((512, 512), 4) == 4
    assert images_per_call((8192, 8192), 256) == 1  # 805 MB for one image: never more than one
    assert images_per_call((4096, 4096), 256) == MAX_PIXEL_BATCH_BYTES // (4096 * 4096 * 12) == 5
    assert images_per_call((16384, 16384), 8) == 1  # over budget alone: still one, never zero


def test_large_buckets_are_encoded_fewer_per_call_and_the_report_says_so(folder: Path, cache: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import dataset_cache.encode_run as inc

    monkeypatch.setattr(inc, "MAX_PIXEL_BATCH_BYTES", 64 * 64 * 12)  # one 64×64 image per call
    enc = FakeEncoders()
    report = _build(folder, cache, enc)
    assert enc.images == N_IMAGES and max(enc.batch_sizes) == 1
    assert "NOTE: images of 3 bucket(s) are encoded fewer per VAE call than batch_size 2 (the 64x64 ones 1 per " \
           "call)" in report.summary()
    _assert_complete(cache)


def test_an_image_smaller_than_one_bucket_step_is_left_out_and_named_when_upscale_is_off(folder: Path,
                                                                                        cache: Path) -> None:
    settings = EncodeSettings(bucket=BucketConfig(resolution=512, step=128, min_side=128, upscale=False),
                              batch_size=2)
    plan = _plan(folder, cache, settings=settings)
    assert plan.failures and all("smaller than one bucket step (128) and upscale is off" in f.reason
                                 for f in plan.failures)
    assert len(plan.samples) + plan.skipped == N_IMAGES and plan.skipped == len(plan.failures)
    ok = EncodeSettings(bucket=BucketConfig(resolution=512, step=16, min_side=16, upscale=False), batch_size=2)
    plan = _plan(folder, cache, settings=ok)
    assert not plan.failures and max(b[0] * b[1] for b in plan.missing_latents) <= 96 * 96


def test_hostile_captions_are_cut_noted_or_left_out_naming_the_file(folder: Path, cache: Path) -> None:
    from dataset_cache.captions import CAPTION_VARIANTS_NOTE, MAX_CAPTION_CHARS, MAX_CAPTION_VARIANTS

    images = sorted(p for p in folder.rglob("*") if p.suffix in (".png", ".jpg"))
    huge, many, too_many = images[0], images[1], images[2]
    huge.with_suffix(".txt").write_text("word " * 48_000, encoding="utf-8")  # one 240 KB line
    many.with_suffix(".txt").write_text("\n".join(f"variant {i}" for i in range(CAPTION_VARIANTS_NOTE + 8)))
    too_many.with_suffix(".txt").write_text("\n".join(f"line {i}" for i in range(MAX_CAPTION_VARIANTS + 44)))
    enc = FakeEncoders()
    report = _build(folder, cache, enc)
    rel = lambda p: p.relative_to(folder).as_posix()  # noqa: E731
    assert [f.relpath for f in report.failures] == [rel(too_many)]
    assert f"{MAX_CAPTION_VARIANTS + 44} lines (variants), above the limit" in report.failures[0].reason
    summary = report.summary()
    assert f"lines over {MAX_CAPTION_CHARS} characters, encoded cut to that length (first: the caption of " \
           f"{rel(huge)})" in summary
    assert f"more than {CAPTION_VARIANTS_NOTE} caption lines" in summary and rel(many) in summary
    assert max(len(t) for t in enc.texts) <= MAX_CAPTION_CHARS
    assert report.samples == N_IMAGES - 1 and report.skipped == 1
    again = FakeEncoders()
    _build(folder, cache, again)  # the cut text is what was keyed: nothing is encoded again
    assert again.calls == 0
