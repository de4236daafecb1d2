"""``train_layers`` patterns (``dataset_cache.layer_filter``): parsing, choosing, refusals."""

from __future__ import annotations

import pytest

from dataset_cache.layer_filter import MAX_TRAIN_LAYERS_CHARS, LayerFilter

NAMES = [
    "diffusion_model.input_blocks.1.1.proj_in",
    "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q",
    "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k",
    "diffusion_model.input_blocks.1.1.transformer_blocks.0.norm1",
    "diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_v",
    "diffusion_model.out.2",
]


def test_empty_text_trains_every_layer() -> None:
    for text in ("", " ", ",\n ,"):
        f = LayerFilter.parse(text)
        assert f.everything and f.select(NAMES) == NAMES and f.text() == "" and f.unmatched(NAMES) == []


def test_plain_patterns_choose_and_minus_patterns_leave_out() -> None:
    f = LayerFilter.parse(" attn ,\n-attn1,input_blocks, attn")  # spaces, new lines and repeats
    assert (f.include, f.exclude) == (("attn", "input_blocks"), ("attn1",))
    assert f.select(NAMES) == [NAMES[0], NAMES[2], NAMES[3], NAMES[4]]
    assert f.text() == "attn, input_blocks, -attn1" and LayerFilter.parse(f.text()) == f
    only_out = LayerFilter.parse("-norm, - out.")
    assert only_out.exclude == ("norm", "out.") and only_out.select(NAMES) == NAMES[:3] + [NAMES[4]]


def test_patterns_in_no_name_are_reported_with_their_sign() -> None:
    assert LayerFilter.parse("attn2, atn1, -nrom").unmatched(NAMES) == ["atn1", "-nrom"]


def test_a_filter_choosing_nothing_is_refused_quoting_names_from_the_whole_model() -> None:
    with pytest.raises(ValueError) as err:
        LayerFilter.parse("double_blocks").select(NAMES)
    message = str(err.value)
    assert message.startswith("train_layers 'double_blocks' selects none of the model's 6 layers")
    assert f"'{NAMES[0]}'" in message and f"'{NAMES[-1]}'" in message and "leave train_layers empty" in message
    assert LayerFilter.parse("attn2").select([]) == []  # a model without layers: nothing to refuse


@pytest.mark.parametrize(("text", "match"), [
    ("attn, -", "train_layers pattern '-' leaves out nothing"),
    ("attn, -  ", "train_layers pattern '-' leaves out nothing"),
    ("at\ttn", "control character"),
    ("a" * (MAX_TRAIN_LAYERS_CHARS + 1), f"at most {MAX_TRAIN_LAYERS_CHARS}"),
    (5, "train_layers must be text"),
    (None, "train_layers must be text"),
])
def test_bad_text_is_refused_naming_the_input(text: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LayerFilter.parse(text)


def test_a_prefix_copied_from_full_keys_is_taken_off_the_patterns() -> None:
    f = LayerFilter.parse("diffusion_model.input_blocks.1, attn2, "
                          "-diffusion_model.input_blocks.1.1.transformer_blocks.0.norm1")
    short = f.without_prefix("diffusion_model.")
    assert (short.include, short.exclude) == (("input_blocks.1", "attn2"),
                                              ("input_blocks.1.1.transformer_blocks.0.norm1",))
    names = [n.removeprefix("diffusion_model.") for n in NAMES]
    assert short.select(names) == [names[0], names[1], names[2], names[4]]
    # a pattern that is the prefix alone stays as written (it chooses nothing, and is noted as such)
    assert LayerFilter.parse("diffusion_model.").without_prefix("diffusion_model.").include == ("diffusion_model.",)
