"""The shared-template fast path of skeleton decoding gives exactly what the plain decoder gives."""

import pytest

from dataset_cache.format import skeleton


def plain(text):
    return skeleton.decode(skeleton.loads(text), lambda c, r: ("T", c, r))


def fast(text):
    return skeleton.decode_text(text, lambda c, r: ("T", c, r))


@pytest.mark.parametrize(
    "text",
    [
        '{"samples":{"$tensor":[0,17]}}',
        '[[{"$tensor":[1,3]},{"pooled_output":{"$tensor":[2,3]}}]]',
        '{"a": {"$tensor": [ 0 , 5 ]}, "b": {"$tuple": [1, 2.5, {"$tensor":[0,6]}]}}',
        # a user dict whose key spells the marker: must never be read as a tensor reference
        '{"$dict":{"$tensor":[0,1],"x":{"$tensor":[0,2]}}}',
        # a reference the regex does not recognise (too many digits) takes the exact path
        '{"s":{"$tensor":[0,1234567890123456789]}}',
        '{"s":"{\\"$tensor\\":[0,1]}"}',  # marker text inside a JSON string stays a string
        '{"s":{"$float":"nan"},"t":[null,true,1,1.0]}',
    ],
)
def test_fast_decode_equals_plain_decode(text):
    a, b = plain(text), fast(text)
    assert repr(a) == repr(b)  # repr: nan != nan, and keeps tuple vs list and 1 vs 1.0 visible


def test_templates_are_shared_but_values_are_fresh():
    one = fast('{"samples":{"$tensor":[0,1]}}')
    two = fast('{"samples":{"$tensor":[0,2]}}')
    assert one == {"samples": ("T", 0, 1)} and two == {"samples": ("T", 0, 2)}
    one["samples"] = None
    assert fast('{"samples":{"$tensor":[0,3]}}') == {"samples": ("T", 0, 3)}


def test_malformed_text_still_raises_skeleton_error():
    with pytest.raises(skeleton.SkeletonError):
        fast('{"samples":{"$tensor":[0,1]}')
    with pytest.raises(skeleton.SkeletonError):
        fast('{"samples":{"$bogus":1}}')
