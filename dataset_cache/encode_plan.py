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

Sourceless datasets: when the folder no longer exists but the cache holds the dataset, the plan reports every
recorded source as removed, needs no encoder, and keeps the dataset as it is (training reads the cache alone).
Entries stay in the cache until ``clean`` removes what no dataset references.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .buckets import BucketConfig, CropPlan
from .constants import DEFAULT_SHARD_BYTES
from .dataset import Sample, check_epoch_size
from .errors import CacheError, CacheNotFoundError
from .format.layout import MANIFEST, check_new_cache_location, check_no_links, is_regular_file
from .format.manifest import check_dataset_name
from .format.reader import open_cache
from .gcpause import gc_paused
from .keys import PlanKeys, hash_bytes, latent_key
from .scan import DatasetFolderError, SourceClip, SourceFailure, scan_folder
from .sources import SourcesRecord, SourcesRecordError, Validation, load_record, save_record, validate_sources
from .video import MAX_CLIP_PIXEL_BYTES, FrameSettings, clip_folder_of

__all__ = [
    "FAILURE_POLICIES",
    "SOURCES_DIR",
    "EncodeSettings",
    "LatentJob",
    "ClipJob",
    "EncodePlan",
    "plan_encode",
    "sources_record_path",
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
"""Caption lines of one image above which the image is left out as a failure naming its caption file (a file of
thousands of lines is a log or a list pasted by mistake, and each line would be encoded)."""

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
    """

    bucket: BucketConfig = field(default_factory=BucketConfig)
    caption_prefix: str = ""
    caption_suffix: str = ""
    batch_size: int = 8
    failure_policy: str = "skip"
    encode_threads: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    video: FrameSettings = field(default_factory=FrameSettings)

    def __post_init__(self) -> None:
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

    def describe(self) -> dict[str, Any]:
        """Return the settings as plain JSON (stored in the dataset's info)."""
        return {
            "bucket": self.bucket.describe(), "caption_prefix": self.caption_prefix,
            "caption_suffix": self.caption_suffix, "batch_size": self.batch_size,
            "failure_policy": self.failure_policy, "shard_bytes": self.shard_bytes, "video": self.video.describe(),
        }


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

    @property
    def bucket(self) -> tuple[int, int]:
        """``(width, height)`` of the bucket."""
        return self.plan.bucket


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
            images with many caption variants), for the report.
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

    @property
    def needs_vae(self) -> bool:
        """Whether any latent must be encoded (load the VAE only then)."""
        return any(self.missing_latents.values()) or bool(self.missing_clips)

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
        return not self.needs_vae and not self.needs_text_encoder and self.dataset_current

    def counts(self) -> dict[str, int]:
        """Source file counts and work to do, for logs and the dataset's info."""
        return {
            "new": self.new, "changed": self.changed, "unchanged": self.unchanged, "removed": self.removed,
            "failed": len(self.failures), "skipped": self.skipped, "samples": len(self.samples),
            "latents_to_encode": self.latent_count,
            "conditionings_to_encode": len(self.missing_conditionings), "reused": self.reused,
        }

    def summary(self) -> str:
        """A one-line description for logs and UI."""
        if self.sourceless:
            return (f"dataset {self.dataset!r}: source folder {self.folder} is gone; {len(self.samples)} samples "
                    f"are served from the cache ({self.removed} source files removed, nothing to encode)")
        return (f"dataset {self.dataset!r}: {len(self.samples)} samples; to encode {self.latent_count} latents "
                f"and {len(self.missing_conditionings)} conditionings, {self.reused} entries reused; sources "
                f"{self.new} new, {self.changed} changed, {self.unchanged} unchanged, {self.removed} removed"
                + (f"; {len(self.failures)} failed" if self.failures else ""))


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
    if validation.hashed or validation.captions_added or not validation.clean:  # else the record is current
        frames = [f for clip in scan.clips for f in clip.frames]
        save_record(record.with_image_sizes([*scan.images, *frames]), record_path)  # before any encode: never re-hash

    samples: list[Sample] = []
    latents: dict[str, LatentJob] = {}
    texts: dict[str, str] = {}
    keys = PlanKeys(vae_fingerprint, text_fingerprint)
    bucket = settings.bucket
    center: dict[tuple[int, int], CropPlan] = {}  # a center crop depends on the size alone
    unplannable: list[SourceFailure] = []
    cut: list[str] = []  # images with a caption line cut at MAX_CAPTION_CHARS
    many: list[str] = []  # images with more than CAPTION_VARIANTS_NOTE caption lines
    for img in scan.images:
        entry = record.get(img.relpath)
        if entry is None:  # could not be hashed: already listed among the validation failures
            continue
        if len(img.captions) > MAX_CAPTION_VARIANTS:
            unplannable.append(SourceFailure(img.relpath, img.path, f"its caption file has {len(img.captions)} "
                                             f"lines (variants), above the limit of {MAX_CAPTION_VARIANTS}; each "
                                             "line is encoded separately: keep one caption per line"))
            continue
        try:
            if bucket.crop == "center":
                plan = center.get((img.width, img.height))
                if plan is None:
                    plan = center[(img.width, img.height)] = bucket.plan(img.width, img.height)
            else:
                plan = bucket.plan(img.width, img.height, token=entry.hash)
        except ValueError as exc:  # e.g. smaller than one bucket step with upscale off: left out, named
            unplannable.append(SourceFailure(img.relpath, img.path, str(exc)))
            continue
        lkey = keys.latent(entry.hash, plan)
        if lkey not in latents:
            latents[lkey] = LatentJob(lkey, img.path, img.relpath, entry.hash, plan)
        if len(img.captions) > CAPTION_VARIANTS_NOTE:
            many.append(img.relpath)
        ckeys = []
        for line in img.captions:
            if len(line) > MAX_CAPTION_CHARS:
                cut.append(img.relpath)
                line = line[:MAX_CAPTION_CHARS]
            text = settings.caption_text(line)
            ckey = keys.conditioning(text)
            texts.setdefault(ckey, text)
            ckeys.append(ckey)
        samples.append(Sample(lkey, tuple(ckeys), img.repeats, img.relpath))

    clips = _plan_clips(scan.clips, record, settings, vae_fingerprint, keys, samples, texts, unplannable, cut, many)
    try:
        check_epoch_size(samples, f"dataset {dataset!r}")
    except ValueError as exc:  # before any encode: the dataset could never be stored
        raise DatasetFolderError(src, str(exc)) from None
    have, _stored, info = _cache_view(root, dataset, load=False)
    digest = samples_digest(samples)
    by_bucket: dict[tuple[int, int], list[LatentJob]] = {}
    for job in latents.values():
        if job.key not in have:
            by_bucket.setdefault(job.bucket, []).append(job)
    missing_texts = {k: t for k, t in texts.items() if k not in have}
    missing_clips = tuple(sorted((j for j in clips.values() if j.key not in have),
                                 key=lambda j: (len(j.clip.indices) if j.clip else 0, j.bucket[1], j.bucket[0],
                                                j.relpath)))
    unique = {(f.relpath, f.reason): f for f in (*validation.failures, *scan.failures, *unplannable)}
    counts = validation.counts()
    return EncodePlan(
        cache_root=root, dataset=dataset, folder=src, settings=settings, vae_fingerprint=vae_fingerprint,
        text_fingerprint=text_fingerprint, new=counts["new"], changed=counts["changed"],
        unchanged=counts["unchanged"], removed=counts["removed"],
        failures=tuple(unique[k] for k in sorted(unique)), samples=tuple(samples),
        missing_latents={b: tuple(sorted(jobs, key=lambda j: j.relpath)) for b, jobs in sorted(by_bucket.items())},
        missing_conditionings=missing_texts,
        reused=sum(k in have for k in latents) + sum(k in have for k in clips) + sum(k in have for k in texts),
        dataset_current=info is not None and info.get("samples_digest") == digest, validation=validation,
        skipped=_listed_samples(validation) - len(samples), notes=_caption_notes(cut, many) + _clip_notes(settings),
        missing_clips=missing_clips,
    )


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


def _clip_notes(settings: EncodeSettings) -> tuple[str, ...]:
    video = settings.video
    if video.stride and video.stride > 1 and video.effective_frames != video.frames:
        return (f"frame count {video.frames} is taken as {video.effective_frames}: the VAE compresses time by "
                f"{video.stride}, so it encodes 1 + {video.stride}·m frames without dropping any",)
    return ()


def _caption_keys(captions: Sequence[str], relpath: str, settings: EncodeSettings, keys: PlanKeys,
                  texts: dict[str, str], cut: list[str], many: list[str]) -> tuple[str, ...]:
    if len(captions) > CAPTION_VARIANTS_NOTE:
        many.append(relpath)
    out = []
    for line in captions:
        if len(line) > MAX_CAPTION_CHARS:
            cut.append(relpath)
            line = line[:MAX_CAPTION_CHARS]
        text = settings.caption_text(line)
        ckey = keys.conditioning(text)
        texts.setdefault(ckey, text)
        out.append(ckey)
    return tuple(out)


def _plan_clips(clips: Sequence[SourceClip], record: SourcesRecord, settings: EncodeSettings, vae_fp: str,
                keys: PlanKeys, samples: list[Sample], texts: dict[str, str], unplannable: list[SourceFailure],
                cut: list[str], many: list[str]) -> dict[str, LatentJob]:
    """Key every clip (its bytes, or its frames' in order, plus the crop plan and the frame settings), add its
    sample; return the latent jobs by key. Clips that cannot be planned are added to ``unplannable``."""
    jobs: dict[str, LatentJob] = {}
    video = settings.video
    for clip in clips:
        if video.stride == 0:
            unplannable.append(SourceFailure(clip.relpath, clip.path, (
                "is a video clip, but the VAE encodes still images only (it reads a batch as separate images); "
                "connect a video VAE (e.g. WAN's) or move the clip out of the folder")))
            continue
        if len(clip.captions) > MAX_CAPTION_VARIANTS:
            unplannable.append(SourceFailure(clip.relpath, clip.path, f"its caption file has {len(clip.captions)} "
                                             f"lines (variants), above the limit of {MAX_CAPTION_VARIANTS}"))
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
        extra = {"clip": {**video.key_fields(), "kind": clip.kind, "indices": list(indices)}}
        lkey = latent_key(source_hash, plan.key_fields(), vae_fp, extra=extra)
        if lkey not in jobs:
            jobs[lkey] = LatentJob(lkey, clip.path, clip.relpath, source_hash, plan,
                                   ClipJob(indices, frame_paths, frame_hashes))
        ckeys = _caption_keys(clip.captions, clip.relpath, settings, keys, texts, cut, many)
        samples.append(Sample(lkey, ckeys, clip.repeats, clip.relpath))
    return jobs


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
