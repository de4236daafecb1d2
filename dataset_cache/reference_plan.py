"""Reference images of an edit model's dataset (Flux Kontext, Qwen-Image-Edit): which image each sample edits, from
a second folder, and the crop that makes its latent the size of the sample's.

An edit pair is a training image (the result) and the image it was made from (the reference), which the model reads
beside the noise through its conditioning (ComfyUI's ReferenceLatent node). As ai-toolkit's ``control_path`` and
musubi-tuner's ``control_directory``, the references live in a folder of their own, each named as its training
image: ``sub/a.png`` of the dataset folder finds ``sub/a.<any image extension>`` there, or ``a.<ext>`` at its top.

A reference is encoded at its sample's bucket (rows of one batch then hold references of one size) by the crop plan
:meth:`.buckets.BucketConfig.fit_plan` gives, the very plan of the training image when both have the same size (the
usual edit pair: pixels stay aligned, also with random crops), and mirrored with it. Its latent is an ordinary
latent entry keyed by its content and plan, so a reference shared by samples, or equal to a training image, is
encoded once. The folder is validated like the dataset's (its own sources record), so an unchanged folder costs its
listing, and an edited reference re-encodes that reference alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .buckets import BucketConfig, CropPlan
from .encode_jobs import LatentJob, Planned
from .errors import DatasetFolderError, SourceFailure
from .scan import SourceImage, scan_folder
from .sources import Validation, validate_sources
from .sources_record import load_record_or_empty, save_record

__all__ = ["NO_CAPTIONS", "References", "reference_notes", "reference_of", "reference_keys", "scan_references"]


@dataclass(frozen=True)
class References:
    """A reference folder as a plan sees it.

    Attributes:
        folder: the folder, absolute.
        validation: its validation against its own sources record (saved by :func:`scan_references`).
        by_stem: its images by path without the extension (POSIX separators).
        failures: its files that could not be read, for the report.
        failed_stems: the name (without extension) of each file that could not be read -> how reports name it,
            so its training image is left out rather than trained without its reference.
    """

    folder: str
    validation: Validation
    by_stem: Mapping[str, tuple[SourceImage, ...]]
    failures: tuple[SourceFailure, ...] = ()
    failed_stems: Mapping[str, str] = field(default_factory=dict)

    def name(self, image: SourceImage) -> str:
        """How reports name a reference: the folder's name and its path there."""
        return f"{os.path.basename(self.folder)}/{image.relpath}"


def _check_folders(folder: str, dataset_folder: str) -> None:
    """Refuse a reference folder that is missing, not a folder, or nested with the dataset's (its images would be
    training samples, or the samples references)."""
    if not os.path.isdir(folder):
        what = "does not exist" if not os.path.exists(folder) else "is not a folder"
        raise DatasetFolderError(folder, f"reference_folder {what}; give the folder of the images the dataset's "
                                         "images were made from, or leave it empty")
    real, data = os.path.realpath(folder), os.path.realpath(dataset_folder)
    if real == data or real.startswith(data + os.sep) or data.startswith(real + os.sep):
        raise DatasetFolderError(folder, f"reference_folder and the dataset folder {dataset_folder} are the same or "
                                         "one holds the other; keep the reference images in a folder of their own "
                                         "beside the dataset folder")


NO_CAPTIONS = ".no-captions"
"""The caption extension a reference folder is listed with: one no file has, so its text files are neither paired,
hashed nor read (a reference has no caption; a bad ``.txt`` there must not cost its image)."""


def scan_references(folder: str, dataset_folder: str, record_path: Path, *, threads: int | None) -> References:
    """Validate and scan the reference folder, saving its sources record when it changed (before any encode, as
    the dataset folder's, so a crash never costs a re-hash).

    Raises:
        DatasetFolderError: the folder is missing, not a folder, or nested with the dataset folder.
    """
    _check_folders(folder, dataset_folder)
    try:
        validation = validate_sources(folder, load_record_or_empty(record_path), threads=threads,
                                      caption_extension=NO_CAPTIONS)
    except DatasetFolderError:  # checked above that it is a folder: it holds no image
        raise DatasetFolderError(folder, "reference_folder holds no image; put the images the dataset's images "
                                         "were made from in it, each named as its image (a.png for a.png), or "
                                         "leave reference_folder empty") from None
    record = validation.record
    scan = scan_folder(validation.listing, known_sizes=record.image_sizes(), known_captions=record.caption_lines(),
                       threads=threads)
    if validation.record_changed:
        save_record(record.with_image_sizes(scan.images), record_path)
    by_stem: dict[str, list[SourceImage]] = {}
    for image in scan.images:
        by_stem.setdefault(os.path.splitext(image.relpath)[0], []).append(image)
    base = os.path.basename(folder)
    failed = (*validation.failures, *scan.failures)
    failures = tuple(SourceFailure(f"{base}/{f.relpath}", f.path, f.reason) for f in failed)
    stems = {os.path.splitext(f.relpath)[0]: f"{base}/{f.relpath}" for f in failed}
    return References(folder, validation, {k: tuple(v) for k, v in by_stem.items()}, failures, stems)


def reference_of(refs: References, relpath: str, path: str) -> SourceImage | SourceFailure | None:
    """The reference image of the training image ``relpath`` (``None``: it has none), or why the image is left out
    (two references of its name: which one it edits cannot be told; its reference could not be read)."""
    stem = os.path.splitext(relpath)[0]
    stems = (stem, stem.rsplit("/", 1)[1]) if "/" in stem else (stem,)
    found = next((refs.by_stem[s] for s in stems if s in refs.by_stem), None)
    if not found:
        failed = next((refs.failed_stems[s] for s in stems if s in refs.failed_stems), None)
        if failed is not None:
            return SourceFailure(relpath, path, f"left out: its reference {failed} cannot be read (see that "
                                                "file's line)")
        return None
    if len(found) > 1:
        names = ", ".join(refs.name(f) for f in found[:3])
        return SourceFailure(relpath, path, f"left out: {len(found)} reference images have its name ({names}); "
                                            "keep one")
    if refs.validation.record.get(found[0].relpath) is None:  # not hashed: named among the folder's failures
        return SourceFailure(relpath, path, f"left out: its reference {refs.name(found[0])} cannot be read (see "
                                            "that file's line)")
    return found[0]


def reference_keys(refs: References, ref: SourceImage, plan: CropPlan, mirrored: bool, config: BucketConfig,
                   token: str, acc: Planned) -> tuple[str, str | None]:
    """The keys of the reference's latent for the training image's crop ``plan``, and of its mirror (``None``
    unless ``mirrored``: the plan has a mirror), both planned into ``acc``.

    ``ref``: a reference :func:`reference_of` gave; ``config``: the dataset's bucket settings (crop mode, seed and
    resize method; the bucket is ``plan``'s); ``token``: the training image's content hash, which seeds a random
    crop, so a reference of the image's size is cropped as the image is."""
    entry = refs.validation.record.get(ref.relpath)
    assert entry is not None, ref.relpath  # reference_of gives only hashed references
    content = entry.hash
    acc.used_references.add(ref.relpath)
    fitted = config.fit_plan(plan, ref.width, ref.height, token=token)
    key = _planned(refs, ref, content, fitted, acc)
    if not mirrored:
        return key, None
    return key, _planned(refs, ref, content, config.mirror_plan(fitted), acc)


def _planned(refs: References, ref: SourceImage, content: str, plan: CropPlan, acc: Planned) -> str:
    """The key of the reference's latent at ``plan``, its job planned into ``acc`` (counted as a reference, its
    mirror too: the report's mirrors are the training images')."""
    key = acc.keys.latent(content, plan)
    if key not in acc.latents:
        acc.latents[key] = LatentJob(key, ref.path, refs.name(ref), content, plan, reference=True)
    return key


def reference_notes(refs: References | None, without: Sequence[str], used: set[str], clips: bool
                    ) -> tuple[str, ...]:
    """What the report says about references: images without one (trained without), reference images of no
    training image, and that clips get none."""
    if refs is None:
        return ()
    notes = []
    if without:
        notes.append(f"{len(without)} image(s) have no reference image in {refs.folder} and train without one "
                     f"(first: {sorted(without)[0]})")
    unused = sorted(refs.name(i) for images in refs.by_stem.values() for i in images if i.relpath not in used)
    if unused:
        notes.append(f"{len(unused)} reference image(s) are the reference of no image and are not used (first: "
                     f"{unused[0]})")
    if clips:
        notes.append("clips get no reference image: references apply to images only")
    return tuple(notes)
