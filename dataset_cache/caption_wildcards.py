"""Caption wildcards: ``{red|blue} car`` trains as ``red car`` and as ``blue car``, each choice a cached variant.

kohya's ``enable_wildcard`` picks one option of every ``{a|b|c}`` group at random each time a caption is used, which a
cache of text-encoder outputs cannot do (sd-scripts#1750 asks for it). Here every combination of a line's options is
its own caption text, encoded once and keyed by its content; training picks one per epoch uniformly, which is the
same as choosing each group's option uniformly and independently, kohya's draw. An option written twice weighs twice,
as in kohya. ``{{`` and ``}}`` are literal braces. A line with a brace that has no pair is kept as written (and the
report says so), never guessed at.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import product

__all__ = ["expand_wildcards", "wildcard_count", "has_wildcards", "wildcard_notes"]

_Part = str | tuple[str, ...]


def _parts(line: str) -> list[_Part] | None:
    """The line as literal pieces and option groups, or ``None`` when a brace has no pair (or groups nest)."""
    parts: list[_Part] = []
    text: list[str] = []
    i = 0
    while i < len(line):
        if line.startswith("{{", i) or line.startswith("}}", i):
            text.append(line[i])
            i += 2
            continue
        c = line[i]
        if c == "}":
            return None
        if c == "{":
            end, nested = line.find("}", i + 1), line.find("{", i + 1)
            if end < 0 or 0 <= nested < end:
                return None
            parts.append("".join(text))
            text = []
            parts.append(tuple(line[i + 1:end].split("|")))
            i = end + 1
            continue
        text.append(c)
        i += 1
    parts.append("".join(text))
    return parts


def has_wildcards(line: str) -> bool:
    """Whether ``line`` holds an option group with a choice in it (``{a|b}``), braces all paired."""
    parts = _parts(line)
    return parts is not None and any(isinstance(p, tuple) and len(p) > 1 for p in parts)


def wildcard_count(line: str) -> int:
    """How many texts :func:`expand_wildcards` gives for ``line`` (the product of its groups' option counts; 1 for
    a line without groups or with an unpaired brace), computed without making them."""
    parts = _parts(line)
    if parts is None:
        return 1
    return math.prod(len(p) for p in parts if isinstance(p, tuple))


def expand_wildcards(line: str, limit: int) -> tuple[str, ...]:
    """Every text ``line`` stands for: one per combination of its groups' options (first group slowest), with
    ``{{``/``}}`` made single braces; the line itself when a brace has no pair.

    Raises:
        ValueError: the line has more than ``limit`` combinations (checked before any is made).
    """
    parts = _parts(line)
    if parts is None:
        return (line,)
    count = math.prod(len(p) for p in parts if isinstance(p, tuple))
    if count > limit:
        raise ValueError(f"caption line {line[:80]!r} has {count} wildcard combinations, above the limit of {limit}")
    groups = [p if isinstance(p, tuple) else (p,) for p in parts]
    return tuple("".join(choice) for choice in product(*groups))


def wildcard_notes(enabled: bool, captions: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """What the report says about braces in caption lines: groups written while ``wildcards`` is off (encoded as
    written), or, with it on, lines whose braces do not pair (encoded as written). Lines are counted once each."""
    lines = {line for lines in captions for line in lines if "{" in line or "}" in line}
    if enabled:
        unpaired = sorted(line for line in lines if _parts(line) is None)
        if unpaired:
            return (f"{len(unpaired)} caption line(s) have a brace without its pair, so their wildcards are encoded "
                    f"as written (e.g. {unpaired[0][:80]!r}); write {{{{ and }}}} for a literal brace",)
        return ()
    written = sorted(line for line in lines if has_wildcards(line))
    if written:
        return (f"{len(written)} caption line(s) hold {{a|b}} wildcards, encoded as written with the braces (e.g. "
                f"{written[0][:80]!r}); turn wildcards on to train each choice as a caption variant",)
    return ()
