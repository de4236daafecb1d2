"""Dataset files with variants (mirror latents, loss masks, the empty caption): version 2 of the dataset file.

A dataset without variants must still be written as version 1, byte for byte, so caches written before variants
and the releases that wrote them keep working; a committed cache with a version-2 dataset (``data/v1-variants``)
must stay readable and be written again exactly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheCorruptError, CacheFormatError
from dataset_cache.format import CacheWriter, open_cache
from support.goldens import assert_golden_reads, assert_writer_reproduces, dataset_doc, regenerate

GOLDEN = Path(__file__).parent / "data" / "v1-variants"


def variant_entries() -> dict:
    ar = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    mask = torch.tensor([[0, 128, 255, 255], [0, 128, 255, 255], [0, 0, 64, 255]], dtype=torch.uint8)
    return {
        "latent-0": {"samples": ar.half()},
        "latent-0-mirror": {"samples": ar.flip(-1).half()},
        "latent-1": {"samples": (ar + 1).half()},
        "mask-0": {"mask": mask.reshape(1, 1, 3, 4)},
        "cond-0": [[ar.reshape(1, 6, 4).bfloat16(), {"pooled_output": torch.arange(4).float().reshape(1, 4)}]],
        "cond-0-shuffled": [[(ar + 2).reshape(1, 6, 4).bfloat16(), {}]],
        "cond-empty": [[torch.zeros(1, 6, 4).bfloat16(), {}]],
    }


def variant_samples() -> list[Sample]:
    return [
        Sample("latent-0", ("cond-0", "cond-0-shuffled"), 2, "2_x/a.png", mirror="latent-0-mirror", mask="mask-0",
               empty_caption="cond-empty"),
        Sample("latent-1", ("cond-0",), 1, "2_x/b.png", empty_caption="cond-empty"),
    ]


def build(root: Path) -> None:
    with CacheWriter(root) as w:
        for k, v in variant_entries().items():
            w.add(k, v, kind="latent" if k.startswith(("latent", "mask")) else "conditioning", name=k)
        w.set_dataset("variants", variant_samples(), info={"note": "variants golden"})


def test_golden_variants_cache_is_readable(same):
    assert_golden_reads(GOLDEN, variant_entries(), "variants", variant_samples(), same)


def test_writer_still_produces_the_golden_variant_files(tmp_path):
    assert_writer_reproduces(build, tmp_path, GOLDEN)


def test_dataset_without_variants_stays_version_1(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("l", {"samples": torch.zeros(1, 4, 2, 2)}, kind="latent")
        w.add("c", [[torch.zeros(1, 3, 4), {}]], kind="conditioning")
        w.set_dataset("plain", [Sample("l", ("c",), 3, "a.png")])
    doc = dataset_doc(tmp_path)
    assert doc["version"] == 1
    assert sorted(doc) == ["captions", "format", "latent", "name", "repeats", "source", "version"]


def test_variant_keys_are_live(tmp_path):
    """clean keeps, verify checks and a writer requires every key a sample references, variants included."""
    from dataset_cache.clean import preview_clean

    build(tmp_path)
    report = preview_clean(tmp_path)
    assert report.unreferenced == ()
    with CacheWriter(tmp_path) as w, pytest.raises(ValueError, match="not in the cache"):
        w.set_dataset("broken", [Sample("latent-1", ("cond-0",), mask="no-such-mask")])


def test_one_empty_caption_per_dataset(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("l", {"samples": torch.zeros(1, 4, 2, 2)}, kind="latent")
        for k in ("c", "e1", "e2"):
            w.add(k, [[torch.zeros(1, 3, 4), {}]], kind="conditioning")
        with pytest.raises(ValueError, match="different empty captions"):
            w.set_dataset("two", [Sample("l", ("c",), empty_caption="e1"), Sample("l", ("c",), empty_caption="e2")])


@pytest.mark.parametrize("edit, error", [
    (lambda d: d.update(version=4), CacheFormatError),
    (lambda d: d.update(version=3), CacheCorruptError),  # version 3 without its reference column
    (lambda d: d.update(version=3, reference=["x"]), CacheCorruptError),
    (lambda d: d.update(version=3, reference=["", None]), CacheCorruptError),
    (lambda d: d.update(version=3, reference_mirror=["x", None]), CacheCorruptError),
    (lambda d: d.update(mirror=["x"]), CacheCorruptError),
    (lambda d: d.update(mask=[5, None]), CacheCorruptError),
    (lambda d: d.update(empty_caption=7), CacheCorruptError),
    (lambda d: d.update(mirror=["", None]), CacheCorruptError),
])
def test_malformed_variant_columns_are_refused_by_name(tmp_path, edit, error):
    shutil.copytree(GOLDEN, tmp_path / "c")
    (file,) = (tmp_path / "c" / "datasets").iterdir()
    doc = json.loads(file.read_bytes())
    edit(doc)
    file.write_text(json.dumps(doc))
    with pytest.raises(error, match=file.name):
        open_cache(tmp_path / "c").dataset("variants")


if __name__ == "__main__":  # regenerate: never for an existing golden
    regenerate(GOLDEN, build, sys.argv)
