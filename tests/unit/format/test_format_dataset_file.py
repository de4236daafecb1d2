"""A dataset file is JSON anyone can edit: every malformed sample is refused naming the file and the sample.

The columns are checked whole first (C-speed set/min/max) and the samples then built without checking each one
again; only when a column fails does the per-sample loop run, to name the first bad sample. These tests hold the
two paths to the same verdict and the same samples.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_cache.constants import FORMAT_NAME
from dataset_cache.dataset import MAX_REPEATS, DatasetInfo, Sample
from dataset_cache.errors import CacheCorruptError
from dataset_cache.format import dataset_file
from dataset_cache.format.dataset_file import DATASET_VERSION, DATASET_VERSION_REFERENCES, parse_dataset


def _raw(n: int, **columns: Any) -> tuple[bytes, DatasetInfo]:
    doc: dict[str, Any] = {"format": FORMAT_NAME, "version": DATASET_VERSION, "name": "d",
                           "latent": [f"L{i}" for i in range(n)], "captions": [[f"C{i}"] for i in range(n)],
                           "repeats": [1] * n, "source": [f"img{i}.png" for i in range(n)]}
    doc.update(columns)
    return json.dumps(doc).encode(), DatasetInfo("d", "datasets/d.json", n)


def test_a_well_formed_file_gives_the_samples_a_checked_constructor_gives() -> None:
    raw, info = _raw(3, mirror=[None, "M1", None], mask=["K0", None, None], empty_caption="E",
                     captions=[["C0"], ["C1", "C1b"], ["C2"]], repeats=[1, 2, MAX_REPEATS])
    got = parse_dataset("d.json", raw, info)
    assert got == [Sample("L0", ("C0",), 1, "img0.png", None, "K0", "E"),
                   Sample("L1", ("C1", "C1b"), 2, "img1.png", "M1", None, "E"),
                   Sample("L2", ("C2",), MAX_REPEATS, "img2.png", None, None, "E")]
    assert len({hash(s) for s in got}) == 3 and all(type(s.captions) is tuple for s in got)
    with pytest.raises(AttributeError):
        got[0].latent = "X"  # type: ignore[misc]  (still frozen)
    # as compact as a sample built the usual way (a dict given whole would lose the shared keys: +190 bytes each)
    assert sys.getsizeof(vars(got[0])) == sys.getsizeof(vars(Sample("L0", ("C0",), 1, "img0.png", None, "K0", "E")))
    # a file without references stores no reference fields in its samples (the class's None is read instead)
    assert not {"reference", "reference_mirror"} & set(vars(got[0])) and got[0].reference is None


@pytest.mark.parametrize("column, value, why", [
    ("latent", 5, "malformed"),
    ("captions", [], "malformed"),
    ("captions", ["C", 7], "malformed"),
    ("captions", "C", "malformed"),
    ("repeats", 0, "malformed"),
    ("repeats", True, "malformed"),
    ("repeats", 1.0, "malformed"),
    ("repeats", MAX_REPEATS + 1, "above the limit"),
    ("source", 3, "malformed"),
    ("mirror", "", "mirror must be an entry key"),
    ("mirror", 4, "malformed"),
    ("mask", "", "mask must be an entry key"),
    ("mask", ["K"], "malformed"),
])
def test_a_malformed_sample_is_refused_naming_the_file_and_its_number(column: str, value: Any, why: str) -> None:
    n = 4
    good: dict[str, list[Any]] = {"mirror": [None] * n, "mask": [None] * n}
    raw0, _ = _raw(n)
    good.update({k: v for k, v in json.loads(raw0).items() if type(v) is list})
    good[column][2] = value
    raw, info = _raw(n, **good)
    with pytest.raises(CacheCorruptError, match=f"d.json.*sample 2.*{why}"):
        parse_dataset("d.json", raw, info)


def test_an_empty_string_for_the_empty_caption_is_refused() -> None:
    raw, info = _raw(2, empty_caption="")
    with pytest.raises(CacheCorruptError, match="d.json.*sample 0.*empty_caption must be an entry key"):
        parse_dataset("d.json", raw, info)


def test_an_empty_dataset_opens_as_no_samples() -> None:
    raw, info = _raw(0)
    assert parse_dataset("d.json", raw, info) == []


_key = st.one_of(st.text(max_size=3), st.none(), st.integers(-1, 2), st.booleans(), st.lists(st.text(max_size=2),
                                                                                               max_size=2))
_captions = st.one_of(st.lists(st.one_of(st.text(max_size=2), st.integers(0, 1)), max_size=3), st.text(max_size=2),
                      st.none())
_repeats = st.one_of(st.integers(-1, 3), st.sampled_from([MAX_REPEATS, MAX_REPEATS + 1, 1.0, True, "1", None]))


_WILD = (_key, _captions, _repeats, _key, _key, _key, _key, _key)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_column_check_agrees_with_the_per_sample_check(data: st.DataObject) -> None:
    """Where the columns pass the fast check, the per-sample loop accepts every sample and builds equal ones;
    wherever the loop refuses, the fast check refused too (so a malformed file never skips the loop). Each example
    edits up to two values of a valid file: a single odd value is what tells a loose column check."""
    n = data.draw(st.integers(1, 4))
    mirrored = data.draw(st.booleans())  # every sample mirrored, with its reference's mirror
    cols: tuple[list[Any], ...] = ([f"L{i}" for i in range(n)], [[f"C{i}"] for i in range(n)],
                                   [1 + i for i in range(n)], [None] * n,
                                   [f"M{i}" if mirrored else None for i in range(n)], [f"K{i}" for i in range(n)],
                                   [f"R{i}" for i in range(n)], [f"RM{i}" if mirrored else None for i in range(n)])
    empty = data.draw(st.sampled_from(["E", None, ""]))
    for _ in range(data.draw(st.integers(0, 2))):
        c = data.draw(st.integers(0, len(cols) - 1))
        cols[c][data.draw(st.integers(0, n - 1))] = data.draw(_WILD[c])
    try:
        checked: list[Sample] | None = dataset_file._checked_samples("d.json", *cols[:6], empty, *cols[6:])
    except CacheCorruptError:
        checked = None
    if dataset_file._well_formed(*cols[:6], empty) and dataset_file._references_well_formed(
            cols[4], cols[6], cols[7]):
        assert checked is not None
    raw, info = _raw(n, latent=cols[0], captions=cols[1], repeats=cols[2], source=cols[3], mirror=cols[4],
                     mask=cols[5], empty_caption=empty, reference=cols[6], reference_mirror=cols[7],
                     version=DATASET_VERSION_REFERENCES)
    if checked is None:
        with pytest.raises(CacheCorruptError):
            parse_dataset("d.json", raw, info)
    else:
        assert parse_dataset("d.json", raw, info) == checked
