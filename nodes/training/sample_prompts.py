"""What the sample images are prompted with when not the cache's captions: the conditioning wired to
``sample_prompt``, and the lines of ``sample_texts`` encoded with the CLIP wired to ``sample_clip`` (kohya's prompt
file: one prompt per line, a line's own negative after ``--n``), with ``sample_negative`` the negative of the
others' guidance.

The lines are encoded by ComfyUI's own CLIP Text Encode before the run, so the text encoder leaves the device when
training loads the model, as it does after any prompt. Each image's noise is keyed by its prompt (a line's by its
text, so reordering or adding lines keeps every other line's images), and by its number among that prompt's images.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import xxhash

from ...dataset_cache.captions import MAX_CAPTION_CHARS
from ...dataset_cache.trainable import UNTRAINABLE_CONDITIONING_KEYS

__all__ = ["MAX_SAMPLE_TEXTS", "NO_PROMPTS", "SampleLine", "SamplePrompts", "SampleText", "check_prompt",
           "encode_sample_texts", "sample_text_lines"]

MAX_SAMPLE_TEXTS = 16
"""The most ``sample_texts`` lines: each gives ``sample_count`` images at every sampling."""


class SampleLine(NamedTuple):
    """One ``sample_texts`` line: its prompt and, after ``--n``, its own negative (``None``: none)."""

    prompt: str
    negative: str | None = None


class SampleText(NamedTuple):
    """A ``sample_texts`` line encoded: its prompt's text and conditioning, and its own negative's (``None``)."""

    text: str
    conditioning: Any
    negative: Any = None


class SampleImage(NamedTuple):
    """One image of a prompt: its noise key, its conditioning and its own negative (``None``: the default one)."""

    key: str
    conditioning: Any
    negative: Any = None


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
            out += [SampleImage(f"sample_text:{digest}:{i}", text.conditioning, text.negative) for i in range(count)]
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
        return f"{prompt}{len(self.texts)} sample_texts line(s) ({lines}{more}; {count} noise(s) each{negatives})"


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


_KOHYA_OPTIONS = {"w": "sample_width", "h": "sample_height", "l": "sample_cfg", "s": "sample_steps",
                  "d": "sample_seed (each line's noise comes from it and the line)"}
"""kohya's per-line prompt options this node sets for every line, and the input that does."""


def _line(raw: str) -> SampleLine:
    """One prompt-file line as kohya splits it (on ``" --"``): the prompt, and ``--n <negative>``.

    Raises:
        ValueError: another option (``--w``, ``--h``, ``--l``, ``--s``, ``--d``: set for every line by an input,
            named), or an unknown one.
    """
    prompt, *options = raw.split(" --")
    negative = None
    for option in options:
        key, _, value = option.strip().partition(" ")
        if key.lower() == "n":
            negative = value.strip()
            continue
        where = _KOHYA_OPTIONS.get(key.lower())
        hint = f"here {where} sets it for every line" if where else "it is no option here (only --n, the negative)"
        raise ValueError(f"sample_texts line {raw[:60]!r}: --{key[:10]} is kohya's per-line option; {hint}: take it "
                         "out of the line")
    return SampleLine(prompt.strip(), negative)


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

    return tuple(SampleText(line.prompt, encode(line.prompt), None if line.negative is None else encode(line.negative))
                 for line in lines)
