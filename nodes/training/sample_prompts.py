"""What the sample images are prompted with when not the cache's captions: the conditioning wired to
``sample_prompt``, and the lines of ``sample_texts`` encoded with the CLIP wired to ``sample_clip`` (kohya's prompt
file: one prompt per line), with ``sample_negative`` the negative of their guidance.

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

__all__ = ["MAX_SAMPLE_TEXTS", "NO_PROMPTS", "SamplePrompts", "check_prompt", "encode_sample_texts",
           "sample_text_lines"]

MAX_SAMPLE_TEXTS = 16
"""The most ``sample_texts`` lines: each gives ``sample_count`` images at every sampling."""


class SamplePrompts(NamedTuple):
    """The conditionings wired to the node's ``sample_prompt`` and ``sample_negative`` (``None``: not connected),
    and the ``sample_texts`` lines with their conditionings."""

    positive: Any = None
    negative: Any = None
    texts: tuple[tuple[str, Any], ...] = ()

    @property
    def given(self) -> bool:
        """Whether prompts replace the cache's captions."""
        return self.positive is not None or bool(self.texts)

    def images(self, count: int) -> list[tuple[str, Any]]:
        """``count`` images of each prompt as ``(noise key, conditioning)``: the ``sample_prompt``'s first (keys
        ``"sample_prompt:<i>"``), then each line's (``"sample_text:<digest of the line>:<i>"``)."""
        out = [(f"sample_prompt:{i}", self.positive) for i in range(count)] if self.positive is not None else []
        for text, conditioning in self.texts:
            digest = xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
            out += [(f"sample_text:{digest}:{i}", conditioning) for i in range(count)]
        return out

    def describe(self, count: int) -> str:
        """The summary's name of what is sampled (the lines shortened)."""
        if not self.texts:
            return f"the sample_prompt ({count} noises)"
        lines = ", ".join(repr(text[:40] + ("..." if len(text) > 40 else "")) for text, _ in self.texts[:3])
        more = ", ..." if len(self.texts) > 3 else ""
        prompt = "the sample_prompt and " if self.positive is not None else ""
        return f"{prompt}{len(self.texts)} sample_texts line(s) ({lines}{more}; {count} noise(s) each)"


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


def sample_text_lines(text: object) -> tuple[str, ...]:
    """The prompts of ``sample_texts``: its lines stripped, blank lines and ``#`` comments left out (kohya's prompt
    file), each once, in order.

    Raises:
        ValueError: not text, more than :data:`MAX_SAMPLE_TEXTS` prompts, or a line longer than a caption line may
            be (:data:`~dataset_cache.captions.MAX_CAPTION_CHARS`), naming ``sample_texts``.
    """
    if text is None:
        return ()
    if not isinstance(text, str):
        raise ValueError(f"sample_texts must be text, one prompt per line, got {type(text).__name__}")
    lines = tuple(dict.fromkeys(line.strip() for line in text.splitlines()
                                if line.strip() and not line.strip().startswith("#")))
    if len(lines) > MAX_SAMPLE_TEXTS:
        raise ValueError(f"sample_texts holds {len(lines)} prompts; at most {MAX_SAMPLE_TEXTS} (each gives "
                         "sample_count images at every sampling): keep the ones you want to watch")
    long = next((line for line in lines if len(line) > MAX_CAPTION_CHARS), None)
    if long is not None:
        raise ValueError(f"sample_texts line {long[:40]!r}... has {len(long)} characters; at most "
                         f"{MAX_CAPTION_CHARS}, as a caption line: shorten it")
    return lines


def encode_sample_texts(clip: Any, lines: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """Each line with its conditioning, encoded as ComfyUI's CLIP Text Encode encodes a prompt with ``clip`` (the
    ``sample_clip`` input: its tokenizer, then ``encode_from_tokens_scheduled``) and checked as a connected prompt
    is.

    Raises:
        ValueError: lines without a CLIP, naming ``sample_clip``; a conditioning one model call cannot take.
    """
    if not lines:
        return ()
    if clip is None:
        raise ValueError(f"sample_texts holds {len(lines)} prompt(s) but no CLIP is connected to sample_clip: connect "
                         "the text encoder's Load CLIP (or the checkpoint loader's CLIP), or clear sample_texts")
    encoded = []
    for line in lines:
        conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(line))  # what CLIP Text Encode runs
        check_prompt(conditioning, f"sample_texts line {line[:40]!r}")
        encoded.append((line, conditioning))
    return tuple(encoded)
