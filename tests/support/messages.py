"""Telling an error message written for a user from a bare Python one.

The pack's nodes must say, in every error they raise, which input is wrong, what its value is and what to do. A
message that Python produced on its own (``KeyError: 'x'``, ``'NoneType' object has no attribute 'shape'``, ``list
index out of range``) says none of that: it means an input reached code that did not check it. The e2e suite
collects every error the pack's nodes report over HTTP (:data:`support.client.SEEN_NODE_ERRORS`) and refuses any
that :func:`why_bare` flags.
"""

from __future__ import annotations

import re

__all__ = ["BARE_TYPES", "why_bare"]

BARE_TYPES = frozenset({
    "KeyError", "IndexError", "AttributeError", "TypeError", "ZeroDivisionError", "NameError", "UnboundLocalError",
    "AssertionError", "StopIteration", "RecursionError", "NotImplementedError", "OverflowError", "UnicodeDecodeError",
    "UnicodeEncodeError", "LookupError", "ArithmeticError", "SystemError",
})
"""Built-in exceptions the pack never raises on purpose: seen unqualified in an error, they escaped from Python."""
_PYTHON_PHRASES = (
    r"object has no attribute", r"is not subscriptable", r"index out of range", r"division by zero",
    r"unsupported operand type", r"not enough values to unpack", r"too many values to unpack",
    r"object is not callable", r"object is not iterable", r"invalid literal for", r"takes \d+ positional argument",
    r"got an unexpected keyword argument", r"missing \d+ required positional argument", r"'NoneType'",
    r"referenced before assignment", r"cannot be interpreted as an integer", r"can't multiply sequence",
    r"^\s*'[^']*'\s*$", r"^\s*\d+\s*$",
)


def why_bare(exception_type: str, message: str) -> str | None:
    """Why ``message`` (raised as ``exception_type``) is not written for a user, or None when it is.

    ``exception_type`` is ComfyUI's ``exception_type`` (a module-qualified name for the pack's own exceptions, the
    bare name for built-ins); validation errors pass an empty type.
    """
    kind = exception_type.strip()
    if kind in BARE_TYPES:
        return f"a built-in {kind} escaped"
    for phrase in _PYTHON_PHRASES:
        if re.search(phrase, message):
            return f"reads like Python's own message ({phrase!r})"
    if len(message.split()) < 4:
        return "too short to name the input, its value and what to do"
    return None
