"""Repeat counts from files and folder names are bounded before anything allocates per occurrence.

A dataset file is JSON anyone can edit: repeats of 10^12, 2^63 or 5·10^8 used to pass verify and Load, then made
the sampler allocate terabytes. Each is now refused where the file is read, naming the file and the sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dataset_cache.dataset import MAX_EPOCH_OCCURRENCES, MAX_REPEATS, Sample
from dataset_cache.errors import CacheCorruptError
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.sampler import BucketSampler
from dataset_cache.listing import list_folder
from support.datasets import Subset, make_kohya_folder


def _cache_with_repeats(root: Path, repeats: list[int]) -> Path:
    """A cache whose dataset file is then edited to say ``repeats`` (as a hostile file would)."""
    with CacheWriter(root) as w:
        for i in range(len(repeats)):
            w.add(f"L{i}", {"samples": torch.zeros(1, 4, 8, 8)}, kind="latent")
        w.add("C", [[torch.zeros(1, 7, 16), {}]], kind="conditioning")
        w.set_dataset("d", [Sample(f"L{i}", ("C",), source=f"img{i}.png") for i in range(len(repeats))])
    (file,) = (root / "datasets").glob("*.json")
    doc = json.loads(file.read_text())
    doc["repeats"] = repeats
    file.write_text(json.dumps(doc))
    return file


@pytest.mark.parametrize("hostile", [10**12, 2**63, 5 * 10**8, MAX_REPEATS + 1])
def test_a_dataset_file_with_huge_repeats_is_refused_where_it_is_read(tmp_path: Path, hostile: int) -> None:
    file = _cache_with_repeats(tmp_path, [1, hostile])
    with open_cache(tmp_path) as reader:
        with pytest.raises(CacheCorruptError, match=rf"sample 1 \(img1.png\) repeats {hostile} times, above the "
                                                    rf"limit of {MAX_REPEATS}"):
            reader.dataset("d")
        problems = reader.verify()
    assert [str(file) in str(p) for p in problems] == [True]


def test_an_epoch_too_large_in_total_is_refused(tmp_path: Path) -> None:
    n = MAX_EPOCH_OCCURRENCES // MAX_REPEATS + 1  # each within the limit, the sum above it
    _cache_with_repeats(tmp_path / "edited", [MAX_REPEATS] * n)
    with open_cache(tmp_path / "edited") as reader:
        with pytest.raises(CacheCorruptError, match="occurrences per epoch, above"):
            reader.dataset("d")
    samples = [Sample(f"L{i}", ("C",), repeats=MAX_REPEATS) for i in range(n)]
    with pytest.raises(ValueError, match="occurrences per epoch"):
        BucketSampler(samples, [0] * n, 1)
    with CacheWriter(tmp_path / "other") as w, pytest.raises(ValueError, match="occurrences per epoch"):
        w.set_dataset("d", samples)


def test_samples_refuse_repeats_out_of_range() -> None:
    for bad in (0, MAX_REPEATS + 1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match=f"repeats must be an int from 1 to {MAX_REPEATS}"):
            Sample("L", ("C",), repeats=bad)  # type: ignore[arg-type]
    assert Sample("L", ("C",), repeats=MAX_REPEATS).repeats == MAX_REPEATS


def test_a_kohya_folder_with_a_huge_repeat_count_is_skipped_and_named(tmp_path: Path) -> None:
    make_kohya_folder(tmp_path, (Subset(3, "ok", ((64, 64),), "png"), Subset(10**12, "typo", ((64, 64),), "png")))
    listing = list_folder(tmp_path)
    assert [img.repeats for img in listing.images] == [3]
    (failure,) = listing.failures
    assert failure.relpath == f"{10**12}_typo" and f"above the limit of {MAX_REPEATS}" in failure.reason


@pytest.mark.parametrize("fields, why", [
    ({"reference_mirror": "rm"}, "reference_mirror needs a reference and a mirror"),
    ({"reference": "r", "reference_mirror": "rm"}, "reference_mirror needs a reference and a mirror"),
    ({"mirror": "m", "reference": "r"}, "needs the reference's mirror"),
    ({"reference": ""}, "reference must be an entry key"),
])
def test_reference_columns_must_fit_the_mirror(fields: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Sample("l", ("c",), **fields)
    assert Sample("l", ("c",), mirror="m", reference="r", reference_mirror="rm").keys() == ("l", "m", "c", "r", "rm")
