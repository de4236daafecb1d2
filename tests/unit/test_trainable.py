"""dataset_cache.trainable: values with valid checksums that would train silently wrong are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.trainable import check_trainable, non_finite_entries

GOOD_COND = [[torch.randn(1, 7, 16), {"pooled_output": torch.randn(1, 16),
                                      "attention_mask": torch.ones(1, 7, dtype=torch.long)}]]


def _cache(root: Path, latent: object, cond: object) -> list[Sample]:
    samples = [Sample("L0", ("C0",), source="a.png"), Sample("L1", ("C1",), source="b.png")]
    with CacheWriter(root) as w:
        w.add("L0", {"samples": torch.randn(1, 4, 8, 8)}, kind="latent")
        w.add("C0", GOOD_COND, kind="conditioning")
        w.add("L1", latent, kind="latent")
        w.add("C1", cond, kind="conditioning")
        w.set_dataset("d", samples)
    return samples


def test_float_latents_and_one_entry_conditionings_with_integer_masks_pass(tmp_path: Path) -> None:
    samples = _cache(tmp_path, {"samples": torch.randn(1, 16, 1, 8, 8).to(torch.bfloat16)}, GOOD_COND)
    with open_cache(tmp_path) as reader:
        check_trainable(reader, samples)


@pytest.mark.parametrize(("latent", "cond", "message"), [
    ({"samples": torch.zeros(1, 4, 8, 8, dtype=torch.int32)}, GOOD_COND,
     r"sample 1 \(b.png\): latent entry L1 holds torch.int32 samples"),
    ({"samples": torch.randn(1, 4, 8, 8)}, GOOD_COND + GOOD_COND,
     r"sample 1 \(b.png\): conditioning entry C1 holds 2 conditionings .*Conditioning Concat"),
    ({"samples": torch.randn(1, 4, 8, 8)}, [[torch.zeros(1, 7, 16, dtype=torch.int64), {}]],
     r"conditioning entry C1 holds a torch.int64 tensor"),
    ({"samples": torch.randn(1, 4, 8, 8)}, [[torch.randn(1, 7, 16), {"area": (8, 8, 0, 0), "strength": 1.0}]],
     r"conditioning entry C1 carries 'area', 'strength'"),
    ({"samples": torch.randn(1, 4, 8, 8)}, [[torch.randn(1, 7, 16), {"pooled_output": torch.ones(1, 16,
                                                                                                  dtype=torch.bool)}]],
     r"pooled_output is torch.bool"),
])
def test_what_would_train_wrongly_is_refused_naming_the_entry(tmp_path: Path, latent: object, cond: object,
                                                                message: str) -> None:
    samples = _cache(tmp_path, latent, cond)
    with open_cache(tmp_path) as reader, pytest.raises(ValueError, match=message):
        check_trainable(reader, samples)


def test_non_finite_entries_names_the_rows_that_hold_them() -> None:
    latents = torch.randn(3, 4, 8, 8)
    latents[1, 0, 0, 0] = float("nan")
    conds = [GOOD_COND, GOOD_COND, [[torch.full((1, 7, 16), float("inf")), {}]]]
    found = non_finite_entries(["a", "b", "c"], latents, ["x", "y", "z"], conds)
    assert found == ["latent b", "conditioning z at [0][0]"]
    assert non_finite_entries(["a"], torch.zeros(1, 4, 8, 8), ["x"], [GOOD_COND]) == []
