"""gc_paused: the collector is off inside, restored after, whatever the nesting, threads or exceptions.
StepCollector: a training loop's collections at step boundaries, nothing leaked past them, the collector restored."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from dataset_cache.gcpause import StepCollector, gc_paused


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_and_back_on_after_even_on_an_exception():
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_had_switched_off_stays_off():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_on_threads_end_with_the_last_one():
    gc.enable()
    entered, release = threading.Barrier(3), threading.Event()
    states: list[bool] = []

    def worker(hold: float) -> None:
        with gc_paused():
            entered.wait()
            release.wait(hold)
            states.append(gc.isenabled())

    first = threading.Thread(target=worker, args=(0.0,))
    second = threading.Thread(target=worker, args=(5.0,))
    first.start()
    second.start()
    entered.wait()
    first.join()  # the first pause ended while the second still runs: still off
    assert not gc.isenabled()
    release.set()
    second.join()
    assert states == [False, False] and gc.isenabled()


def test_validation_and_opening_leave_the_collector_as_they_found_it(tmp_path):
    from dataset_cache.format import CacheWriter, open_cache
    from dataset_cache.sources import build_record, validate_sources

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.png").write_bytes(b"png")
    gc.enable()
    validate_sources(tmp_path / "data", build_record(tmp_path / "data"))
    with CacheWriter(tmp_path / "cache") as w:
        w.add("k", [1])
    open_cache(tmp_path / "cache").close()
    assert gc.isenabled()


def test_an_encode_plan_runs_paused_and_restores_the_collector(tmp_path, monkeypatch):
    from dataset_cache import sources
    from dataset_cache.buckets import BucketConfig
    from dataset_cache.encode_settings import EncodeSettings
    from dataset_cache.encode_plan import plan_encode
    from PIL import Image

    (tmp_path / "data").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "data" / "a.png")
    seen: list[bool] = []
    listing = sources.list_folder

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return listing(*args, **kwargs)

    monkeypatch.setattr(sources, "list_folder", spy)
    gc.enable()
    plan = plan_encode(tmp_path / "data", tmp_path / "cache", dataset="d", vae_fingerprint="v",
                       text_fingerprint="t",
                       settings=EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32)))
    assert len(plan.samples) == 1 and seen == [False] and gc.isenabled()


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_a_step_collector_pauses_freezes_and_restores_even_on_an_exception():
    gc.enable()
    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with StepCollector():
            assert not gc.isenabled()
            assert gc.get_freeze_count() > before  # what was alive at the start is frozen
            raise RuntimeError("a step failed")
    assert gc.isenabled() and gc.get_freeze_count() == before


def test_a_cycle_made_in_a_step_is_freed_at_the_step_boundary():
    with StepCollector(full_every=1000) as collector:
        gone = _cycle()
        for _ in range(10_000):  # allocations that would have started collections: none runs inside the step
            [object()]
        assert gone() is not None
        collector.step()
        assert gone() is None


def test_a_cycle_that_outlives_its_step_is_freed_by_the_next_full_pass():
    with StepCollector(full_every=3) as collector:
        held = _Node()
        for _ in range(5):  # young passes promote it to the oldest generation
            collector.step()
        gone = weakref.ref(held)
        del held
        while collector.steps % 3:
            collector.step()
            if collector.steps % 3:
                assert gone() is not None  # young passes do not walk the oldest generation
        assert gone() is None


def test_garbage_from_before_the_loop_is_freed_not_frozen():
    gc.disable()
    gone = _cycle()
    assert gone() is not None
    with StepCollector():
        assert gone() is None


def test_overlapping_step_collectors_unfreeze_with_the_last_one():
    gc.enable()
    before = gc.get_freeze_count()
    outer = StepCollector()
    outer.__enter__()
    with StepCollector():
        pass
    assert gc.get_freeze_count() > before and not gc.isenabled()  # the outer loop still runs
    outer.__exit__(None, None, None)
    assert gc.get_freeze_count() == before and gc.isenabled()


def test_full_every_must_be_positive():
    with pytest.raises(ValueError, match="full_every"):
        StepCollector(full_every=0)
