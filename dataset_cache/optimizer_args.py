"""An optimizer's settings written as kohya's ``optimizer_args``: ``weight_decay=0.1 betas=0.9,0.99 d_coef=0.8``.

A kohya, musubi-tuner or OneTrainer recipe tunes its optimizer beyond the learning rate (AdamW's weight decay and
betas, Prodigy's ``d_coef``); users paste those settings as they are written there. The text is parsed here and
checked against the optimizer's own constructor (its keyword arguments, the kind of each default), so a typo is named
with the settings that exist before anything loads, and the values reach the optimizer exactly as the constructor
takes them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_ARGS_CHARS", "IMPLEMENTATION_ARGS", "OptimizerArg", "parse_optimizer_args", "check_optimizer_args",
           "format_optimizer_args"]

OptimizerArg = bool | float | tuple[float, ...] | None
MAX_ARGS_CHARS = 2000
"""The longest ``optimizer_args`` accepted: a recipe's settings take a line; past this it is not settings."""
IMPLEMENTATION_ARGS = frozenset({"params", "lr", "foreach", "fused", "capturable", "differentiable", "maximize"})
"""Constructor arguments that are not a recipe's to set: the parameters, the learning rate (its own input and
schedule), and torch's implementation switches (the trainer picks those)."""


def parse_optimizer_args(text: object) -> dict[str, OptimizerArg]:
    """``name=value`` pairs separated by spaces or lines, each optionally in quotes (as on kohya's command line or
    in its TOML list); a value is ``True``/``False``, ``None``, a number (``inf`` too) or numbers separated by commas
    (a tuple such as ``betas``). Empty text: no settings.

    Raises:
        ValueError: naming ``optimizer_args``, the piece and what it should be.
    """
    if not isinstance(text, str) or len(text) > MAX_ARGS_CHARS:
        raise ValueError(f"optimizer_args must be text of at most {MAX_ARGS_CHARS} characters, got {text!r:.60}")
    out: dict[str, OptimizerArg] = {}
    for piece in text.split():
        piece = piece.strip("\"'")
        name, sep, value = piece.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"optimizer_args: {piece!r:.60} is not name=value (e.g. weight_decay=0.1 betas=0.9,0.99)")
        if name in out:
            raise ValueError(f"optimizer_args: {name} is given twice")
        out[name] = _value(name, value.strip())
    return out


def _value(name: str, text: str) -> OptimizerArg:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        numbers = tuple(float(part) for part in text.split(","))
    except ValueError:
        numbers = ()
    if not numbers or any(math.isnan(n) for n in numbers):
        raise ValueError(f"optimizer_args: {name}={text!r:.40} is not a number, True/False, None, or numbers "
                         "separated by commas")
    return numbers[0] if len(numbers) == 1 and "," not in text else numbers


def check_optimizer_args(optimizer: str, cls: type, args: Mapping[str, OptimizerArg]) -> None:
    """Refuse a setting ``cls`` (the optimizer named ``optimizer``) does not take, or a value of another kind than
    its default (a flag for a flag, as many numbers as a tuple default has, a number for a number).

    Raises:
        ValueError: naming ``optimizer_args``, the setting, and the settings ``optimizer`` has.
    """
    params = {n: p for n, p in inspect.signature(cls).parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    known = [n for n in params if n not in IMPLEMENTATION_ARGS]
    for name, value in args.items():
        if name == "lr":
            raise ValueError("optimizer_args: lr is the learning_rate input (and lr_schedule), not an optimizer "
                             "setting here")
        if name not in known:
            raise ValueError(f"optimizer_args: {optimizer} has no setting {name!r}; its settings: {', '.join(known)}")
        _check_kind(optimizer, name, value, params[name].default)


def _check_kind(optimizer: str, name: str, value: OptimizerArg, default: Any) -> None:
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "True or False"
    elif isinstance(default, tuple):
        ok = isinstance(value, tuple) and len(value) == len(default)
        want = f"{len(default)} numbers separated by commas"
    elif default is None:
        ok, want = value is None or isinstance(value, float), "a number or None"
    else:
        ok, want = isinstance(value, float), "a number"
    if not ok:
        raise ValueError(f"optimizer_args: {optimizer}'s {name} takes {want}, got "
                         f"{format_optimizer_args({name: value})}")


def format_optimizer_args(args: Mapping[str, OptimizerArg]) -> str:
    """``args`` as the text they were parsed from (``name=value`` separated by spaces; a tuple's numbers by commas):
    what the summary and the LoRA's metadata say."""
    def text(value: OptimizerArg) -> str:
        if isinstance(value, tuple):
            return ",".join(f"{v:g}" for v in value)
        return f"{value:g}" if isinstance(value, float) else str(value)
    return " ".join(f"{name}={text(value)}" for name, value in args.items())
