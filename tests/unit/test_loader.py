"""PrefetchLoader on CPU: order, values, errors, thread hygiene, resume, bounded read-ahead, one CPU.

A small in-test reader with the CacheReader interface (``get``, ``read(keys, pin_memory=, out=)``) keeps these
tests independent of the on-disk format; ``test_with_the_real_reader`` runs the same loop over a real cache when
``dataset_cache.format`` provides one.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheCorruptError
from dataset_cache.format.reader import ReadBuffer
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import Batch, LoaderWorkerError, PrefetchLoader
from dataset_cache.sampler import BucketSampler

ROOT = Path(__file__).resolve().parents[2]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _rebuild(value: Any, it) -> Any:
    if isinstance(value, torch.Tensor):
        return next(it)
    if isinstance(value, list):
        return [_rebuild(v, it) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, it) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, it) for k, v in value.items()}
    return value


def _raise_corrupt(key: str) -> None:
    raise CacheCorruptError("shards/00.safetensors", "checksum mismatch", entry=key)


class FakeReader:
    """Entries in memory; ``read`` sleeps ``delay`` seconds, writes into ``out`` and returns views into it."""

    def __init__(self, entries: dict[str, Any], delay: float = 0.0, fail_on: set[str] | None = None) -> None:
        self.entries = entries
        self.delay = delay
        self.fail_on = fail_on or set()
        self.lock = threading.Lock()
        self.reads: list[tuple[str, ...]] = []
        self.active = 0
        self.max_active = 0
        self.buffers: dict[int, ReadBuffer] = {}  # every buffer a read was asked to reuse
        self.allocations = 0  # buffer (re)allocations

    def get(self, key: str) -> Any:
        lazy = (SimpleNamespace(shape=t.shape, dtype=t.dtype) for t in _tensors(self.entries[key]))
        return _rebuild(self.entries[key], lazy)

    def read(self, keys, *, pin_memory: bool = False, out: ReadBuffer | None = None) -> list[Any]:
        with self.lock:
            self.reads.append(tuple(keys))
            if out is not None:
                self.buffers[id(out)] = out
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self.delay:
                time.sleep(self.delay)
            for k in keys:
                if k in self.fail_on:
                    _raise_corrupt(k)
            values = [self.entries[k] for k in keys]
            tensors = _tensors(values)
            sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors]
            if out is None:
                return _rebuild(values, (t.clone() for t in tensors))
            before = out.tensor.data_ptr()
            data = out.ensure(sum(sizes))
            self.allocations += out.tensor.data_ptr() != before
            views, at = [], 0
            for t, n in zip(tensors, sizes):
                v = data[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                v.copy_(t)
                views.append(v)
                at += n
            return _rebuild(values, iter(views))
        finally:
            with self.lock:
                self.active -= 1


def make_dataset(n: int = 20, shapes=((4, 8, 8), (4, 16, 8))):
    entries: dict[str, Any] = {}
    samples = []
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        shape = shapes[i % len(shapes)]
        lat = f"{i:032x}"
        entries[lat] = {"samples": torch.randn((1, *shape), generator=g)}
        if i % 4 == 0:
            entries[lat]["noise_mask"] = torch.ones(1, 1, *shape[1:])
        caps = tuple(f"{i:030x}c{j}" for j in range(2))
        for c in caps:
            entries[c] = [[torch.randn(1, 7, 16, generator=g), {"pooled_output": torch.randn(1, 16, generator=g)}]]
        samples.append(Sample(lat, caps, repeats=1 + i % 2))
    return samples, entries


def make(n: int = 20, batch_size: int = 3, delay: float = 0.0, fail_on=None, seed: int = 1):
    samples, entries = make_dataset(n)
    reader = FakeReader(entries, delay=delay, fail_on=fail_on)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), batch_size, seed, tail="wrap")
    return samples, entries, reader, sampler


def expected_batch(entries, plan) -> tuple[torch.Tensor, list[Any]]:
    lat = torch.cat([entries[k]["samples"] for k in plan.latent_keys])
    return lat, [entries[k] for k in plan.caption_keys]


def assert_batch_matches(batch: Batch, entries) -> None:
    lat, cond = expected_batch(entries, batch.plan)
    assert torch.equal(batch.latents, lat)
    assert len(batch.conditioning) == len(cond)
    for got, want in zip(batch.conditioning, cond):
        assert torch.equal(got[0][0], want[0][0])
        assert torch.equal(got[0][1]["pooled_output"], want[0][1]["pooled_output"])


def live_threads() -> set[threading.Thread]:
    return set(threading.enumerate())


# ---------------------------------------------------------------------------------------------- order and values
@pytest.mark.parametrize("prefetch,threads", [(0, None), (1, 1), (2, None), (3, 2), (4, 3)])
def test_batches_come_in_sampler_order_with_exact_values(prefetch, threads):
    _, entries, reader, sampler = make()
    ref = sampler.epoch_plans(0)
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, threads=threads) as loader:
        got = list(loader)
    assert [b.plan for b in got] == ref
    for b in got:
        assert_batch_matches(b, entries)
        assert b.latents.shape[0] == 3


@pytest.mark.parametrize("threads", [0, 2])
def test_video_latents_stack_into_five_dimensional_batches(threads):
    samples, entries = make_dataset(12, shapes=((16, 1, 8, 8), (16, 3, 8, 8)))  # one-frame images and clips
    reader = FakeReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 3, 1, tail="wrap")
    with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=threads) as loader:
        got = list(loader)
    assert got and {tuple(b.latents.shape[2:]) for b in got} == {(1, 8, 8), (3, 8, 8)}
    for b in got:
        assert b.latents.shape[:2] == (3, 16)
        assert_batch_matches(b, entries)


def test_out_of_order_completion_is_delivered_in_order():
    _, entries, reader, sampler = make(n=30)
    slow_first = reader.read

    def jittery(keys, **kw):  # early batches slower than later ones: completion order differs from plan order
        time.sleep(0.02 * (len(reader.reads) % 3 == 0))
        return slow_first(keys, **kw)

    reader.read = jittery
    with PrefetchLoader(reader, sampler, prefetch_batches=4, threads=4) as loader:
        assert [b.plan for b in loader] == sampler.epoch_plans(0)


def test_latent_extras_and_conditioning_are_materialized():
    _, entries, reader, sampler = make()
    with PrefetchLoader(reader, sampler) as loader:
        for b in loader:
            for i, key in enumerate(b.plan.latent_keys):
                has_mask = "noise_mask" in entries[key]
                if b.latent_extras is None:
                    assert not has_mask
                else:
                    assert ("noise_mask" in b.latent_extras[i]) == has_mask
            assert all(isinstance(c[0][0], torch.Tensor) for c in b.conditioning)


def test_kept_cpu_batches_never_change():
    _, entries, reader, sampler = make(n=40)
    with PrefetchLoader(reader, sampler, prefetch_batches=2) as loader:
        batches = list(loader)  # keep them all while later batches are read
    # CPU target: a buffer is read into again only once nothing refers to its memory, so every kept batch has its
    # own memory and none changed under it
    assert len({b.latents.untyped_storage().data_ptr() for b in batches}) == len(batches)
    for b in batches:
        assert_batch_matches(b, entries)


def test_cpu_read_buffers_are_reused_once_the_consumer_lets_go_of_their_batches():
    _, entries, reader, sampler = make(n=40)
    depth = 2
    with PrefetchLoader(reader, sampler, prefetch_batches=depth) as loader:
        seen = 0
        for batch in loader:
            assert_batch_matches(batch, entries)  # a reused buffer never holds another batch's bytes under it
            del batch
            seen += 1
    assert seen == len(reader.reads) > depth + 1
    assert 1 <= len(reader.buffers) <= depth + 2  # the pool's buffers, taken again and again


def test_a_view_kept_from_a_batch_keeps_its_buffer_from_being_reused():
    _, entries, reader, sampler = make(n=40)
    kept = []
    with PrefetchLoader(reader, sampler, prefetch_batches=2) as loader:
        for i, batch in enumerate(loader):
            if i % 3 == 0:
                kept.append((batch.plan, batch.latents[:1]))  # only a view of the first row survives the batch
            del batch
    assert len(kept) > 3
    for plan, first in kept:
        assert torch.equal(first, expected_batch(entries, plan)[0][:1])


def test_several_epochs_and_endless_iteration():
    _, _, reader, sampler = make()
    ref = sampler.epoch_plans(0) + sampler.epoch_plans(1) + sampler.epoch_plans(2)
    with PrefetchLoader(reader, sampler, epochs=2) as loader:
        assert len(loader) == 2 * len(sampler)
        assert [b.plan for b in loader] == ref[: 2 * len(sampler)]
    sampler.set_epoch(0)
    with PrefetchLoader(reader, sampler, epochs=None) as loader:
        got = []
        for b in loader:
            got.append(b.plan)
            if len(got) == len(ref):
                break
        assert got == ref


# ---------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("stop_after", [0, 1, 4, 7])
def test_state_dict_resumes_on_the_batch_after_the_last_delivered(stop_after):
    _, _, reader, sampler = make()
    ref = sampler.epoch_plans(0)
    with PrefetchLoader(reader, sampler, prefetch_batches=3) as loader:
        it = iter(loader)
        for _ in range(stop_after):
            next(it)
        state = loader.state_dict()  # the loader has read ahead; the state must not
        del it
    _, _, reader2, sampler2 = make()
    sampler2.load_state_dict(state)
    with PrefetchLoader(reader2, sampler2) as loader2:
        assert [b.plan for b in loader2] == ref[stop_after:]


def test_break_then_iterate_again_continues_where_the_consumer_stopped():
    _, _, reader, sampler = make()
    ref = sampler.epoch_plans(0)
    with PrefetchLoader(reader, sampler, prefetch_batches=3) as loader:
        first = []
        for b in loader:
            first.append(b.plan)
            if len(first) == 2:
                break
        assert [b.plan for b in loader] == ref[2:]
        assert first == ref[:2]


def test_a_new_iteration_supersedes_an_unfinished_one():
    _, _, reader, sampler = make()
    with PrefetchLoader(reader, sampler) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)
        assert next(new).plan.index == 1
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)


# ---------------------------------------------------------------------------------------------------- errors
def test_worker_exception_reaches_consumer_at_the_failing_batch_with_its_traceback():
    samples, entries, reader, sampler = make()
    plans = sampler.epoch_plans(0)
    bad = plans[3].latent_keys[0]
    first_bad = next(i for i, p in enumerate(plans) if bad in p.latent_keys)
    reader.fail_on = {bad}
    before = live_threads()
    loader = PrefetchLoader(reader, sampler, prefetch_batches=2, threads=2)
    delivered = []
    with pytest.raises(LoaderWorkerError, match=f"batch {first_bad} of epoch 0") as info:
        for b in loader:
            delivered.append(b.plan)
    assert delivered == plans[:first_bad]
    cause = info.value.__cause__
    assert isinstance(cause, CacheCorruptError) and cause.entry == bad
    assert info.value.plan == plans[first_bad]
    tb = "".join(traceback.format_exception(cause))
    assert "_raise_corrupt" in tb and "run_job" in tb  # the worker's own frames survive
    assert "checksum mismatch" in str(info.value)
    assert live_threads() == before  # the failed iteration stopped its threads
    assert sampler.position == (0, first_bad)  # a retry starts at the failed batch
    loader.close()


def test_wrong_buckets_are_reported_not_stacked():
    samples, entries, reader, _ = make()
    sampler = BucketSampler(samples, [0] * len(samples), 4, seed=0)  # ignores the two latent shapes
    with PrefetchLoader(reader, sampler) as loader, pytest.raises(LoaderWorkerError, match="mixes latent shapes"):
        list(loader)


# ----------------------------------------------------------------------------------------------- thread hygiene
def test_close_joins_every_thread_and_no_read_happens_after():
    _, _, reader, sampler = make(delay=0.01)
    before = live_threads()
    loader = PrefetchLoader(reader, sampler, prefetch_batches=4, threads=2)
    it = iter(loader)
    next(it)
    assert len(live_threads() - before) == loader.threads >= 1
    loader.close()
    assert live_threads() == before
    reads = len(reader.reads)
    assert reader.active == 0
    time.sleep(0.05)
    assert len(reader.reads) == reads
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    with pytest.raises(RuntimeError, match="superseded|closed"):
        next(it)
    loader.close()  # idempotent


def test_threads_survive_a_finished_epoch_and_stop_at_close():
    _, _, reader, sampler = make()
    before = live_threads()
    with PrefetchLoader(reader, sampler, threads=2) as loader:
        list(loader)
        kept = live_threads() - before
        list(loader)
        assert live_threads() - before == kept and len(kept) == loader.threads  # persistent workers, reused
    assert live_threads() == before


def test_exception_in_the_consumer_loop_stops_the_threads():
    _, _, reader, sampler = make(delay=0.005)
    before = live_threads()
    loader = PrefetchLoader(reader, sampler, prefetch_batches=3, threads=2)
    with pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(loader):
            if i == 2:
                raise ZeroDivisionError("the consumer's step failed")
    assert live_threads() == before
    reads = len(reader.reads)
    time.sleep(0.03)
    assert len(reader.reads) == reads
    assert [b.plan.index for b in loader][0] == 3  # still usable; resumes after the last delivered batch
    loader.close()


def test_garbage_collected_unclosed_loader_leaves_no_threads():
    _, _, reader, sampler = make(delay=0.005)
    before = live_threads()

    def abandon() -> None:
        loader = PrefetchLoader(reader, sampler, prefetch_batches=3, threads=2)
        it = iter(loader)
        next(it)
        assert live_threads() != before

    abandon()
    gc.collect()
    assert live_threads() == before

    loader = PrefetchLoader(reader, sampler, prefetch_batches=3, threads=2)
    list(loader)  # finished epoch: threads kept for the next one
    del loader
    gc.collect()
    assert live_threads() == before


# ----------------------------------------------------------------------------------------------- waiting, memory
def test_on_wait_runs_in_the_consumer_thread_and_can_interrupt():
    _, _, reader, sampler = make(delay=0.15)
    calls: list[threading.Thread] = []
    before = live_threads()

    class Interrupted(BaseException):  # ComfyUI's InterruptProcessingException is a BaseException too
        pass

    def on_wait() -> None:
        calls.append(threading.current_thread())
        if len(calls) >= 3:
            raise Interrupted

    loader = PrefetchLoader(reader, sampler, on_wait=on_wait)
    with pytest.raises(Interrupted):
        list(loader)
    assert set(calls) == {threading.current_thread()}
    assert live_threads() == before
    loader.close()


def test_read_ahead_is_bounded_by_prefetch_depth():
    _, _, reader, sampler = make(n=40)
    depth = 2
    batch_bytes = 3 * (4 * 16 * 8 + 2 * 4 * 8 * 8) * 4 + 3 * (7 * 16 + 16) * 4  # biggest bucket, with masks
    with PrefetchLoader(reader, sampler, prefetch_batches=depth, threads=2) as loader:
        for i, batch in enumerate(loader):
            del batch
            time.sleep(0.01)  # a slow consumer: the loader must not run ahead
            assert len(reader.reads) <= i + 1 + depth
            # finished batches read ahead, and the kept read buffers no batch uses (the batch just dropped's, once
            # enumerate() lets go of it too)
            assert loader.held_bytes() <= (depth + 1) * batch_bytes * 5 // 4 + 4096
    assert reader.max_active <= 2
    assert len(reader.buffers) <= depth + 2  # the pool's reusable buffers (see _BufferPool)


class HintingReader(FakeReader):
    """A FakeReader whose reads are planned (a ``PlannedReader``): records each plan made, and each announcement
    with the number of reads started before it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hints: list[tuple[tuple[str, ...], int]] = []
        self.plans: list[tuple[str, ...]] = []
        self.announced_reads: list[bool] = []

    def plan(self, keys) -> tuple[str, ...]:
        with self.lock:
            self.plans.append(tuple(keys))
        return tuple(keys)

    def announce(self, plan) -> bool:
        with self.lock:
            self.hints.append((plan, len(self.reads)))
        return True

    def read_plan(self, plan, *, pin_memory: bool = False, out: ReadBuffer | None = None,
                  announced: bool = False) -> list[Any]:
        with self.lock:
            self.announced_reads.append(announced)
        return self.read(plan, pin_memory=pin_memory, out=out)


def _keys_of(plan) -> tuple[str, ...]:
    return tuple(dict.fromkeys(plan.latent_keys + plan.caption_keys))


def test_a_worker_hints_the_next_batchs_reads_before_reading_its_own():
    samples, entries = make_dataset(20)
    reader = HintingReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 3, 1, tail="wrap")
    plans = sampler.epoch_plans(0)
    with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=1) as loader:
        for batch in loader:
            assert_batch_matches(batch, entries)
            time.sleep(0.002)
    # one thread: job k hints job k + 1 before its own read (k reads started), the last job hints nothing
    assert reader.hints == [(_keys_of(plans[k + 1]), k) for k in range(len(plans) - 1)]
    assert reader.reads == [_keys_of(p) for p in plans]
    assert sorted(reader.plans) == sorted(_keys_of(p) for p in plans)  # each batch planned once: its job keeps it
    assert reader.announced_reads == [False] + [True] * (len(plans) - 1)


def test_no_hints_without_read_ahead():
    samples, entries = make_dataset(8)
    reader = HintingReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 3, 1, tail="wrap")
    with PrefetchLoader(reader, sampler, prefetch_batches=0) as loader:
        assert len(list(loader)) == len(sampler)
    assert reader.hints == [] and len(reader.reads) == len(sampler)
    assert reader.announced_reads == [False] * len(sampler)


def test_stats_report_read_and_wait_times():
    _, _, reader, sampler = make(delay=0.01)
    with PrefetchLoader(reader, sampler, prefetch_batches=2) as loader:
        for _ in loader:
            time.sleep(0.03)  # a step slower than a read: reads are hidden after the first batch
        s = loader.stats
    assert s.batches == len(sampler) == len(s.recent_read_s) == len(s.recent_wait_s)
    assert s.mean_read_s >= 0.01
    assert s.elapsed_s >= 0.03 * (s.batches - 1)
    assert s.wait_fraction < 0.25
    assert 0.005 < s.recent_wait_s[0]  # the first batch is always waited for


def test_bad_arguments_are_refused():
    _, _, reader, sampler = make()
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        PrefetchLoader(reader, sampler, pin_memory=True)
    with pytest.raises(ValueError, match="prefetch_batches must be >= 0"):
        PrefetchLoader(reader, sampler, prefetch_batches=-1)
    with pytest.raises(ValueError, match="epochs must be"):
        PrefetchLoader(reader, sampler, epochs=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            PrefetchLoader(reader, sampler, device="cuda")


def test_threads_are_clamped_to_depth_and_cpus(caplog):
    _, _, reader, sampler = make()
    with caplog.at_level("WARNING"):
        assert PrefetchLoader(reader, sampler, prefetch_batches=2, threads=8).threads <= 2
    assert "loader threads: 8 requested" in caplog.text
    assert PrefetchLoader(reader, sampler, prefetch_batches=0, threads=8).threads == 0
    from dataset_cache.loader import default_loader_threads

    default = PrefetchLoader(reader, sampler)
    assert default.threads == default_loader_threads(default._depth) >= 1


@pytest.mark.parametrize("cpus,depth,expected", [(1, 2, 1), (2, 2, 1), (3, 2, 2), (16, 2, 2), (16, 1, 1), (16, 8, 2)])
def test_default_threads_leave_a_cpu_to_the_training_thread(monkeypatch, cpus, depth, expected):
    import dataset_cache.loader as loader_mod

    monkeypatch.setattr(loader_mod, "available_cpus", lambda: cpus)
    assert loader_mod.default_loader_threads(depth) == expected


def test_rows_already_back_to_back_are_used_as_one_block_without_a_copy():
    from dataset_cache.batch_assembly import as_one_block, stack_rows

    base = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 1, 2, 3)
    rows = [base[i] for i in range(4)]  # each [1, 2, 3]: a latent row of shape [1, C, W] back to back
    block = as_one_block(rows)
    assert block is not None and block.data_ptr() == base.data_ptr() and torch.equal(block, base.view(4, 2, 3))
    stacked = stack_rows(rows)
    assert stacked.data_ptr() == base.data_ptr()  # no copy
    # out of order, a gap, or another storage: stacked by copying, values the same
    for other in ([rows[1], rows[0]], [rows[0], rows[2]], [rows[0], base.clone()[1]]):
        assert as_one_block(other) is None
        assert torch.equal(stack_rows(other), torch.cat(other))


def test_the_real_reader_lays_a_batchs_latents_back_to_back_in_the_order_asked(tmp_path):
    from dataset_cache.format import CacheWriter, open_cache
    from dataset_cache.batch_assembly import as_one_block

    with CacheWriter(tmp_path) as w:
        for i in range(10):
            w.add(f"l{i}", {"samples": torch.full((1, 4, 2, 2), float(i))})
            w.add(f"c{i}", [[torch.full((1, 3, 8), float(i)), {"pooled_output": torch.zeros(1, 8)}]])
    r = open_cache(tmp_path)
    keys = ["l7", "c7", "l2", "c2", "l5", "l2"]
    values = r.read(keys)
    latents = [values[i]["samples"] for i in (0, 2, 4)]
    block = as_one_block(latents)
    assert block is not None
    assert block[:, 0, 0, 0].tolist() == [7.0, 2.0, 5.0]
    assert values[5]["samples"].data_ptr() == values[2]["samples"].data_ptr()  # a repeated key is read once
    r.close()


def test_works_on_one_cpu(tmp_path):
    script = tmp_path / "one_cpu.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys, threading
            sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]
            os.sched_setaffinity(0, {{0}})
            import test_loader as t
            from dataset_cache.loader import PrefetchLoader
            _, entries, reader, sampler = t.make(delay=0.001)
            before = set(threading.enumerate())
            with PrefetchLoader(reader, sampler, prefetch_batches=4, threads=4) as loader:
                assert loader.threads == 1, loader.threads
                got = list(loader)
            assert [b.plan for b in got] == sampler.epoch_plans(0)
            for b in got:
                t.assert_batch_matches(b, entries)
            assert set(threading.enumerate()) == before
            print("ok", len(os.sched_getaffinity(0)))
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "1"]


# ------------------------------------------------------------------------------------------------ real reader
def test_with_the_real_reader(tmp_path):
    reader_mod = pytest.importorskip("dataset_cache.format.reader", reason="format reader not written yet")
    writer_mod = pytest.importorskip("dataset_cache.format.writer", reason="format writer not written yet")
    samples, entries = make_dataset(12)
    with writer_mod.CacheWriter(tmp_path / "cache") as w:
        for key, value in entries.items():
            w.add(key, value, kind="latent" if isinstance(value, dict) else "conditioning")
    reader = reader_mod.open_cache(tmp_path / "cache")
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 2, seed=3, tail="wrap")
    before = live_threads()
    with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=2) as loader:
        batches = list(loader)
    assert live_threads() == before
    assert [b.plan for b in batches] == sampler.epoch_plans(0)
    for b in batches:
        assert_batch_matches(b, entries)
    reader.close()
