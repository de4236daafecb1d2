"""PrefetchLoader with a CUDA target: every branch the trainer takes, equal to the CPU path bit for bit.

Skipped without CUDA. The same runs go through the CUDA delivery's steps on a CPU stand-in of pinned memory in
``test_cuda_delivery.py`` (every suite run), so what differs here is only what a GPU adds: pinned memory, the side
stream, events, ``record_stream``, and the device's own kernels (a copy, ``cat``, ``flip``, ``index_select``: none
of them computes a new float, so nothing may differ from the CPU in any bit).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from dataset_cache.batch_assembly import MASK_LUT, widen_masks
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).parent))
import loader_cases as cases  # noqa: E402
import test_loader as cpu  # noqa: E402  (the CPU suite's in-memory reader and dataset)


def _snapshots(batches: list) -> list:
    return [cases.snapshot(b) for b in batches]


@pytest.mark.parametrize("prefetch,threads", [(0, None), (2, 1), (3, 3)])
def test_values_on_device_equal_the_cpu_reference(prefetch, threads):
    _, _, reader, sampler = cpu.make(n=30)
    with PrefetchLoader(reader, sampler, device="cpu") as ref_loader:
        ref = [values for values, _ in _snapshots(list(ref_loader))]
    sampler.set_epoch(0)
    reader.buffers.clear()  # the CPU reference's pooled (pageable) buffers are not the CUDA loader's
    with PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=prefetch, threads=threads) as loader:
        assert loader.pin_memory
        got = list(loader)  # keep every batch alive: record_stream must keep their memory from being reused
        side = loader._ctx.cuda.side_stream
        list(loader)  # a second epoch: same side stream, no new one per epoch
        assert loader._ctx.cuda.side_stream is side
        stats = loader.stats
    torch.cuda.synchronize()
    assert reader.buffers and all(buf.pin_memory and buf.tensor.is_pinned() for buf in reader.buffers.values())
    assert stats.pageable_copies == 0  # the delivery checked every storage it copied from: all pinned
    assert [b.plan for b in got] == sampler.epoch_plans(0)
    for (g, devices), r in zip(_snapshots(got), ref, strict=True):
        assert devices == {"cuda"}
        for part in r:
            assert cases.same(g[part], r[part]), part


@pytest.mark.parametrize("name", list(cases.CASES))
def test_every_branch_on_the_device_equals_the_cpu_bit_for_bit(name, tmp_path, caplog):
    """Image and video latents, conditionings with pooled output, guidance, reference latents and attention masks
    (real CacheReader), masks and mirrored rows, batches spanning two real caches with regularization rows, the
    per_batch hook's tensors, and a reader value outside the read buffer: each batch on the device equal to the
    CPU's, snapshot as delivered without synchronizing (the consumer's stream must wait for the copies)."""
    case = cases.CASES[name](tmp_path)
    try:
        ref = cases.run(case, "cpu")
        with caplog.at_level("WARNING", logger="dataset_cache.loader"):
            got = cases.run(case, "cuda")
    finally:
        case.close()
    cases.assert_same(got, ref, "cuda")
    if case.pageable == 0:
        assert got.stats.pageable_copies == 0
    else:
        assert got.stats.pageable_copies == sum(len(set(p.caption_keys)) for p, _, _ in got.batches)
        assert sum("pinned host memory" in r.getMessage() for r in caplog.records) == 1


def test_a_dropped_batch_is_not_overwritten_before_the_consumer_stream_read_it():
    """The consumer's stream lags (a sleep kernel per batch) and each batch is dropped right after work on it is
    queued: without ``record_stream`` its memory would go back to the side stream at once and later batches'
    copies would overwrite it before the queued clones ran."""
    _, _, reader, sampler = cpu.make(n=40)
    with PrefetchLoader(reader, sampler, device="cpu", per_batch=cases.noise) as ref_loader:
        ref = [(b.latents.clone(), b.conditioning[0][0][0].clone(), b.extras["noise"].clone()) for b in ref_loader]
    sampler.set_epoch(0)
    clones = []
    with PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=3, threads=2,
                        per_batch=cases.noise) as loader:
        for b in loader:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: the side stream runs ahead meanwhile
            clones.append((b.latents.clone(), b.conditioning[0][0][0].clone(), b.extras["noise"].clone()))
            del b
    torch.cuda.synchronize()
    assert len(clones) == len(ref) > 4
    for got, want in zip(clones, ref):
        assert all(cases.same(g.cpu(), w) for g, w in zip(got, want))


def test_consumer_stream_sees_finished_copies_without_synchronize():
    """The consumer's stream waits on the copy event: an in-place op right after delivery sees the full data."""
    _, _, reader, sampler = cpu.make(n=30)
    with PrefetchLoader(reader, sampler) as ref_loader:
        sums = [b.latents.double().sum().item() for b in ref_loader]
    sampler.set_epoch(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=3) as loader:
        got = [b.latents.double().sum() for b in loader]  # queued on `stream`, never synchronized in between
    torch.cuda.synchronize()
    assert [g.item() for g in got] == pytest.approx(sums, rel=1e-12)


def test_real_reader_on_device(tmp_path):
    from dataset_cache.format.reader import open_cache
    from dataset_cache.format.writer import CacheWriter

    samples, entries = cpu.make_dataset(16)
    with CacheWriter(tmp_path / "cache") as w:
        for key, value in entries.items():
            w.add(key, value, kind="latent" if isinstance(value, dict) else "conditioning")
    reader = open_cache(tmp_path / "cache")
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 2, seed=3, tail="wrap")
    before = set(threading.enumerate())
    with PrefetchLoader(reader, sampler, device="cuda", threads=2) as loader:
        batches = list(loader)
        stats = loader.stats
        slots = [s for s in loader._ctx.slots if s.buffer is not None]
        assert slots and all(s.buffer.tensor.is_pinned() and s.buffer.pin_memory for s in slots)
    reader.close()
    assert set(threading.enumerate()) == before
    assert stats.pageable_copies == 0
    for b in batches:
        lat, cond = cpu.expected_batch(entries, b.plan)
        assert cases.same(b.latents.cpu(), lat)
        for g, want in zip(b.conditioning, cond):
            assert cases.same(g[0][0].cpu(), want[0][0])
            assert cases.same(g[0][1]["pooled_output"].cpu(), want[0][1]["pooled_output"])


def test_the_pinned_buffers_of_the_loader_and_of_a_two_cache_reader(tmp_path):
    """Every host buffer a CUDA loader copies from is pinned: each worker's read and staging buffers, and the
    per-group buffers a MultiCacheReader keeps with them for batches that span caches."""
    case = cases.two_caches(tmp_path)
    try:
        sampler = case.sampler()
        with PrefetchLoader(case.reader, sampler, device="cuda", per_batch=cases.noise, **case.kwargs) as loader:
            assert len(list(loader)) == len(sampler) * 3
            slots = [s for s in loader._ctx.slots if s.buffer is not None]
            extra = [b for group in case.reader._extras.values() for b in group.values()]
            assert slots and extra  # batches spanned both caches
            for buf in [b for s in slots for b in (s.buffer, s.staging)] + extra:
                assert buf.pin_memory and buf.tensor.numel() and buf.tensor.is_pinned()
            assert loader.stats.pageable_copies == 0
    finally:
        case.close()


def test_masks_widen_on_the_device_through_the_cpus_table():
    """All 256 mask bytes widened on the device: the CPU's bits (the table is divided on the CPU, then looked up)."""
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(4, 1, 8, 8)
    on_device = widen_masks(every.cuda(), MASK_LUT.cuda())
    torch.cuda.synchronize()
    assert cases.same(on_device.cpu(), every.float() / 255)


@pytest.mark.parametrize("threads", [1, 3])
def test_masks_on_device_equal_the_cpu_reference(threads):
    """Masks travel from the pinned buffer on the side stream and are widened on the device (#16)."""
    import test_loader_masks as masks

    samples, entries = masks.dataset(12)
    reader = cpu.FakeReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=3, tail="wrap")
    with PrefetchLoader(reader, sampler, device="cpu", epochs=2) as ref_loader:
        ref = list(ref_loader)
    sampler.set_epoch(0)
    with PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=3, threads=threads, epochs=2) as loader:
        got = list(loader)
    torch.cuda.synchronize()
    for g, r in zip(got, ref, strict=True):
        assert g.plan == r.plan and r.masks is not None
        assert g.masks.device.type == "cuda" and g.masks.dtype == torch.float32
        assert cases.same(g.masks.cpu(), r.masks)


def test_copies_overlap_compute():
    """Measured with CUDA events: batch N+1's copy on the side stream runs while batch N's compute runs."""
    shape = (16, 256, 256)  # 4 MiB a row, 32 MiB a batch of 8: a copy of a few ms
    samples, entries = [], {}
    for i in range(64):
        key = f"{i:032x}"
        entries[key] = {"samples": torch.full((1, *shape), float(i))}
        entries["c" + key[1:]] = [[torch.zeros(1, 4, 8), {}]]
        samples.append(cpu.Sample(key, ("c" + key[1:],)))
    reader = cpu.FakeReader(entries)
    sampler = BucketSampler(samples, [shape] * len(samples), 8, seed=0)
    w = torch.randn(4096, 4096, device="cuda")
    step_events = []
    copy_events = []
    with PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=2) as loader:
        for b in loader:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x = w
            for _ in range(12):  # ~ tens of ms of compute on the consumer's stream
                x = torch.tanh(x @ w)
            _ = b.latents.sum() + x.sum()
            end.record()
            step_events.append((start, end))
            copy_events.append(b.copy_events)
    torch.cuda.synchronize()
    t0 = step_events[0][0]
    steps = [(t0.elapsed_time(s), t0.elapsed_time(e)) for s, e in step_events]
    copies = [(t0.elapsed_time(s), t0.elapsed_time(e)) for s, e in copy_events]
    overlapped = sum(
        any(cs < se and ss < ce for ss, se in steps[: i]) for i, (cs, ce) in enumerate(copies) if i > 0
    )
    copy_ms = sum(ce - cs for cs, ce in copies[1:]) / (len(copies) - 1)
    step_ms = sum(se - ss for ss, se in steps) / len(steps)
    print(f"\ncopy {copy_ms:.2f} ms/batch, step {step_ms:.2f} ms, overlapped {overlapped}/{len(copies) - 1}")
    assert overlapped >= (len(copies) - 1) // 2
