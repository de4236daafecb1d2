"""RowShardSampler: global batches shared among ranks by rows, and the same order whatever the number of ranks
(MosaicML's elastic determinism) — what makes 2 devices × batch b train what 1 device × batch 2b trains, and a run
continue on another number of devices."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from dataset_cache.dataset import Sample
from dataset_cache.dataset_mix import Regularization
from dataset_cache.sampler import BatchPlan, BucketSampler
from dataset_cache.sharding import RankPlan, RowShardSampler, rows_of, shard_sampler, share, share_of

DATA = Path(__file__).resolve().parent / "data"


def make_samples(n: int = 23) -> list[Sample]:
    return [Sample(latent=f"{i:032x}", captions=tuple(f"c{i}v{j}" for j in range(1 + i % 3)), repeats=1 + i % 3,
                   source=f"img{i}.png", mirror=f"{i + 1000:032x}" if i % 4 == 0 else None,
                   mask=f"{i + 2000:032x}" if i % 5 == 0 else None, empty_caption="empty")
            for i in range(n)]


def buckets(samples: list[Sample]) -> list[tuple[int, int, int]]:
    return [(4, 8 + 8 * (i % 3), 8) for i in range(len(samples))]


def ranks(world: int, batch: int, samples: list[Sample] | None = None, **kw) -> list[RowShardSampler]:
    samples = samples if samples is not None else make_samples()
    return [RowShardSampler(samples, buckets(samples), batch, 7, rank=r, world_size=world, **kw)
            for r in range(world)]


def joined(plans_of: list[list[RankPlan]]) -> list[BatchPlan]:
    """The global batches the ranks train together: each index's shares, rows concatenated in rank order (stand-in
    rows left out), each share's row weights back to the global batch's (the share's scale taken out)."""
    out = []
    world = len(plans_of)
    for parts in zip(*plans_of):
        real = [p for p in parts if p.sample_indices]
        rows = parts[0].global_rows
        assert [p.first_row for p in real] == [share(rows, r, world)[0] for r in range(len(real))]
        assert all(not p.sample_indices and p.weights == (0.0,) for p in parts[len(real):])  # stand-ins last
        weights: tuple[float, ...] = ()
        for p in real:
            scale = len(p.sample_indices) * world / rows
            weights += tuple(w / scale for w in p.weights) if scale != 1 else p.weights
        first = parts[0]
        out.append(BatchPlan(
            first.epoch, first.index, sum((p.sample_indices for p in real), ()),
            sum((p.latent_keys for p in real), ()), sum((p.caption_keys for p in real), ()), first.bucket,
            sum((p.mirrored for p in real), ()), sum((p.dropped for p in real), ()),
            sum((p.mask_keys for p in real), ()), weights))
    return out


def _plain(plan: BatchPlan) -> BatchPlan:
    """``plan`` with weights that are all 1.0 written as none (an uneven share writes them out)."""
    return plan if any(w != 1.0 for w in plan.weights) else dataclasses.replace(plan, weights=())


@pytest.mark.parametrize("tail", ["drop", "wrap", "short"])
@pytest.mark.parametrize("world,batch", [(2, 1), (2, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_ranks_rows_together_are_the_one_rank_plans_of_the_global_batch(tail, world, batch, shuffle):
    samples = make_samples()
    reg = Regularization([Sample(f"{i + 3000:032x}", (f"r{i}",), empty_caption="empty") for i in range(5)],
                         [(4, 8, 8)] * 5, ratio=0.5, weight=0.25)
    options = {"tail": tail, "shuffle": shuffle, "caption_dropout": 0.3, "reg": reg}
    one = BucketSampler(samples, buckets(samples), batch * world, 7, **options)
    shards = ranks(world, batch, samples, **options)
    assert {len(s) for s in shards} == {len(one)}  # every rank takes the same number of steps per epoch
    assert [(s.rank, s.world_size) for s in shards] == [(r, world) for r in range(world)]
    for epoch in range(3):
        per_rank = [s.epoch_plans(epoch) for s in shards]
        assert all(len(p.sample_indices) <= batch for plans in per_rank for p in plans)
        if tail != "short":  # full global batches: every share is batch_size rows, weights untouched
            assert all(len(p.sample_indices) == batch for plans in per_rank for p in plans)
        got = [_plain(p) for p in joined(per_rank)]
        want = [_plain(p) for p in one.epoch_plans(epoch)]
        assert [p.sample_indices for p in got] == [p.sample_indices for p in want]
        assert [dataclasses.replace(p, weights=()) for p in got] == [dataclasses.replace(p, weights=()) for p in want]
        assert all(g.weights == pytest.approx(w.weights, rel=1e-12) for g, w in zip(got, want))
    assert any(p.dropped and any(p.dropped) for p in one.epoch_plans(0))  # the variants were exercised
    assert any(p.weights for p in one.epoch_plans(0)) and any(p.mirrored for p in one.epoch_plans(0))


def test_one_rank_is_the_plain_sampler_byte_for_byte():
    """shard_sampler with one rank is BucketSampler itself: the plans recorded before #16 (and this change)."""
    golden = json.loads((DATA / "sampler-plans-v1.json").read_text())
    samples = [Sample(latent=f"{i:032x}", captions=tuple(f"c{i}v{j}" for j in range(1 + i % 3)), repeats=1 + i % 3,
                      source=f"img{i}.png") for i in range(golden["samples"])]
    checked = 0
    for cfg in golden["configs"]:
        if cfg["world_size"] != 1:
            continue
        s = shard_sampler(samples, buckets(samples), golden["batch_size"], golden["seed"], tail=cfg["tail"],
                          shuffle=cfg["shuffle"])
        assert type(s) is BucketSampler
        got = [[p.epoch, p.index, list(p.sample_indices), list(p.latent_keys), list(p.caption_keys), list(p.bucket)]
               for e in range(3) for p in s.epoch_plans(e)]
        assert got == cfg["plans"] and s.fingerprint == cfg["fingerprint"]
        checked += 1
    assert checked == 4


def test_several_ranks_get_a_row_shard_sampler():
    samples = make_samples()
    s = shard_sampler(samples, buckets(samples), 2, 7, rank=1, world_size=2, tail="wrap")
    assert isinstance(s, RowShardSampler) and s.rank_batch_size == 2 and s.batch_size == 4


@pytest.mark.parametrize("before,after", [((2, 2), (1, 4)), ((1, 4), (4, 1)), ((4, 1), (2, 2))])
@pytest.mark.parametrize("tail", ["drop", "wrap", "short"])
def test_a_run_continues_on_another_number_of_ranks_with_the_very_next_rows(before, after, tail):
    """Elastic determinism: global batch 4 as 2 × 2, then as 1 × 4 (or 4 × 1): the rows after the resume are those
    an uninterrupted run trains, none repeated, none skipped, across an epoch boundary too."""
    samples = make_samples()
    (w0, b0), (w1, b1) = before, after
    whole = BucketSampler(samples, buckets(samples), 4, 7, tail=tail)
    expected = [row for e in range(2) for p in whole.epoch_plans(e) for row in p.sample_indices]
    first = ranks(w0, b0, tail=tail)
    steps = len(first[0]) + 3  # past the end of epoch 0
    seen: list[int] = []
    states = set()
    iters = [iter(s.plans(epochs=None)) for s in first]
    for _ in range(steps):
        parts = [next(it) for it in iters]
        seen += [i for p in parts for i in p.sample_indices]
        for s, p in zip(first, parts):
            s.seek(p.epoch, p.index + 1)
    for s in first:
        states.add(json.dumps(s.state_dict(), sort_keys=True))
    (state,) = states  # every rank saves the same state
    second = ranks(w1, b1, tail=tail)
    for s in second:
        s.load_state_dict(json.loads(state))
    iters = [iter(s.plans(epochs=None)) for s in second]
    while len(seen) < len(expected):
        seen += [i for it in iters for i in next(it).sample_indices]
    assert seen == expected


def test_each_epoch_trains_every_occurrence_once_under_drop_when_batches_divide():
    samples = [Sample(f"{i:032x}", (f"c{i}",), repeats=2) for i in range(12)]  # one bucket, 24 occurrences
    shards = [RowShardSampler(samples, [0] * 12, 2, 3, rank=r, world_size=3, tail="drop") for r in range(3)]
    for epoch in range(2):
        rows = Counter(i for s in shards for p in s.epoch_plans(epoch) for i in p.sample_indices)
        assert rows == {i: 2 for i in range(12)}


def test_a_state_of_another_global_batch_is_refused():
    a = ranks(2, 2)[0]
    with pytest.raises(ValueError, match="different dataset or configuration"):
        ranks(2, 1)[0].load_state_dict(a.state_dict())


def test_interleaved_batches_would_not_be_elastic():
    """Why the trainer does not use BucketSampler's own rank sharding: 2 ranks × batch 2 there train other rows
    per step than 1 rank × batch 4 (batches cut at 2 rows, interleaved), and the state is tied to the world size."""
    samples = make_samples()
    one = BucketSampler(samples, buckets(samples), 4, 7)
    interleaved = [BucketSampler(samples, buckets(samples), 2, 7, rank=r, world_size=2) for r in range(2)]
    steps = [sorted(a.sample_indices + b.sample_indices) for a, b in zip(*(s.epoch_plans(0) for s in interleaved))]
    assert steps[:5] != [sorted(p.sample_indices) for p in one.epoch_plans(0)[:5]]
    assert interleaved[0].fingerprint != BucketSampler(samples, buckets(samples), 2, 7, rank=0,
                                                       world_size=1).fingerprint


def test_bad_ranks_are_refused():
    samples = make_samples()
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank must be in"):
            RowShardSampler(samples, buckets(samples), 1, rank=rank, world_size=world)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        RowShardSampler(samples, buckets(samples), 0, rank=0, world_size=2)


def test_rows_of_keeps_empty_variant_tuples_empty():
    plan = BatchPlan(0, 3, (1, 2, 3, 4), tuple("abcd"), tuple("ABCD"), "b")
    assert rows_of(plan, 2, 4) == BatchPlan(0, 3, (3, 4), ("c", "d"), ("C", "D"), "b")


@pytest.mark.parametrize("rows,world", [(5, 2), (3, 4), (1, 2), (7, 3), (8, 4)])
def test_short_global_batches_weigh_each_row_as_the_whole_batch_does(rows, world):
    """The ranks' mean of their shares' weighted mean losses is the global batch's mean loss, whatever the split:
    an uneven share's rows are scaled by share × world / rows, a stand-in weighs 0."""
    samples = [Sample(f"{i:032x}", (f"c{i}",)) for i in range(rows + 40)]  # a small bucket and a large one
    shards = [RowShardSampler(samples, [0] * rows + [1] * 40, (rows + world - 1) // world + 1, 3, rank=r,
                              world_size=world, tail="short") for r in range(world)]
    (index,) = [p.index for p in shards[0].epoch_plans(0) if p.bucket == 0]  # the small bucket: one short batch
    parts = [s.plan(0, index) for s in shards]
    assert all(p.global_rows == rows for p in parts)
    losses = {i: random.Random(i).uniform(0.1, 5.0) for i in range(rows)}
    per_rank = []
    for p in parts:
        if not p.sample_indices:  # a stand-in: one row of weight 0, the global batch's first
            assert p.weights == (0.0,) and p.latent_keys == (samples[parts[0].sample_indices[0]].latent,)
            per_rank.append(0.0)
            continue
        weights = p.weights or (1.0,) * len(p.sample_indices)
        per_rank.append(sum(w * losses[i] for w, i in zip(weights, p.sample_indices)) / len(p.sample_indices))
    assert sum(per_rank) / world == pytest.approx(sum(losses.values()) / rows, rel=1e-12)
    assert sorted(i for p in parts for i in p.sample_indices) == list(range(rows))  # each row once


def test_share_is_as_even_as_the_rows_allow():
    assert [share(7, r, 3) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert [share(1, r, 2) for r in range(2)] == [(0, 1), (1, 0)]
    assert share_of(BatchPlan(0, 0, (1,), ("a",), ("b",)), 1) == (1, 0)
    assert share_of(RankPlan(0, 0, (1,), ("a",), ("b",), global_rows=4, first_row=2), 1) == (4, 2)
