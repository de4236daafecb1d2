"""PrefetchLoader with a CUDA target: exact values on device, one side stream, copies overlapping compute.

Skipped without CUDA. The in-memory reader of ``test_loader.py`` is reused (it reads into the same
``ReadBuffer`` the real reader uses, pinned here); one test also runs over a real on-disk cache.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler, buckets_from_reader

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).parent))
import test_loader as cpu  # noqa: E402  (the CPU suite's in-memory reader and dataset)


def _assert_same(gpu, ref) -> None:
    assert gpu.plan == ref.plan
    assert gpu.latents.device.type == "cuda"
    assert torch.equal(gpu.latents.cpu(), ref.latents)
    for g, r in zip(gpu.conditioning, ref.conditioning):
        assert g[0][0].device.type == "cuda"
        assert torch.equal(g[0][0].cpu(), r[0][0])
        assert torch.equal(g[0][1]["pooled_output"].cpu(), r[0][1]["pooled_output"])
    assert (gpu.latent_extras is None) == (ref.latent_extras is None)
    if ref.latent_extras is not None:
        for g, r in zip(gpu.latent_extras, ref.latent_extras):
            assert g.keys() == r.keys()
            for k in r:
                assert torch.equal(g[k].cpu(), r[k])


@pytest.mark.parametrize("prefetch,threads", [(0, None), (2, 1), (3, 3)])
def test_values_on_device_equal_the_cpu_reference(prefetch, threads):
    _, _, reader, sampler = cpu.make(n=30)
    with PrefetchLoader(reader, sampler, device="cpu") as ref_loader:
        ref = list(ref_loader)
    sampler.set_epoch(0)
    with PrefetchLoader(reader, sampler, device="cuda", prefetch_batches=prefetch, threads=threads) as loader:
        assert loader.pin_memory
        got = list(loader)  # keep every batch alive: record_stream must keep their memory from being reused
        side = loader._ctx.side_stream
        list(loader)  # a second epoch: same side stream, no new one per epoch
        assert loader._ctx.side_stream is side
    torch.cuda.synchronize()
    assert all(buf.pin_memory and buf.tensor.is_pinned() for buf in reader.buffers.values())
    for g, r in zip(got, ref, strict=True):
        _assert_same(g, r)


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
    reader_mod = pytest.importorskip("dataset_cache.format.reader")
    writer_mod = pytest.importorskip("dataset_cache.format.writer")
    samples, entries = cpu.make_dataset(16)
    with writer_mod.CacheWriter(tmp_path / "cache") as w:
        for key, value in entries.items():
            w.add(key, value, kind="latent" if isinstance(value, dict) else "conditioning")
    reader = reader_mod.open_cache(tmp_path / "cache")
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 2, seed=3, tail="wrap")
    before = set(threading.enumerate())
    with PrefetchLoader(reader, sampler, device="cuda", threads=2) as loader:
        batches = list(loader)
    assert set(threading.enumerate()) == before
    for b in batches:
        lat, cond = cpu.expected_batch(entries, b.plan)
        assert torch.equal(b.latents.cpu(), lat)
        for g, want in zip(b.conditioning, cond):
            assert torch.equal(g[0][0].cpu(), want[0][0])


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
        assert torch.equal(g.masks.cpu(), r.masks)
