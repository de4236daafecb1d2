"""PrefetchLoader's loss masks (#16): read with the batch, widened to float in [0, 1], mirrored rows flipped,
ones for rows without a mask, ``None`` when no row has one, and a mask of the wrong size named."""

from __future__ import annotations

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import LoaderWorkerError, PrefetchLoader
from dataset_cache.sampler import BucketSampler
from support.memory_reader import MemoryReader


def dataset(n: int = 8, h: int = 4, w: int = 6, with_masks: bool = True):
    g = torch.Generator().manual_seed(0)
    entries: dict = {"empty": [[torch.zeros(1, 2, 8), {}]]}
    samples = []
    for i in range(n):
        entries[f"l{i}"] = {"samples": torch.randn(1, 4, h, w, generator=g)}
        entries[f"m{i}"] = {"samples": entries[f"l{i}"]["samples"].flip(-1)}
        entries[f"c{i}"] = [[torch.randn(1, 2, 8, generator=g), {}]]
        has_mask = with_masks and i % 2 == 0
        if has_mask:
            entries[f"k{i}"] = {"mask": torch.randint(0, 256, (1, 1, h, w), generator=g, dtype=torch.uint8)}
        samples.append(Sample(f"l{i}", (f"c{i}",), mirror=f"m{i}", mask=f"k{i}" if has_mask else None,
                              empty_caption="empty"))
    return samples, entries


@pytest.mark.parametrize("prefetch,threads", [(0, None), (2, 1), (3, 3)])
def test_masks_are_read_with_the_batch_flipped_with_mirrored_rows_and_ones_without(prefetch, threads):
    samples, entries = dataset()
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=2, tail="wrap")
    flipped = unflipped = ones = 0
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, threads=threads, epochs=3) as loader:
        for batch in loader:
            plan = batch.plan
            assert batch.masks is not None
            assert batch.masks.shape == (4, 1, 4, 6) and batch.masks.dtype == torch.float32
            assert batch.masks.device == batch.latents.device
            assert 0.0 <= float(batch.masks.min()) and float(batch.masks.max()) <= 1.0
            for r, key in enumerate(plan.mask_keys):
                if key is None:
                    assert torch.equal(batch.masks[r], torch.ones(1, 4, 6))
                    ones += 1
                    continue
                stored = entries[key]["mask"][0].float() / 255
                want = stored.flip(-1) if plan.mirrored[r] else stored
                assert torch.equal(batch.masks[r], want)
                flipped += plan.mirrored[r]
                unflipped += not plan.mirrored[r]
    assert flipped and unflipped and ones


def test_each_batch_is_one_read_holding_its_masks():
    samples, entries = dataset()
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 4, seed=2, tail="wrap")
    plans = sampler.epoch_plans(0)
    reader.reads.clear()
    with PrefetchLoader(reader, sampler, prefetch_batches=0) as loader:
        got = list(loader)
    assert len(reader.reads) == len(got) == len(plans)
    for keys, plan in zip(reader.reads, plans):
        want = {k for k in plan.mask_keys if k is not None}
        assert want <= set(keys) and set(plan.latent_keys) <= set(keys)


@pytest.mark.parametrize("with_masks", [False, True], ids=["no mask in the dataset", "rows without masks"])
def test_batches_whose_rows_have_no_mask_get_no_masks_tensor(with_masks):
    samples, entries = dataset(with_masks=with_masks)
    samples = [s for s in samples if s.mask is None]  # with masks in the dataset: only the rows without one
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 2, seed=1)
    with PrefetchLoader(reader, sampler, prefetch_batches=1) as loader:
        assert all(b.masks is None for b in loader)


def test_a_mask_of_the_wrong_size_names_its_entry_and_latent():
    samples, entries = dataset()
    entries["k2"] = {"mask": torch.zeros(1, 1, 4, 5, dtype=torch.uint8)}
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 8, seed=1, shuffle=False)
    with PrefetchLoader(reader, sampler, prefetch_batches=1) as loader:
        with pytest.raises(LoaderWorkerError, match=r"mask entry k2 is \[4, 5\] but its latent (l|m)2 is \[4, 6\]"):
            list(loader)


@pytest.mark.parametrize("bad", [torch.zeros(4, 6), {"samples": torch.zeros(1, 1, 4, 6)}, {"mask": "x"},
                                 {"mask": torch.zeros(1, 2, 4, 6, dtype=torch.uint8)}])
def test_an_entry_that_is_not_a_mask_is_named(bad):
    samples, entries = dataset()
    entries["k0"] = bad
    reader = MemoryReader(entries)
    sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 8, seed=1, shuffle=False)
    with PrefetchLoader(reader, sampler, prefetch_batches=0) as loader:
        with pytest.raises(LoaderWorkerError, match="mask entry k0 is not a mask dict"):
            list(loader)


def test_masks_through_the_real_reader(tmp_path):
    from dataset_cache.format.reader import open_cache
    from dataset_cache.format.writer import CacheWriter

    samples, entries = dataset(6)
    with CacheWriter(tmp_path / "cache") as w:
        for key, value in entries.items():
            w.add(key, value, kind="conditioning" if isinstance(value, list) else "latent")
    reader = open_cache(tmp_path / "cache")
    try:
        sampler = BucketSampler(samples, buckets_from_reader(reader, samples), 3, seed=4, tail="wrap")
        with PrefetchLoader(reader, sampler, prefetch_batches=2, threads=2, epochs=2) as loader:
            for batch in loader:
                for r, key in enumerate(batch.plan.mask_keys):
                    want = torch.ones(1, 4, 6) if key is None else entries[key]["mask"][0].float() / 255
                    if key is not None and batch.plan.mirrored[r]:
                        want = want.flip(-1)
                    assert torch.equal(batch.masks[r], want)
    finally:
        reader.close()
