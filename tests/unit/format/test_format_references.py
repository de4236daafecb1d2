"""Dataset files with reference images (edit models): version 3 of the dataset file.

A dataset without references must still be written as version 2 or 1, exactly as before; a committed cache with a
version-3 dataset (``data/v1-references``) must stay readable and be written again exactly, and its reference keys
are live (kept by clean, required by a writer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter
from dataset_cache.format.dataset_file import DATASET_VERSION_REFERENCES
from support.goldens import assert_golden_reads, assert_writer_reproduces, dataset_doc, regenerate

GOLDEN = Path(__file__).parent / "data" / "v1-references"


def reference_entries() -> dict:
    ar = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    return {
        "latent-0": {"samples": ar.half()},
        "latent-0-mirror": {"samples": ar.flip(-1).half()},
        "latent-1": {"samples": (ar + 1).half()},
        "reference-0": {"samples": (ar * 2).half()},
        "reference-0-mirror": {"samples": (ar * 2).flip(-1).half()},
        "cond-0": [[ar.reshape(1, 6, 4).bfloat16(), {"guidance": 2.5}]],
    }


def reference_samples() -> list[Sample]:
    return [
        Sample("latent-0", ("cond-0",), 2, "a.png", mirror="latent-0-mirror", reference="reference-0",
               reference_mirror="reference-0-mirror"),
        Sample("latent-1", ("cond-0",), 1, "b.png", reference="latent-0"),  # another sample's image as reference
        Sample("latent-0", ("cond-0",), 1, "c.png"),  # no reference
    ]


def build(root: Path) -> None:
    with CacheWriter(root) as w:
        for k, v in reference_entries().items():
            w.add(k, v, kind="conditioning" if k.startswith("cond") else "latent", name=k)
        w.set_dataset("edits", reference_samples(), info={"note": "references golden"})


def test_golden_references_cache_is_readable(same):
    assert_golden_reads(GOLDEN, reference_entries(), "edits", reference_samples(), same)
    assert dataset_doc(GOLDEN)["version"] == DATASET_VERSION_REFERENCES


def test_writer_still_produces_the_golden_reference_files(tmp_path):
    assert_writer_reproduces(build, tmp_path, GOLDEN)


def test_reference_keys_are_live(tmp_path):
    """clean keeps, and a writer requires, every reference key a sample names."""
    from dataset_cache.clean import preview_clean

    build(tmp_path)
    assert preview_clean(tmp_path).unreferenced == ()
    with CacheWriter(tmp_path) as w, pytest.raises(ValueError, match="not in the cache"):
        w.set_dataset("broken", [Sample("latent-1", ("cond-0",), reference="no-such-reference")])


def test_a_dataset_without_references_keeps_its_version(tmp_path):
    with CacheWriter(tmp_path) as w:
        for k, v in reference_entries().items():
            w.add(k, v, kind="conditioning" if k.startswith("cond") else "latent")
        w.set_dataset("plain", [Sample("latent-0", ("cond-0",), mirror="latent-0-mirror")])
    doc = dataset_doc(tmp_path)
    assert doc["version"] == 2 and "reference" not in doc and "reference_mirror" not in doc


if __name__ == "__main__":  # regenerate: never for an existing golden
    regenerate(GOLDEN, build, sys.argv)
