"""dataset_cache.saving: datasets stored without encoding (a copy, ComfyUI's lists) and dataset info updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataset_cache import (
    CacheWriter,
    Sample,
    copy_dataset,
    open_cache,
    read_dataset_info,
    save_latent_lists,
    update_dataset_info,
)
from dataset_cache.batching import batched


def _latent(v: float, side: int = 8) -> dict:
    return {"samples": torch.full((1, 4, side, side), v)}


def _cond(v: float) -> list:
    return [[torch.full((1, 7, 16), v), {"pooled_output": torch.full((1, 16), v)}]]


def _source(root: Path) -> None:
    with CacheWriter(root) as w:
        samples = []
        for i in range(5):
            w.add(f"{i:032x}", _latent(float(i), 8 if i % 2 else 16), kind="latent")
            w.add(f"{100 + i:032x}", _cond(float(i)), kind="conditioning")
            samples.append(Sample(f"{i:032x}", (f"{100 + i:032x}",), repeats=1 + i % 2, source=f"img{i}.png"))
        w.set_dataset("src", samples, info={"note": "source"})


def test_copy_is_self_contained_and_saving_again_adds_nothing(tmp_path: Path) -> None:
    _source(tmp_path / "a")
    with open_cache(tmp_path / "a") as reader:
        first = copy_dataset(reader, "src", tmp_path / "b", "copy")
        again = copy_dataset(reader, "src", tmp_path / "b", "copy")
        want = reader.dataset("src")
    assert (first.samples, first.added) == (5, 10) and (again.samples, again.added) == (5, 0)
    with open_cache(tmp_path / "b") as copy:
        assert copy.dataset("copy") == want
        assert copy.datasets()["copy"].info["copied_from"] == {"cache": str(tmp_path / "a"), "dataset": "src"}
        (value,) = copy.read([want[3].latent])
        assert torch.equal(value["samples"], torch.full((1, 4, 8, 8), 3.0))
    with open_cache(tmp_path / "a") as reader, pytest.raises(KeyError, match="no dataset 'nope'"):
        copy_dataset(reader, "nope", tmp_path / "b", "copy")


def test_latent_lists_pair_like_comfyuis_trainer(tmp_path: Path) -> None:
    batch = {"samples": torch.stack([torch.full((4, 8, 8), 1.0), torch.full((4, 8, 8), 2.0)])}
    result = save_latent_lists([batch, _latent(3.0)], [_cond(9.0)], tmp_path, "lists")  # one cond for all
    assert result.samples == 3 and result.added == 4  # three latents, one shared conditioning
    assert save_latent_lists([batch, _latent(3.0)], [_cond(9.0)], tmp_path, "lists").added == 0
    with pytest.raises(ValueError, match="2 latents but 3 conditionings"):
        save_latent_lists([_latent(1.0), _latent(2.0)], [_cond(1.0)] * 3, tmp_path, "bad")
    with pytest.raises(ValueError, match="latents list is empty"):
        save_latent_lists([], [], tmp_path, "bad")


def test_dataset_info_is_read_and_updated_only_when_it_changes(tmp_path: Path) -> None:
    assert read_dataset_info(tmp_path / "none", "src") is None  # no cache at all
    _source(tmp_path)
    assert read_dataset_info(tmp_path, "other") is None
    assert read_dataset_info(tmp_path, "src").info == {"note": "source"}
    assert update_dataset_info(tmp_path, "src", "record", {"vae": {"id": "fp"}})
    assert not update_dataset_info(tmp_path, "src", "record", {"vae": {"id": "fp"}})  # same value: nothing written
    assert not update_dataset_info(tmp_path, "other", "record", 1)  # no such dataset
    info = read_dataset_info(tmp_path, "src")
    assert info.info == {"note": "source", "record": {"vae": {"id": "fp"}}}
    with open_cache(tmp_path) as reader:
        assert len(reader.dataset("src")) == 5  # the samples are kept as they were


def test_batched_slices() -> None:
    assert [list(b) for b in batched(list(range(7)), 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(batched([], 4)) == []
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        list(batched([1], 0))
