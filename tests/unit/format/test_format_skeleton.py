"""Skeleton encoding: exact JSON round trips and "not storable" errors with paths."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataset_cache.constants import MAX_SKELETON_DEPTH
from dataset_cache.errors import UnstorableValueError
from dataset_cache.format import skeleton


def roundtrip(value):
    tensors = []

    def on_tensor(t, where):
        tensors.append(t)
        return [0, len(tensors) - 1]

    text = skeleton.dumps(skeleton.encode(value, "v", on_tensor))
    return skeleton.decode(skeleton.loads(text), lambda c, r: tensors[r]), text


@pytest.mark.parametrize("value", [
    None, True, False, 0, -5, 2**63 - 1, -(2**63), 1.0, -0.0, 1e300, "", "héllo \u2603 \ud800", [], (), {},
    [1, 1.0, "1"], (1, (2, [3])), {"a": {"b": [None]}}, {"$tensor": [0, 0]}, {"$x": 1, "y": (2,)},
    {"": 1}, [[{"$dict": {"$": 1}}]],
])
def test_plain_values_round_trip_exactly(value):
    got, _ = roundtrip(value)
    assert got == value
    assert repr(got) == repr(value)  # type-exact: tuple vs list, 1.0 vs 1


def test_non_finite_floats_round_trip():
    got, text = roundtrip([math.nan, math.inf, -math.inf])
    assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf
    assert "NaN" not in text and "Infinity" not in text


def test_tensor_leaves_become_refs():
    t = torch.ones(2)
    got, text = roundtrip([[t, {"pooled_output": t}]])
    assert got[0][0] is t and got[0][1]["pooled_output"] is t
    assert json.loads(text) == [[{"$tensor": [0, 0]}, {"pooled_output": {"$tensor": [0, 1]}}]]


class HookGroup:
    pass


@pytest.mark.parametrize("value, where, type_name", [
    ([[torch.ones(1), {"hooks": HookGroup()}]], "conditioning[0][1]['hooks']", "HookGroup"),
    ({1: 2}, "conditioning[1]", "dict key of type int"),
    ([{1, 2}], "conditioning[0]", "set"),
    ([2**63], "conditioning[0]", "int"),
    ([torch.ones(2, dtype=torch.complex64)], "conditioning[0]", "Tensor of dtype torch.complex64"),
])
def test_unstorable_values_name_their_path(value, where, type_name):
    with pytest.raises(UnstorableValueError, match=r"is not storable") as info:
        skeleton.encode(value, "conditioning", lambda t, w: [0, 0])
    assert info.value.where == where
    assert info.value.type_name == type_name
    assert str(info.value).startswith(f"{where}: {type_name} is not storable")


def test_subclasses_are_refused_with_a_hint():
    class MyInt(int):
        pass

    with pytest.raises(UnstorableValueError, match="convert it to a plain int"):
        skeleton.encode({"x": MyInt(3)}, "v", lambda t, w: [0, 0])


def test_depth_limit_on_encode_and_decode():
    deep = []
    for _ in range(MAX_SKELETON_DEPTH + 2):
        deep = [deep]
    with pytest.raises(UnstorableValueError, match="nested deeper"):
        skeleton.encode(deep, "v", lambda t, w: [0, 0])
    text = "[" * (MAX_SKELETON_DEPTH + 5) + "]" * (MAX_SKELETON_DEPTH + 5)
    with pytest.raises(skeleton.SkeletonError, match="deeper"):
        skeleton.decode(skeleton.loads(text), lambda c, r: None)
    with pytest.raises(skeleton.SkeletonError):
        skeleton.loads("[" * 200_000)


@pytest.mark.parametrize("text", [
    '{"$tensor": [0]}', '{"$tensor": [0, true]}', '{"$tensor": "x"}', '{"$tuple": 1}', '{"$float": "NaN"}',
    '{"$dict": []}', '{"$what": 1}', '{"$tuple": [], "b": 1}', "NaN", "[Infinity]", "{",
])
def test_malformed_skeletons_raise_skeleton_error(text):
    with pytest.raises(skeleton.SkeletonError):
        skeleton.decode(skeleton.loads(text), lambda c, r: None)


# ------------------------------------------------------------------------------------------ the lean encoder
def _both(value):
    """The skeleton text and tensor order from the checked encoder and from the lean one (None: NotLean)."""
    checked, lean = [], []
    text = skeleton.dumps(skeleton.encode(value, "v", lambda t, w: checked.append(t) or [0, len(checked) - 1]))
    try:
        lean_text = skeleton.dumps(skeleton.encode_lean(value, lambda t: lean.append(t) or [0, len(lean) - 1]))
    except skeleton.NotLean:
        return text, checked, None, None
    return text, checked, lean_text, lean


_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.sampled_from([torch.ones(2), torch.zeros((), dtype=torch.bfloat16),
                                          torch.arange(6, dtype=torch.int16).view(2, 3).t()]),
)
_values = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.text(alphabet="$ab", max_size=3), inner, max_size=4),
), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_lean_encoder_writes_exactly_what_the_checked_one_writes(value):
    text, checked, lean_text, lean = _both(value)
    assert lean_text is not None, "an ordinary value fell back to the checked encoder"
    assert lean_text == text
    assert [id(t) for t in lean] == [id(t) for t in checked]  # same tensors, same document order


@pytest.mark.parametrize("value", [
    [[torch.ones(1), {"hooks": HookGroup()}]], {1: 2}, {"$a": 1, 2: 3}, [{1, 2}], [2**63], [-(2**63) - 1],
    [torch.ones(2, dtype=torch.complex64)], torch.ones(2).to_sparse(), [torch.empty(2, device="meta")],
    {"x": type("MyInt", (int,), {})(3)},
    torch.nn.Parameter(torch.ones(2)),
])
def test_lean_encoder_defers_whatever_is_not_ordinary_to_the_checked_one(value):
    with pytest.raises(skeleton.NotLean):
        skeleton.encode_lean(value, lambda t: [0, 0])


def test_lean_encoder_respects_the_depth_limit():
    deep = torch.ones(1)
    for _ in range(MAX_SKELETON_DEPTH + 1):
        deep = [deep]
    with pytest.raises(skeleton.NotLean):
        skeleton.encode_lean(deep, lambda t: [0, 0])
    with pytest.raises(UnstorableValueError, match="nested deeper"):
        skeleton.encode(deep, "v", lambda t, w: [0, 0])
