"""What an encode plan is made of: its jobs, the plan itself and its tallies (the settings it was computed with are
:mod:`.encode_settings`').

Shared by the planning (:mod:`.encode_plan`, :mod:`.clip_plan`, :mod:`.mask_plan`), the run (:mod:`.encode_run`)
and the node, none of which needs the others' code to name them; the settings' ``describe`` is stored in a dataset's
info, so its fields and defaults are part of the format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .buckets import CropPlan
from .dataset import Sample
from .encode_settings import EncodeSettings
from .encode_report import CaptionExample
from .errors import SourceFailure
from .keys import PlanKeys
from .sources import Validation
from .variants import role_keys

__all__ = [
    "ClipJob",
    "LatentJob",
    "MaskJob",
    "EncodePlan",
    "Planned",
    "variant_counts",
    "caption_example",
    "CAPTION_EXAMPLE_TEXTS",
]

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
        mirror: the latent is a training image's mirror of ``flip="random"`` (counted in the report).
        reference: the image is a reference image (:mod:`.reference_plan`), not a training image.
    """

    key: str
    path: str
    relpath: str
    source_hash: str
    plan: CropPlan
    clip: ClipJob | None = None
    mirror: bool = False
    reference: bool = False

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
    """What :func:`.encode_plan.plan_encode` found. Source counts are files (images and caption files).

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
        notes: what the plan changed or wants the user to know (caption lines cut at
            :data:`.captions.MAX_CAPTION_CHARS`, images with many caption variants, images without a mask, unused
            mask files), for the report.
        missing_masks: loss masks to make, sorted by path.
        empty_caption: the empty caption's conditioning key (``settings.empty_caption``), else ``None``.
        images_without_mask: images that train unmasked (full weight): with ``masks="masklabel"`` those without
            a mask file, with ``masks="alpha"`` those without an alpha channel.
        unused_masks: mask files in the folder that no sample uses.
        short_clips: clips that give fewer frames than asked, each ``"<relpath>: <taken> of <asked> frames
            (why)"``, sorted by path (they are kept, in frame buckets of their own, and named in ``notes``).
        caption_example: with tag shuffles or wildcards, what the first sample with several caption texts trains
            with, for the report: its source, how many distinct texts it has, and the first of them (at most
            :data:`CAPTION_EXAMPLE_TEXTS`); ``None`` otherwise.
        tag_frequency: ``folder -> tag -> images`` of the folder's captions (:mod:`.tag_frequency`), kept in the
            dataset's info for the metadata of the LoRAs trained from it.
        tags_current: the stored dataset's info already holds ``tag_frequency`` (else the dataset is stored again
            even when its samples are unchanged, so a cache encoded before the counts existed gains them).
        reference_validation: the reference folder's validation (``settings.reference_folder``), whose record
            is settled with the dataset's; ``None`` without one.
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
    caption_example: CaptionExample | None = None
    tag_frequency: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    tags_current: bool = True
    reference_validation: Validation | None = None

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
        """True when there is nothing to encode and the dataset is already stored as planned (its info too)."""
        return (not self.needs_vae and not self.needs_text_encoder and not self.missing_masks
                and self.dataset_current and self.tags_current)

    def counts(self) -> dict[str, int]:
        """Source file counts and work to do, for logs and the dataset's info."""
        return {
            "new": self.new, "changed": self.changed, "unchanged": self.unchanged, "removed": self.removed,
            "failed": len(self.failures), "skipped": self.skipped, "samples": len(self.samples),
            "latents_to_encode": self.latent_count,
            "conditionings_to_encode": len(self.missing_conditionings), "reused": self.reused,
            "masks_to_encode": len(self.missing_masks),
        }

    def variants(self) -> dict[str, int | float]:
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


CAPTION_EXAMPLE_TEXTS = 4
"""Caption texts of one sample the report shows, so the settings' effect can be seen before training."""


def caption_example(samples: Sequence[Sample], texts: Mapping[str, str], settings: EncodeSettings
                    ) -> CaptionExample | None:
    """:attr:`EncodePlan.caption_example`: the first sample with several distinct caption texts, with tag shuffles
    or wildcards on; ``None`` otherwise (or when none has several)."""
    if not (settings.shuffle_variants or settings.wildcards):
        return None
    for sample in samples:
        distinct = list(dict.fromkeys(sample.captions))
        if len(distinct) > 1 and all(k in texts for k in distinct):
            shown = tuple(texts[k] for k in distinct[:CAPTION_EXAMPLE_TEXTS])
            return CaptionExample(sample.source or sample.latent, len(distinct), shown)
    return None


def variant_counts(samples: Sequence[Sample], settings: EncodeSettings | None = None) -> dict[str, int | float]:
    """Distinct caption conditionings, mirrors and masks the samples name (and how many have a mask), whether they
    name an empty caption (0/1), with reference images their distinct latents and how many samples have one; with
    ``settings``, the shuffle count too (``shuffle_variants``, and ``tag_dropout`` and ``wildcards`` (1) when set)
    and, with ``flip="always"``, how many samples are stored mirrored (``flipped``: all of them)."""
    keys = role_keys(samples)
    out: dict[str, int | float] = {
        "captions": len(keys["captions"]), "mirrors": len(keys["mirrors"]), "masks": len(keys["masks"]),
        "masked_samples": sum(1 for s in samples if s.mask is not None),
        "empty_caption": int(bool(keys["empty_caption"]))}
    if keys["references"]:  # only then: a dataset without references reports what it did before them
        out["references"] = len(keys["references"])
        out["referenced_samples"] = sum(1 for s in samples if s.reference is not None)
    if settings is not None:
        out["shuffle_variants"] = settings.shuffle_variants
        if settings.tag_dropout:
            out["tag_dropout"] = settings.tag_dropout
        if settings.wildcards:
            out["wildcards"] = 1
        if settings.bucket.flip == "always":
            out["flipped"] = len(samples)
    return out


@dataclass
class Planned:
    """What planning the folder's images (then its clips) adds up: the samples and the entries they need (here,
    beside the jobs it holds, so the images' planning and :mod:`.clip_plan` share it)."""

    keys: PlanKeys
    samples: list[Sample] = field(default_factory=list)
    latents: dict[str, LatentJob] = field(default_factory=dict)
    masks: dict[str, MaskJob] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    unplannable: list[SourceFailure] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)  # images with a caption line cut at captions.MAX_CAPTION_CHARS
    many: list[str] = field(default_factory=list)  # images with more than captions.CAPTION_VARIANTS_NOTE caption lines
    no_mask: list[str] = field(default_factory=list)  # images without a mask file (masklabel) or alpha (alpha)
    fewer_clips: list[str] = field(default_factory=list)  # videos whose clips_per_video windows overlap
    empty: str | None = None  # the empty caption's key, when caption dropout is planned
    no_reference: list[str] = field(default_factory=list)  # images without a reference image (reference_folder)
    used_references: set[str] = field(default_factory=set)  # the reference folder's images some sample uses
