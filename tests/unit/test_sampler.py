"""BucketSampler: determinism, resume at every position, buckets, repeats, caption variants, tails, ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_cache.dataset import Sample
from dataset_cache.latent_buckets import buckets_from_reader, fit_batch_size
from dataset_cache.sampler import BatchPlan, BucketSampler

ROOT = Path(__file__).resolve().parents[2]


def make_samples(n: int = 23, variants: int = 3, repeats: bool = True) -> list[Sample]:
    return [
        Sample(
            latent=f"{i:032x}",
            captions=tuple(f"c{i}v{j}" for j in range(1 + i % variants)),
            repeats=1 + (i % 3 if repeats else 0),
            source=f"img{i}.png",
        )
        for i in range(n)
    ]


def bucket_ids(samples: list[Sample]) -> list[tuple[int, int, int]]:
    return [(4, 8 + 8 * (i % 3), 8) for i in range(len(samples))]


def make_sampler(samples=None, **kw) -> BucketSampler:
    samples = samples if samples is not None else make_samples()
    kw.setdefault("batch_size", 2)
    kw.setdefault("seed", 7)
    return BucketSampler(samples, kw.pop("bucket_of", bucket_ids(samples)), kw.pop("batch_size"), kw.pop("seed"), **kw)


def rows(plans: list[BatchPlan]) -> list[tuple[int, ...]]:
    return [p.sample_indices for p in plans]


# ------------------------------------------------------------------------------------------------- determinism
def test_same_seed_same_batches_across_instances():
    a, b = make_sampler(), make_sampler()
    for epoch in range(3):
        assert a.epoch_plans(epoch) == b.epoch_plans(epoch)
    assert list(a) == b.epoch_plans(0)


def test_order_does_not_touch_or_depend_on_the_global_rng():
    torch.manual_seed(1)
    ref = make_sampler().epoch_plans(0)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    again = make_sampler().epoch_plans(0)
    assert again == ref
    assert torch.equal(torch.get_rng_state(), state)


def test_different_epochs_and_seeds_give_different_orders():
    s = make_sampler()
    orders = [rows(s.epoch_plans(e)) for e in range(4)]
    assert len({tuple(o) for o in orders}) == 4
    assert rows(make_sampler(seed=8).epoch_plans(0)) != orders[0]


@pytest.mark.parametrize("tail", ["drop", "short", "wrap"])
def test_resume_at_every_position_of_an_epoch(tail):
    ref = make_sampler(tail=tail)
    expected = ref.epoch_plans(0) + ref.epoch_plans(1)
    n = len(ref)
    for pos in range(n + 1):
        first = make_sampler(tail=tail)
        it = iter(first)
        consumed = [next(it) for _ in range(pos)]
        state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
        resumed = make_sampler(tail=tail)
        resumed.load_state_dict(state)
        rest = list(resumed)
        if pos == n:  # the whole epoch was consumed: resume starts the next one
            assert resumed.epoch == 2 and rest == expected[n:]
        else:
            assert consumed + rest == expected[:n]
            assert list(resumed) == expected[n:]


def test_iteration_walks_successive_epochs_and_set_epoch_restarts():
    s = make_sampler()
    e0, e1 = list(s), list(s)
    assert [p.epoch for p in e0 + e1] == [0] * len(s) + [1] * len(s)
    s.set_epoch(0)
    assert list(s) == e0
    assert [p.index for p in e0] == list(range(len(s)))


# ------------------------------------------------------------------------------------------ buckets and contents
@pytest.mark.parametrize("shuffle", [True, False])
def test_buckets_are_never_mixed(shuffle):
    samples = make_samples(40)
    buckets = bucket_ids(samples)
    s = make_sampler(samples, batch_size=3, tail="wrap", shuffle=shuffle)
    for epoch in range(3):
        for p in s.epoch_plans(epoch):
            assert {buckets[i] for i in p.sample_indices} == {p.bucket}
            assert len(p.sample_indices) == 3
            assert p.latent_keys == tuple(samples[i].latent for i in p.sample_indices)


def test_callable_bucket_of_matches_precomputed_ids():
    samples = make_samples()
    by_list = make_sampler(samples)
    ids = dict(zip(samples, bucket_ids(samples)))
    by_fn = make_sampler(samples, bucket_of=ids.__getitem__)
    assert by_fn.epoch_plans(0) == by_list.epoch_plans(0)
    assert by_fn.fingerprint == by_list.fingerprint


def test_repeats_appear_that_many_times_per_epoch():
    # one bucket; occurrences 1+2+3+1+2+3 = 12 = 4 batches of 3: nothing dropped
    samples = make_samples(6)
    s = BucketSampler(samples, [0] * 6, 3, seed=1)
    for epoch in range(3):
        counts = Counter(i for p in s.epoch_plans(epoch) for i in p.sample_indices)
        assert counts == {i: samples[i].repeats for i in range(6)}


def test_one_caption_variant_per_sample_per_epoch_and_all_variants_used():
    samples = [Sample(f"{i:032x}", tuple(f"c{i}v{j}" for j in range(3)), repeats=3) for i in range(4)]
    s = BucketSampler(samples, [0] * 4, 2, seed=3)
    seen: dict[int, set[str]] = {i: set() for i in range(4)}
    for epoch in range(30):
        per_epoch: dict[int, set[str]] = {}
        for p in s.epoch_plans(epoch):
            for i, key in zip(p.sample_indices, p.caption_keys):
                assert key in samples[i].captions
                per_epoch.setdefault(i, set()).add(key)
        assert all(len(v) == 1 for v in per_epoch.values())
        for i, v in per_epoch.items():
            seen[i] |= v
    assert all(len(v) == 3 for v in seen.values())


def test_shuffle_false_keeps_dataset_order_within_buckets():
    samples = make_samples(12, repeats=False)
    s = BucketSampler(samples, [i // 6 for i in range(12)], 3, seed=0, shuffle=False)
    assert rows(s.epoch_plans(0)) == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]


def test_tail_drop_and_wrap():
    samples = make_samples(7, repeats=False)  # one bucket of 7
    drop = BucketSampler(samples, [0] * 7, 3, seed=0, tail="drop")
    wrap = BucketSampler(samples, [0] * 7, 3, seed=0, tail="wrap")
    assert len(drop) == 2 and len(wrap) == 3
    for epoch in range(3):
        d = [i for p in drop.epoch_plans(epoch) for i in p.sample_indices]
        w = [i for p in wrap.epoch_plans(epoch) for i in p.sample_indices]
        assert len(set(d)) == 6  # one occurrence dropped, no duplicates
        assert set(w) == set(range(7)) and len(w) == 9  # everything once, two wrapped repeats
        assert sorted(Counter(w).values()) == [1] * 5 + [2] * 2  # the tail is completed by two repeats


def test_wrap_trains_a_bucket_smaller_than_a_batch(caplog):
    samples = make_samples(4, repeats=False)
    buckets = [0, 0, 0, 1]
    with caplog.at_level("WARNING", logger="dataset_cache.sampler"):
        drop = BucketSampler(samples, buckets, 3, seed=0, tail="drop")
    assert "never train" in caplog.text
    assert all(p.bucket == 0 for p in drop.epoch_plans(0))
    wrap = BucketSampler(samples, buckets, 3, seed=0, tail="wrap")
    assert any(p.sample_indices == (3, 3, 3) for p in wrap.epoch_plans(0))


# ---------------------------------------------------------------------------------- tail "short" (what trains)
def test_short_tail_trains_a_small_bucket_as_a_smaller_batch_never_as_copies():
    """#27 item 1: a bucket of one image at batch 4 was filled with 4 copies of it (tail "wrap"); under "short" it
    trains as a batch of one, and a bucket of 5 as a batch of 4 and one of 1: every occurrence once per epoch."""
    samples = make_samples(10, repeats=False)
    buckets = [0] * 5 + [1] + [2] * 4  # 5 images, 1 image, 4 images
    s = BucketSampler(samples, buckets, 4, seed=3, tail="short")
    assert len(s) == 2 + 1 + 1
    for epoch in range(4):
        plans = s.epoch_plans(epoch)
        assert Counter(i for p in plans for i in p.sample_indices) == {i: 1 for i in range(10)}
        assert sorted(len(p.sample_indices) for p in plans) == [1, 1, 4, 4]
        assert [p.sample_indices for p in plans if p.bucket == 1] == [(5,)]
        for p in plans:
            assert {buckets[i] for i in p.sample_indices} == {p.bucket}


def test_short_tail_plans_equal_todays_where_no_bucket_is_short():
    """Buckets whose occurrences fill whole batches: "short" gives exactly the plans "wrap" gave (the order and
    every draw), for one rank and for ranks that divide the batches."""
    samples = make_samples(24, repeats=False)
    buckets = [i % 3 for i in range(24)]  # 3 buckets of 8 at batch 4: 6 batches
    for world in (1, 2, 3, 6):
        for rank in range(world):
            kw = {"world_size": world, "rank": rank, "caption_dropout": 0.0}
            short = BucketSampler(samples, buckets, 4, 11, tail="short", **kw)
            wrap = BucketSampler(samples, buckets, 4, 11, tail="wrap", **kw)
            for epoch in range(3):
                assert short.epoch_plans(epoch) == wrap.epoch_plans(epoch)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_short_tail_gives_every_rank_the_same_steps_by_splitting_batches(world):
    """31 samples in 3 buckets at batch 4: the ranks' shares are equal in length on every epoch, they partition the
    epoch exactly (no padding copies, nothing left out), and batches are never mixed across buckets."""
    samples = make_samples(31)
    buckets = bucket_ids(samples)
    single = make_sampler(samples, batch_size=4, tail="short", world_size=1, rank=0)
    shards = [make_sampler(samples, batch_size=4, tail="short", world_size=world, rank=r) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    for epoch in range(3):
        per_rank = [s.epoch_plans(epoch) for s in shards]
        assert len({len(p) for p in per_rank}) == 1
        union = Counter(i for plans in per_rank for p in plans for i in p.sample_indices)
        assert union == Counter(i for p in single.epoch_plans(epoch) for i in p.sample_indices)
        assert union == {i: samples[i].repeats for i in range(len(samples))}
        for plans in per_rank:
            for p in plans:
                assert 1 <= len(p.sample_indices) <= 4 and {buckets[i] for i in p.sample_indices} == {p.bucket}


def test_short_tail_leaves_out_rows_only_when_no_split_can_even_the_ranks():
    """3 occurrences at batch 2 for 2 ranks: a batch of 2 and one of 1, all trained; at batch 1: one row each, the
    third left out (it would have to be a copy); 1 occurrence for 2 ranks: refused."""
    samples = make_samples(3, repeats=False)
    for batch_size, trained in ((2, 3), (1, 2)):
        shards = [BucketSampler(samples, [0] * 3, batch_size, 0, tail="short", world_size=2, rank=r)
                  for r in range(2)]
        assert [len(s) for s in shards] == [1, 1]
        seen = [i for s in shards for p in s.epoch_plans(0) for i in p.sample_indices]
        assert len(seen) == len(set(seen)) == trained
    with pytest.raises(ValueError, match="no batch of 1 for each of 2 rank"):
        BucketSampler(samples[:1], [0], 1, 0, tail="short", world_size=2, rank=0)


def test_short_tail_caption_dropout_has_one_draw_per_row():
    samples = [Sample(f"{i:032x}", ("c",), empty_caption="e") for i in range(5)]
    s = BucketSampler(samples, [0, 0, 0, 1, 1], 2, 0, tail="short", caption_dropout=0.5)
    for epoch in range(5):
        for p in s.epoch_plans(epoch):
            assert len(p.dropped) == len(p.sample_indices) == len(p.caption_keys)


# -------------------------------------------------------------------------------------------------------- ranks
@pytest.mark.parametrize("tail", ["drop", "wrap"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_get_equal_disjoint_shares_whose_union_is_the_epoch(tail, world):
    samples = make_samples(31)
    single = make_sampler(samples, tail=tail, world_size=1, rank=0)
    shards = [make_sampler(samples, tail=tail, world_size=world, rank=r) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    total = len(single)
    for epoch in range(2):
        global_rows = rows(single.epoch_plans(epoch))
        per_rank = [rows(s.epoch_plans(epoch)) for s in shards]
        interleaved = [per_rank[r][i] for i in range(len(shards[0])) for r in range(world)]
        if tail == "drop":
            assert interleaved == global_rows[: total - total % world]  # disjoint: a prefix of the epoch
        else:
            pad = len(interleaved) - total
            assert interleaved == global_rows + global_rows[:pad]  # everything, plus < world padding batches


def test_state_is_rank_independent_but_world_size_dependent():
    a = make_sampler(world_size=2, rank=0)
    b = make_sampler(world_size=2, rank=1)
    next(iter(a))
    b.load_state_dict(a.state_dict())
    assert b.position == (0, 1)
    with pytest.raises(ValueError, match="different dataset or configuration"):
        make_sampler(world_size=3, rank=0).load_state_dict(a.state_dict())


def test_two_process_gloo_ranks_are_disjoint_and_equal_length(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.distributed as dist
            from dataset_cache.dataset import Sample
            from dataset_cache.sampler import BucketSampler
            rank, init = int(sys.argv[1]), sys.argv[2]
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
            samples = [Sample(f"{{i:032x}}", (f"c{{i}}",), repeats=1 + i % 2) for i in range(25)]
            s = BucketSampler(samples, [i % 2 for i in range(25)], 3, seed=5)
            plans = [list(p.sample_indices) for p in s.epoch_plans(0)]
            gathered = [None, None]
            dist.all_gather_object(gathered, plans)
            dist.destroy_process_group()
            json.dump({{"rank": s.rank, "world": s.world_size, "all": gathered}}, open(sys.argv[3], "w"))
            """
        )
    )
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), init, str(tmp_path / f"out{r}.json")])
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert [o["rank"] for o in outs] == [0, 1] and {o["world"] for o in outs} == {2}
    r0, r1 = outs[0]["all"]
    assert outs[1]["all"] == [r0, r1]  # every rank agrees on every share
    assert len(r0) == len(r1) > 0
    occurrences = Counter(i for row in r0 + r1 for i in row)
    single = BucketSampler(
        [Sample(f"{i:032x}", (f"c{i}",), repeats=1 + i % 2) for i in range(25)], [i % 2 for i in range(25)], 3,
        seed=5, world_size=1,
    )
    union_ref = Counter(i for p in single.epoch_plans(0)[: 2 * len(r0)] for i in p.sample_indices)
    assert occurrences == union_ref


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    n_buckets=st.integers(1, 4),
    batch_size=st.integers(1, 5),
    world=st.integers(1, 3),
    tail=st.sampled_from(["drop", "short", "wrap"]),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_invariants_hold_for_any_configuration(n, n_buckets, batch_size, world, tail, shuffle, seed):
    samples = [Sample(f"{i:032x}", tuple(f"c{i}v{j}" for j in range(1 + i % 2)), repeats=1 + (i * 7) % 3)
               for i in range(n)]
    buckets = [(i * 5) % n_buckets for i in range(n)]
    try:
        shards = [BucketSampler(samples, buckets, batch_size, seed, tail=tail, shuffle=shuffle, rank=r,
                                world_size=world) for r in range(world)]
    except ValueError as exc:
        assert "no batch of" in str(exc) or "larger than the largest bucket" in str(exc)
        return
    epoch = seed % 5
    per_rank = [s.epoch_plans(epoch) for s in shards]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) > 0
    counts: Counter[int] = Counter()
    for plans in per_rank:
        for p in plans:
            if tail == "short":
                assert 1 <= len(p.sample_indices) <= batch_size
            else:
                assert len(p.sample_indices) == batch_size
            assert {buckets[i] for i in p.sample_indices} == {p.bucket}
            counts.update(p.sample_indices)
    for i, c in counts.items():
        if tail in ("drop", "short"):
            assert c <= samples[i].repeats  # nothing is seen more often than its repeats
    if tail == "short":  # everything trains, unless every batch is down to one row and the ranks still differ
        occurrences = sum(s.repeats for s in samples)
        singles = all(len(p.sample_indices) == 1 for plans in per_rank for p in plans)
        assert sum(counts.values()) == occurrences or (singles and sum(counts.values()) == occurrences // world * world)
    if tail == "wrap":
        assert all(counts[i] >= samples[i].repeats for i in range(n))  # nothing is left out


@given(repeats=st.lists(st.integers(1, 5), min_size=1, max_size=12), n_buckets=st.integers(1, 4),
       batch_size=st.integers(1, 10_000))
def test_fit_batch_size_gives_the_largest_batch_a_bucket_fills(repeats, n_buckets, batch_size):
    samples = [Sample(f"{i:032x}", ("c",), repeats=r) for i, r in enumerate(repeats)]
    buckets = [i % n_buckets for i in range(len(samples))]
    fitted = fit_batch_size(samples, buckets, batch_size)
    largest = max(sum(s.repeats for s, b in zip(samples, buckets) if b == k) for k in set(buckets))
    assert fitted == min(batch_size, largest)
    sampler = BucketSampler(samples, buckets, fitted, tail="wrap")  # accepted, and no row beyond the dataset
    assert all(len(p.sample_indices) == fitted for p in sampler.epoch_plans(0))


# -------------------------------------------------------------------------------------------- state validation
def test_state_from_another_dataset_or_config_is_refused():
    state = make_sampler().state_dict()
    with pytest.raises(ValueError, match="different dataset or configuration"):
        make_sampler(make_samples(24)).load_state_dict(state)
    with pytest.raises(ValueError, match="different dataset or configuration"):
        make_sampler(batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="different dataset or configuration"):
        make_sampler(tail="wrap").load_state_dict(state)
    with pytest.raises(ValueError, match="seed=7 but this sampler has seed=8"):
        make_sampler(seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="malformed"):
        make_sampler().load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="version 99"):
        make_sampler().load_state_dict({**state, "version": 99})


def test_bad_arguments_are_refused():
    samples = make_samples(5, repeats=False)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BucketSampler(samples, [0] * 5, 0)
    with pytest.raises(ValueError, match="tail must be one of"):
        BucketSampler(samples, [0] * 5, 2, tail="pad")
    with pytest.raises(ValueError, match="4 ids for 5 samples"):
        BucketSampler(samples, [0] * 4, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        BucketSampler(samples, [0] * 5, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"batch_size 2 is larger than the largest bucket \(1 occurrences"):
        BucketSampler(samples, list(range(5)), 2)
    with pytest.raises(ValueError, match=r"batch_size 10000 is larger than the largest bucket \(5 .*fit_batch_size"):
        BucketSampler(samples, [0] * 5, 10_000, tail="wrap")  # 10000 rows of 5 samples: refused, not allocated
    with pytest.raises(ValueError, match="no batch of 2 for each of 4 rank"):
        BucketSampler(samples[:2], [0, 0], 2, rank=0, world_size=4)
    with pytest.raises(ValueError, match="no samples"):
        BucketSampler([], [], 2)
    with pytest.raises(IndexError, match="out of range"):
        make_sampler().plan(0, 10_000)


# ------------------------------------------------------------------------------------------ buckets from headers
class _HeaderOnlyReader:
    """Stands in for CacheReader.get(): lazy values whose tensors only carry a shape."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.gets = 0

    def get(self, key: str):
        self.gets += 1
        return {"samples": SimpleNamespace(shape=torch.Size(self.shapes[key]))}


def test_buckets_from_reader_uses_header_shapes_once_per_entry():
    samples = make_samples(6)
    shapes = {s.latent: (1, 4, 8 * (1 + i % 2), 8) for i, s in enumerate(samples)}
    shared = Sample(samples[0].latent, ("x",))  # same latent entry as sample 0
    reader = _HeaderOnlyReader(shapes)
    buckets = buckets_from_reader(reader, samples + [shared])
    assert buckets == [(4, 8, 8), (4, 16, 8)] * 3 + [(4, 8, 8)]
    assert reader.gets == 6
    s = BucketSampler(samples, buckets[:6], 3, seed=0)
    assert s.buckets == {(4, 8, 8): 1 + 3 + 2, (4, 16, 8): 2 + 1 + 3}


@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (2, 16, 1, 8, 8), (4, 8, 8), (1, 1, 16, 1, 8, 8)])
def test_buckets_from_reader_refuses_batched_latents_and_other_ranks(shape):
    samples = make_samples(1)
    with pytest.raises(ValueError, match=r"expected \[1, C, H, W\] \(images\) or \[1, C, T, H, W\]"):
        buckets_from_reader(_HeaderOnlyReader({samples[0].latent: shape}), samples)


def test_video_latents_bucket_by_frames_and_size():
    samples = make_samples(6)
    frames = (1, 1, 5, 5, 1, 5)  # one-frame images and 5-frame clips of one size: two buckets
    shapes = {s.latent: (1, 16, t, 8, 8) for s, t in zip(samples, frames)}
    buckets = buckets_from_reader(_HeaderOnlyReader(shapes), samples)
    assert buckets == [(16, t, 8, 8) for t in frames]
    sampler = BucketSampler(samples, buckets, 2, seed=0, tail="drop")
    for plan in sampler.epoch_plans(0):
        assert len({frames[i] for i in plan.sample_indices}) == 1  # a batch never mixes frame counts
