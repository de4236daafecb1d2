"""Caption lines → the texts that are encoded: the limits on them, kohya-style tag shuffles and tag dropout (with
``keep_tokens`` or ``keep_tokens_separator``), wildcards (:mod:`.caption_wildcards`), and the report's notes.

Kept apart from the planning of sources because what a caption line becomes is one rule shared by images and clips
(and by the settings, which validate against its limits); every text this module gives is keyed as it is, so a
changed rule here changes conditioning keys.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import xxhash

from .caption_wildcards import expand_wildcards, wildcard_count
from .keys import PlanKeys

if TYPE_CHECKING:  # encode_jobs imports this module's limits and shuffles
    from .encode_settings import EncodeSettings

__all__ = [
    "MAX_CAPTION_CHARS",
    "CAPTION_VARIANTS_NOTE",
    "MAX_CAPTION_VARIANTS",
    "MAX_SHUFFLE_VARIANTS",
    "MAX_KEEP_TOKENS",
    "tag_orders",
    "shuffle_tags",
    "drop_tags",
    "without_separator",
    "MAX_TAG_DROPOUT",
    "MAX_SEPARATOR_CHARS",
    "too_many_variants",
    "caption_keys",
    "shuffle_notes",
    "separator_notes",
    "caption_notes",
]

MAX_CAPTION_CHARS = 2000
"""Characters of one caption line that are encoded; the rest is cut off, with a note naming the file. kohya's
longest setting is 225 CLIP tokens (about 1,000 characters of English); a 240 KB line (169k tokens) used to take
the server down inside the text encoder."""

CAPTION_VARIANTS_NOTE = 32
"""Caption lines (variants) of one image above which the report says so: each line is encoded on its own."""

MAX_CAPTION_VARIANTS = 256
"""Caption variants of one image (its lines, times the tag shuffles of each) above which the image is left out as a
failure naming its caption file (a file of thousands of lines is a log or a list pasted by mistake, and each
variant would be encoded)."""

MAX_SHUFFLE_VARIANTS = 64
"""Shuffled-tag variants per caption line: each is a conditioning to encode and store (a few MB each for large
text encoders), and past a few dozen epochs more variants add nothing the sampler would use."""

MAX_KEEP_TOKENS = 255

MAX_SEPARATOR_CHARS = 16
"""The longest ``keep_tokens_separator`` (kohya's examples use ``|||``)."""

MAX_TAG_DROPOUT = 0.9
"""The largest tag dropout: past it a caption keeps almost no tag (and 1 would train the empty caption, which
``caption_dropout`` does on purpose)."""


_DRAWS_PER_VARIANT = 64
"""Seeded draws per variant before the distinct orders still missing are taken in enumeration order (reached only
by lines with few orders, where random draws keep hitting the ones already chosen)."""


def _split_tags(text: str) -> list[str]:
    """``text``'s tags split on ``,``, stripped, empty ones dropped."""
    return [t for t in (part.strip() for part in text.split(",")) if t]


def _tags(line: str, keep_tokens: int, separator: str = "") -> tuple[list[str], list[str], list[str]]:
    """The line's tags (see :func:`_split_tags`) as the ones kept in front, the ones that move, the ones kept at the
    end. With ``separator`` in the line (kohya's ``keep_tokens_separator``): the tags before its first occurrence,
    between it and a second one, after the second (``keep_tokens`` is then not used); otherwise the first
    ``keep_tokens`` tags and the rest, none at the end."""
    if separator and separator in line:
        head, _, rest = line.partition(separator)
        middle, _, tail = rest.partition(separator)
        return _split_tags(head), _split_tags(middle), _split_tags(tail.replace(separator, ","))
    tags = _split_tags(line)
    return tags[:keep_tokens], tags[keep_tokens:], []


def without_separator(line: str, separator: str) -> str:
    """``line`` unshuffled with ``separator`` taken out: its tags joined with ``", "`` (the separator is a marker for
    the shuffle, never text to encode)."""
    return ", ".join(t for part in _tags(line, 0, separator) for t in part)


def tag_orders(line: str, keep_tokens: int = 0, limit: int = MAX_SHUFFLE_VARIANTS + 1, separator: str = "") -> int:
    """How many distinct orders the shuffled tags of ``line`` have (repeated tags counted once per order), capped
    at ``limit``: 1 means the line cannot be shuffled (one tag to move or none, e.g. ``keep_tokens`` keeps all)."""
    rest = _tags(line, keep_tokens, separator)[1]
    n = math.factorial(len(rest))
    for count in Counter(rest).values():
        n //= math.factorial(count)
    return min(n, limit)


def _distinct_orders(rest: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Every distinct order of ``rest`` (a multiset), lazily, in lexicographic order of first appearance."""
    first = {t: i for i, t in reversed(list(enumerate(rest)))}
    perm = sorted(first[t] for t in rest)
    while True:
        yield tuple(rest[i] for i in perm)
        k = next((k for k in range(len(perm) - 2, -1, -1) if perm[k] < perm[k + 1]), -1)
        if k < 0:
            return
        j = next(j for j in range(len(perm) - 1, k, -1) if perm[j] > perm[k])
        perm[k], perm[j] = perm[j], perm[k]
        perm[k + 1:] = reversed(perm[k + 1:])


def _orders(line: str, variants: int, keep_tokens: int, separator: str = ""
            ) -> tuple[list[str], list[tuple[str, ...]], list[str]]:
    """The line's tags kept in front, up to ``variants`` distinct orders of the ones that move (see
    :func:`shuffle_tags`), and the tags kept at the end."""
    fixed, rest, tail = _tags(line, keep_tokens, separator)
    own = tuple(rest)
    orders = tag_orders(line, keep_tokens, variants + 1, separator)
    chosen: list[tuple[str, ...]] = []
    if orders - 1 < variants:  # every order, the shuffled ones first
        every = list(_distinct_orders(rest))
        return fixed, [o for o in every if o != own] + [own], tail
    seen = {own}
    for i in range(variants * _DRAWS_PER_VARIANT):
        drawn = list(rest)
        random.Random(xxhash.xxh64_intdigest(f"{i}\0{line}".encode("utf-8", "surrogatepass"))).shuffle(drawn)
        if tuple(drawn) not in seen:
            seen.add(tuple(drawn))
            chosen.append(tuple(drawn))
            if len(chosen) == variants:
                break
    for order in _distinct_orders(rest):  # draws kept repeating (few orders): the rest in enumeration order
        if len(chosen) == variants:
            break
        if order not in seen:
            seen.add(order)
            chosen.append(order)
    return fixed, chosen, tail


def shuffle_tags(line: str, variants: int, keep_tokens: int = 0, separator: str = "") -> tuple[str, ...]:
    """Return up to ``variants`` shuffled-tag versions of one caption line (kohya's ``shuffle_caption`` with
    ``keep_tokens``), before prefix and suffix: distinct orders, none the line's own order where the tags allow.

    The line is split on ``,``; each tag is stripped and empty tags dropped; the first ``keep_tokens`` tags stay
    in place and the rest are shuffled; tags are joined with ``", "``. Draw ``i`` is an order shuffled by a private
    ``random.Random`` seeded with the xxh64 of ``"<i>\\0<line>"`` (UTF-8), so the texts depend on the line alone:
    the same on every machine and run, and a changed line changes only its own variants. Draws ``0, 1, 2, ...``
    are taken in turn, skipping an order already taken and the line's own order, until ``variants`` are taken: a
    line whose first ``variants`` draws were distinct and shuffled gives the texts it gave before this rule (so
    its conditionings stay cached). A line with fewer shuffled orders than ``variants`` (:func:`tag_orders`) gives
    every order it has, its own last: fewer texts (one for a line that cannot be shuffled). With ``separator`` in
    the line, the tags before it stay in front and those after a second one at the end (:func:`_tags`).
    """
    fixed, chosen, tail = _orders(line, variants, keep_tokens, separator)
    return tuple(", ".join([*fixed, *order, *tail]) for order in chosen)


def _dropped_in(line: str, position: int, variants: int, rate: float) -> set[int]:
    """Which of the ``variants`` leave out the movable tag at ``position``: ``rate × variants`` of them, the
    fraction rounded up or down by a seeded draw (so its expectation is exact), the variants chosen at random."""
    seed = xxhash.xxh64_intdigest(f"drop\0{position}\0{variants}\0{rate:.4f}\0{line}".encode("utf-8",
                                                                                          "surrogatepass"))
    rng = random.Random(seed)
    share = rate * variants
    count = math.floor(share) + (1 if rng.random() < share - math.floor(share) else 0)
    return set(rng.sample(range(variants), count))


def drop_tags(line: str, variants: int, keep_tokens: int, rate: float, separator: str = "") -> tuple[str, ...]:
    """Return ``variants`` versions of one caption line, each shuffled and with tags left out (kohya's
    ``shuffle_caption`` with ``caption_tag_dropout_rate``), before prefix and suffix.

    Version ``i`` takes the ``i``-th order of :func:`shuffle_tags` (cycling when the line has fewer) and leaves out
    the movable tags whose draws chose it: each tag after the first ``keep_tokens`` is left out of ``rate × variants``
    versions, rounded by a seeded draw, the versions chosen at random per tag (:func:`_dropped_in`, seeded by the
    line, the tag's place in it, ``variants`` and ``rate``). So every tag is missing from a ``rate`` share of the
    versions as kohya drops it in a ``rate`` share of steps, even with few versions, where independent draws would
    often drop nothing. Versions may repeat (a line of one tag has two texts): each is a draw, so repeats weigh.
    """
    fixed, orders, tail = _orders(line, variants, keep_tokens, separator)
    rest = _tags(line, keep_tokens, separator)[1]
    dropped = [_dropped_in(line, j, variants, rate) for j in range(len(rest))]
    out = []
    for i in range(variants):
        drop = Counter(rest[j] for j in range(len(rest)) if i in dropped[j])
        kept = []
        for tag in orders[i % len(orders)]:
            if drop[tag]:
                drop[tag] -= 1
            else:
                kept.append(tag)
        out.append(", ".join([*fixed, *kept, *tail]))
    return tuple(out)


def _line_variants(line: str, settings: EncodeSettings) -> int | None:
    """How many texts one caption line gives (:meth:`~.encode_jobs.EncodeSettings.caption_texts`), counted without
    encoding; ``None`` when its wildcard combinations alone pass :data:`MAX_CAPTION_VARIANTS`."""
    line = line[:MAX_CAPTION_CHARS]
    n, keep = settings.shuffle_variants, settings.keep_tokens
    pieces = wildcard_count(line) if settings.wildcards else 1
    if pieces > MAX_CAPTION_VARIANTS:
        return None
    if settings.tag_dropout:
        return pieces * n
    if not n:
        return pieces
    expanded = expand_wildcards(line, MAX_CAPTION_VARIANTS) if settings.wildcards else (line,)
    return sum(min(tag_orders(piece, keep, n + 1, settings.keep_tokens_separator), n) for piece in expanded)


def _too_many_draws(captions: Sequence[str], settings: EncodeSettings) -> str | None:
    """:func:`too_many_variants` where each line's texts are draws (wildcards, tag dropout): lines weigh alike, so
    a sample holds every line's texts repeated to their least common multiple."""
    counts = []
    for line in captions:
        n = _line_variants(line, settings)
        if n is None or n > MAX_CAPTION_VARIANTS:
            said = f"more than {MAX_CAPTION_VARIANTS}" if n is None else str(n)
            return (f"its caption line {line[:60]!r} gives {said} caption variants (wildcard combinations × tag "
                    f"variants), above the limit of {MAX_CAPTION_VARIANTS}; each is encoded separately: write fewer "
                    "wildcard options or lower shuffle_variants")
        counts.append(n)
    if len(counts) < 2:
        return None
    total = len(counts) * math.lcm(*counts)
    if total <= MAX_CAPTION_VARIANTS:
        return None
    shown = ", ".join(map(str, counts[:8])) + (", ..." if len(counts) > 8 else "")
    return (f"its caption file's {len(counts)} lines give {shown} caption variants, which "
            f"weigh alike only as {len(counts)} × {math.lcm(*counts)} = {total} entries of the sample, above the "
            f"limit of {MAX_CAPTION_VARIANTS}: give the lines the same number of wildcard options, lower "
            "shuffle_variants or keep fewer caption lines")


def too_many_variants(captions: Sequence[str], settings: EncodeSettings) -> str | None:
    """Why a sample's caption variants (lines, times the shuffles of each) are too many to encode, or ``None``."""
    if settings.weighs_lines:
        return _too_many_draws(captions, settings)
    lines = len(captions)
    variants = lines * max(1, settings.shuffle_variants)
    if variants <= MAX_CAPTION_VARIANTS:
        return None
    if settings.shuffle_variants:
        return (f"its caption file has {lines} lines × {settings.shuffle_variants} tag shuffles = {variants} "
                f"caption variants, above the limit of {MAX_CAPTION_VARIANTS}; each is encoded separately: lower "
                "shuffle_variants or keep fewer caption lines")
    return (f"its caption file has {lines} lines (variants), above the limit of {MAX_CAPTION_VARIANTS}; each "
            "line is encoded separately: keep one caption per line")


def caption_keys(captions: Sequence[str], relpath: str, settings: EncodeSettings, keys: PlanKeys,
                 texts: dict[str, str], cut: list[str], many: list[str]) -> tuple[str, ...]:
    """The conditioning keys of one sample's caption lines; adds their texts to ``texts``.

    With shuffling alone, every line's variants, each text once; without, one per line, duplicates kept: they
    weight that line. With wildcards or tag dropout (``settings.weighs_lines``) each line's texts are draws, kept
    with their repeats, and each line's are repeated to the least common multiple of the lines' counts: every line
    weighs alike, as kohya picks a line before its wildcards and dropped tags.
    """
    if len(captions) > CAPTION_VARIANTS_NOTE:
        many.append(relpath)
    per_line = []
    for line in captions:
        if len(line) > MAX_CAPTION_CHARS:
            cut.append(relpath)
            line = line[:MAX_CAPTION_CHARS]
        line_keys = []
        for text in settings.caption_texts(line):
            ckey = keys.conditioning(text)
            texts.setdefault(ckey, text)
            line_keys.append(ckey)
        per_line.append(line_keys)
    if settings.weighs_lines:
        common = math.lcm(*map(len, per_line)) if per_line else 1
        return tuple(k for line_keys in per_line for k in line_keys * (common // len(line_keys)))
    out = [k for line_keys in per_line for k in line_keys]
    return tuple(dict.fromkeys(out)) if settings.shuffle_variants else tuple(out)


def _pieces(settings: EncodeSettings, captions: Iterable[Sequence[str]]) -> Iterator[str]:
    """Every distinct caption line as it is shuffled: cut to :data:`MAX_CAPTION_CHARS` and, with wildcards, each of
    its combinations (none for a line over the limit: it is a failure of its own)."""
    seen: set[str] = set()
    for lines in captions:
        for line in lines:
            line = line[:MAX_CAPTION_CHARS]
            if line in seen:
                continue
            seen.add(line)
            if not settings.wildcards:
                yield line
            elif wildcard_count(line) <= MAX_CAPTION_VARIANTS:
                yield from expand_wildcards(line, MAX_CAPTION_VARIANTS)


def shuffle_notes(settings: EncodeSettings, captions: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """What the report says about tag shuffling: ``keep_tokens`` without shuffling (no effect), lines that cannot
    be shuffled at all and why, lines with fewer orders than ``shuffle_variants`` (they give every order they have,
    their own among them). Lines are counted once each, however many images share them."""
    variants, keep = settings.shuffle_variants, settings.keep_tokens
    if not variants:
        if keep:
            return (f"keep_tokens {keep} has no effect: shuffle_variants is 0, so no tags are shuffled (set "
                    "shuffle_variants to shuffle the tags after the first keep_tokens)",)
        return ()
    kept: list[str] = []  # keep_tokens leaves at most one tag to move
    single: list[str] = []  # one tag or none, or all the same
    short: dict[str, int] = {}
    for line in _pieces(settings, captions):
        orders = tag_orders(line, keep, variants + 1, settings.keep_tokens_separator)
        if orders == 1:
            fixed, rest, tail = _tags(line, keep, settings.keep_tokens_separator)
            (kept if len(fixed) + len(rest) + len(tail) > 1 and len(rest) <= 1 else single).append(line)
        elif orders - 1 < variants and not settings.tag_dropout:  # with dropout: versions cycle the orders
            short.setdefault(line, orders)
    notes = []
    if kept:
        kept = sorted(set(kept))
        by = (f"keep_tokens {keep} (or keep_tokens_separator {settings.keep_tokens_separator!r})"
              if settings.keep_tokens_separator else f"keep_tokens {keep}")
        notes.append(f"{len(kept)} caption line(s) cannot be shuffled: {by} keeps all their tags in place (or all "
                     f"but one), so they train unshuffled (e.g. {kept[0][:80]!r}); lower keep_tokens")
    if single:
        single = sorted(set(single))
        notes.append(f"{len(single)} caption line(s) cannot be shuffled: they have one comma-separated tag (or "
                     f"only the same tag repeated), so they train unshuffled (e.g. {single[0][:80]!r})")
    if short:
        line, orders = min(short.items())
        notes.append(f"{len(short)} caption line(s) have fewer tag orders than shuffle_variants {variants} asks for "
                     f"(e.g. {line[:80]!r}: {orders} orders): each gives every order it has, its own among them")
    return tuple(notes)


def separator_notes(settings: EncodeSettings, captions: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """What the report says about ``keep_tokens_separator`` and ``secondary_separator``: set, but in no caption line
    (a typo, or captions written without it: every line then is treated as without it)."""
    lines = [line for group in captions for line in group]
    notes = []
    sep = settings.keep_tokens_separator
    if sep and not any(sep in line for line in lines):
        notes.append(f"keep_tokens_separator {sep!r} is in no caption line: every line is treated as without it "
                     f"(keep_tokens {settings.keep_tokens})")
    sep = settings.secondary_separator
    if sep and not any(sep in line for line in lines):
        notes.append(f"secondary_separator {sep!r} is in no caption line: every tag is its own")
    return tuple(notes)


def caption_notes(cut: Sequence[str], many: Sequence[str]) -> tuple[str, ...]:
    """What the report says about caption files: lines cut at :data:`MAX_CAPTION_CHARS` (``cut``: their samples),
    samples with more than :data:`CAPTION_VARIANTS_NOTE` lines (``many``)."""
    notes = []
    if cut:
        names = sorted(set(cut))
        notes.append(f"{len(names)} caption file(s) have lines over {MAX_CAPTION_CHARS} characters, encoded cut to "
                     f"that length (first: the caption of {names[0]})")
    if many:
        names = sorted(set(many))
        notes.append(f"{len(names)} image(s) have more than {CAPTION_VARIANTS_NOTE} caption lines, each encoded as "
                     f"a variant (first: the caption of {names[0]}); is that what you meant?")
    return tuple(notes)
