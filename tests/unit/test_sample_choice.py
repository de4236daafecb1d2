"""dataset_cache.sample_choice: which cached captions sample images come from, and the sampling settings' ranges."""

from __future__ import annotations

import math
import re

import pytest

from dataset_cache.dataset import Sample
from dataset_cache.holdout import source_rank
from dataset_cache.sample_choice import MAX_SAMPLE_COUNT, check_sampling, choose_sample_rows

SQUARE, WIDE = (1, 4, 8, 8), (1, 4, 8, 12)


def _sample(name: str, *, captions: int = 2, source: bool = True) -> Sample:
    return Sample(latent=f"lat-{name}", captions=tuple(f"cap-{name}-{i}" for i in range(captions)), repeats=3,
                  source=f"{name}.png" if source else None, mirror=f"mir-{name}", mask=f"mask-{name}",
                  empty_caption="empty")


def test_the_bucket_with_most_sources_gives_its_first_ranked_sources_with_their_first_caption() -> None:
    samples = [_sample(n) for n in "abcdef"]
    buckets = [SQUARE, WIDE, SQUARE, WIDE, WIDE, WIDE]  # WIDE: b, d, e, f
    chosen, shape = choose_sample_rows(samples, buckets, 2)
    assert shape == WIDE
    wide = sorted((s.source for s, b in zip(samples, buckets) if b == WIDE), key=source_rank)
    assert [s.source for s in chosen] == wide[:2]
    for s in chosen:
        name = s.source.removesuffix(".png")
        assert (s.captions, s.repeats, s.mirror, s.mask, s.empty_caption) == ((f"cap-{name}-0",), 1, None, None,
                                                                              "empty")


def test_a_source_counts_once_and_the_choice_ignores_the_datasets_order() -> None:
    """A source at two resolutions (two samples of one bucket after rounding) is one caption; the order of the
    samples does not matter; fewer sources than asked for give them all."""
    samples = [_sample("a"), _sample("a"), _sample("b"), _sample("c", source=False)]
    buckets = [SQUARE] * 4
    chosen, _ = choose_sample_rows(samples, buckets, 8)
    assert len(chosen) == 3 and len({s.latent for s in chosen}) == 3
    again, _ = choose_sample_rows(samples[::-1], buckets[::-1], 8)
    assert [s.latent for s in again] == [s.latent for s in chosen]


def test_a_tie_between_buckets_goes_to_the_one_holding_the_first_ranked_source() -> None:
    samples = [_sample(n) for n in "wxyz"]
    buckets = [SQUARE, SQUARE, WIDE, WIDE]
    first = min((s.source for s in samples), key=source_rank)
    _, shape = choose_sample_rows(samples, buckets, 1)
    assert shape == buckets[[s.source for s in samples].index(first)]


def test_no_samples_or_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_count: there are no samples"):
        choose_sample_rows([], [], 2)
    with pytest.raises(ValueError, match="sample_count: 2 samples but 1 latent shapes"):
        choose_sample_rows([_sample("a"), _sample("b")], [SQUARE], 2)


@pytest.mark.parametrize("values", [(0, 0, 1, 1.0), (MAX_SAMPLE_COUNT, 500, 100, 30.0), (4, 100, 20, 7)])
def test_sampling_settings_accept_their_ranges(values: tuple) -> None:
    check_sampling(*values)


@pytest.mark.parametrize(("values", "message"), [
    ((17, 0, 20, 1.0), "sample_count must be a whole number from 0 to 16, got 17"),
    ((2.0, 0, 20, 1.0), "sample_count must be a whole number from 0 to 16, got 2.0"),
    ((2, -1, 20, 1.0), "sample_every must be a whole number 0 or more, got -1"),
    ((2, 0, 0, 1.0), "sample_steps must be a whole number from 1 to 100, got 0"),
    ((2, 0, 20, 0.5), "sample_cfg must be a number from 1 (no guidance: the model's own prediction) to 30, got 0.5"),
    ((2, 0, 20, math.inf), "sample_cfg must be a number from 1 (no guidance: the model's own prediction) to 30, "
                           "got inf"),
    ((2, 0, 20, True), "sample_cfg must be a number from 1"),
])
def test_sampling_settings_refuse_other_values_naming_the_field(values: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sampling(*values)


def test_a_chosen_sample_keeps_its_reference_and_drops_the_mirrors() -> None:
    """An edit model's sample image edits the sample's reference: kept; the mirrored reference goes with the
    mirror (a sample image is generated unmirrored)."""
    samples = [Sample("lat-a", ("cap-a",), source="a.png", mirror="mir-a", reference="ref-a",
                      reference_mirror="refmir-a"), Sample("lat-b", ("cap-b",), source="b.png")]
    chosen, _shape = choose_sample_rows(samples, [SQUARE, SQUARE], 2)
    by_source = {s.source: s for s in chosen}
    assert (by_source["a.png"].reference, by_source["a.png"].mirror, by_source["a.png"].reference_mirror) == (
        "ref-a", None, None)
    assert by_source["b.png"].reference is None
