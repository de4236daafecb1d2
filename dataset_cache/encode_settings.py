"""The settings an encode plan is computed with (:class:`EncodeSettings`): checked when made, each caption line's
texts (shuffles, dropped tags, wildcards), and ``describe``, which is stored in a dataset's info, so its fields and
defaults are part of the format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .buckets import BucketConfig
from .caption_wildcards import expand_wildcards
from .captions import (MAX_CAPTION_VARIANTS, MAX_KEEP_TOKENS, MAX_SEPARATOR_CHARS, MAX_SHUFFLE_VARIANTS,
                       MAX_TAG_DROPOUT, drop_tags, shuffle_tags, without_separator)
from .constants import DEFAULT_SHARD_BYTES
from .frames import FrameSettings
from .imaging import MASK_MODES
from .listing import CAPTION_EXTENSION, check_caption_extension
from .missing_captions import MISSING_CAPTIONS

__all__ = ["FAILURE_POLICIES", "MAX_EXTRA_RESOLUTIONS", "EncodeSettings"]

FAILURE_POLICIES = ("skip", "stop")
"""``skip``: leave a sample whose image or caption cannot be read out of the dataset (counted and listed);
``stop``: raise :class:`.errors.SourceError` naming the file. A zero tensor never stands in for data."""
MAX_EXTRA_RESOLUTIONS = 8
"""Extra resolutions per dataset: each is a full latent per image (ai-toolkit's configs use two or three)."""


@dataclass(frozen=True)
class EncodeSettings:
    """How a folder becomes cache entries. Fields that change stored values reach the entry keys.

    Attributes:
        bucket: aspect-ratio bucketing and crop settings (their crop plan is part of every latent key).
        caption_prefix: text put before every caption line, e.g. a trigger word ``"ohwx, "``. Prefix, line and
            suffix are joined verbatim (include your own separator), then stripped of surrounding whitespace;
            the result is the exact text encoded and keyed, so changing it encodes each distinct line once.
        caption_suffix: text put after every caption line, e.g. ``", ohwx"``.
        batch_size: images (of one bucket) or captions per encoder call; each finished batch is checkpointed, so
            an interruption loses at most one batch.
        failure_policy: ``"skip"`` or ``"stop"`` (see :data:`FAILURE_POLICIES`).
        encode_threads: image decode threads working ahead of the encoder; ``None`` chooses from the CPUs this
            process may use.
        shard_bytes: target size of the cache's shard files.
        video: which frames a clip (video file or ``.frames`` folder) gives, and the VAE's temporal compression
            (see :class:`.frames.FrameSettings`); images ignore it.
        shuffle_variants: ``0`` (off) or how many shuffled-tag texts each caption line gives (kohya's
            ``shuffle_caption``, see :func:`.captions.shuffle_tags`); the unshuffled line itself is then not encoded.
        keep_tokens: with shuffling, the leading comma-separated tags that stay in place (kohya's
            ``keep_tokens``, e.g. 1 for a trigger word at the start of every caption).
        empty_caption: also encode the empty caption ``""`` (one conditioning per text encoder), which caption
            dropout in training uses (``Sample.empty_caption``).
        masks: loss masks: ``"none"``, ``"masklabel"`` (``<stem>-masklabel.<ext>`` beside the image) or
            ``"alpha"`` (the image's alpha channel); see :func:`.imaging.load_mask`. Images only.
        extra_resolutions: more resolutions each image is encoded at besides ``bucket.resolution`` (a
            multi-resolution dataset: one sample per image and distinct crop plan, each its own latent entry); the
            bucket settings of each are ``bucket.at_resolution(r)``. Clips too: a sample per resolution
            and window.
        missing_caption: what a source without a caption file is captioned with: ``"empty"`` (the empty prompt),
            ``"folder name"`` (its kohya ``<repeats>_<name>`` folder's name) or ``"file name"`` (see
            :mod:`.missing_captions`).
        tag_dropout: with shuffling, the share of the shuffled versions each tag after ``keep_tokens`` is left out
            of (kohya's ``caption_tag_dropout_rate``, see :func:`.captions.drop_tags`); ``0`` leaves every tag in.
        wildcards: ``{a|b}`` option groups in caption lines give one text per combination of options (kohya's
            ``enable_wildcard``, see :mod:`.caption_wildcards`); off, braces are encoded as written.
        keep_tokens_separator: kohya's: in a line holding it, the tags before it stay in front and those after a
            second one stay at the end, the ones between are shuffled and dropped (``keep_tokens`` is not used
            for that line); the separator itself is never encoded (the parts are joined with ``", "``, shuffled
            or not). ``""``: none.
        secondary_separator: kohya's: tags joined by it (``"hatsune miku;;;vocaloid"``) are one tag for the shuffle
            and tag dropout, and it is encoded as a comma (``"hatsune miku,vocaloid"``, kohya's default
            ``caption_separator``). ``""``: none.
        caption_extension: the caption files' extension, lowercased with its dot (kohya's ``caption_extension``:
            ``".txt"``, or ``".caption"`` for datasets captioned so; see
            :func:`.listing.check_caption_extension`).
        reference_folder: the folder of the images the dataset's images were edited from (an edit model's
            reference images, see :mod:`.reference_plan`), absolute; ``""``: none.
        mask_factor: the VAE's spatial compression (8 for SD/SDXL/Flux), which sets a mask's latent resolution;
            a property of the VAE, not a user setting (not described). ``None``: unknown (the VAE was not
            loaded): mask keys are then unresolved, so the VAE is asked for, and such a plan cannot be encoded.
    """

    bucket: BucketConfig = field(default_factory=BucketConfig)
    caption_prefix: str = ""
    caption_suffix: str = ""
    batch_size: int = 8
    failure_policy: str = "skip"
    encode_threads: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    video: FrameSettings = field(default_factory=FrameSettings)
    shuffle_variants: int = 0
    keep_tokens: int = 0
    empty_caption: bool = False
    masks: str = "none"
    mask_factor: int | None = None
    missing_caption: str = "empty"
    extra_resolutions: tuple[int, ...] = ()
    tag_dropout: float = 0.0
    wildcards: bool = False
    keep_tokens_separator: str = ""
    caption_extension: str = CAPTION_EXTENSION
    secondary_separator: str = ""
    reference_folder: str = ""

    def __post_init__(self) -> None:
        if type(self.shuffle_variants) is not int or not 0 <= self.shuffle_variants <= MAX_SHUFFLE_VARIANTS:
            raise ValueError(f"EncodeSettings.shuffle_variants must be an int from 0 (off) to "
                             f"{MAX_SHUFFLE_VARIANTS}, got {self.shuffle_variants!r}")
        if type(self.keep_tokens) is not int or not 0 <= self.keep_tokens <= MAX_KEEP_TOKENS:
            raise ValueError(f"EncodeSettings.keep_tokens must be an int from 0 to {MAX_KEEP_TOKENS}, "
                             f"got {self.keep_tokens!r}")
        self._check_caption_draws()
        if check_caption_extension(self.caption_extension) != self.caption_extension:
            raise ValueError(f"EncodeSettings.caption_extension must be lowercase with its dot, such as "
                             f"{check_caption_extension(self.caption_extension)!r}; got {self.caption_extension!r}")
        if type(self.empty_caption) is not bool:
            raise TypeError(f"EncodeSettings.empty_caption must be a bool, got {self.empty_caption!r}")
        if self.masks not in MASK_MODES:
            raise ValueError(f"EncodeSettings.masks must be one of {MASK_MODES}, got {self.masks!r}")
        if self.missing_caption not in MISSING_CAPTIONS:
            raise ValueError(f"EncodeSettings.missing_caption must be one of {MISSING_CAPTIONS}, "
                             f"got {self.missing_caption!r:.40}")
        self._check_extra_resolutions()
        if not isinstance(self.reference_folder, str) or (self.reference_folder
                                                          and not os.path.isabs(self.reference_folder)):
            raise ValueError(f"EncodeSettings.reference_folder must be an absolute path or '', got "
                             f"{self.reference_folder!r:.80}")
        if self.mask_factor is not None and (type(self.mask_factor) is not int or not 1 <= self.mask_factor <= 64):
            raise ValueError(f"EncodeSettings.mask_factor must be None or an int from 1 to 64, "
                             f"got {self.mask_factor!r}")
        if not isinstance(self.video, FrameSettings):
            raise TypeError(f"EncodeSettings.video must be a FrameSettings, got {type(self.video).__name__}")
        if not isinstance(self.bucket, BucketConfig):
            raise TypeError(f"EncodeSettings.bucket must be a BucketConfig, got {type(self.bucket).__name__}")
        for name in ("caption_prefix", "caption_suffix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"EncodeSettings.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"EncodeSettings.failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.failure_policy!r}")
        for name in ("batch_size", "shard_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"EncodeSettings.{name} must be an int >= 1, got {value!r}")
        if self.encode_threads is not None and (type(self.encode_threads) is not int or self.encode_threads < 0):
            raise ValueError(f"EncodeSettings.encode_threads must be None or an int >= 0, got {self.encode_threads!r}")

    def _check_caption_draws(self) -> None:
        rate = self.tag_dropout
        if type(rate) not in (int, float) or not 0 <= rate <= MAX_TAG_DROPOUT:
            raise ValueError(f"EncodeSettings.tag_dropout must be a number from 0 to {MAX_TAG_DROPOUT}, "
                             f"got {rate!r:.40}")
        if rate and not self.shuffle_variants:
            raise ValueError(f"tag_dropout {rate:g} leaves tags out of the shuffled versions of each caption line, and "
                             "shuffle_variants is 0: set shuffle_variants to how many versions to encode (e.g. 8)")
        if type(self.wildcards) is not bool:
            raise TypeError(f"EncodeSettings.wildcards must be a bool, got {self.wildcards!r:.40}")
        for name, example in (("keep_tokens_separator", "|||"), ("secondary_separator", ";;;")):
            sep = getattr(self, name)
            if not isinstance(sep, str) or len(sep) > MAX_SEPARATOR_CHARS or (sep and (
                    not sep.strip() or "," in sep or "\n" in sep or "{" in sep or "}" in sep)):
                raise ValueError(f"{name} {sep!r:.40}: use a few characters that are no comma, brace or line break, "
                                 f"e.g. {example!r} (at most {MAX_SEPARATOR_CHARS}), or leave it empty")
        keep, secondary = self.keep_tokens_separator, self.secondary_separator
        if keep and secondary and (keep in secondary or secondary in keep):
            raise ValueError(f"keep_tokens_separator {keep!r} and secondary_separator {secondary!r}: one holds the "
                             "other, so a caption line could not say which it means; use two different markers, "
                             "e.g. '|||' and ';;;'")

    @property
    def weighs_lines(self) -> bool:
        """Whether a caption line's texts are draws that keep their repeats and lines weigh alike (wildcards, tag
        dropout; see :func:`.captions.caption_keys`)."""
        return self.wildcards or bool(self.tag_dropout)

    def _check_extra_resolutions(self) -> None:
        extra = self.extra_resolutions
        if not isinstance(extra, tuple) or not all(type(r) is int for r in extra):
            raise TypeError(f"EncodeSettings.extra_resolutions must be a tuple of ints, got {extra!r:.80}")
        if len(extra) > MAX_EXTRA_RESOLUTIONS:
            raise ValueError(f"EncodeSettings.extra_resolutions: at most {MAX_EXTRA_RESOLUTIONS}, got {len(extra)}")
        if len(set(extra)) != len(extra) or self.bucket.resolution in extra:
            raise ValueError(f"EncodeSettings.extra_resolutions {list(extra)} repeats a resolution (the dataset's "
                             f"own is {self.bucket.resolution})")
        if extra and self.bucket.fixed is not None:
            raise ValueError("EncodeSettings.extra_resolutions needs bucketing: a fixed bucket size has one resolution")
        for r in extra:
            self.bucket.at_resolution(r)  # validates the buckets it makes

    def bucket_configs(self) -> tuple[BucketConfig, ...]:
        """The bucket settings of each resolution images are encoded at: ``bucket``, then each extra resolution's."""
        return (self.bucket, *(self.bucket.at_resolution(r) for r in self.extra_resolutions))

    def caption_text(self, line: str) -> str:
        """Return the text encoded for one caption line: ``(prefix + line + suffix).strip()``."""
        return (self.caption_prefix + line + self.caption_suffix).strip()

    def caption_texts(self, line: str) -> tuple[str, ...]:
        """Return the texts encoded for one caption line, each through :meth:`caption_text`: with wildcards, each
        combination of its options (:func:`.caption_wildcards.expand_wildcards`); of each, with shuffling, the
        :func:`.captions.shuffle_tags` variants (distinct orders), with tag dropout the :func:`.captions.drop_tags`
        versions instead.

        Raises:
            ValueError: the line's wildcard combinations pass :data:`.captions.MAX_CAPTION_VARIANTS` (planning
                leaves such a sample out first, naming its caption).
        """
        pieces = expand_wildcards(line, MAX_CAPTION_VARIANTS) if self.wildcards else (line,)
        sep = self.keep_tokens_separator
        out: list[str] = []
        for piece in pieces:
            if self.tag_dropout:
                texts = drop_tags(piece, self.shuffle_variants, self.keep_tokens, float(self.tag_dropout), sep)
            elif self.shuffle_variants:
                texts = shuffle_tags(piece, self.shuffle_variants, self.keep_tokens, sep)
            elif sep and sep in piece:  # unshuffled, the separator still never reaches the encoder
                texts = (without_separator(piece, sep),)
            else:
                texts = (piece,)
            if self.secondary_separator:  # its groups moved as one tag; encoded as kohya writes them
                texts = tuple(t.replace(self.secondary_separator, ",") for t in texts)
            out.extend(self.caption_text(t) for t in texts)
        return tuple(out)

    def describe(self) -> dict[str, Any]:
        """Return the settings as plain JSON (stored in the dataset's info).

        The variant settings appear only when not at their defaults, so the info of a dataset encoded without
        them is what it was before they existed.
        """
        out = {
            "bucket": self.bucket.describe(), "caption_prefix": self.caption_prefix,
            "caption_suffix": self.caption_suffix, "batch_size": self.batch_size,
            "failure_policy": self.failure_policy, "shard_bytes": self.shard_bytes, "video": self.video.describe(),
        }
        if self.shuffle_variants:
            out["shuffle_variants"] = self.shuffle_variants
            if self.keep_tokens:
                out["keep_tokens"] = self.keep_tokens
            if self.tag_dropout:
                out["tag_dropout"] = self.tag_dropout
        if self.wildcards:
            out["wildcards"] = True
        if self.keep_tokens_separator:
            out["keep_tokens_separator"] = self.keep_tokens_separator
        if self.empty_caption:
            out["empty_caption"] = True
        if self.masks != "none":
            out["masks"] = self.masks
        if self.missing_caption != "empty":
            out["missing_caption"] = self.missing_caption
        if self.extra_resolutions:
            out["extra_resolutions"] = list(self.extra_resolutions)
        if self.caption_extension != CAPTION_EXTENSION:
            out["caption_extension"] = self.caption_extension
        if self.secondary_separator:
            out["secondary_separator"] = self.secondary_separator
        if self.reference_folder:
            out["reference_folder"] = self.reference_folder
        return out
