"""PrefetchLoader's reference images (edit models): each row's reference latent read in the batch's one read and put
in its conditioning's ``reference_latents`` as ComfyUI's ReferenceLatent node does, the mirrored reference for a
mirrored row, rows without one and the shared caption objects untouched, and a reference that is not a latent
named."""

from __future__ import annotations

import pytest
import torch

from dataset_cache.batch_assembly import REFERENCE_LATENTS, entry_keys, with_references
from dataset_cache.dataset import Sample
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import LoaderWorkerError, PrefetchLoader
from dataset_cache.sampler import BucketSampler
from dataset_cache.sharding import RowShardSampler
from support.memory_reader import MemoryReader


def dataset(n: int = 8):
    """Samples of one bucket: every one mirrored; the even ones with a reference (and its mirror); all sharing
    two captions, the first of which already holds a reference latent of its own."""
    g = torch.Generator().manual_seed(0)
    entries: dict = {"c0": [[torch.randn(1, 2, 8, generator=g), {REFERENCE_LATENTS: [torch.zeros(1, 4, 2, 2)]}]],
                     "c1": [[torch.randn(1, 2, 8, generator=g), {"guidance": 3.5}]]}
    samples = []
    for i in range(n):
        entries[f"l{i}"] = {"samples": torch.randn(1, 4, 4, 6, generator=g)}
        entries[f"m{i}"] = {"samples": entries[f"l{i}"]["samples"].flip(-1)}
        ref = i % 2 == 0
        if ref:
            entries[f"r{i}"] = {"samples": torch.randn(1, 4, 4, 6, generator=g)}
            entries[f"rm{i}"] = {"samples": entries[f"r{i}"]["samples"].flip(-1)}
        samples.append(Sample(f"l{i}", (f"c{i % 2}",), mirror=f"m{i}", reference=f"r{i}" if ref else None,
                              reference_mirror=f"rm{i}" if ref else None))
    return samples, entries


def _originals(entries: dict) -> dict:
    return {k: (v[0][0], dict(v[0][1])) for k, v in entries.items() if k.startswith("c")}


@pytest.mark.parametrize("prefetch,threads", [(0, None), (2, 1), (3, 3)])
def test_each_row_gets_its_reference_its_mirror_for_a_mirrored_row(prefetch, threads):
    samples, entries = dataset()
    before = _originals(entries)
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=3, tail="wrap")
    mirrored = plain = without = 0
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, threads=threads, epochs=3) as loader:
        for batch in loader:
            plan = batch.plan
            for r, (i, ref_key, caption) in enumerate(zip(plan.sample_indices, plan.reference_keys,
                                                          plan.caption_keys)):
                (entry,) = batch.conditioning[r]
                stored_tensor, stored_options = before[caption]
                assert entry[0] is stored_tensor  # the caption's tensor itself, not a copy
                refs = entry[1].get(REFERENCE_LATENTS, [])
                if ref_key is None:
                    assert samples[i].reference is None
                    assert entry[1] == stored_options
                    without += 1
                    continue
                want = samples[i].reference_mirror if plan.mirrored[r] else samples[i].reference
                assert ref_key == want
                assert refs[-1] is entries[want]["samples"]  # appended after any the caption holds
                assert len(refs) == len(stored_options.get(REFERENCE_LATENTS, [])) + 1
                assert {k: v for k, v in entry[1].items() if k != REFERENCE_LATENTS} == \
                    {k: v for k, v in stored_options.items() if k != REFERENCE_LATENTS}
                mirrored += plan.mirrored[r]
                plain += not plan.mirrored[r]
    assert mirrored and plain and without
    assert _originals(entries).keys() == before.keys()
    for key, (tensor, options) in before.items():  # the cached conditionings are never changed in place
        assert entries[key][0][0] is tensor and entries[key][0][1] == options


def test_each_batch_is_one_read_holding_its_references():
    samples, entries = dataset()
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=3, tail="wrap")
    plans = sampler.epoch_plans(0)
    with PrefetchLoader(reader, sampler, prefetch_batches=0, epochs=1) as loader:
        assert sum(1 for _ in loader) == len(plans)
    assert reader.reads == [tuple(entry_keys(p)) for p in plans]
    for keys, plan in zip(reader.reads, plans):
        assert {k for k in plan.reference_keys if k is not None} <= set(keys)


def test_a_dataset_without_references_plans_none():
    samples, entries = dataset()
    plain = [Sample(s.latent, s.captions, mirror=s.mirror) for s in samples]
    sampler = BucketSampler(plain, buckets_from_reader(MemoryReader(entries), plain), 4, seed=3)
    assert all(p.reference_keys == () for p in sampler.epoch_plans(0))


def test_row_shares_keep_their_rows_references():
    samples, entries = dataset()
    buckets = buckets_from_reader(MemoryReader(entries), samples)
    whole = BucketSampler(samples, buckets, 4, seed=3).epoch_plans(0)
    halves = [RowShardSampler(samples, buckets, 2, seed=3, rank=r, world_size=2).epoch_plans(0) for r in (0, 1)]
    for plan, first, second in zip(whole, *halves):
        assert first.reference_keys + second.reference_keys == plan.reference_keys


def test_a_reference_that_is_not_a_latent_is_named():
    samples, entries = dataset()
    entries["r0"] = [[torch.zeros(1, 2, 8), {}]]  # a conditioning where a latent belongs
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples[:1], buckets_from_reader(reader, samples[:1]), 1, seed=0)
    with PrefetchLoader(reader, sampler, prefetch_batches=0, epochs=1) as loader:
        with pytest.raises((LoaderWorkerError, ValueError), match="reference entry r0"):
            list(loader)


def test_with_references_leaves_rows_without_one_as_they_are():
    cond = [[torch.zeros(1), {"a": 1}]]
    ref = torch.ones(1, 4, 2, 2)
    out = with_references([cond, cond], [None, ref])
    assert out[0] is cond and out[1] is not cond
    assert out[1][0][1] == {"a": 1, REFERENCE_LATENTS: [ref]} and cond[0][1] == {"a": 1}
    assert with_references([cond], None) == [cond]
