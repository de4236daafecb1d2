"""The adapter dropout's rates and masks (``dataset_cache.adapter_dropout``), without ComfyUI."""

from __future__ import annotations

import pytest
import torch

from dataset_cache.adapter_dropout import (MAX_DROPOUT, DropoutRates, dropped_hidden, dropped_ranks, rank_scale,
                                           seed_generators, skipped_layers)


def test_rates_out_of_range_are_refused_by_name() -> None:
    DropoutRates(0.1, 0.2, MAX_DROPOUT).validate()
    assert not DropoutRates().active and DropoutRates(module=0.1).active
    assert DropoutRates(network=0.1).in_activations and not DropoutRates(rank=0.1).in_activations
    for rates, name in ((DropoutRates(network=1.0), "network_dropout"), (DropoutRates(rank=-0.1), "rank_dropout"),
                        (DropoutRates(module=float("nan")), "module_dropout"),
                        (DropoutRates(module=True), "module_dropout")):
        with pytest.raises(ValueError, match=f"{name} must be a number from 0 \\(none\\) to 0.9"):
            rates.validate()


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_dropped_ranks_zero_whole_ranks_and_leave_the_others(p: float) -> None:
    """Each rank (column of up) is zeroed or kept exactly; the kept ones' scale is :func:`rank_scale`'s, 1/(1 - p),
    which the caller folds into its own."""
    up = torch.rand(16, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    torch.manual_seed(3)
    out = dropped_ranks(up, p)
    kept = [bool(out[:, r].ne(0).any()) for r in range(8)]
    for r in range(8):
        assert torch.equal(out[:, r], up[:, r] if kept[r] else torch.zeros(16))
    assert 0 < sum(kept) < 8
    torch.manual_seed(3)
    assert torch.equal(dropped_ranks(up.view(16, 8, 1, 1), p).view(16, 8), out)  # one mask over the rank dimension
    assert dropped_ranks(up, 0.0) is up
    assert rank_scale(p) == 1 / (1 - p) and rank_scale(0.0) == 1.0


@pytest.mark.parametrize("channels_first", [False, True])
def test_rank_dropout_of_hidden_units_is_one_mask_per_image_and_rank(channels_first: bool) -> None:
    """Batch 4 of 6 tokens and rank 8: every token of an image shares its rank's choice, zeroed or kept."""
    hidden = torch.rand(4, 6, 8, generator=torch.Generator().manual_seed(1)) + 0.5  # B × tokens × rank
    given = hidden.transpose(1, 2).contiguous() if channels_first else hidden
    torch.manual_seed(5)
    out = dropped_hidden(given, 0.0, 0.5, channels_first=channels_first)
    out = out.transpose(1, 2) if channels_first else out
    ratio = out / hidden
    assert torch.equal(ratio, ratio[:, :1, :].expand_as(ratio))  # one choice per image and rank
    assert set(ratio.unique().tolist()) == {0.0, 1.0}
    assert len({tuple(ratio[i, 0].tolist()) for i in range(4)}) > 1  # images draw their own


def test_network_dropout_drops_each_unit_as_torch_dropout() -> None:
    hidden = torch.rand(2, 5, 4) + 0.5
    torch.manual_seed(9)
    out = dropped_hidden(hidden, 0.5, 0.0, channels_first=False)
    torch.manual_seed(9)
    assert torch.equal(out, torch.nn.functional.dropout(hidden, 0.5, training=True))
    assert torch.equal(dropped_hidden(hidden, 0.0, 0.0, channels_first=False), hidden)


def test_seeded_generators_repeat_the_draws_and_restore_the_callers() -> None:
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    with seed_generators(42, torch.device("cpu")):
        first = torch.rand(64)
    assert torch.equal(torch.random.get_rng_state(), before)
    with seed_generators(42, torch.device("cpu")):
        assert torch.equal(torch.rand(64), first)


def test_skipped_layers_are_one_seeded_draw_per_batch() -> None:
    """p 0.9 over 1000 layers: 900 expected, a binomial's standard deviation 9.5, so 850-950 holds for any seed but
    a 5-sigma one (and this seed is fixed); the same generator seed, the same layers."""
    skipped = skipped_layers(1000, 0.9, torch.Generator().manual_seed(4))
    assert 850 <= sum(skipped) <= 950
    assert skipped == skipped_layers(1000, 0.9, torch.Generator().manual_seed(4))
    assert skipped_layers(5, 0.0, torch.Generator()) == [False] * 5
