"""dataset_cache.holdout: a validation split held out of a dataset, whole sources, the same on every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dataset_cache.dataset import Sample
from dataset_cache.dataset_mix import DatasetPart, mix_datasets
from dataset_cache.holdout import MAX_VAL_SPLIT, hold_out


def _samples(n: int, prefix: str = "img", per_source: int = 1) -> list[Sample]:
    return [Sample(f"{prefix}{i}-{k}", (f"cap{i}",), repeats=2, source=f"{prefix}{i}.png")
            for i in range(n) for k in range(per_source)]


def test_a_share_of_the_sources_is_held_out_whole_and_the_rest_trains() -> None:
    mix = mix_datasets([DatasetPart("ds", _samples(20, per_source=2))])  # two resolutions per image
    held = hold_out(mix, 0.1)
    assert len(held.sources) == 2 and len(held.validation) == 4
    assert {s.source for s in held.validation} == set(held.sources)
    assert not {s.source for s in held.train.samples} & set(held.sources)
    assert len(held.train.samples) == 36 and held.train.parts == (("ds", 36),)
    assert all(s.repeats == 2 for s in held.train.samples)  # training samples as they were
    assert "val_split 0.1: 2 source(s) held out of training for the validation loss (4 samples:" in held.describe(0.1)


def test_the_split_is_the_same_whatever_the_order_and_a_new_source_moves_little() -> None:
    samples = _samples(40)
    first = hold_out(mix_datasets([DatasetPart("ds", samples)]), 0.25).sources
    assert hold_out(mix_datasets([DatasetPart("ds", samples[::-1])]), 0.25).sources == first
    grown = hold_out(mix_datasets([DatasetPart("ds", samples + _samples(1, "new"))]), 0.25).sources
    assert len(set(first) ^ set(grown)) <= 2  # 10 of 40, then 10 of 41: at most one in, one out
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from dataset_cache.holdout import hold_out; "
            "from dataset_cache.dataset import Sample; "
            "from dataset_cache.dataset_mix import DatasetPart, mix_datasets; "
            "s = [Sample(f'img{i}-0', (f'cap{i}',), 2, f'img{i}.png') for i in range(40)]; "
            "print(hold_out(mix_datasets([DatasetPart('ds', s)]), 0.25).sources)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[2])], capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "77", "PATH": ""})
    assert out.stdout.strip() == str(first)  # no salted hash: the same split in another process


def test_parts_of_a_combined_mix_keep_their_counts_and_sources_without_a_path_use_their_latent() -> None:
    anonymous = [Sample(f"latent{i}", ("c",)) for i in range(6)]  # from Make Training Dataset: no source
    mix = mix_datasets([DatasetPart("a", _samples(6)), DatasetPart("b", anonymous)])
    held = hold_out(mix, 0.25)
    assert len(held.sources) == 3 and sum(n for _, n in held.train.parts) == len(held.train.samples) == 9
    assert [name for name, _ in held.train.parts] == ["a", "b"]


@pytest.mark.parametrize("share", [-0.1, MAX_VAL_SPLIT + 0.01, float("nan"), True, "0.1"])
def test_bad_shares_are_refused_by_name(share: object) -> None:
    with pytest.raises(ValueError, match="val_split must be a number from 0"):
        hold_out(mix_datasets([DatasetPart("ds", _samples(4))]), share)  # type: ignore[arg-type]


def test_a_split_that_leaves_nothing_to_train_is_refused() -> None:
    with pytest.raises(ValueError, match="holds out 1 of the dataset's 1 source"):
        hold_out(mix_datasets([DatasetPart("ds", _samples(1, per_source=3))]), 0.1)
