"""The first half of encoding: what a dataset folder needs that the cache does not have yet (no encoder needed).

:func:`plan_encode` needs no encoder. The ComfyUI node calls it first to decide whether to load the VAE and the
text encoder at all: when nothing is missing neither is loaded. Steps:

1. validate the folder against the sources record of the dataset (``<cache>/sources/<id>.json``): unchanged files
   are trusted by stat, changed ones re-hashed (see :mod:`.sources`);
2. scan image sizes from headers and caption variants (:mod:`.scan`; both are kept in the record, so files
   trusted by stat are not opened), then save the updated record at once, so a crash during the encode that
   follows never costs a re-hash;
3. bucket every image (:class:`.buckets.BucketConfig`) and compute its latent key from the source content hash,
   the crop plan and the VAE fingerprint, and one conditioning key per caption variant from the final caption
   text (prefix + line + suffix) and the text encoder fingerprint (:mod:`.keys`);
4. look the keys up in the cache: what is absent is what :func:`.encode_run.run_encode` encodes.

Keys are content addressed, so a caption line shared by 100 images is one conditioning to encode, renamed or
touched files cost nothing, and a new VAE fingerprint re-encodes latents but no conditioning.

Variants (issue #16), each an entry of its own key, planned here and encoded by :mod:`.encode_run`:

* tag shuffles (``shuffle_variants`` > 0): each caption line gives that many shuffled-tag texts
  (:meth:`EncodeSettings.caption_texts`), keyed like any caption text, so only a changed line's variants are new;
* the empty caption (``empty_caption``): the text ``""`` (no prefix or suffix), one conditioning per text encoder,
  named by every sample's ``empty_caption``;
* mirrors (``bucket.flip == "random"``): the mirrored crop plan's latent (the key ``flip="always"`` gives), named
  by ``Sample.mirror``; ``Sample.latent`` stays the key ``flip="none"`` gives, so switching modes re-encodes only
  what is new;
* loss masks (``masks``): a :class:`MaskJob` per image with a mask, keyed by :func:`.keys.mask_key` (the mask's
  source hash, mode, the latent's crop plan and the VAE's spatial factor), so an edited mask file re-encodes the
  mask alone, and encoding one needs no VAE once the factor is known (``mask_factor``).

Sourceless datasets: when the folder no longer exists but the cache holds the dataset, the plan reports every
recorded source as removed, needs no encoder, and keeps the dataset as it is (training reads the cache alone).
Entries stay in the cache until ``clean`` removes what no dataset references.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .buckets import BucketConfig, CropPlan
from .constants import DEFAULT_SHARD_BYTES
from .dataset import Sample, check_epoch_size
from .errors import CacheError, CacheNotFoundError, DatasetFolderError, SourceError, SourceFailure
from .format.layout import MANIFEST, check_new_cache_location, check_no_links, is_regular_file
from .format.manifest import check_dataset_name
from .format.reader import open_cache
from .gcpause import gc_paused
from .imaging import MASK_MODES, has_alpha, mask_aspect_problem, read_image_size
from .keys import PlanKeys, content_key, hash_bytes, latent_key, mask_key
from .listing import FolderListing
from .scan import SourceClip, SourceImage, scan_folder
from .sources import Validation, validate_sources
from .sources_record import SourcesRecord, SourcesRecordError, load_record, save_record
from .variants import role_keys
from .video import (MAX_CLIP_PIXEL_BYTES, FrameSettings, clip_folder_of, clip_key_fields,
                    legacy_clip_key_fields)

__all__ = [
    "FAILURE_POLICIES",
    "SOURCES_DIR",
    "EncodeSettings",
    "LatentJob",
    "ClipJob",
    "MaskJob",
    "MAX_SHUFFLE_VARIANTS",
    "shuffle_tags",
    "tag_orders",
    "EncodePlan",
    "plan_encode",
    "sources_record_path",
    "settle_sources",
    "samples_digest",
]

log = logging.getLogger("dataset_cache.encode")

FAILURE_POLICIES = ("skip", "stop")
"""``skip``: leave a sample whose image or caption cannot be read out of the dataset (counted and listed);
``stop``: raise :class:`.errors.SourceError` naming the file. A zero tensor never stands in for data."""

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


_DRAWS_PER_VARIANT = 64
"""Seeded draws per variant before the distinct orders still missing are taken in enumeration order (reached only
by lines with few orders, where random draws keep hitting the ones already chosen)."""


def _tags(line: str, keep_tokens: int) -> tuple[list[str], list[str]]:
    """The line's tags split on ``,`` (stripped, empty ones dropped): the first ``keep_tokens`` and the rest."""
    tags = [t for t in (part.strip() for part in line.split(",")) if t]
    return tags[:keep_tokens], tags[keep_tokens:]


def tag_orders(line: str, keep_tokens: int = 0, limit: int = MAX_SHUFFLE_VARIANTS + 1) -> int:
    """How many distinct orders the shuffled tags of ``line`` have (repeated tags counted once per order), capped
    at ``limit``: 1 means the line cannot be shuffled (one tag to move or none, e.g. ``keep_tokens`` keeps all)."""
    rest = _tags(line, keep_tokens)[1]
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


def shuffle_tags(line: str, variants: int, keep_tokens: int = 0) -> tuple[str, ...]:
    """Return up to ``variants`` shuffled-tag versions of one caption line (kohya's ``shuffle_caption`` with
    ``keep_tokens``), before prefix and suffix: distinct orders, none the line's own order where the tags allow.

    The line is split on ``,``; each tag is stripped and empty tags dropped; the first ``keep_tokens`` tags stay
    in place and the rest are shuffled; tags are joined with ``", "``. Draw ``i`` is an order shuffled by a private
    ``random.Random`` seeded with the xxh64 of ``"<i>\\0<line>"`` (UTF-8), so the texts depend on the line alone:
    the same on every machine and run, and a changed line changes only its own variants. Draws ``0, 1, 2, ...``
    are taken in turn, skipping an order already taken and the line's own order, until ``variants`` are taken: a
    line whose first ``variants`` draws were distinct and shuffled gives the texts it gave before this rule (so
    its conditionings stay cached). A line with fewer shuffled orders than ``variants`` (:func:`tag_orders`) gives
    every order it has, its own last: fewer texts (one for a line that cannot be shuffled).
    """
    fixed, rest = _tags(line, keep_tokens)
    own = tuple(rest)
    orders = tag_orders(line, keep_tokens, variants + 1)
    chosen: list[tuple[str, ...]] = []
    if orders - 1 < variants:  # every order, the shuffled ones first
        every = list(_distinct_orders(rest))
        chosen = [o for o in every if o != own] + [own]
    else:
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
    return tuple(", ".join([*fixed, *order]) for order in chosen)


SOURCES_DIR = "sources"
"""Folder of the cache that holds one sources record per dataset name."""


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
            (see :class:`.video.FrameSettings`); images ignore it.
        shuffle_variants: ``0`` (off) or how many shuffled-tag texts each caption line gives (kohya's
            ``shuffle_caption``, see :func:`shuffle_tags`); the unshuffled line itself is then not encoded.
        keep_tokens: with shuffling, the leading comma-separated tags that stay in place (kohya's
            ``keep_tokens``, e.g. 1 for a trigger word at the start of every caption).
        empty_caption: also encode the empty caption ``""`` (one conditioning per text encoder), which caption
            dropout in training uses (``Sample.empty_caption``).
        masks: loss masks: ``"none"``, ``"masklabel"`` (``<stem>-masklabel.<ext>`` beside the image) or
            ``"alpha"`` (the image's alpha channel); see :func:`.imaging.load_mask`. Images only.
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

    def __post_init__(self) -> None:
        if type(self.shuffle_variants) is not int or not 0 <= self.shuffle_variants <= MAX_SHUFFLE_VARIANTS:
            raise ValueError(f"EncodeSettings.shuffle_variants must be an int from 0 (off) to "
                             f"{MAX_SHUFFLE_VARIANTS}, got {self.shuffle_variants!r}")
        if type(self.keep_tokens) is not int or not 0 <= self.keep_tokens <= MAX_KEEP_TOKENS:
            raise ValueError(f"EncodeSettings.keep_tokens must be an int from 0 to {MAX_KEEP_TOKENS}, "
                             f"got {self.keep_tokens!r}")
        if type(self.empty_caption) is not bool:
            raise TypeError(f"EncodeSettings.empty_caption must be a bool, got {self.empty_caption!r}")
        if self.masks not in MASK_MODES:
            raise ValueError(f"EncodeSettings.masks must be one of {MASK_MODES}, got {self.masks!r}")
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

    def caption_text(self, line: str) -> str:
        """Return the text encoded for one caption line: ``(prefix + line + suffix).strip()``."""
        return (self.caption_prefix + line + self.caption_suffix).strip()

    def caption_texts(self, line: str) -> tuple[str, ...]:
        """Return the texts encoded for one caption line: ``(caption_text(line),)``, or with shuffling the
        :func:`shuffle_tags` variants (distinct orders), each through :meth:`caption_text`."""
        if not self.shuffle_variants:
            return (self.caption_text(line),)
        return tuple(self.caption_text(t) for t in shuffle_tags(line, self.shuffle_variants, self.keep_tokens))

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
        if self.empty_caption:
            out["empty_caption"] = True
        if self.masks != "none":
            out["masks"] = self.masks
        return out


@dataclass(frozen=True)
class ClipJob:
    """What makes a latent job a clip: which frames, and for a frame folder the frame files.

    Attributes:
        indices: source frame indices to decode, in order (their count is the clip's frame count).
        frames: a ``.frames`` folder's frame files (absolute, in order; ``indices`` index them); empty for a video.
        frame_hashes: the content hash of each frame file, re-checked when it is decoded.
    """

    indices: tuple[int, ...]
    frames: tuple[str, ...] = ()
    frame_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LatentJob:
    """One latent to encode: the image, the hash its key was made from, and its crop plan.

    Attributes:
        key: the latent entry key.
        path: absolute image path.
        relpath: path relative to the dataset folder (reports).
        source_hash: xxh3-128 of the image bytes the key was computed from; the encoder re-checks it, so a file
            edited after planning can never be stored under the old content's key.
        plan: how the image becomes the bucket's pixels (each frame's, for a clip).
        clip: for a clip, its frames (``None`` for an image).
    """

    key: str
    path: str
    relpath: str
    source_hash: str
    plan: CropPlan
    clip: ClipJob | None = None
    mirror: bool = False

    @property
    def bucket(self) -> tuple[int, int]:
        """``(width, height)`` of the bucket."""
        return self.plan.bucket


@dataclass(frozen=True)
class MaskJob:
    """One loss mask to make (no encoder: see :func:`.imaging.load_mask`).

    Attributes:
        key: the mask entry key (:func:`.keys.mask_key`).
        path: the mask file (``masklabel``) or the image (``alpha``), absolute.
        relpath: ``path`` relative to the dataset folder (reports).
        source_hash: xxh3-128 of ``path``'s bytes, re-checked when it is read.
        plan: the crop plan of the latent the mask belongs to.
        mode: ``"masklabel"`` or ``"alpha"``.
        factor: the VAE's spatial compression.
    """

    key: str
    path: str
    relpath: str
    source_hash: str
    plan: CropPlan
    mode: str
    factor: int


@dataclass(frozen=True, eq=False)
class EncodePlan:
    """What :func:`plan_encode` found. Source counts are files (images and caption files).

    Attributes:
        cache_root: the cache directory.
        dataset: the dataset's name in the cache.
        folder: the source folder (absolute).
        settings: the settings the keys were computed with.
        vae_fingerprint: identity of the VAE the latent keys name.
        text_fingerprint: identity of the text encoder the conditioning keys name.
        new / changed / unchanged / removed: source files added, edited, as before, gone since the last plan.
        failures: unusable files (file + reason), sorted by path; their samples are not in ``samples``.
        skipped: listed images left out of ``samples`` because of a failure.
        samples: the dataset as it will be once encoded (scan order).
        missing_latents: bucket -> latents of images to encode (one job per distinct key, sorted by path).
        missing_clips: latents of clips to encode, by bucket ``(frames, height, width)`` then path.
        missing_conditionings: key -> final caption text to encode (each distinct text once).
        reused: distinct entries the samples need that the cache already has.
        dataset_current: the cache already holds this dataset with exactly these samples (by the
            ``samples_digest`` its info records, so the dataset file is not loaded).
        sourceless: the folder is gone and the dataset is served from the cache as it was.
        validation: the sources validation (``None`` when sourceless).
        notes: what the plan changed or wants the user to know (caption lines cut at :data:`MAX_CAPTION_CHARS`,
            images with many caption variants, images without a mask, unused mask files), for the report.
        missing_masks: loss masks to make, sorted by path.
        empty_caption: the empty caption's conditioning key (``settings.empty_caption``), else ``None``.
        images_without_mask: images that train unmasked (full weight): with ``masks="masklabel"`` those without
            a mask file, with ``masks="alpha"`` those without an alpha channel.
        unused_masks: mask files in the folder that no sample uses.
        short_clips: clips that give fewer frames than asked, each ``"<relpath>: <taken> of <asked> frames
            (why)"``, sorted by path (they are kept, in frame buckets of their own, and named in ``notes``).
    """

    cache_root: str
    dataset: str
    folder: str
    settings: EncodeSettings
    vae_fingerprint: str
    text_fingerprint: str
    new: int
    changed: int
    unchanged: int
    removed: int
    failures: tuple[SourceFailure, ...]
    samples: tuple[Sample, ...]
    missing_latents: Mapping[tuple[int, int], tuple[LatentJob, ...]]
    missing_conditionings: Mapping[str, str]
    reused: int
    dataset_current: bool
    skipped: int = 0
    sourceless: bool = False
    validation: Validation | None = None
    notes: tuple[str, ...] = ()
    missing_clips: tuple[LatentJob, ...] = ()
    missing_masks: tuple[MaskJob, ...] = ()
    empty_caption: str | None = None
    images_without_mask: int = 0
    unused_masks: int = 0
    short_clips: tuple[str, ...] = ()

    @property
    def needs_vae(self) -> bool:
        """Whether any latent must be encoded, or a mask while the VAE's spatial factor is unknown (load the VAE
        only then: masks are made without it)."""
        return (any(self.missing_latents.values()) or bool(self.missing_clips)
                or (bool(self.missing_masks) and self.settings.mask_factor is None))

    @property
    def needs_text_encoder(self) -> bool:
        """Whether any conditioning must be encoded (load the text encoder only then)."""
        return bool(self.missing_conditionings)

    @property
    def latent_count(self) -> int:
        """Number of latents to encode."""
        return sum(len(jobs) for jobs in self.missing_latents.values()) + len(self.missing_clips)

    @property
    def up_to_date(self) -> bool:
        """True when there is nothing to encode and the dataset is already stored as planned."""
        return (not self.needs_vae and not self.needs_text_encoder and not self.missing_masks
                and self.dataset_current)

    def counts(self) -> dict[str, int]:
        """Source file counts and work to do, for logs and the dataset's info."""
        return {
            "new": self.new, "changed": self.changed, "unchanged": self.unchanged, "removed": self.removed,
            "failed": len(self.failures), "skipped": self.skipped, "samples": len(self.samples),
            "latents_to_encode": self.latent_count,
            "conditionings_to_encode": len(self.missing_conditionings), "reused": self.reused,
            "masks_to_encode": len(self.missing_masks),
        }

    def variants(self) -> dict[str, int]:
        """What the planned dataset holds beyond one latent and caption per sample, for the report: distinct
        caption conditionings, mirrors and masks, whether the empty caption is named (0/1), and the settings."""
        return variant_counts(self.samples, self.settings)

    def summary(self) -> str:
        """A one-line description for logs and UI."""
        if self.sourceless:
            return (f"dataset {self.dataset!r}: source folder {self.folder} is gone; {len(self.samples)} samples "
                    f"are served from the cache ({self.removed} source files removed, nothing to encode)")
        masks = f", {len(self.missing_masks)} masks" if self.missing_masks else ""
        return (f"dataset {self.dataset!r}: {len(self.samples)} samples; to encode {self.latent_count} latents "
                f"and {len(self.missing_conditionings)} conditionings{masks}, {self.reused} entries reused; sources "
                f"{self.new} new, {self.changed} changed, {self.unchanged} unchanged, {self.removed} removed"
                + (f"; {len(self.failures)} failed" if self.failures else ""))


def variant_counts(samples: Sequence[Sample], settings: EncodeSettings | None = None) -> dict[str, int]:
    """Distinct caption conditionings, mirrors and masks the samples name, and whether they name an empty
    caption (0/1); with ``settings``, the shuffle count too (``shuffle_variants``) and, with ``flip="always"``, how
    many samples are stored mirrored (``flipped``: all of them)."""
    keys = role_keys(samples)
    out = {"captions": len(keys["captions"]), "mirrors": len(keys["mirrors"]), "masks": len(keys["masks"]),
           "masked_samples": sum(1 for s in samples if s.mask is not None),
           "empty_caption": int(bool(keys["empty_caption"]))}
    if settings is not None:
        out["shuffle_variants"] = settings.shuffle_variants
        if settings.bucket.flip == "always":
            out["flipped"] = len(samples)
    return out


def sources_record_path(cache_root: str | os.PathLike[str], dataset: str) -> Path:
    """Return ``<cache>/sources/<slug>-<hash>.json``, the sources record of dataset ``dataset``.

    The id is a readable slug of the name plus an xxh3-64 of the exact name, so two names that slug alike
    (``"a b"`` and ``"a_b"``) never share a record.
    """
    if not isinstance(dataset, str) or not dataset:
        raise ValueError(f"dataset name must be a non-empty str, got {dataset!r}")
    slug = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_" for ch in dataset)
    slug = slug.lstrip(".")[:48] or "dataset"
    return Path(cache_root) / SOURCES_DIR / f"{slug}-{xxhash.xxh3_64_hexdigest(dataset.encode('utf-8'))}.json"


def settle_sources(plan: EncodePlan) -> None:
    """Record that the dataset is now stored from the sources ``plan`` saw: the next plan counts new, changed and
    removed files against them. Left as it is when another plan has saved a different record meanwhile (the
    next plan then counts against the older sources: more files "new" than strictly are, never fewer)."""
    if plan.sourceless or plan.validation is None or not plan.validation.record.pending:
        return
    path = sources_record_path(plan.cache_root, plan.dataset)
    current = _load_record(path)
    if current.same_sources(plan.validation.record):
        save_record(current.settled(), path)


def _check_cache_location(root: str) -> None:
    """Refuse, before the sources record is written, a cache with linked parts or one that would nest."""
    if not is_regular_file(os.path.join(root, MANIFEST)):
        check_new_cache_location(root)
    check_no_links(root)


def _load_record(path: Path) -> SourcesRecord:
    try:
        return load_record(path, missing_ok=True)
    except SourcesRecordError as exc:  # costs one re-hash of every file, never a re-encode
        log.warning("%s; validating against an empty record instead", exc)
        return SourcesRecord()


def _cache_view(cache_root: str | os.PathLike[str], dataset: str, *, load: bool
                ) -> tuple[set[str], list[Sample] | None, dict[str, Any] | None]:
    """Return the cache's entry keys, the stored samples of ``dataset`` (only with ``load``) and its info
    (``None`` when the cache or the dataset does not exist)."""
    try:
        reader = open_cache(cache_root, verify=False, strict=False)  # damaged shards count as absent
    except CacheNotFoundError:
        return set(), None, None
    with reader:
        keys = set(reader.keys())
        stored: list[Sample] | None = None
        found = reader.datasets().get(dataset)
        if found is not None and load:
            try:
                stored = reader.dataset(dataset)
            except CacheError as exc:  # a damaged dataset file is rewritten by the encode
                log.warning("dataset %r cannot be read (%s); it will be rewritten", dataset, exc)
    return keys, stored, (found.info if found is not None else None)


def samples_digest(samples: Sequence[Sample]) -> str:
    """Return an xxh3-128 digest of a sample list (stored in the dataset's info as ``samples_digest``).

    Lets a plan tell whether the stored dataset already matches without loading its file (a 100k-sample dataset
    file takes about a second to load and check).
    """
    h = xxhash.xxh3_128()
    for s in samples:
        line = f"{s.latent}|{','.join(s.captions)}|{s.repeats}|{s.source or ''}"
        if s.mirror is not None or s.mask is not None or s.empty_caption is not None:  # else as before variants
            line += f"|{s.mirror or ''}|{s.mask or ''}|{s.empty_caption or ''}"
        h.update(f"{line}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _output_settings(described: Mapping[str, Any]) -> dict[str, Any]:
    """The described settings that change stored values (not batch size, threads, shard size or policy)."""
    out = {k: described.get(k) for k in ("bucket", "caption_prefix", "caption_suffix", "video")}
    if isinstance(out["bucket"], Mapping) and "upscale" not in out["bucket"]:
        out["bucket"] = {**out["bucket"], "upscale": True}  # datasets stored before the setting always upscaled
    if out["video"] is None:
        out["video"] = FrameSettings().describe()  # datasets stored before clips: the defaults (no clip in them)
    # variant settings: absent (as in datasets stored before them) means the default
    shuffle = described.get("shuffle_variants", 0)
    out["shuffle_variants"] = shuffle
    out["keep_tokens"] = described.get("keep_tokens", 0) if shuffle else 0  # no effect without shuffling
    out["empty_caption"] = described.get("empty_caption", False)
    out["masks"] = described.get("masks", "none")
    return out


def _sourceless_plan(cache_root: str, dataset: str, folder: str, settings: EncodeSettings, vae_fp: str,
                     text_fp: str, record_path: Path) -> EncodePlan:
    _keys, stored, info = _cache_view(cache_root, dataset, load=True)
    info = info or {}
    if stored is None:
        raise DatasetFolderError(folder, "dataset folder does not exist and the cache at "
                                         f"{cache_root} holds no dataset {dataset!r} to train from; check the path")
    want = {"vae_fingerprint": vae_fp, "text_fingerprint": text_fp, **_output_settings(settings.describe())}
    have = {"vae_fingerprint": info.get("vae_fingerprint"), "text_fingerprint": info.get("text_fingerprint"),
            **_output_settings(info.get("settings") or {})}
    differ = sorted(k for k in want if want[k] != have.get(k))
    if differ:  # the stored entries were made by other encoders or settings: training on them would be wrong
        raise DatasetFolderError(folder, f"dataset folder does not exist, and dataset {dataset!r} in the cache was "
                                         f"encoded with other {', '.join(differ)} than requested, so it cannot be "
                                         "re-encoded; restore the folder or use the settings it was built with")
    record = _load_record(record_path)
    log.info("%s: source folder is gone; dataset %r (%d samples) is served from the cache", folder, dataset,
             len(stored))
    return EncodePlan(
        cache_root=cache_root, dataset=dataset, folder=folder, settings=settings, vae_fingerprint=vae_fp,
        text_fingerprint=text_fp, new=0, changed=0, unchanged=0, removed=len(record), failures=(),
        samples=tuple(stored), missing_latents={}, missing_conditionings={}, reused=0, dataset_current=True,
        sourceless=True,
    )


def plan_encode(
    folder: str | os.PathLike[str],
    cache_root: str | os.PathLike[str],
    *,
    dataset: str,
    settings: EncodeSettings,
    vae_fingerprint: str,
    text_fingerprint: str,
    threads: int | None = None,
) -> EncodePlan:
    """Validate and scan ``folder``, key every sample, and list what the cache lacks. Loads no encoder.

    Saves the updated sources record of ``dataset`` before returning (creating ``<cache>/sources/``).

    Args:
        folder: the image + caption folder (kohya layout allowed, see :mod:`.scan`).
        cache_root: the cache directory (it need not exist yet).
        dataset: the dataset's name in the cache; the sources record is kept per name.
        settings: bucketing, caption and batching settings.
        vae_fingerprint: identity of the VAE (see :mod:`.keys`); part of every latent key.
        text_fingerprint: identity of the text encoder; part of every conditioning key.
        threads: hashing and header-reading threads; ``None`` chooses from the CPUs this process may use.

    Raises:
        DatasetFolderError: the folder is missing (and the cache has no such dataset), is not a folder, or holds
            no usable image.
        CacheLinkError: a part of the cache is a symbolic link (nothing is written).
        CacheNestingError: the cache would be created inside another cache (nothing is written).
        ValueError: an empty fingerprint or dataset name.
    """
    check_dataset_name(dataset)  # before hours of encoding, not when the dataset is stored at the end
    for name, fp in (("vae_fingerprint", vae_fingerprint), ("text_fingerprint", text_fingerprint)):
        if not isinstance(fp, str) or not fp:
            raise ValueError(f"{name} must be a non-empty str identifying the encoder (see keys.fingerprint)")
    with gc_paused():  # a plan allocates a few acyclic objects per file: see .gcpause
        return _plan_encode(folder, cache_root, dataset, settings, vae_fingerprint, text_fingerprint, threads)


def _plan_encode(folder: str | os.PathLike[str], cache_root: str | os.PathLike[str], dataset: str,
                 settings: EncodeSettings, vae_fingerprint: str, text_fingerprint: str, threads: int | None
                 ) -> EncodePlan:
    root = os.path.abspath(os.fspath(cache_root))
    src = os.path.abspath(os.fspath(folder))
    record_path = sources_record_path(root, dataset)
    _check_cache_location(root)
    if not os.path.exists(src):
        return _sourceless_plan(root, dataset, src, settings, vae_fingerprint, text_fingerprint, record_path)

    validation = validate_sources(src, _load_record(record_path), threads=threads)
    record = validation.record
    scan = scan_folder(validation.listing, known_sizes=record.image_sizes(), known_captions=record.caption_lines(),
                       threads=threads)
    if validation.record_changed:  # else the record is current
        frames = [f for clip in scan.clips for f in clip.frames]
        save_record(record.with_image_sizes([*scan.images, *frames]), record_path)  # before any encode: never re-hash

    acc = _Planned(PlanKeys(vae_fingerprint, text_fingerprint))
    if settings.empty_caption:  # the text "" itself: no prefix or suffix (dropout trains with no caption)
        acc.empty = acc.keys.conditioning("")
        acc.texts[acc.empty] = ""
    _plan_images(scan.images, record, validation.listing, settings, acc)
    samples, latents, masks, texts, empty = acc.samples, acc.latents, acc.masks, acc.texts, acc.empty
    unplannable, cut, many, no_mask = acc.unplannable, acc.cut, acc.many, acc.no_mask

    have, _stored, info = _cache_view(root, dataset, load=False)
    short: list[str] = []  # clips that give fewer frames than asked, each with why
    clips = _plan_clips(scan.clips, record, settings, vae_fingerprint, acc.keys, samples, texts, unplannable, cut,
                        many, empty, have, short)
    try:
        check_epoch_size(samples, f"dataset {dataset!r}")
    except ValueError as exc:  # before any encode: the dataset could never be stored
        raise DatasetFolderError(src, str(exc)) from None
    digest = samples_digest(samples)
    missing = _Missing.of(latents, texts, masks, clips, have)
    unused = _unused_masks(settings, validation.listing)
    unique = {(f.relpath, f.reason): f for f in (*validation.failures, *scan.failures, *unplannable)}
    counts = validation.counts()
    return EncodePlan(
        cache_root=root, dataset=dataset, folder=src, settings=settings, vae_fingerprint=vae_fingerprint,
        text_fingerprint=text_fingerprint, new=counts["new"], changed=counts["changed"],
        unchanged=counts["unchanged"], removed=counts["removed"],
        failures=tuple(unique[k] for k in sorted(unique)), samples=tuple(samples),
        missing_latents=missing.latents, missing_conditionings=missing.texts,
        reused=(sum(k in have for k in latents) + sum(k in have for k in clips) + sum(k in have for k in texts)
                + sum(k in have for k in masks)),
        dataset_current=info is not None and info.get("samples_digest") == digest, validation=validation,
        skipped=_listed_samples(validation) - len(samples),
        notes=(_caption_notes(cut, many) + _clip_notes(settings, short)
               + _mask_notes(settings, no_mask, unused, validation.listing, bool(scan.clips))
               + shuffle_notes(settings, [*(i.captions for i in scan.images), *(c.captions for c in scan.clips)])),
        missing_clips=missing.clips, missing_masks=missing.masks, empty_caption=empty,
        images_without_mask=len(no_mask), unused_masks=len(unused), short_clips=tuple(short),
    )


@dataclass
class _Planned:
    """What planning the folder's images (then its clips) adds up: the samples and the entries they need."""

    keys: PlanKeys
    samples: list[Sample] = field(default_factory=list)
    latents: dict[str, LatentJob] = field(default_factory=dict)
    masks: dict[str, MaskJob] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    unplannable: list[SourceFailure] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)  # images with a caption line cut at MAX_CAPTION_CHARS
    many: list[str] = field(default_factory=list)  # images with more than CAPTION_VARIANTS_NOTE caption lines
    no_mask: list[str] = field(default_factory=list)  # images without a mask file (masklabel) or alpha (alpha)
    empty: str | None = None  # the empty caption's key, when caption dropout is planned


def _plan_images(images: Sequence[SourceImage], record: SourcesRecord, listing: FolderListing,
                 settings: EncodeSettings, acc: _Planned) -> None:
    """Key each image's crop plan, mirror, mask and captions into ``acc``; one that cannot be planned is named
    among ``acc.unplannable``."""
    bucket = settings.bucket
    center: dict[tuple[int, int], CropPlan] = {}  # a center crop depends on the size alone
    mirrors: dict[CropPlan, CropPlan] = {}
    for img in images:
        entry = record.get(img.relpath)
        if entry is None:  # could not be hashed: already listed among the validation failures
            continue
        too_many = _too_many_variants(img.captions, settings)
        if too_many:
            acc.unplannable.append(SourceFailure(img.relpath, img.path, too_many))
            continue
        try:
            if bucket.crop == "center":
                plan = center.get((img.width, img.height))
                if plan is None:
                    plan = center[(img.width, img.height)] = bucket.plan(img.width, img.height)
            else:
                plan = bucket.plan(img.width, img.height, token=entry.hash)
        except ValueError as exc:  # e.g. smaller than one bucket step with upscale off: left out, named
            acc.unplannable.append(SourceFailure(img.relpath, img.path, str(exc)))
            continue
        mkey = None
        if settings.masks != "none":
            found = _mask_job(img, entry.hash, plan, settings, listing, record)
            if isinstance(found, SourceFailure):
                acc.unplannable.append(found)
                continue
            if found is None:
                acc.no_mask.append(img.relpath)
            else:
                mkey = found.key
                acc.masks.setdefault(mkey, found)
        lkey = acc.keys.latent(entry.hash, plan)
        if lkey not in acc.latents:
            acc.latents[lkey] = LatentJob(lkey, img.path, img.relpath, entry.hash, plan)
        mirror = None
        if bucket.flip == "random":
            mplan = mirrors.get(plan)
            if mplan is None:
                mplan = mirrors[plan] = bucket.mirror_plan(plan)
            mirror = acc.keys.latent(entry.hash, mplan)
            if mirror not in acc.latents:
                acc.latents[mirror] = LatentJob(mirror, img.path, img.relpath, entry.hash, mplan, mirror=True)
        ckeys = _caption_keys(img.captions, img.relpath, settings, acc.keys, acc.texts, acc.cut, acc.many)
        acc.samples.append(Sample(lkey, ckeys, img.repeats, img.relpath, mirror=mirror, mask=mkey,
                                  empty_caption=acc.empty))


@dataclass(frozen=True)
class _Missing:
    """The planned entries the cache does not hold yet, in the order the run encodes them."""

    latents: dict[tuple[int, int], tuple[LatentJob, ...]]
    texts: dict[str, str]
    masks: tuple[MaskJob, ...]
    clips: tuple[LatentJob, ...]

    @classmethod
    def of(cls, latents: dict[str, LatentJob], texts: dict[str, str], masks: dict[str, MaskJob],
           clips: dict[str, LatentJob], have: set[str]) -> _Missing:
        by_bucket: dict[tuple[int, int], list[LatentJob]] = {}
        for job in latents.values():
            if job.key not in have:
                by_bucket.setdefault(job.bucket, []).append(job)
        return cls(
            {b: tuple(sorted(jobs, key=lambda j: j.relpath)) for b, jobs in sorted(by_bucket.items())},
            {k: t for k, t in texts.items() if k not in have},
            tuple(sorted((j for j in masks.values() if j.key not in have), key=lambda j: (j.relpath, j.key))),
            tuple(sorted((j for j in clips.values() if j.key not in have),
                         key=lambda j: (len(j.clip.indices) if j.clip else 0, j.bucket[1], j.bucket[0], j.relpath))))


def _mask_job(img: SourceImage, image_hash: str, plan: CropPlan, settings: EncodeSettings, listing: FolderListing,
              record: SourcesRecord) -> MaskJob | SourceFailure | None:
    """The mask of one image (``None``: it has no mask file), or why the image must be left out (a mask that is
    a link out of the folder, unreadable, or of another aspect ratio: named, never a crash)."""
    mode = settings.masks
    if mode == "alpha":
        path, relpath, source_hash = img.path, img.relpath, image_hash
        try:
            if not _has_alpha(path, image_hash):  # e.g. a JPEG: no mask, trained as with masks off
                return None
        except SourceError as exc:
            return SourceFailure(img.relpath, img.path, f"left out: {exc.reason}")
    else:
        if img.relpath in listing.refused_masks:
            return SourceFailure(img.relpath, img.path, "left out: its mask file is a symbolic link outside the "
                                 "dataset folder (see that file's line)")
        relpath = listing.mask_of.get(img.relpath)  # type: ignore[assignment]
        if relpath is None:
            return None
        path = listing.abspath(relpath)
        entry = record.get(relpath)
        if entry is None:  # could not be hashed: listed among the validation failures
            return SourceFailure(img.relpath, img.path, f"left out: its mask {relpath} cannot be read (see that "
                                 "file's line)")
        source_hash = entry.hash
        if entry.width is not None and entry.height is not None:
            size = (entry.width, entry.height)
        else:
            try:
                size = read_image_size(path)
            except SourceError as exc:
                return SourceFailure(relpath, path, f"mask of {img.relpath}: {exc.reason}")
        problem = mask_aspect_problem(size, (img.width, img.height))
        if problem:
            return SourceFailure(relpath, path, f"mask of {img.relpath}: {problem}")
    factor = settings.mask_factor
    if factor is None:  # unknown until the VAE is loaded: a key no stored mask has, so the VAE is asked for
        key = content_key("mask-unresolved", {"source": source_hash, "mode": mode, "pixels": plan.key_fields()})
        factor = 0
    else:
        key = mask_key(source_hash, mode, plan.key_fields(), factor)
    return MaskJob(key, path, relpath, source_hash, plan, mode, factor)


@functools.lru_cache(maxsize=1 << 16)
def _has_alpha(path: str, content_hash: str) -> bool:
    """:func:`.imaging.has_alpha`, once per file content in a process: a plan runs two or three times per encode
    (the node plans before loading anything), and a warm one should not open every image again."""
    return has_alpha(path)


def _unused_masks(settings: EncodeSettings, listing: FolderListing) -> tuple[str, ...]:
    """The mask files no sample uses: those of no image, or every one unless ``masks`` is ``masklabel``."""
    return listing.unused_masks if settings.masks == "masklabel" else tuple(m[0] for m in listing.masks)


def _mask_notes(settings: EncodeSettings, no_mask: Sequence[str], unused: Sequence[str], listing: FolderListing,
                clips: bool) -> tuple[str, ...]:
    notes = []
    if settings.masks == "none":
        if listing.masks:
            notes.append(f"{len(listing.masks)} mask file(s) (<name>-masklabel.<ext>, e.g. {listing.masks[0][0]}) "
                         "are in the folder but masks is none: they are not used (set masks to masklabel)")
        return tuple(notes)
    if no_mask and settings.masks == "alpha":
        names = sorted(no_mask)
        notes.append(f"{len(names)} image(s) have no alpha channel (e.g. JPEGs) and train unmasked, as with masks "
                     f"none: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}")
    elif no_mask:
        notes.append(f"{len(no_mask)} image(s) have no mask file <name>-masklabel.<ext> and train at full weight "
                     f"(first: {sorted(no_mask)[0]})")
    if unused:
        notes.append(f"{len(unused)} mask file(s) belong to no image and are not used (first: {unused[0]})")
    if clips:
        notes.append("clips get no loss mask: masks apply to images only")
    return tuple(notes)


def _listed_samples(validation: Validation) -> int:
    """Samples the listing holds: images and videos, and one per ``.frames`` folder (not one per frame)."""
    folders = set()
    n = 0
    for item in validation.listing.images:
        folder = clip_folder_of(item.relpath)
        if folder is None:
            n += 1
        elif folder not in folders:
            folders.add(folder)
            n += 1
    return n


SHORT_CLIPS_NAMED = 20
"""Clips giving fewer frames than asked that the report's note names one by one (then a count; the plan's
``short_clips`` and the node's structured report hold them all)."""


def _clip_notes(settings: EncodeSettings, short: Sequence[str]) -> tuple[str, ...]:
    video = settings.video
    notes = []
    if video.stride and video.stride > 1 and video.effective_frames != video.frames:
        notes.append(f"frame count {video.frames} is taken as {video.effective_frames}: the VAE compresses time by "
                     f"{video.stride}, so it encodes 1 + {video.stride}·m frames without dropping any")
    if short:
        more = f"; and {len(short) - SHORT_CLIPS_NAMED} more" if len(short) > SHORT_CLIPS_NAMED else ""
        notes.append(f"{len(short)} clip(s) give fewer frames than the {video.effective_frames} asked; each trains "
                     "with the frames it gives, in the bucket of that frame count: "
                     + "; ".join(short[:SHORT_CLIPS_NAMED]) + more)
    return tuple(notes)


def _too_many_variants(captions: Sequence[str], settings: EncodeSettings) -> str | None:
    """Why a sample's caption variants (lines, times the shuffles of each) are too many to encode, or ``None``."""
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


def _caption_keys(captions: Sequence[str], relpath: str, settings: EncodeSettings, keys: PlanKeys,
                  texts: dict[str, str], cut: list[str], many: list[str]) -> tuple[str, ...]:
    """The conditioning keys of one sample's caption lines (with shuffling, every line's variants, each text
    once; without, one per line, duplicates kept: they weight that line); adds their texts to ``texts``."""
    if len(captions) > CAPTION_VARIANTS_NOTE:
        many.append(relpath)
    out = []
    for line in captions:
        if len(line) > MAX_CAPTION_CHARS:
            cut.append(relpath)
            line = line[:MAX_CAPTION_CHARS]
        for text in settings.caption_texts(line):
            ckey = keys.conditioning(text)
            texts.setdefault(ckey, text)
            out.append(ckey)
    return tuple(dict.fromkeys(out)) if settings.shuffle_variants else tuple(out)


def _clip_key(source_hash: str, plan: CropPlan, vae_fp: str, video: FrameSettings, kind: str,
              indices: tuple[int, ...], have: set[str]) -> str:
    """A clip's latent key: the frames it takes (:func:`.video.clip_key_fields`), or the key an earlier build
    gave it for these settings when the cache holds that one (its clips are kept, not encoded again)."""
    key = latent_key(source_hash, plan.key_fields(), vae_fp, extra=clip_key_fields(kind, indices, video.stride))
    if key not in have and video.stride is not None:
        legacy = latent_key(source_hash, plan.key_fields(), vae_fp,
                            extra=legacy_clip_key_fields(video, kind, indices))
        if legacy in have:
            return legacy
    return key


def _plan_clips(clips: Sequence[SourceClip], record: SourcesRecord, settings: EncodeSettings, vae_fp: str,
                keys: PlanKeys, samples: list[Sample], texts: dict[str, str], unplannable: list[SourceFailure],
                cut: list[str], many: list[str], empty: str | None, have: set[str], short: list[str]
                ) -> dict[str, LatentJob]:
    """Key every clip (its bytes, or its frames' in order, plus the crop plan and the frames it takes), add its
    sample; return the latent jobs by key. Clips that cannot be planned are added to ``unplannable``, clips that
    give fewer frames than asked to ``short`` (``"<relpath>: <taken> of <asked> frames (why)"``)."""
    jobs: dict[str, LatentJob] = {}
    video = settings.video
    for clip in clips:
        if video.stride == 0:
            unplannable.append(SourceFailure(clip.relpath, clip.path, (
                "is a video clip, but the VAE encodes still images only (it reads a batch as separate images); "
                "connect a video VAE (e.g. WAN's) or move the clip out of the folder")))
            continue
        too_many = _too_many_variants(clip.captions, settings)
        if too_many:
            unplannable.append(SourceFailure(clip.relpath, clip.path, too_many))
            continue
        if clip.kind == "video":
            entry = record.get(clip.relpath)
            if entry is None:  # could not be hashed: already a validation failure
                continue
            source_hash = entry.hash
            frame_paths: tuple[str, ...] = ()
            frame_hashes: tuple[str, ...] = ()
        else:
            entries = [record.get(f.relpath) for f in clip.frames]
            if any(e is None for e in entries):
                continue
            frame_hashes = tuple(e.hash for e in entries if e is not None)
            names = [f.relpath.rpartition("/")[2] for f in clip.frames]
            # the frames' names (within the folder) and contents in order: moving the folder keeps the key
            source_hash = hash_bytes("\n".join(f"{n}\t{h}" for n, h in zip(names, frame_hashes)).encode("utf-8",
                                                                                                 "surrogatepass"))
            frame_paths = tuple(f.path for f in clip.frames)
        try:
            plan = settings.bucket.plan(clip.width, clip.height, token=source_hash)
        except ValueError as exc:
            unplannable.append(SourceFailure(clip.relpath, clip.path, str(exc)))
            continue
        indices = video.indices(clip.frame_count, clip.rate)
        width, height = plan.bucket
        need = len(indices) * width * height * 3 * 4
        if need > MAX_CLIP_PIXEL_BYTES:
            unplannable.append(SourceFailure(clip.relpath, clip.path, (
                f"{len(indices)} frames at {width}x{height} take {need / (1 << 30):.1f} GiB of pixels to encode, "
                f"above the limit of {MAX_CLIP_PIXEL_BYTES >> 30} GiB; lower the frame count or the resolution")))
            continue
        lack = video.shortfall(clip.frame_count, clip.rate)
        if lack is not None:
            short.append(f"{clip.relpath}: {lack}")
        lkey = _clip_key(source_hash, plan, vae_fp, video, clip.kind, indices, have)
        if lkey not in jobs:
            jobs[lkey] = LatentJob(lkey, clip.path, clip.relpath, source_hash, plan,
                                   ClipJob(indices, frame_paths, frame_hashes))
        mirror = None
        if settings.bucket.flip == "random":
            mplan = settings.bucket.mirror_plan(plan)
            mirror = _clip_key(source_hash, mplan, vae_fp, video, clip.kind, indices, have)
            if mirror not in jobs:
                jobs[mirror] = LatentJob(mirror, clip.path, clip.relpath, source_hash, mplan,
                                         ClipJob(indices, frame_paths, frame_hashes), mirror=True)
        ckeys = _caption_keys(clip.captions, clip.relpath, settings, keys, texts, cut, many)
        samples.append(Sample(lkey, ckeys, clip.repeats, clip.relpath, mirror=mirror, empty_caption=empty))
    return jobs


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
    for lines in captions:
        for line in lines:
            line = line[:MAX_CAPTION_CHARS]
            orders = tag_orders(line, keep, variants + 1)
            if orders == 1:
                fixed, rest = _tags(line, keep)
                (kept if len(fixed) + len(rest) > 1 and len(rest) <= 1 else single).append(line)
            elif orders - 1 < variants:
                short.setdefault(line, orders)
    notes = []
    if kept:
        kept = sorted(set(kept))
        notes.append(f"{len(kept)} caption line(s) cannot be shuffled: keep_tokens {keep} keeps all their tags in "
                     f"place (or all but one), so they train unshuffled (e.g. {kept[0][:80]!r}); lower keep_tokens")
    if single:
        single = sorted(set(single))
        notes.append(f"{len(single)} caption line(s) cannot be shuffled: they have one comma-separated tag (or "
                     f"only the same tag repeated), so they train unshuffled (e.g. {single[0][:80]!r})")
    if short:
        line, orders = min(short.items())
        notes.append(f"{len(short)} caption line(s) have fewer tag orders than shuffle_variants {variants} asks for "
                     f"(e.g. {line[:80]!r}: {orders} orders): each gives every order it has, its own among them")
    return tuple(notes)


def _caption_notes(cut: Sequence[str], many: Sequence[str]) -> tuple[str, ...]:
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
