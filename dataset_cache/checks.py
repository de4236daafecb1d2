"""The range check every numeric training setting shares, so each refusal reads the same way and names its field."""

from __future__ import annotations

import math

__all__ = ["check_number"]


def check_number(name: str, value: object, high: float, *, zero: str = "", hint: str = "") -> float:
    """``value`` as a float when it is a finite number (not a bool) from 0 to ``high``; else refuse it.

    ``zero`` says what 0 means (``"no clipping"``), ``hint`` the usual values; both go into the message.

    Raises:
        ValueError: ``"<name> must be a number from 0 (<zero>) to <high>, got <value> (<hint>)"``.
    """
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0.0 <= value <= high):
        raise ValueError(f"{name} must be a number from 0{f' ({zero})' if zero else ''} to {high:g}, got "
                         f"{value!r:.40}{f' ({hint})' if hint else ''}")
    return float(value)
