"""BucketSampler's training-time variety (#16): caption dropout, mirror choice, mask keys, regularization, mixes.

Determinism (runs, loader threads, resume, ranks), statistics over many epochs with tolerances derived in the
tests, the unchanged order when every new setting is off (against plans recorded before the settings existed), and
hostile values.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from dataset_cache.dataset import MAX_REPEATS, Sample
from dataset_cache.loader import PrefetchLoader
from dataset_cache.dataset_mix import DatasetPart, Regularization, mix_datasets
from dataset_cache.sampler import BucketSampler
from dataset_cache.sampler_epoch import FLIP_PROBABILITY

DATA = Path(__file__).parent / "data"


def variant_samples(n: int = 24, *, shuffle: int = 4, mirror: bool = True, mask: bool = True,
                    empty: bool = True, prefix: str = "") -> list[Sample]:
    """Samples with ``shuffle`` caption variants, a mirror, a mask on every other one and the empty caption."""
    return [
        Sample(
            latent=f"{prefix}l{i}",
            captions=tuple(f"{prefix}c{i}v{j}" for j in range(shuffle)),
            repeats=1 + i % 2,
            source=f"{prefix}img{i}.png",
            mirror=f"{prefix}m{i}" if mirror else None,
            mask=f"{prefix}k{i}" if mask and i % 2 == 0 else None,
            empty_caption=f"{prefix}empty" if empty else None,
        )
        for i in range(n)
    ]


def shapes(samples: list[Sample], k: int = 2) -> list[tuple[int, int, int]]:
    return [(4, 8 * (1 + i % k), 8) for i in range(len(samples))]


def sampler(samples=None, **kw) -> BucketSampler:
    samples = samples if samples is not None else variant_samples()
    return BucketSampler(samples, kw.pop("bucket_of", shapes(samples)), kw.pop("batch_size", 2), kw.pop("seed", 5),
                         **kw)


def rows_of(s: BucketSampler, plans) -> list[tuple]:
    """(sample, caption key, dropped, mirrored) of every row: what the issue calls the sequence."""
    out = []
    for p in plans:
        for r, i in enumerate(p.sample_indices):
            out.append((i, p.caption_keys[r], p.latent_keys[r], p.dropped[r] if p.dropped else False,
                        p.mirrored[r] if p.mirrored else False))
    return out


# ------------------------------------------------------------------------------- today's order, byte for byte
def test_every_new_setting_off_gives_the_plans_recorded_before_they_existed():
    """tests/unit/data/sampler-plans-v1.json was written by the sampler of 3a95372 (before #16's variants): 23
    samples, 3 buckets, batch 2, seed 7, both tails, shuffle on/off, 1 and 3 ranks, epochs 0-2."""
    golden = json.loads((DATA / "sampler-plans-v1.json").read_text())
    samples = [Sample(latent=f"{i:032x}", captions=tuple(f"c{i}v{j}" for j in range(1 + i % 3)), repeats=1 + i % 3,
                      source=f"img{i}.png") for i in range(golden["samples"])]
    for cfg in golden["configs"]:
        s = BucketSampler(samples, [(4, 8 + 8 * (i % 3), 8) for i in range(len(samples))], golden["batch_size"],
                          golden["seed"], tail=cfg["tail"], rank=cfg["rank"], world_size=cfg["world_size"],
                          shuffle=cfg["shuffle"], caption_dropout=0.0)
        plans = [p for e in range(3) for p in s.epoch_plans(e)]
        got = [[p.epoch, p.index, list(p.sample_indices), list(p.latent_keys), list(p.caption_keys), list(p.bucket)]
               for p in plans]
        assert got == cfg["plans"], cfg["tail"]
        assert s.fingerprint == cfg["fingerprint"]  # old resume states still load
        assert all(p.mirrored == p.dropped == p.mask_keys == p.weights == () for p in plans)
        assert set(s.state_dict()) == {"version", "epoch", "batch", "seed", "fingerprint", "batches_per_epoch"}


def test_variants_leave_the_order_and_caption_streams_of_the_main_dataset_alone():
    """Dropout, mirrors and masks draw from their own streams: the sample order and the caption variant drawn for
    every sample are those of the same samples without them."""
    plain = variant_samples(mirror=False, mask=False)
    rich = variant_samples()
    a, b = sampler(plain), sampler(rich, caption_dropout=0.3)
    for e in range(3):
        pa, pb = a.epoch_plans(e), b.epoch_plans(e)
        assert [p.sample_indices for p in pa] == [p.sample_indices for p in pb]
        for x, y in zip(pa, pb):
            for r in range(len(x.sample_indices)):
                if not y.dropped[r]:
                    assert x.caption_keys[r] == y.caption_keys[r]


# ---------------------------------------------------------------------------------------------- plan contents
def test_plan_rows_name_the_chosen_latent_caption_mask_and_drop():
    samples = variant_samples()
    s = sampler(samples, caption_dropout=0.5)
    seen_mirror = seen_plain = seen_drop = 0
    for e in range(4):
        for p in s.epoch_plans(e):
            assert len(p.mirrored) == len(p.dropped) == len(p.mask_keys) == len(p.sample_indices)
            assert p.weights == ()
            for r, i in enumerate(p.sample_indices):
                smp = samples[i]
                assert p.latent_keys[r] == (smp.mirror if p.mirrored[r] else smp.latent)
                assert p.mask_keys[r] == smp.mask  # the unmirrored latent's mask; the loader flips it
                if p.dropped[r]:
                    assert p.caption_keys[r] == smp.empty_caption
                else:
                    assert p.caption_keys[r] in smp.captions
                seen_mirror += p.mirrored[r]
                seen_plain += not p.mirrored[r]
                seen_drop += p.dropped[r]
    assert seen_mirror and seen_plain and seen_drop


def test_a_sample_uses_one_latent_and_caption_variant_for_the_whole_epoch():
    samples = variant_samples()
    s = sampler(samples)
    for e in range(3):
        chosen: dict[int, set] = {}
        for p in s.epoch_plans(e):
            for r, i in enumerate(p.sample_indices):
                chosen.setdefault(i, set()).add((p.latent_keys[r], p.caption_keys[r]))
        assert all(len(v) == 1 for v in chosen.values())


def test_samples_without_a_mirror_are_never_mirrored_and_no_mask_means_no_mask_keys():
    samples = variant_samples(mask=False)
    samples = [s if i % 3 else Sample(s.latent, s.captions, s.repeats, s.source) for i, s in enumerate(samples)]
    s = sampler(samples)
    for p in s.epoch_plans(0) + s.epoch_plans(1):
        assert p.mask_keys == ()
        for r, i in enumerate(p.sample_indices):
            if i % 3 == 0:
                assert not p.mirrored[r] and p.latent_keys[r] == samples[i].latent


# ---------------------------------------------------------------------------------------------- determinism
def test_same_seed_same_sequence_across_runs_and_a_new_seed_changes_it():
    a = [rows_of(s, s.epoch_plans(e)) for s in [sampler(caption_dropout=0.2)] for e in range(3)]
    b = [rows_of(s, s.epoch_plans(e)) for s in [sampler(caption_dropout=0.2)] for e in range(3)]
    c = [rows_of(s, s.epoch_plans(e)) for s in [sampler(caption_dropout=0.2, seed=6)] for e in range(3)]
    assert a == b
    assert a != c


class _KeysReader:
    """Every key reads as a small tensor of the shape its name implies; enough for the loader to run."""

    def get(self, key):
        return self._value(key)

    def read(self, keys, *, pin_memory=False, out=None):
        return [self._value(k) for k in keys]

    @staticmethod
    def _value(key: str):
        n = int("".join(ch for ch in key if ch.isdigit()) or 0)
        h = 8 * (1 + n % 2)
        if key.startswith(("l", "m", "rl", "rm")):
            return {"samples": torch.full((1, 4, h, 8), float(n))}
        if key.startswith(("k", "rk")):
            return {"mask": torch.full((1, 1, h, 8), 255, dtype=torch.uint8)}
        return [[torch.zeros(1, 3, 8), {}]]


@pytest.mark.parametrize("threads", [1, 3])
def test_the_loader_delivers_the_same_sequence_with_one_or_three_threads(threads):
    ref = sampler(caption_dropout=0.25)
    expected = rows_of(ref, ref.epoch_plans(0) + ref.epoch_plans(1))
    s = sampler(caption_dropout=0.25)
    with PrefetchLoader(_KeysReader(), s, prefetch_batches=3, threads=threads, epochs=2) as loader:
        got = rows_of(s, [b.plan for b in loader])
    assert got == expected


@pytest.mark.parametrize("stop_after", [1, 7, 13])
def test_a_mid_epoch_stop_and_resume_gives_the_uninterrupted_sequence(stop_after):
    reg = Regularization(variant_samples(5, prefix="r"), shapes(variant_samples(5)), ratio=0.5, weight=0.7)
    first = sampler(caption_dropout=0.3, reg=reg)
    uninterrupted = rows_of(first, [p for e in range(2) for p in first.epoch_plans(e)])
    with PrefetchLoader(_KeysReader(), first, prefetch_batches=2, threads=2, epochs=2) as loader:
        head = []
        for batch in loader:
            head.append(batch.plan)
            if len(head) == stop_after:
                state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
                break
    resumed = sampler(caption_dropout=0.3, reg=reg)
    resumed.load_state_dict(state)
    with PrefetchLoader(_KeysReader(), resumed, prefetch_batches=2, threads=2, epochs=2) as loader:
        tail = [b.plan for b in loader]
    tail = [p for p in tail if p.epoch < 2]
    assert rows_of(first, head) + rows_of(resumed, tail) == uninterrupted


def test_two_ranks_get_disjoint_shares_with_the_drops_a_single_rank_has():
    samples = variant_samples(30)
    one = sampler(samples, caption_dropout=0.4, tail="drop", world_size=1, rank=0)
    ranks = [sampler(samples, caption_dropout=0.4, tail="drop", world_size=2, rank=r) for r in range(2)]
    whole = one.epoch_plans(3)
    shares = [r.epoch_plans(3) for r in ranks]
    assert len(shares[0]) == len(shares[1]) == len(whole) // 2
    for r, share in enumerate(shares):
        for k, p in enumerate(share):
            q = whole[2 * k + r]  # rank r takes batches r, r + 2, ...
            assert (p.sample_indices, p.caption_keys, p.dropped, p.mirrored) == \
                (q.sample_indices, q.caption_keys, q.dropped, q.mirrored)
    # every batch of the epoch order goes to exactly one rank: the shares together are its first 2 × share batches
    union = Counter(i for share in shares for p in share for i in p.sample_indices)
    assert union == Counter(i for p in whole[: 2 * len(shares[0])] for i in p.sample_indices)


# ----------------------------------------------------------------------------------------------- statistics
def test_dropout_and_flip_rates_over_many_epochs_are_within_five_binomial_sds():
    """Each occurrence is dropped with probability p independently, so the observed rate over N occurrences has
    standard deviation sqrt(p(1 - p) / N); each sample with a mirror is flipped per epoch with probability 1/2
    (N = samples × epochs). Five standard deviations: a false failure about once in 1.7 million runs."""
    p = 0.1
    samples = variant_samples(40)
    s = sampler(samples, caption_dropout=p, batch_size=4, tail="wrap")
    drops = occurrences = 0
    flips = draws = 0
    used: Counter[str] = Counter()
    epochs = 60
    for e in range(epochs):
        first_row: dict[int, bool] = {}
        for plan in s.epoch_plans(e):
            drops += sum(plan.dropped)
            occurrences += len(plan.dropped)
            for r, i in enumerate(plan.sample_indices):
                first_row.setdefault(i, plan.mirrored[r])
                if not plan.dropped[r]:
                    used[plan.caption_keys[r]] += 1
        flips += sum(first_row.values())
        draws += len(first_row)
    tol_drop = 5 * math.sqrt(p * (1 - p) / occurrences)
    assert abs(drops / occurrences - p) < tol_drop, (drops, occurrences, tol_drop)
    q = FLIP_PROBABILITY
    tol_flip = 5 * math.sqrt(q * (1 - q) / draws)
    assert abs(flips / draws - q) < tol_flip, (flips, draws, tol_flip)
    every_variant = {c for smp in samples for c in smp.captions}
    assert set(used) == every_variant  # every shuffle variant is trained


def test_dropout_one_drops_every_row_and_zero_none():
    all_dropped = sampler(caption_dropout=1.0)
    for p in all_dropped.epoch_plans(0):
        assert all(p.dropped) and set(p.caption_keys) == {"empty"}
    assert all(p.dropped == () for p in sampler(caption_dropout=0.0).epoch_plans(0))


# ------------------------------------------------------------------------------------------- regularization
def reg_set(n: int = 6, ratio: float = 1.0, weight: float = 0.5, k: int = 3) -> Regularization:
    rs = variant_samples(n, prefix="r")
    return Regularization(rs, [(4, 8 * (1 + i % k), 8) for i in range(n)], ratio=ratio, weight=weight, name="reg")


def test_regularization_occurrences_per_epoch_follow_the_ratio_with_their_weight_and_constant_length():
    main = variant_samples(24)  # 36 occurrences per epoch (repeats 1 and 2)
    main_total = sum(s.repeats for s in main)
    for ratio in (0.25, 1.0, 2.5):
        reg = reg_set(ratio=ratio)
        s = sampler(main, reg=reg, tail="wrap", batch_size=1)
        wanted = math.floor(ratio * main_total + 0.5)
        assert sum(s.reg_buckets.values()) == wanted
        assert sum(s.buckets.values()) == main_total + wanted
        lengths = set()
        for e in range(5):
            plans = s.epoch_plans(e)
            lengths.add(len(plans))
            reg_rows = [(p.sample_indices[r], p.weights[r]) for p in plans for r in range(len(p.sample_indices))
                        if p.sample_indices[r] >= s.main_samples]
            assert len(reg_rows) == wanted  # batch 1: no wrap copies, so the count is exact
            assert {w for _, w in reg_rows} == {0.5}
            main_w = {p.weights[r] for p in plans for r in range(len(p.sample_indices))
                      if p.sample_indices[r] < s.main_samples}
            assert main_w == {1.0}
            per_bucket = Counter(p.bucket for p in plans for i in p.sample_indices if i >= s.main_samples)
            assert dict(per_bucket) == s.reg_buckets  # each bucket's share, every epoch
        assert lengths == {len(s)}


def test_which_regularization_samples_are_used_varies_per_epoch_and_all_are_used():
    main = variant_samples(24)
    s = sampler(main, reg=Regularization(variant_samples(30, prefix="r"), shapes(variant_samples(30)), ratio=0.2),
                tail="wrap", batch_size=1)
    used_per_epoch = []
    for e in range(80):  # 7 of 45 reg occurrences an epoch: a sample is missed by all 80 with p < 1e-5
        used_per_epoch.append(frozenset(i for p in s.epoch_plans(e) for i in p.sample_indices if i >= 24))
    assert len(set(used_per_epoch)) > 1
    assert frozenset().union(*used_per_epoch) == frozenset(range(24, 54))


def test_largest_remainder_shares_and_a_shape_only_the_reg_set_has_gets_its_own_bucket():
    main = variant_samples(4, mirror=False, mask=False)  # occurrences 6; buckets (4,8,8), (4,16,8)
    rs = variant_samples(3, prefix="r", mirror=False, mask=False)  # occurrences 1, 2, 1
    reg = Regularization(rs, [(4, 8, 8), (4, 24, 8), (4, 24, 8)], ratio=0.5)  # 3 wanted; pools 1 and 3
    s = sampler(main, reg=reg, bucket_of=shapes(main), tail="wrap", batch_size=1)
    # 3 × 1/4 = 0.75 -> 0 (+1: larger remainder), 3 × 3/4 = 2.25 -> 2
    assert s.reg_buckets == {(4, 8, 8): 1, (4, 24, 8): 2}
    assert (4, 24, 8) in s.buckets and s.buckets[(4, 24, 8)] == 2
    for p in s.epoch_plans(0):
        assert len({s.samples[i].latent for i in p.sample_indices}) >= 1
        if p.bucket == (4, 24, 8):
            assert all(i >= 4 for i in p.sample_indices)


def test_a_ratio_too_small_for_a_share_adds_no_empty_bucket_and_zero_adds_nothing():
    main = variant_samples(4, mirror=False, mask=False)  # 6 occurrences
    rs = variant_samples(3, prefix="r", mirror=False, mask=False)
    reg = Regularization(rs, [(4, 8, 8), (4, 24, 8), (4, 24, 8)], ratio=0.1)  # round(0.6) = 1: to the 3-pool
    s = sampler(main, reg=reg, bucket_of=shapes(main), tail="drop", batch_size=1)
    assert s.reg_buckets == {(4, 24, 8): 1} and (4, 24, 8) in s.buckets
    none = sampler(main, reg=Regularization(rs, [(4, 40, 8)] * 3, ratio=0.0), bucket_of=shapes(main), batch_size=1)
    assert none.reg_buckets == {} and (4, 40, 8) not in none.buckets
    assert [p.sample_indices for p in none.epoch_plans(0)] == \
        [p.sample_indices for p in sampler(main, bucket_of=shapes(main), batch_size=1).epoch_plans(0)]
    assert {w for p in none.epoch_plans(0) for w in p.weights} == {1.0}


def test_a_large_ratio_on_a_tiny_regularization_set_cycles_it_evenly():
    main = variant_samples(10, mirror=False, mask=False)  # 15 occurrences
    rs = [Sample("rl0", ("rc0",)), Sample("rl1", ("rc1",))]
    s = sampler(main, reg=Regularization(rs, [(4, 8, 8)] * 2, ratio=16.0), bucket_of=[(4, 8, 8)] * 10,
                tail="wrap", batch_size=1)
    counts = Counter(i for p in s.epoch_plans(0) for i in p.sample_indices if i >= 10)
    assert sum(counts.values()) == 240 and set(counts.values()) == {120}


def test_regularization_drops_captions_too_and_needs_its_empty_caption():
    main = variant_samples(8)
    reg = Regularization(variant_samples(4, prefix="r", empty=False), shapes(variant_samples(4)), name="class imgs")
    with pytest.raises(ValueError, match="'class imgs'.*empty_caption"):
        sampler(main, reg=reg, caption_dropout=0.1)
    ok = Regularization(variant_samples(4, prefix="r"), shapes(variant_samples(4)))
    plans = sampler(main, reg=ok, caption_dropout=1.0).epoch_plans(0)
    assert {p.caption_keys[r] for p in plans for r, i in enumerate(p.sample_indices) if i >= 8} == {"rempty"}


@pytest.mark.parametrize("ratio,weight", [(-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0), (1.0, -0.5),
                                          (1.0, float("nan")), ("1", 1.0)])
def test_bad_ratio_or_weight_is_refused_naming_it(ratio, weight):
    reg = Regularization(variant_samples(3, prefix="r"), shapes(variant_samples(3)), ratio=ratio, weight=weight)
    with pytest.raises(ValueError, match="ratio|weight"):
        sampler(reg=reg)


def test_an_empty_regularization_set_or_an_epoch_past_the_limit_is_refused():
    with pytest.raises(ValueError, match="no samples"):
        sampler(reg=Regularization([], []))
    big = [Sample(f"l{i}", (f"c{i}",), repeats=MAX_REPEATS) for i in range(500)]
    reg = Regularization([Sample("rl0", ("rc0",))], [(4, 8, 8)], ratio=16.0, name="reg")
    with pytest.raises(ValueError, match="'?reg'?: ratio 16.0.*above the limit"):
        BucketSampler(big, [(4, 8, 8)] * 500, 2, reg=reg)


# ---------------------------------------------------------------------------------------------- dropout errors
def test_dropout_without_the_empty_caption_names_the_dataset_and_what_to_enable():
    with pytest.raises(ValueError, match=r"dataset 'people'.*Encode Dataset's empty_caption"):
        BucketSampler(variant_samples(4, empty=False), shapes(variant_samples(4)), 1, caption_dropout=0.1,
                      name="people")
    sampler(variant_samples(4, empty=False), caption_dropout=0.0, batch_size=1)  # off: nothing needed


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_a_dropout_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="caption_dropout must be a number from 0 to 1"):
        sampler(caption_dropout=bad)


def test_resuming_with_another_dropout_or_reg_setting_is_refused_clearly():
    s = sampler(caption_dropout=0.1)
    state = s.state_dict()
    with pytest.raises(ValueError, match=r"caption_dropout=0.1 but this sampler has caption_dropout=0.2"):
        sampler(caption_dropout=0.2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"caption_dropout=0.1 but this sampler has caption_dropout=0.0"):
        sampler().load_state_dict(state)
    with pytest.raises(ValueError, match=r"caption_dropout=0.0 but this sampler has caption_dropout=0.1"):
        s.load_state_dict(sampler().state_dict())
    r = sampler(reg=reg_set(ratio=1.0))
    with pytest.raises(ValueError, match=r"reg_ratio=1.0 but this sampler has reg_ratio=2.0"):
        sampler(reg=reg_set(ratio=2.0)).load_state_dict(r.state_dict())
    with pytest.raises(ValueError, match=r"reg_ratio=none \(no regularization dataset\)"):
        r.load_state_dict(sampler().state_dict())
    assert s.fingerprint != sampler(caption_dropout=0.2).fingerprint
    sampler(caption_dropout=0.1).load_state_dict(state)  # the same setting resumes


# -------------------------------------------------------------------------------------------- several datasets
def test_mix_concatenates_with_repeats_multiplied_and_names_parts():
    a, b = variant_samples(4, prefix="a"), variant_samples(3, prefix="b", empty=False)
    mix = mix_datasets([DatasetPart("a", a, 3), DatasetPart("b", b, 1)])
    assert [s.repeats for s in mix.samples] == [r * 3 for r in (1, 2, 1, 2)] + [1, 2, 1]
    assert mix.samples[4] is b[0]  # repeats 1: the sample itself
    assert mix.parts == (("a", 4), ("b", 3))
    assert [mix.name_of(i) for i in (0, 3, 4, 6)] == ["a", "a", "b", "b"]
    s = BucketSampler(mix, shapes(list(mix.samples)), 1)
    assert sum(s.buckets.values()) == 3 * 6 + 4
    counts = Counter(i for p in s.epoch_plans(0) for i in p.sample_indices)
    assert counts[1] == 6 and counts[5] == 2
    with pytest.raises(ValueError, match="dataset 'b' has no empty caption"):
        BucketSampler(mix, shapes(list(mix.samples)), 1, caption_dropout=0.5)


def test_mix_repeats_at_the_limit_work_and_past_it_name_the_dataset():
    one = [Sample("l0", ("c0",), repeats=1)]
    mix = mix_datasets([DatasetPart("solo", one, MAX_REPEATS)])
    assert mix.samples[0].repeats == MAX_REPEATS
    assert len(BucketSampler(mix, [(4, 8, 8)], 1000)) == MAX_REPEATS // 1000
    two = [Sample("l0", ("c0",), repeats=2, source="x.png")]
    with pytest.raises(ValueError, match=r"dataset 'pets': sample x.png repeats 2 .* above the limit"):
        mix_datasets([DatasetPart("pets", two, MAX_REPEATS)])
    for bad in (0, MAX_REPEATS + 1, 1.5, True):
        with pytest.raises(ValueError, match="dataset 'pets': repeats must be an int"):
            mix_datasets([DatasetPart("pets", one, bad)])
    with pytest.raises(ValueError, match="at least one"):
        mix_datasets([])
    many = [DatasetPart(f"d{i}", [Sample(f"l{i}", ("c",), repeats=MAX_REPEATS)], MAX_REPEATS // MAX_REPEATS)
            for i in range(7000)]
    with pytest.raises(ValueError, match="occurrences per epoch, above the limit"):
        mix_datasets(many)
