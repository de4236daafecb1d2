"""The memory plan (``dataset_cache.memory_plan``): which plan a model, a batch shape and a free-memory figure get.

The models are tables of sizes shaped like the real ones (docs/ARCHITECTURE.md, "Memory"): Flux-dev's 19 double
blocks of 679 MB and 38 single blocks of 283 MB in bf16, SDXL's units, WAN 2.1 1.3B's 30 blocks. Every choice is
arithmetic on those numbers, so each case states the plan it must get.
"""

from __future__ import annotations

import itertools
import random

import pytest

from dataset_cache.memory_plan import (
    KEEP_WHOLE, SPARE_SHARE, BlockCost, Budget, MemoryNeeds, MemoryRequest, estimate, pick_kept, pick_streamed,
    plan_memory, spread,
)

MB = 1_000_000
GB = 1_000_000_000


def flux_dev(fp8_allowed: bool = True, fp8_model: bool = False) -> MemoryNeeds:
    """Flux-dev at 1024², batch 1, bf16: 23.7 GB of block weights; a block's recompute holds its activations and
    ComfyUI's patched weight copies; the checkpoints keep one 28 MB hidden state per block."""
    def block(name: str, weight: int, saved: int) -> BlockCost:
        if fp8_model:
            return BlockCost(name, weight // 2, saved, 28 * MB, None)
        return BlockCost(name, weight, saved, 28 * MB, weight // 2 if fp8_allowed else None)

    blocks = tuple([block(f"double_blocks.{i}", 679 * MB, 2000 * MB) for i in range(19)]
                   + [block(f"single_blocks.{i}", 283 * MB, 1200 * MB) for i in range(38)])
    return MemoryNeeds(blocks, other_weight_bytes=300 * MB, trainable_bytes=200 * MB, held_bytes=60 * GB,
                       held_checkpointed_bytes=1700 * MB, largest_weight_bytes=150 * MB)


def uniform(n: int = 10, weight: int = 100 * MB, saved: int = 50 * MB) -> MemoryNeeds:
    blocks = tuple(BlockCost(f"blocks.{i}", weight, saved, 5 * MB, weight // 2) for i in range(n))
    return MemoryNeeds(blocks, other_weight_bytes=20 * MB, trainable_bytes=10 * MB, held_bytes=n * saved,
                       held_checkpointed_bytes=n * 5 * MB, largest_weight_bytes=10 * MB)


def _plan(needs: MemoryNeeds, gb: float, **request: object):
    return plan_memory(needs, Budget(int(gb * GB)), MemoryRequest(**request))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the ladder
@pytest.mark.parametrize(("gb", "checkpoint", "expect"), [
    # (free memory, gradient_checkpointing, (checkpointed, streamed blocks > 0, host activations, fp8))
    (141, True, (True, False, False, False)),  # an H200: everything on the device, blocks checkpointed
    (141, False, (False, False, False, False)),  # no checkpointing asked, and 84 GB of it fits
    (60, False, (True, False, False, False)),  # no checkpointing does not fit; checkpointing alone does
    (24, True, (True, True, False, False)),  # a 24 GB card: some blocks streamed
    (12, True, (True, True, False, False)),  # 12 GB: more blocks streamed
    (6.0, True, (True, True, True, False)),  # streaming every block is not enough: activations on the host too
    (5.0, True, (True, True, True, True)),  # not even that: fp8 block weights (allowed here)
])
def test_auto_picks_the_first_rung_that_fits(gb: float, checkpoint: bool, expect: tuple[bool, ...]) -> None:
    plan = _plan(flux_dev(), gb, checkpoint=checkpoint, allow_fp8=True)
    assert (plan.checkpoint, bool(plan.streamed), plan.host_activations, plan.fp8) == expect
    assert plan.fits and plan.estimate.total <= plan.budget_bytes


def test_streaming_streams_no_more_blocks_than_it_must() -> None:
    """At 24 and 12 GB: dropping any one streamed block (keeping it on the device) no longer fits, and the
    blocks streamed are the 283 MB single blocks (a smaller slot than a 679 MB double block costs)."""
    needs = flux_dev()
    counts = {}
    for gb in (24, 12):
        plan = _plan(needs, gb)
        assert plan.fits
        assert all(needs.blocks[i].name.startswith("single_blocks") for i in plan.streamed) or gb == 12
        for i in plan.streamed:
            fewer = [j for j in plan.streamed if j != i]
            total = estimate(needs, checkpoint=True, streamed=fewer).total
            assert total > plan.budget_bytes, (gb, i)
        counts[gb] = len(plan.streamed)
    assert 0 < counts[24] < counts[12]


def test_more_memory_never_streams_more_bytes() -> None:
    """(Not always fewer blocks: at 16 GB double blocks must be streamed, at 20 GB the small single blocks do.)"""
    needs = flux_dev()
    streamed = [_plan(needs, gb).transfer_bytes for gb in (6, 8, 10, 12, 16, 20, 24, 28, 32)]
    assert streamed == sorted(streamed, reverse=True) and streamed[-1] == 0


def test_a_plan_that_does_not_fit_is_the_most_frugal_one_and_says_so() -> None:
    plan = _plan(flux_dev(), 1.0)
    assert not plan.fits and plan.host_activations and not plan.fp8
    assert len(plan.streamed) == 57
    assert any("no plan fits" in n and "or allow fp8 weights" in n for n in plan.notes)
    assert "may run out of memory" in plan.describe()
    unconvertible = _plan(flux_dev(fp8_allowed=False), 1.0)
    assert any("no plan fits" in n and "fp8" not in n for n in unconvertible.notes)


def test_fp8_only_when_allowed_and_not_for_a_model_already_in_fp8() -> None:
    assert not _plan(flux_dev(), 2.4).fp8  # not allowed: the frugal plan without it
    assert not _plan(flux_dev(fp8_model=True), 1.5, allow_fp8=True).fp8  # nothing left to convert


def test_a_model_already_in_fp8_streams_fewer_blocks() -> None:
    """Flux-dev loaded in fp8 (11.9 GB of weights) in 12 GB streams fewer blocks than bf16 in 24 GB."""
    fp8 = _plan(flux_dev(fp8_model=True), 12)
    bf16 = _plan(flux_dev(), 24)
    assert fp8.fits and bf16.fits and not fp8.fp8
    assert fp8.transfer_bytes < bf16.transfer_bytes


# --------------------------------------------------------------------------------------------- expert overrides
def test_no_offload_keeps_every_weight_and_says_when_it_will_not_fit() -> None:
    plan = _plan(flux_dev(), 12, mode="no offload")
    assert not plan.streamed and plan.checkpoint and not plan.fits
    assert any("'auto' would stream" in n for n in plan.notes)
    assert _plan(flux_dev(), 141, mode="no offload").notes == ()


def test_stream_blocks_with_a_count_streams_the_largest_spread_out() -> None:
    needs = flux_dev()
    plan = _plan(needs, 141, mode="stream blocks", stream_blocks=5)
    assert len(plan.streamed) == 5 and all(needs.blocks[i].name.startswith("double") for i in plan.streamed)
    assert plan.streamed == (1, 5, 9, 13, 17)  # spread over the 19 double blocks, not the first five
    everything = _plan(needs, 141, mode="stream blocks", stream_blocks=1000)
    assert len(everything.streamed) == 57


def test_stream_modes_turn_checkpointing_on_and_keep_host_activations_apart() -> None:
    plan = _plan(uniform(), 100, mode="stream blocks", checkpoint=False, stream_blocks=2)
    assert plan.checkpoint and any("need gradient checkpointing" in n for n in plan.notes)
    assert not plan.host_activations
    assert _plan(uniform(), 100, mode="stream blocks + host activations", stream_blocks=2).host_activations


def test_stream_blocks_without_a_count_streams_what_it_must() -> None:
    auto = _plan(flux_dev(), 12)
    forced = _plan(flux_dev(), 12, mode="stream blocks")
    assert forced.streamed == auto.streamed
    assert _plan(flux_dev(), 141, mode="stream blocks").streamed == ()  # it fits as it is


def test_comfyui_managing_the_weights_wins() -> None:
    plan = _plan(flux_dev(), 12, managed_by="offloading is on")
    assert plan.checkpoint and not plan.streamed and not plan.host_activations and not plan.fp8
    assert "weights managed by ComfyUI (offloading is on)" in plan.describe()
    assert "estimated" not in plan.describe()  # ComfyUI decides what sits on the device
    with pytest.raises(ValueError, match="ComfyUI manages this model's weights .*offloading"):
        _plan(flux_dev(), 12, mode="stream blocks", managed_by="offloading is on")


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown memory 'lots'; use one of auto, auto \+ keep blocks whole, no "):
        _plan(uniform(), 10, mode="lots")


# ------------------------------------------------------------------------------------------------- arithmetic
def test_estimate_adds_up_each_item() -> None:
    needs = uniform(n=4, weight=100 * MB, saved=50 * MB)
    resident = estimate(needs, checkpoint=True)
    assert resident.weights == 420 * MB and resident.slots == 0
    assert resident.activations == 20 * MB + 75 * MB  # the checkpoints' inputs + one block's backward (1.5 ×)
    assert resident.trainable == 10 * MB and resident.copies == 20 * MB
    assert resident.total == resident.subtotal + resident.subtotal // 20
    streamed = estimate(needs, checkpoint=True, streamed=[1, 3])
    assert streamed.weights == 220 * MB and streamed.slots == 200 * MB  # two slots of the largest streamed block
    no_ckpt = estimate(needs, checkpoint=False)
    assert no_ckpt.activations == 200 * MB + 25 * MB
    host = estimate(needs, checkpoint=True, host_activations=True)
    assert host.activations == 5 * MB + 75 * MB  # one block's inputs back for its recompute
    assert estimate(needs, checkpoint=True, fp8=True).weights == 220 * MB


def test_describe_reads_as_the_plan() -> None:
    plan = _plan(flux_dev(), 12)
    text = plan.describe()
    assert text.startswith(f"57 blocks checkpointed, {len(plan.streamed)} of 57 blocks streamed (")
    assert "copied per pass), estimated " in text and text.endswith(" of 11.2 GiB")
    data = plan.as_dict()
    assert data["streamed_blocks"] == len(plan.streamed) and data["estimate_bytes"] == plan.estimate.total
    assert data["budget_bytes"] == 12 * GB and data["fits"] and data["description"] == text
    assert sum(data["estimate"].values()) == plan.estimate.total


# ---------------------------------------------------------------------------------------- choosing the blocks
def test_spread_picks_evenly() -> None:
    assert spread(list(range(10)), 2) == [2, 7]
    assert spread(list(range(10)), 5) == [1, 3, 5, 7, 9]
    assert spread([4, 8], 5) == [4, 8]


def test_pick_streamed_pays_for_its_slots() -> None:
    assert pick_streamed([100] * 4, 0) == ()
    assert pick_streamed([100] * 4, 150, slots=2) == (0, 1, 2, 3)  # 4 × 100 − 2 × 100 = 200 ≥ 150
    assert pick_streamed([100] * 4, 250, slots=2) is None
    assert pick_streamed([100, 100, 100, 100, 500], 150) == (0, 1, 2, 3)  # the big one would cost 1000 of slots
    assert pick_streamed([100] * 4, 150, streamable=[True, True, True, False]) is None


@pytest.mark.parametrize("seed", range(40))
def test_pick_streamed_is_close_to_the_fewest_bytes(seed: int) -> None:
    """Against every subset of a small random model: what is picked saves enough, and streams at most one block's
    bytes more than the best subset (largest-first overshoots by less than the last block it adds)."""
    rng = random.Random(seed)
    weights = [rng.choice([60, 100, 100, 250, 400]) for _ in range(rng.randint(3, 9))]
    need = rng.randint(1, sum(weights))
    slots = rng.choice([2, 3])

    def saves(chosen: tuple[int, ...]) -> int:
        return sum(weights[i] for i in chosen) - slots * max((weights[i] for i in chosen), default=0)

    options = [c for r in range(1, len(weights) + 1) for c in itertools.combinations(range(len(weights)), r)
               if saves(c) >= need]
    picked = pick_streamed(weights, need, slots)
    if not options:
        assert picked is None
        return
    assert picked is not None and saves(picked) >= need
    best = min(sum(weights[i] for i in c) for c in options)
    assert sum(weights[i] for i in picked) <= best + max(weights)


# ------------------------------------------------------------------------------------- blocks kept whole (auto)
def unet(n_low: int = 6, n_high: int = 4) -> MemoryNeeds:
    """A UNet-like model at batch 1: low-resolution blocks replay as many saved tensors as high-resolution ones
    (350) for a fraction of their bytes, so keeping them whole saves the most recompute per byte."""
    blocks = tuple([BlockCost(f"high.{i}", 10 * MB, 350 * MB, 3 * MB, saves=350) for i in range(n_high)]
                   + [BlockCost(f"low.{i}", 130 * MB, 90 * MB, 1 * MB, saves=350) for i in range(n_low)]
                   + [BlockCost("resnet", 20 * MB, 25 * MB, 3 * MB, saves=56)])
    return MemoryNeeds(blocks, other_weight_bytes=50 * MB, trainable_bytes=10 * MB,
                       held_bytes=sum(b.saved_bytes for b in blocks), held_checkpointed_bytes=30 * MB,
                       largest_weight_bytes=20 * MB)


def test_auto_keeps_blocks_whole_within_half_the_spare_memory() -> None:
    needs = unet()
    frugal = _plan(needs, 2.0, spare_share=0)
    assert frugal.kept == () and frugal.checkpoint
    for gb in (1.6, 2.0, 3.0, 6.0):
        plan = _plan(needs, gb)
        spare = plan.budget_bytes - _plan(needs, gb, spare_share=0).estimate.total
        assert plan.checkpoint and not plan.streamed and plan.fits
        assert plan.estimate == estimate(needs, checkpoint=True, kept=plan.kept)
        assert plan.estimate.total <= frugal.estimate.total + SPARE_SHARE * spare
    assert len(_plan(needs, 6.0).kept) == len(needs.blocks)  # everything fits in half of what is left


def test_the_cheapest_recompute_per_byte_is_kept_first() -> None:
    """With room for a few blocks: the low-resolution ones (350 saves in 90 MB), not the high-resolution ones
    (350 in 350 MB) nor the small resnet (56 in 25 MB, fewer per byte than the low ones)."""
    needs = unet()
    checkpointed = estimate(needs, checkpoint=True).total
    kept = pick_kept(needs, checkpointed + 300 * MB)
    assert kept and all(needs.blocks[i].name.startswith("low.") for i in kept)
    assert estimate(needs, checkpoint=True, kept=kept).total <= checkpointed + 300 * MB
    # a block that does not fit is passed over for smaller ones after it
    assert pick_kept(needs, checkpointed + 30 * MB) == (10,)  # 25 MB and its 5% reserve


def test_more_spare_memory_never_keeps_fewer_bytes() -> None:
    needs = unet()
    kept = [sum(needs.blocks[i].saved_bytes for i in _plan(needs, gb).kept) for gb in (1.2, 1.6, 2, 3, 4, 8)]
    assert kept == sorted(kept) and kept[-1] > kept[0]


def test_no_block_is_kept_whole_where_memory_is_short_or_the_user_fixed_the_plan() -> None:
    needs = flux_dev()
    assert _plan(needs, 24).kept == ()  # blocks streamed: every one must be recomputed with its weights
    assert _plan(needs, 141, mode="no offload").kept == ()  # the leanest plan without streaming, as asked
    assert _plan(needs, 141, managed_by="offloading is on").kept == ()
    assert _plan(needs, 141, checkpoint=False).kept == ()  # no checkpointing at all fits
    assert _plan(needs, 141).kept  # an H200: the same model keeps blocks whole


def test_a_kept_estimate_holds_their_activations_and_the_largest_backward() -> None:
    needs = uniform(n=4, weight=100 * MB, saved=50 * MB)
    est = estimate(needs, checkpoint=True, kept=[0, 2])
    assert est.activations == 20 * MB + 100 * MB + 75 * MB  # inputs + two blocks' saved + a recomputed backward
    every = estimate(needs, checkpoint=True, kept=range(4))
    assert every.activations == 20 * MB + 200 * MB + 25 * MB  # no recompute left: a kept block's gradients


def test_describe_and_as_dict_name_the_blocks_kept_whole() -> None:
    needs = unet()
    plan = _plan(needs, 2.0)
    assert 0 < len(plan.kept) < len(needs.blocks)
    assert plan.describe().startswith(f"{len(needs.blocks) - len(plan.kept)} of {len(needs.blocks)} blocks "
                                      f"checkpointed ({len(plan.kept)} kept whole in spare memory), all weights")
    data = plan.as_dict()
    assert data["kept_blocks"] == len(plan.kept) and data["kept"] == [needs.blocks[i].name for i in plan.kept]


@pytest.mark.parametrize("batch_size", [2, 8])
def test_auto_above_batch_1_checkpoints_every_block_and_names_what_keeping_would_cost(batch_size: int) -> None:
    """From batch 2 on a kept block's activations grow with the batch: ``auto`` holds the least memory without
    streaming and says what ``auto + keep blocks whole`` would keep, which keeps exactly what ``auto`` keeps at
    batch 1 on the same figures."""
    needs = unet()
    lean = _plan(needs, 2.0, spare_share=0)
    plan = _plan(needs, 2.0, batch_size=batch_size)
    assert plan.kept == () and plan.estimate == lean.estimate and not plan.streamed
    speed = _plan(needs, 2.0, mode=KEEP_WHOLE, batch_size=batch_size)
    assert speed.kept == _plan(needs, 2.0).kept and 0 < len(speed.kept) < len(needs.blocks)
    assert plan.keepable == speed.kept and plan.keepable_bytes == speed.estimate.total - lean.estimate.total > 0
    assert plan.describe().startswith(f"{len(needs.blocks)} blocks checkpointed ('{KEEP_WHOLE}' would keep "
                                      f"{len(speed.kept)} whole, faster, in ")
    assert plan.as_dict()["keepable_blocks"] == len(speed.kept)
    assert speed.keepable == () and speed.as_dict()["keepable_blocks"] == 0


def test_keep_blocks_whole_follows_autos_ladder_where_every_weight_does_not_fit() -> None:
    """The mode spends spare memory, never memory the run needs: where blocks must be streamed it streams them as
    ``auto`` does and keeps none (a streamed block is recomputed with its weights)."""
    needs = flux_dev()
    for batch_size in (1, 4):
        plan = _plan(needs, 24, mode=KEEP_WHOLE, batch_size=batch_size)
        auto = _plan(needs, 24, batch_size=batch_size)
        assert plan.streamed == auto.streamed and plan.streamed and plan.kept == () and plan.keepable == ()
    assert _plan(needs, 141, mode=KEEP_WHOLE, managed_by="offloading is on").kept == ()
    assert _plan(needs, 141, mode=KEEP_WHOLE, batch_size=4).kept
    assert _plan(needs, 141, batch_size=4).keepable  # the same device under auto only names them
