"""kohya's ``optimizer_args`` text: parsed, checked against an optimizer's constructor, written back."""

from __future__ import annotations

import math

import pytest
import torch

from dataset_cache.lion import Lion
from dataset_cache.optimizer_args import check_optimizer_args, format_optimizer_args, parse_optimizer_args
from dataset_cache.prodigy import Prodigy


def test_kohyas_ways_of_writing_them_parse_to_the_values() -> None:
    assert parse_optimizer_args("") == {} and parse_optimizer_args("  \n ") == {}
    args = parse_optimizer_args('"weight_decay=0.1" "betas=0.9,0.99"\namsgrad=True eps=1e-6 beta3=None '
                                "growth_rate=inf safeguard_warmup=false")
    assert args == {"weight_decay": 0.1, "betas": (0.9, 0.99), "amsgrad": True, "eps": 1e-6, "beta3": None,
                    "growth_rate": math.inf, "safeguard_warmup": False}


@pytest.mark.parametrize(("text", "message"), [
    ("weight_decay", "'weight_decay' is not name=value"),
    ("=0.1", "is not name=value"),
    ("weight_decay=0.1 weight_decay=0.2", "weight_decay is given twice"),
    ("weight_decay=abc", "weight_decay='abc' is not a number"),
    ("betas=0.9,x", "is not a number"),
    ("eps=nan", "is not a number"),
    ("eps=", "is not a number"),
    ("x" * 3000, "at most 2000 characters"),
])
def test_malformed_text_is_refused_naming_the_piece(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_optimizer_args(text)


def test_a_trailing_comma_is_not_a_number() -> None:
    """Not silently one number: ``betas=0.9,`` is a typo for two."""
    with pytest.raises(ValueError, match="betas='0.9,' is not a number"):
        parse_optimizer_args("betas=0.9,")


def test_settings_are_checked_against_the_constructor() -> None:
    check_optimizer_args("AdamW", torch.optim.AdamW, parse_optimizer_args("weight_decay=0 betas=0.8,0.9 amsgrad=True"))
    check_optimizer_args("Prodigy", Prodigy, parse_optimizer_args("d_coef=0.5 beta3=None use_bias_correction=True"))
    check_optimizer_args("Prodigy", Prodigy, parse_optimizer_args("beta3=0.99"))
    refused = [
        ("AdamW", torch.optim.AdamW, "d_coef=2", "AdamW has no setting 'd_coef'; its settings: betas, eps"),
        ("AdamW", torch.optim.AdamW, "lr=1e-4", "lr is the learning_rate input"),
        ("AdamW", torch.optim.AdamW, "foreach=True", "AdamW has no setting 'foreach'"),
        ("AdamW", torch.optim.AdamW, "amsgrad=1", "AdamW's amsgrad takes True or False, got amsgrad=1"),
        ("AdamW", torch.optim.AdamW, "betas=0.9", "AdamW's betas takes 2 numbers separated by commas, got betas=0.9"),
        ("AdamW", torch.optim.AdamW, "weight_decay=True", "AdamW's weight_decay takes a number, got "),
        ("Lion", Lion, "eps=1e-8", "Lion has no setting 'eps'; its settings: betas, weight_decay"),
        ("Prodigy", Prodigy, "beta3=True", "Prodigy's beta3 takes a number or None"),
    ]
    for name, cls, text, message in refused:
        with pytest.raises(ValueError, match=message):
            check_optimizer_args(name, cls, parse_optimizer_args(text))


def test_the_text_written_back_parses_to_the_same_settings() -> None:
    args = parse_optimizer_args("weight_decay=0.1 betas=0.9,0.99 amsgrad=True beta3=None eps=1e-08")
    text = format_optimizer_args(args)
    assert text == "weight_decay=0.1 betas=0.9,0.99 amsgrad=True beta3=None eps=1e-08"
    assert parse_optimizer_args(text) == args
