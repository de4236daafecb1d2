"""The loss masks' planning: which mask each image has (a ``-masklabel`` file or its alpha channel), its key, and
the report's notes on masks.

Apart from the images' planning because a mask is checked (links, readability, aspect ratio) and keyed on its own
source, and an image whose mask is bad is left out, named, before anything is encoded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .buckets import CropPlan
from .encode_jobs import MaskJob
from .encode_settings import EncodeSettings
from .errors import SourceError, SourceFailure
from .imaging import has_alpha, mask_aspect_problem, read_image_size
from .keys import content_key, mask_key
from .listing import FolderListing
from .scan import SourceImage
from .sources_record import SourcesRecord

__all__ = ["mask_job", "unused_masks", "mask_notes"]


def mask_job(img: SourceImage, image_hash: str, plan: CropPlan, settings: EncodeSettings, listing: FolderListing,
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


def unused_masks(settings: EncodeSettings, listing: FolderListing) -> tuple[str, ...]:
    """The mask files no sample uses: those of no image, or every one unless ``masks`` is ``masklabel``."""
    return listing.unused_masks if settings.masks == "masklabel" else tuple(m[0] for m in listing.masks)


def mask_notes(settings: EncodeSettings, no_mask: Sequence[str], unused: Sequence[str], listing: FolderListing,
               clips: bool) -> tuple[str, ...]:
    """What the report says about masks: mask files unused (masks off, or of no image), images that train
    unmasked (``no_mask``), and that ``clips`` get none."""
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
