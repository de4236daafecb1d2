"""dataset_cache.checks: one refusal for every numeric training setting out of its range, naming the field."""

from __future__ import annotations

import math

import pytest

from dataset_cache.checks import check_number


@pytest.mark.parametrize("value", [0, 0.0, 0.25, 1, 2.0])
def test_numbers_in_range_come_back_as_floats(value: float) -> None:
    out = check_number("x", value, 2.0)
    assert out == value and type(out) is float


@pytest.mark.parametrize("value", [-1e-9, 2.0000001, math.nan, math.inf, -math.inf, True, False, "1", None, [1]])
def test_anything_else_is_refused_naming_the_field_and_the_range(value: object) -> None:
    with pytest.raises(ValueError, match=r"^x must be a number from 0 to 2, got "):
        check_number("x", value, 2.0)


def test_the_message_says_what_zero_means_and_the_usual_values() -> None:
    with pytest.raises(ValueError) as info:
        check_number("max_grad_norm", -1.0, 1e4, zero="no clipping", hint="1.0 is usual")
    assert str(info.value) == "max_grad_norm must be a number from 0 (no clipping) to 10000, got -1.0 (1.0 is usual)"
