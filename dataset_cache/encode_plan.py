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

This module holds the steps and the images' planning; what a plan is made of is :mod:`.encode_jobs`, what caption
lines become :mod:`.captions`, and the clips' and masks' planning :mod:`.clip_plan` and :mod:`.mask_plan`.

Keys are content addressed, so a caption line shared by 100 images is one conditioning to encode, renamed or
touched files cost nothing, and a new VAE fingerprint re-encodes latents but no conditioning.

Variants (issue #16), each an entry of its own key, planned here and encoded by :mod:`.encode_run`:

* tag shuffles (``shuffle_variants`` > 0): each caption line gives that many shuffled-tag texts
  (:meth:`.encode_jobs.EncodeSettings.caption_texts`), keyed like any caption text, so only a changed line's
  variants are new; with ``tag_dropout``, versions with tags left out instead, and with ``wildcards`` each
  combination of a line's ``{a|b}`` options is a line of its own (:mod:`.caption_wildcards`);
* the empty caption (``empty_caption``): the text ``""`` (no prefix or suffix), one conditioning per text encoder,
  named by every sample's ``empty_caption``;
* mirrors (``bucket.flip == "random"``): the mirrored crop plan's latent (the key ``flip="always"`` gives), named
  by ``Sample.mirror``; ``Sample.latent`` stays the key ``flip="none"`` gives, so switching modes re-encodes only
  what is new;
* loss masks (``masks``): a :class:`.encode_jobs.MaskJob` per image with a mask, keyed by :func:`.keys.mask_key`
  (the mask's source hash, mode, the latent's crop plan and the VAE's spatial factor), so an edited mask file
  re-encodes the mask alone, and encoding one needs no VAE once the factor is known (``mask_factor``).

Sourceless datasets: when the folder no longer exists but the cache holds the dataset, the plan reports every
recorded source as removed, needs no encoder, and keeps the dataset as it is (training reads the cache alone).
Entries stay in the cache until ``clean`` removes what no dataset references.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .buckets import BucketConfig, CropPlan, crop_plans
from .caption_wildcards import wildcard_notes
from .captions import caption_keys, caption_notes, separator_notes, shuffle_notes, too_many_variants
from .missing_captions import fill_missing_captions
from .clip_plan import clip_notes, plan_clips
from .dataset import Sample, check_epoch_size
from .encode_jobs import EncodePlan, LatentJob, MaskJob, Planned, caption_example
from .encode_settings import EncodeSettings
from .errors import CacheError, CacheNotFoundError, DatasetFolderError, SourceFailure
from .format.dataset_file import check_dataset_name
from .format.layout import MANIFEST, check_new_cache_location, check_no_links, is_regular_file
from .format.reader import open_cache
from .frames import FrameSettings, clip_folder_of
from .gcpause import gc_paused
from .keys import PlanKeys
from .listing import CAPTION_EXTENSION, FolderListing
from .mask_plan import mask_job, mask_notes, unused_masks
from .reference_plan import References, reference_keys, reference_notes, reference_of, scan_references
from .scan import ScanResult, SourceImage, scan_folder
from .sources import Validation, validate_sources
from .sources_record import SourcesRecord, load_record_or_empty, save_record
from .tag_frequency import count_tags, folder_name, source_folder

__all__ = [
    "SOURCES_DIR",
    "plan_encode",
    "reference_record_path",
    "sources_record_path",
    "settle_sources",
    "samples_digest",
]

log = logging.getLogger("dataset_cache.encode")

SOURCES_DIR = "sources"
"""Folder of the cache that holds one sources record per dataset name."""
REFERENCES_RECORD = "\0references"
"""Added to a dataset's name to name its reference folder's sources record (no dataset name holds a NUL)."""

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


def reference_record_path(cache_root: str | os.PathLike[str], dataset: str) -> Path:
    """Return the sources record of dataset ``dataset``'s reference folder (:mod:`.reference_plan`), beside its
    folder's record."""
    return sources_record_path(cache_root, dataset + REFERENCES_RECORD)


def settle_sources(plan: EncodePlan) -> None:
    """Record that the dataset is now stored from the sources ``plan`` saw: the next plan counts new, changed and
    removed files against them. Left as it is when another plan has saved a different record meanwhile (the
    next plan then counts against the older sources: more files "new" than strictly are, never fewer)."""
    if plan.sourceless:
        return
    for validation, path in ((plan.validation, sources_record_path(plan.cache_root, plan.dataset)),
                             (plan.reference_validation, reference_record_path(plan.cache_root, plan.dataset))):
        if validation is None or not validation.record.pending:
            continue
        current = load_record_or_empty(path)
        if current.same_sources(validation.record):
            save_record(current.settled(), path)


def _check_cache_location(root: str) -> None:
    """Refuse, before the sources record is written, a cache with linked parts or one that would nest."""
    if not is_regular_file(os.path.join(root, MANIFEST)):
        check_new_cache_location(root)
    check_no_links(root)


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
        if s.reference is not None:  # else as before references
            line += f"|{s.reference}|{s.reference_mirror or ''}"
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
    out["tag_dropout"] = described.get("tag_dropout", 0)
    out["wildcards"] = described.get("wildcards", False)
    out["keep_tokens_separator"] = described.get("keep_tokens_separator", "")
    out["empty_caption"] = described.get("empty_caption", False)
    out["masks"] = described.get("masks", "none")
    out["missing_caption"] = described.get("missing_caption", "empty")
    out["extra_resolutions"] = described.get("extra_resolutions", [])
    out["caption_extension"] = described.get("caption_extension", CAPTION_EXTENSION)
    out["secondary_separator"] = described.get("secondary_separator", "")
    out["references"] = bool(described.get("reference_folder"))  # where the folder is does not change entries
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
    record = load_record_or_empty(record_path)
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
        folder: the image + caption folder (kohya layout allowed, see :mod:`.listing`).
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

    validation, scan, filled = _read_folder(src, record_path, settings, threads)
    record = validation.record
    refs = None if not settings.reference_folder else scan_references(
        settings.reference_folder, src, reference_record_path(root, dataset), threads=threads)
    acc = Planned(PlanKeys(vae_fingerprint, text_fingerprint))
    if settings.empty_caption:  # the text "" itself: no prefix or suffix (dropout trains with no caption)
        acc.empty = acc.keys.conditioning("")
        acc.texts[acc.empty] = ""
    _plan_images(scan.images, record, validation.listing, settings, acc, refs)
    samples, latents, masks, texts, empty = acc.samples, acc.latents, acc.masks, acc.texts, acc.empty
    unplannable, cut, many, no_mask = acc.unplannable, acc.cut, acc.many, acc.no_mask

    have, _stored, info = _cache_view(root, dataset, load=False)
    short: list[str] = []  # clips that give fewer frames than asked, each with why
    clips = plan_clips(scan.clips, record, settings, acc, have, short)
    try:
        check_epoch_size(samples, f"dataset {dataset!r}")
    except ValueError as exc:  # before any encode: the dataset could never be stored
        raise DatasetFolderError(src, str(exc)) from None
    digest = samples_digest(samples)
    missing = _Missing.of(latents, texts, masks, clips, have)
    unused = unused_masks(settings, validation.listing)
    unique = {(f.relpath, f.reason): f for f in (*validation.failures, *scan.failures, *unplannable,
                                                  *(refs.failures if refs is not None else ()))}
    lines = [*(i.captions for i in scan.images), *(c.captions for c in scan.clips)]
    counts = validation.counts()
    current = info is not None and info.get("samples_digest") == digest
    tags = _tags(src, scan, info if current else None)
    return EncodePlan(
        cache_root=root, dataset=dataset, folder=src, settings=settings, vae_fingerprint=vae_fingerprint,
        text_fingerprint=text_fingerprint, new=counts["new"], changed=counts["changed"],
        unchanged=counts["unchanged"], removed=counts["removed"],
        failures=tuple(unique[k] for k in sorted(unique)), samples=tuple(samples),
        missing_latents=missing.latents, missing_conditionings=missing.texts,
        reused=(sum(k in have for k in latents) + sum(k in have for k in clips) + sum(k in have for k in texts)
                + sum(k in have for k in masks)),
        dataset_current=current, validation=validation,
        skipped=_listed_samples(validation) - len({s.source for s in samples}),
        notes=(filled + caption_notes(cut, many) + clip_notes(settings, short, acc.fewer_clips)
               + mask_notes(settings, no_mask, unused, validation.listing, bool(scan.clips))
               + shuffle_notes(settings, lines) + separator_notes(settings, lines)
               + wildcard_notes(settings.wildcards, lines)
               + reference_notes(refs, acc.no_reference, acc.used_references, bool(scan.clips))),
        missing_clips=missing.clips, missing_masks=missing.masks, empty_caption=empty,
        images_without_mask=len(no_mask), unused_masks=len(unused), short_clips=tuple(short),
        caption_example=caption_example(samples, texts, settings), tag_frequency=tags,
        tags_current=info is not None and info.get("tag_frequency", {}) == tags,
        reference_validation=None if refs is None else refs.validation,
    )


def _read_folder(src: str, record_path: Path, settings: EncodeSettings, threads: int | None
                 ) -> tuple[Validation, ScanResult, tuple[str, ...]]:
    """Validate the folder against its sources record and scan it, saving the record when it changed (before any
    encode: a crash never costs a re-hash); then fill in missing captions (the notes on that come back)."""
    validation = validate_sources(src, load_record_or_empty(record_path), threads=threads,
                                  caption_extension=settings.caption_extension)
    record = validation.record
    scan = scan_folder(validation.listing, known_sizes=record.image_sizes(), known_captions=record.caption_lines(),
                       threads=threads)
    if validation.record_changed:  # else the record is current
        frames = [f for clip in scan.clips for f in clip.frames]
        save_record(record.with_image_sizes([*scan.images, *frames]), record_path)
    scan, filled = fill_missing_captions(scan, settings.missing_caption)
    return validation, scan, filled


def _plan_images(images: Sequence[SourceImage], record: SourcesRecord, listing: FolderListing,
                 settings: EncodeSettings, acc: Planned, refs: References | None) -> None:
    """Key each image's crop plans (one per resolution, the same plan once), mirrors, masks, reference images and
    captions into ``acc``, a sample per crop plan; one that cannot be planned is named among ``acc.unplannable``."""
    configs = settings.bucket_configs()
    center: dict[tuple[int, int, int], CropPlan] = {}  # a center crop depends on the resolution and size alone
    mirrors: dict[CropPlan, CropPlan] = {}
    for img in images:
        entry = record.get(img.relpath)
        if entry is None:  # could not be hashed: already listed among the validation failures
            continue
        too_many = too_many_variants(img.captions, settings)
        if too_many:
            acc.unplannable.append(SourceFailure(img.relpath, img.path, too_many))
            continue
        try:
            plans = crop_plans(configs, img.width, img.height, entry.hash, center)
        except ValueError as exc:  # e.g. smaller than one bucket step with upscale off: left out, named
            acc.unplannable.append(SourceFailure(img.relpath, img.path, str(exc)))
            continue
        masks: list[MaskJob | None] = [None] * len(plans)
        if settings.masks != "none":
            found = [mask_job(img, entry.hash, plan, settings, listing, record) for plan in plans]
            failed = next((f for f in found if isinstance(f, SourceFailure)), None)
            if failed is not None:
                acc.unplannable.append(failed)
                continue
            masks = [f for f in found if not isinstance(f, SourceFailure)]
            if masks[0] is None:
                acc.no_mask.append(img.relpath)
        ref = _reference(img, refs, acc)
        if isinstance(ref, SourceFailure):
            acc.unplannable.append(ref)
            continue
        ckeys = caption_keys(img.captions, img.relpath, settings, acc.keys, acc.texts, acc.cut, acc.many)
        for plan, mask in zip(plans, masks):
            if mask is not None:
                acc.masks.setdefault(mask.key, mask)
            lkey = acc.keys.latent(entry.hash, plan)
            if lkey not in acc.latents:
                acc.latents[lkey] = LatentJob(lkey, img.path, img.relpath, entry.hash, plan)
            mirror = _mirror(img, entry.hash, plan, settings.bucket, mirrors, acc)
            pair: tuple[str | None, str | None] = (None, None)
            if ref is not None and refs is not None:
                pair = reference_keys(refs, ref, plan, mirror is not None, settings.bucket, entry.hash, acc)
            acc.samples.append(Sample(lkey, ckeys, img.repeats, img.relpath, mirror=mirror,
                                      mask=None if mask is None else mask.key, empty_caption=acc.empty,
                                      reference=pair[0], reference_mirror=pair[1]))


def _reference(img: SourceImage, refs: References | None, acc: Planned) -> SourceImage | SourceFailure | None:
    """The image's reference image (``None``: no reference folder, or none of its name, noted in ``acc``), or why
    the image is left out."""
    if refs is None:
        return None
    ref = reference_of(refs, img.relpath, img.path)
    if ref is None:
        acc.no_reference.append(img.relpath)
    return ref


def _mirror(img: SourceImage, token: str, plan: CropPlan, bucket: BucketConfig, mirrors: dict[CropPlan, CropPlan],
            acc: Planned) -> str | None:
    """The key of ``plan``'s mirrored latent (planned into ``acc``) with ``flip`` random, else ``None``."""
    if bucket.flip != "random":
        return None
    mplan = mirrors.get(plan)
    if mplan is None:
        mplan = mirrors[plan] = bucket.mirror_plan(plan)
    mirror = acc.keys.latent(token, mplan)
    if mirror not in acc.latents:
        acc.latents[mirror] = LatentJob(mirror, img.path, img.relpath, token, mplan, mirror=True)
    return mirror


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


def _tags(folder: str, scan: ScanResult, stored: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """The folder's tag counts (:mod:`.tag_frequency`): those of ``stored``, the info of the dataset as it is stored
    when these very samples are (their caption keys are their texts' content, so the counts are the same), else
    counted, about a second per 100k images of 30 tags: the warm plan of an unchanged folder counts nothing."""
    if stored is not None and isinstance(stored.get("tag_frequency"), dict):
        return stored["tag_frequency"]
    top = folder_name(folder)
    return count_tags([*((source_folder(i.relpath, top), i.captions) for i in scan.images),
                       *((source_folder(c.relpath, top), c.captions) for c in scan.clips)])


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

