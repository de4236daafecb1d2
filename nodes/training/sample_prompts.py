"""What the sample images are prompted with when not the cache's captions: the conditioning wired to
``sample_prompt``, and the lines of ``sample_texts`` encoded with the CLIP wired to ``sample_clip`` (kohya's prompt
file: one prompt per line, a line's own negative after ``--n``), with ``sample_negative`` the negative of the
others' guidance.

The lines are encoded by ComfyUI's own CLIP Text Encode before the run, so the text encoder leaves the device when
training loads the model, as it does after any prompt. Each image's noise is keyed by its prompt (a line's by its
text, so reordering or adding lines keeps every other line's images), and by its number among that prompt's images.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import xxhash

from ...dataset_cache.captions import MAX_CAPTION_CHARS
from ...dataset_cache.sample_choice import MAX_SAMPLE_CFG, MAX_SAMPLE_SIZE, MAX_SAMPLE_STEPS, MIN_SAMPLE_SIZE
from ...dataset_cache.seeding import MAX_SEED
from ...dataset_cache.trainable import UNTRAINABLE_CONDITIONING_KEYS

__all__ = ["MAX_SAMPLE_TEXTS", "NO_PROMPTS", "LineOptions", "SampleLine", "SamplePrompts", "SampleText",
           "check_prompt", "encode_sample_texts", "lines_size", "sample_text_lines"]

MAX_SAMPLE_TEXTS = 16
"""The most ``sample_texts`` lines: each gives ``sample_count`` images at every sampling."""


class LineOptions(NamedTuple):
    """A ``sample_texts`` line's own sampling settings, kohya's ``--s`` (steps), ``--l`` (guidance scale) and ``--d``
    (seed); ``None``: the node's ``sample_steps``, ``sample_cfg``, ``sample_seed``."""

    steps: int | None = None
    cfg: float | None = None
    seed: int | None = None

    def resolved(self, steps: int, cfg: float, seed: int) -> tuple[int, float, int]:
        """The line's steps, guidance scale and seed: its own where it sets them, else the node's given here."""
        return (steps if self.steps is None else self.steps, cfg if self.cfg is None else self.cfg,
                seed if self.seed is None else self.seed)

    def describe(self) -> str:
        """``"--s 30 --l 5"``: the options the line sets, as written in a prompt file."""
        return " ".join(f"--{k} {v:g}" if isinstance(v, float) else f"--{k} {v}"
                        for k, v in (("s", self.steps), ("l", self.cfg), ("d", self.seed)) if v is not None)


class SampleLine(NamedTuple):
    """One ``sample_texts`` line: its prompt, after ``--n`` its own negative (``None``: none), its own ``options``
    and, after ``--w`` and ``--h``, its size in pixels (``None``: the node's)."""

    prompt: str
    negative: str | None = None
    options: LineOptions = LineOptions()
    size: tuple[int, int] | None = None


class SampleText(NamedTuple):
    """A ``sample_texts`` line encoded: its prompt's text and conditioning, its own negative's (``None``) and its
    own sampling ``options``."""

    text: str
    conditioning: Any
    negative: Any = None
    options: LineOptions = LineOptions()


class SampleImage(NamedTuple):
    """One image of a prompt: its noise key, its conditioning, its own negative (``None``: the default one) and its
    line's own sampling ``options``."""

    key: str
    conditioning: Any
    negative: Any = None
    options: LineOptions = LineOptions()


class SamplePrompts(NamedTuple):
    """The conditionings wired to the node's ``sample_prompt`` and ``sample_negative`` (``None``: not connected),
    and the ``sample_texts`` lines encoded."""

    positive: Any = None
    negative: Any = None
    texts: tuple[SampleText, ...] = ()

    @property
    def given(self) -> bool:
        """Whether prompts replace the cache's captions."""
        return self.positive is not None or bool(self.texts)

    @property
    def own_negatives(self) -> bool:
        """Whether every prompt has its own negative (each a ``--n`` line): guidance then needs no other."""
        return self.positive is None and bool(self.texts) and all(t.negative is not None for t in self.texts)

    def images(self, count: int) -> list[SampleImage]:
        """``count`` images of each prompt: the ``sample_prompt``'s first (keys ``"sample_prompt:<i>"``), then each
        line's (``"sample_text:<digest of its prompt>:<i>"``, with the line's own negative)."""
        out = [SampleImage(f"sample_prompt:{i}", self.positive) for i in range(count)] \
            if self.positive is not None else []
        for text in self.texts:
            digest = xxhash.xxh3_64_hexdigest(text.text.encode("utf-8", "surrogatepass"))
            out += [SampleImage(f"sample_text:{digest}:{i}", text.conditioning, text.negative, text.options)
                    for i in range(count)]
        return out

    def describe(self, count: int) -> str:
        """The summary's name of what is sampled (the lines shortened)."""
        if not self.texts:
            return f"the sample_prompt ({count} noises)"
        lines = ", ".join(repr(t.text[:40] + ("..." if len(t.text) > 40 else "")) for t in self.texts[:3])
        more = ", ..." if len(self.texts) > 3 else ""
        prompt = "the sample_prompt and " if self.positive is not None else ""
        own = sum(t.negative is not None for t in self.texts)
        negatives = f", {own} with its own --n negative" if own else ""
        options = [f"{t.text[:20]!r}: {t.options.describe()}" for t in self.texts if t.options != LineOptions()]
        settings = f"; own settings {', '.join(options[:3])}{', ...' if len(options) > 3 else ''}" if options else ""
        return (f"{prompt}{len(self.texts)} sample_texts line(s) ({lines}{more}; {count} noise(s) each{negatives}"
                f"{settings})")

    def needs_empty_caption(self, cfg: float) -> bool:
        """Whether some image is guided against the cache's empty caption: guided (its line's ``--l``, else ``cfg``,
        above 1) with neither its own ``--n`` nor a connected ``sample_negative``."""
        if self.negative is not None:
            return False
        if (self.positive is not None or not self.texts) and cfg > 1:
            return True
        return any(t.options.resolved(0, cfg, 0)[1] > 1 and t.negative is None for t in self.texts)

    def guided(self, cfg: float) -> bool:
        """Whether any image is guided (a line's own ``--l`` or, for the others, ``cfg``, above 1)."""
        scales = [t.options.resolved(0, cfg, 0)[1] for t in self.texts]
        if self.positive is not None or not self.texts:
            scales.append(cfg)
        return any(scale > 1 for scale in scales)


NO_PROMPTS = SamplePrompts()
"""Neither input connected: the cached captions and, for guidance, the empty caption."""


def check_prompt(value: Any, name: str) -> None:
    """Refuse a conditioning wired to ``sample_prompt`` or ``sample_negative`` (or encoded from ``sample_texts``)
    that one model call cannot take: not one ComfyUI conditioning entry, or one with an area, mask, timestep range,
    ControlNet or hook.

    Raises:
        ValueError: naming the input and what to connect instead.
    """
    if value is None:
        return
    if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], (list, tuple))
            and len(value[0]) == 2 and isinstance(value[0][1], dict) and isinstance(value[0][0], torch.Tensor)):
        count = len(value) if isinstance(value, list) else 0
        raise ValueError(f"{name}: connect one prompt's conditioning (a CLIP Text Encode); this one holds {count} "
                         "conditionings (Conditioning Combine makes several: use Conditioning Concat)")
    unusable = [k for k in UNTRAINABLE_CONDITIONING_KEYS if k in value[0][1]]
    if unusable:
        raise ValueError(f"{name}: the conditioning carries {', '.join(map(repr, unusable))}, which a sample image's "
                         "single model call cannot apply; connect the prompt without area, mask, timestep range, "
                         "ControlNet or hook nodes")


_NUMBERS: dict[str, tuple[str, type, float, float]] = {
    "s": ("steps", int, 1, MAX_SAMPLE_STEPS), "l": ("guidance scale", float, 1, MAX_SAMPLE_CFG),
    "d": ("seed", int, 0, MAX_SEED), "w": ("width", int, MIN_SAMPLE_SIZE, MAX_SAMPLE_SIZE),
    "h": ("height", int, MIN_SAMPLE_SIZE, MAX_SAMPLE_SIZE),
}
"""kohya's per-line prompt options besides ``--n``: what each sets, its type and range (the node inputs')."""


def _number(raw: str, key: str, value: str) -> float:
    """The value of option ``--<key>`` of line ``raw``, checked against its range.

    Raises:
        ValueError: naming the line, the option, what it sets and its range.
    """
    what, kind, low, high = _NUMBERS[key]
    try:
        number = kind(value.strip())
    except ValueError:
        number = None
    if number is None or not (isinstance(number, int) or math.isfinite(number)) or not low <= number <= high:
        bounds = f"{int(low)} to {int(high)}" if kind is int else f"{low:g} to {high:g}"
        raise ValueError(f"sample_texts line {raw[:60]!r}: --{key} sets the line's {what}, a "
                         f"{'whole ' if kind is int else ''}number from {bounds}; got {value.strip()!r:.20}")
    return number


def _line(raw: str) -> SampleLine:
    """One prompt-file line as kohya splits it (on ``" --"``): the prompt, ``--n <negative>``, and the line's own
    ``--s`` steps, ``--l`` guidance scale, ``--d`` seed, ``--w`` width and ``--h`` height.

    Raises:
        ValueError: an option out of its range, a width without a height (or the reverse), or an option kohya's
            prompt files have that this node does not, each naming the line.
    """
    prompt, *options = raw.split(" --")
    negative = None
    numbers: dict[str, float] = {}
    for option in options:
        key, _, value = option.strip().partition(" ")
        key = key.lower()
        if key == "n":
            negative = value.strip()
        elif key in _NUMBERS:
            numbers[key] = _number(raw, key, value)
        else:
            raise ValueError(f"sample_texts line {raw[:60]!r}: --{key[:10]} is no option here (these are: --n the "
                             "negative, --s steps, --l guidance scale, --d seed, --w and --h the size): take it out "
                             "of the line")
    if ("w" in numbers) != ("h" in numbers):
        raise ValueError(f"sample_texts line {raw[:60]!r}: give both --w and --h (the image's size in pixels), or "
                         "neither")
    size = (int(numbers["w"]), int(numbers["h"])) if "w" in numbers else None
    steps, seed = numbers.get("s"), numbers.get("d")
    own = LineOptions(None if steps is None else int(steps), numbers.get("l"), None if seed is None else int(seed))
    return SampleLine(prompt.strip(), negative, own, size)


def lines_size(lines: tuple[SampleLine, ...], width: int, height: int) -> tuple[int, int]:
    """The sample images' size with the lines' ``--w`` and ``--h``: a sampling's images leave as one ``LATENT``
    batch, so one size for all (``(width, height)``, the node's, when no line gives one; ``(0, 0)``: the bucket's).

    Raises:
        ValueError: lines of different sizes, or a line's size other than the node's ``sample_width`` and
            ``sample_height`` (or than the bucket's, for lines without one), naming both.
    """
    sizes = {line.size for line in lines if line.size is not None}
    if not sizes:
        return width, height
    if len(sizes) > 1:
        shown = ", ".join(f"{w}×{h}" for w, h in sorted(sizes))
        raise ValueError(f"sample_texts lines ask for sizes {shown}: a sampling's images leave as one LATENT batch of "
                         "one size; give every line the same --w and --h (or none, and set sample_width and "
                         "sample_height)")
    (size,) = sizes
    if (width, height) not in ((0, 0), size):
        raise ValueError(f"sample_texts lines ask for {size[0]}×{size[1]} px and sample_width × sample_height is "
                         f"{width}×{height}: a sampling's images have one size; make them agree (or set both to 0)")
    if any(line.size is None for line in lines):
        raise ValueError(f"sample_texts: some lines ask for {size[0]}×{size[1]} px with --w and --h, others for none "
                         "(the captions' bucket): a sampling's images have one size; give every line the same --w "
                         "and --h, or set sample_width and sample_height instead")
    return size


def sample_text_lines(text: object) -> tuple[SampleLine, ...]:
    """The prompts of ``sample_texts``: its lines stripped, blank lines and ``#`` comments left out (kohya's prompt
    file), each line once, in order, its ``--n`` negative apart.

    Raises:
        ValueError: not text, more than :data:`MAX_SAMPLE_TEXTS` prompts, a line longer than a caption line may
            be (:data:`~dataset_cache.captions.MAX_CAPTION_CHARS`), or a kohya option other than ``--n``, naming
            ``sample_texts``.
    """
    if text is None:
        return ()
    if not isinstance(text, str):
        raise ValueError(f"sample_texts must be text, one prompt per line, got {type(text).__name__}")
    raw = tuple(dict.fromkeys(line.strip() for line in text.splitlines()
                              if line.strip() and not line.strip().startswith("#")))
    if len(raw) > MAX_SAMPLE_TEXTS:
        raise ValueError(f"sample_texts holds {len(raw)} prompts; at most {MAX_SAMPLE_TEXTS} (each gives "
                         "sample_count images at every sampling): keep the ones you want to watch")
    long = next((line for line in raw if len(line) > MAX_CAPTION_CHARS), None)
    if long is not None:
        raise ValueError(f"sample_texts line {long[:40]!r}... has {len(long)} characters; at most "
                         f"{MAX_CAPTION_CHARS}, as a caption line: shorten it")
    return tuple(_line(line) for line in raw)


def encode_sample_texts(clip: Any, lines: tuple[SampleLine, ...]) -> tuple[SampleText, ...]:
    """Each line's prompt and ``--n`` negative with their conditionings, encoded as ComfyUI's CLIP Text Encode
    encodes a prompt with ``clip`` (the ``sample_clip`` input: its tokenizer, then ``encode_from_tokens_scheduled``)
    and checked as a connected prompt is.

    Raises:
        ValueError: lines without a CLIP, naming ``sample_clip``; a conditioning one model call cannot take.
    """
    if not lines:
        return ()
    if clip is None:
        raise ValueError(f"sample_texts holds {len(lines)} prompt(s) but no CLIP is connected to sample_clip: connect "
                         "the text encoder's Load CLIP (or the checkpoint loader's CLIP), or clear sample_texts")

    encoded: dict[str, Any] = {}  # a prompt file's lines often share one --n negative: each text encoded once

    def encode(text: str) -> Any:
        if text not in encoded:
            conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(text))  # what CLIP Text Encode runs
            check_prompt(conditioning, f"sample_texts line {text[:40]!r}")
            encoded[text] = conditioning
        return encoded[text]

    return tuple(SampleText(line.prompt, encode(line.prompt), None if line.negative is None else encode(line.negative),
                            line.options) for line in lines)
