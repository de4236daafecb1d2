"""Which of a model's layers a LoRA trains: the ``train_layers`` patterns, matched against the layers' names.

ComfyUI's trainer gives every layer with weights an adapter (linear, conv and norm weights, biases). kohya
(``train_blocks``, block dims), OneTrainer (its layer filter) and ai-toolkit (``only_if_contains`` /
``ignore_if_contains``) can train a chosen part instead, such as the attention layers or some blocks: a smaller
LoRA, less optimizer state, a faster step, and a concept kept to the layers chosen for it.

A pattern is a piece of a layer's name (the caller's names: Train LoRA gives them inside the diffusion model, such
as ``input_blocks.4.1.transformer_blocks.0.attn2.to_k``); a pattern starting with ``-`` leaves out the layers whose
names contain the rest. A layer trains when some plain pattern is in its name (or there are only ``-`` patterns)
and no ``-`` pattern is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["LayerFilter", "MAX_TRAIN_LAYERS_CHARS", "EXCLUDE_PREFIX"]

MAX_TRAIN_LAYERS_CHARS = 2000
"""The longest ``train_layers`` accepted: room for dozens of patterns, not a pasted file."""
EXCLUDE_PREFIX = "-"
_EXAMPLES = 4
"""Layer names a refusal quotes, so the user sees how names read."""


@dataclass(frozen=True)
class LayerFilter:
    """The parsed ``train_layers``: the patterns a trained layer's name must contain one of (``include``; none: any
    name) and those it must contain none of (``exclude``). The empty filter trains every layer."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: object) -> LayerFilter:
        """The filter of ``text``: patterns separated by commas or new lines, spaces around them ignored.

        Raises:
            ValueError: naming ``train_layers``, the bad pattern and how patterns are written.
        """
        if not isinstance(text, str):
            raise ValueError(f"train_layers must be text (patterns separated by commas), got {type(text).__name__}")
        if len(text) > MAX_TRAIN_LAYERS_CHARS:
            raise ValueError(f"train_layers is {len(text)} characters long; at most {MAX_TRAIN_LAYERS_CHARS}: write "
                             "pieces of layer names (such as 'attn2'), not whole names")
        include: list[str] = []
        exclude: list[str] = []
        for raw in text.replace("\n", ",").split(","):
            pattern = raw.strip()
            if not pattern:
                continue
            if any(ord(c) < 32 for c in pattern):
                raise ValueError(f"train_layers pattern {pattern!r:.60} holds a control character")
            target = exclude if pattern.startswith(EXCLUDE_PREFIX) else include
            piece = pattern.removeprefix(EXCLUDE_PREFIX).strip()
            if not piece:
                raise ValueError(f"train_layers pattern {pattern!r} leaves out nothing: write the piece of the layer "
                                 "names to leave out after the '-' (such as '-norm')")
            if piece not in target:
                target.append(piece)
        return cls(tuple(include), tuple(exclude))

    @property
    def everything(self) -> bool:
        """Whether every layer trains (no pattern): ComfyUI's own trainer."""
        return not self.include and not self.exclude

    def selects(self, name: str) -> bool:
        """Whether the layer ``name`` trains."""
        if any(p in name for p in self.exclude):
            return False
        return not self.include or any(p in name for p in self.include)

    def select(self, names: Sequence[str]) -> list[str]:
        """The names of ``names`` that train, in order.

        Raises:
            ValueError: none does; the message quotes a few names, so the patterns can be corrected.
        """
        chosen = [n for n in names if self.selects(n)]
        if names and not chosen:
            raise ValueError(f"train_layers {self.text()!r:.200} selects none of the model's {len(names)} layers; "
                             f"layer names read like {', '.join(repr(n) for n in _spread(names))}: write pieces "
                             "of them, or leave train_layers empty to train every layer")
        return chosen

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The patterns (``-`` ones with their sign) that occur in none of ``names``: likely typos."""
        names = list(names)
        return [p for p in self.include if not any(p in n for n in names)] + \
            [EXCLUDE_PREFIX + p for p in self.exclude if not any(p in n for n in names)]

    def without_prefix(self, prefix: str) -> LayerFilter:
        """This filter with ``prefix`` taken off the start of each pattern: a pattern copied from a full key (a
        LoRA file's ``diffusion_model.input_blocks.4``) matches names given without it."""
        def strip(patterns: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(p.removeprefix(prefix) or p for p in patterns))

        return LayerFilter(strip(self.include), strip(self.exclude))

    def text(self) -> str:
        """The filter written as ``train_layers`` takes it (normalized)."""
        return ", ".join([*self.include, *(EXCLUDE_PREFIX + p for p in self.exclude)])


def _spread(names: Sequence[str]) -> list[str]:
    """A few of ``names`` spread over the list (its first, middle and last parts of the model)."""
    if len(names) <= _EXAMPLES:
        return list(names)
    step = (len(names) - 1) / (_EXAMPLES - 1)
    return [names[round(i * step)] for i in range(_EXAMPLES)]
