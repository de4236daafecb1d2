"""dataset_cache.lr_schedule: each step's learning rate, a pure function of the step's number over the whole
training, so a continued run sets the rates of the run that never stopped."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataset_cache.lr_schedule import LR_SCHEDULES, LrSchedule

_ULP_SLACK = 1e-12
"""Rounding of one ``cos`` and a few float operations on values of order 1: about 1e-16 each; 1e-12 leaves room."""


def test_constant_without_warmup_is_the_learning_rate_throughout() -> None:
    schedule = LrSchedule("constant", 3e-4, 0, 10)
    assert schedule.is_constant and LrSchedule("constant", 3e-4, 1, 10).is_constant
    assert [schedule.rate(i) for i in range(12)] == [3e-4] * 12
    assert not LrSchedule("constant", 3e-4, 2, 10).is_constant and not LrSchedule("cosine", 3e-4, 0, 10).is_constant


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_the_warmup_rises_in_a_line_from_its_first_step_to_the_full_rate(kind: str) -> None:
    schedule = LrSchedule(kind, 1.0, 4, 20)
    assert [schedule.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the first step already trains
    assert schedule.factor(4) == 1.0  # the decay starts at the full rate


@given(st.sampled_from(["cosine", "linear"]), st.integers(0, 50), st.integers(1, 400))
def test_a_decay_falls_from_the_full_rate_and_never_reaches_zero(kind: str, warmup: int, decay: int) -> None:
    schedule = LrSchedule(kind, 1.0, warmup, warmup + decay)
    factors = [schedule.factor(i) for i in range(warmup, warmup + decay)]
    assert factors[0] == 1.0
    assert all(a >= b for a, b in zip(factors, factors[1:]))
    assert all(0.0 < f <= 1.0 for f in factors)  # no step wasted at a rate of 0
    past = schedule.factor(warmup + decay + 5)
    assert past == factors[-1]  # a step past the end takes the last step's rate


@given(st.integers(0, 20), st.integers(2, 300))
def test_cosine_is_half_a_cosine_and_linear_a_straight_line(warmup: int, decay: int) -> None:
    cosine = LrSchedule("cosine", 1.0, warmup, warmup + decay)
    linear = LrSchedule("linear", 1.0, warmup, warmup + decay)
    for k in range(decay):
        assert cosine.factor(warmup + k) == pytest.approx((1 + math.cos(math.pi * k / decay)) / 2, abs=_ULP_SLACK)
        if k:  # symmetric about the middle of the decay: f(k) + f(decay - k) == 1
            assert cosine.factor(warmup + k) + cosine.factor(warmup + decay - k) == pytest.approx(1.0, abs=_ULP_SLACK)
        assert linear.factor(warmup + k) == pytest.approx(1 - k / decay, abs=_ULP_SLACK)
    drops = [linear.factor(warmup + k) - linear.factor(warmup + k + 1) for k in range(decay - 1)]
    assert max(drops) - min(drops) <= _ULP_SLACK


def test_a_warmup_as_long_as_the_training_never_decays() -> None:
    schedule = LrSchedule("cosine", 2.0, 8, 8)
    assert [schedule.rate(i) for i in range(10)] == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.0, 2.0]
    assert LrSchedule("linear", 1.0, 0, 0).factor(0) == 1.0  # no steps: nothing to divide by


def test_the_rate_of_a_step_does_not_depend_on_where_a_run_stopped() -> None:
    """What makes a continued run exact: a run of 10 steps after 30 trained ones sets the rates steps 30-39 of one
    40-step training set."""
    whole = LrSchedule("cosine", 1e-4, 5, 40)
    continued = LrSchedule("cosine", 1e-4, 5, 30 + 10)
    assert [continued.rate(30 + i) for i in range(10)] == [whole.rate(30 + i) for i in range(10)]


@pytest.mark.parametrize(("args", "message"), [
    (("exponential", 1e-4, 0, 10), "unknown lr_schedule 'exponential'; use one of constant, cosine, linear"),
    (("cosine", 0.0, 0, 10), "learning_rate must be a positive number"),
    (("cosine", float("nan"), 0, 10), "learning_rate must be a positive number"),
    (("cosine", 1e-4, -1, 10), "warmup_steps must be a whole number"),
    (("cosine", 1e-4, True, 10), "warmup_steps must be a whole number"),
    (("cosine", 1e-4, 0, 2.5), "total_steps must be a whole number"),
])
def test_bad_settings_are_refused_naming_the_field(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LrSchedule(*args)
    with pytest.raises(ValueError, match="a step number is 0 or more"):
        LrSchedule("cosine", 1e-4, 0, 10).factor(-1)


def test_as_dict_round_trips_and_from_dict_refuses_anything_else() -> None:
    schedule = LrSchedule("linear", 5e-4, 3, 120)
    assert LrSchedule.from_dict(schedule.as_dict()) == schedule
    for bad in ({"kind": "linear"}, {**schedule.as_dict(), "extra": 1}, {**schedule.as_dict(), "learning_rate": "1"},
                [1, 2]):
        with pytest.raises(ValueError):
            LrSchedule.from_dict(bad)  # type: ignore[arg-type]


def test_describe_names_the_kind_rate_length_and_warmup() -> None:
    assert LrSchedule("cosine", 1e-4, 100, 1000).describe() == "cosine from 0.0001 over 1000 steps, 100 warm-up"
    assert LrSchedule("constant", 5e-4, 10, 1000).describe() == "constant at 0.0005, 10 warm-up"
    assert LrSchedule("linear", 5e-4, 0, 20).describe() == "linear from 0.0005 over 20 steps"
