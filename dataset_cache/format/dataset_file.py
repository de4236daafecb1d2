"""A dataset's file, ``datasets/<slug>-<id>.json``: one named dataset's ordered samples, in columnar JSON.

A dataset is stored in a file of its own, written once and never changed, so that the manifest and journal
only name it (file, sample count, info): publishing or replacing a dataset of any size stays one small journal
line, and opening a cache reads a dataset's samples only when that dataset is asked for. This module writes,
reads and checks those files and the names they store; docs/FORMAT.md section 10 gives the layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any

from ..constants import FORMAT_NAME
from ..dataset import MAX_REPEATS, DatasetInfo, Sample, check_epoch_size
from ..errors import CacheCorruptError, CacheFormatError
from .durable import atomic_write, new_id, read_error
from .safetensors_io import load_json_object, read_regular

__all__ = [
    "DATASET_VERSION_PLAIN",
    "DATASET_VERSION",
    "DATASET_VERSION_REFERENCES",
    "DATASET_VERSIONS",
    "MAX_DATASET_NAME",
    "check_dataset_name",
    "write_dataset",
    "load_dataset",
    "parse_dataset",
]

DATASET_VERSION_PLAIN = 1
"""Version of a dataset file without variants: latent, captions, repeats and source columns only."""

DATASET_VERSION = 2
"""Version of a dataset file with variants: optional ``mirror`` and ``mask`` columns and an ``empty_caption``."""

DATASET_VERSION_REFERENCES = 3
"""Version of a dataset file with reference images: version 2 plus the ``reference`` and optional
``reference_mirror`` columns (a release that reads version 2 only refuses it rather than train an edit model
without the images it edits)."""

DATASET_VERSIONS = (DATASET_VERSION_PLAIN, DATASET_VERSION, DATASET_VERSION_REFERENCES)
"""Dataset file versions this library reads."""

MAX_DATASET_NAME = 200
"""Characters in a dataset name: it is stored in the manifest and shown in every report, never a file name."""


def check_dataset_name(name: object) -> None:
    """Refuse a dataset name the cache cannot store (checked before an encode starts, not after it ends).

    Raises:
        ValueError: not a str, empty, longer than :data:`MAX_DATASET_NAME` or holding control characters.
    """
    if type(name) is not str:
        raise ValueError(f"dataset name must be a str, got {type(name).__name__}")
    if not name or len(name) > MAX_DATASET_NAME or any(ord(ch) < 32 for ch in name):
        raise ValueError(f"dataset name {name!r:.80} ({len(name)} characters): use 1-{MAX_DATASET_NAME} printable "
                         "characters")


def _slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:64]
    return slug or "dataset"


def write_dataset(root: Path, name: str, samples: Sequence[Sample], info: Mapping[str, Any] | None) -> DatasetInfo:
    """Write ``datasets/<name>-<id>.json`` atomically (columnar JSON) and return its manifest record.

    A dataset without variants (no mirror, mask or empty caption) is written as version 1, byte for byte what
    earlier releases wrote, so they still open it; one with variants is version 2, which they refuse rather than
    train without its masks; one with reference images version 3. The file is immutable; publishing it is the
    caller's job (a journal line naming it).

    Raises:
        ValueError: the name, samples or info cannot be stored (e.g. samples with different empty captions).
    """
    check_dataset_name(name)
    info = dict(info or {})
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": DATASET_VERSION_PLAIN,
        "name": name,
        "latent": [s.latent for s in samples],
        "captions": [list(s.captions) for s in samples],
        "repeats": [s.repeats for s in samples],
        "source": [s.source for s in samples],
    }
    empties = {s.empty_caption for s in samples}
    if len(empties) > 1:
        raise ValueError(f"dataset {name!r:.80}: its samples name {len(empties)} different empty captions; a dataset "
                         "has one (encoded by one text encoder): store datasets of different encoders separately")
    empty = next(iter(empties), None)
    if any(s.mirror is not None for s in samples):
        doc["mirror"] = [s.mirror for s in samples]
    if any(s.mask is not None for s in samples):
        doc["mask"] = [s.mask for s in samples]
    if empty is not None:
        doc["empty_caption"] = empty
    if "mirror" in doc or "mask" in doc or "empty_caption" in doc:
        doc["version"] = DATASET_VERSION
    if any(s.reference is not None for s in samples):
        doc["version"] = DATASET_VERSION_REFERENCES
        doc["reference"] = [s.reference for s in samples]
        if any(s.reference_mirror is not None for s in samples):
            doc["reference_mirror"] = [s.reference_mirror for s in samples]
    try:
        raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dataset {name!r:.80}: samples and info must be JSON-serializable ({exc})") from None
    file = f"datasets/{_slug(name)}-{new_id()}.json"
    (root / "datasets").mkdir(exist_ok=True)
    atomic_write(root / file, lambda f: f.write(raw))
    return DatasetInfo(name, file, len(samples), info)


def load_dataset(root: Path, info: DatasetInfo) -> list[Sample]:
    """Read and check a dataset file; every problem raises ``CacheCorruptError`` naming the file."""
    path = root / info.file
    p = str(path)
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        raise CacheCorruptError(p, f"the file of dataset {info.name!r} is missing; re-encode the dataset") from None
    except OSError as exc:
        raise read_error(p, "the dataset file", exc) from None
    return parse_dataset(p, raw, info)


def parse_dataset(p: str, raw: bytes, info: DatasetInfo) -> list[Sample]:
    """Check the bytes ``raw`` of the dataset file ``p`` against its record ``info``; the samples, in order.

    Raises:
        CacheFormatError: a dataset file version this library does not read.
        CacheCorruptError: anything else wrong with it, naming ``p`` (and the sample).
    """
    d = load_json_object(p, raw)
    version = d.get("version")
    if d.get("format") != FORMAT_NAME or type(version) is not int or version not in DATASET_VERSIONS:
        raise CacheFormatError(f"{p}: dataset file of format {d.get('format')!r:.40} version "
                               f"{d.get('version')!r:.20}; this library reads {FORMAT_NAME} versions "
                               f"{', '.join(map(str, DATASET_VERSIONS))}: update the pack to open it")
    columns = [d.get(k) for k in ("latent", "captions", "repeats", "source")]
    lat, caps, reps, srcs = [c if type(c) is list and len(c) == info.samples else None for c in columns]
    if lat is None or caps is None or reps is None or srcs is None:
        raise CacheCorruptError(p, f"latent, captions, repeats and source must be lists of {info.samples} items")
    none_column: list[Any] = [None] * info.samples
    mirrors, masks, empty = none_column, none_column, None
    if version >= 2:
        mirrors, masks = (d.get(k, none_column) for k in ("mirror", "mask"))
        empty = d.get("empty_caption")
        if type(mirrors) is not list or type(masks) is not list or len(mirrors) != info.samples \
                or len(masks) != info.samples:
            raise CacheCorruptError(p, f"mirror and mask must be lists of {info.samples} items")
        if empty is not None and type(empty) is not str:
            raise CacheCorruptError(p, "empty_caption must be an entry key or null")
    references: tuple[list[Any], ...] = ()  # the reference columns (version 3); before it, nothing to check
    if version >= 3:
        refs, ref_mirrors = d.get("reference"), d.get("reference_mirror", none_column)
        if type(refs) is not list or type(ref_mirrors) is not list or len(refs) != info.samples \
                or len(ref_mirrors) != info.samples:
            raise CacheCorruptError(p, f"reference and reference_mirror must be lists of {info.samples} items")
        references = (refs, ref_mirrors)
    samples = (lat, caps, reps, srcs, mirrors, masks)
    if _well_formed(*samples, empty) and (not references or _references_well_formed(mirrors, *references)):
        out = list(map(Sample.checked_elsewhere, lat, map(tuple, caps), reps, srcs, mirrors, masks,
                       repeat(empty, info.samples), *references))
    else:
        out = _checked_samples(p, *samples, empty, *(references or (none_column, none_column)))
    try:
        check_epoch_size(out, f"dataset {info.name!r}")
    except ValueError as exc:
        raise CacheCorruptError(p, str(exc)) from None
    return out


def _well_formed(lat: list, caps: list, reps: list, srcs: list, mirrors: list, masks: list,
                 empty: str | None) -> bool:
    """Whether every sample passes :func:`_checked_samples` (and ``Sample``'s own checks), column by column at C
    speed; the per-sample loop is what names the first bad one."""
    optional_key: set[type] = {str, type(None)}
    return (_only(lat, {str}) and _only(caps, {list}) and all(caps) and _only(chain.from_iterable(caps), {str})
            and _only(reps, {int}) and (not reps or (min(reps) >= 1 and max(reps) <= MAX_REPEATS))
            and _only(srcs, optional_key) and _only(mirrors, optional_key) and _only(masks, optional_key)
            and "" not in mirrors and "" not in masks and empty != "")


def _references_well_formed(mirrors: list, refs: list, ref_mirrors: list) -> bool:
    """Whether the reference columns pass ``Sample``'s checks: keys or nulls, a reference mirror exactly where a
    sample has a mirror and a reference."""
    optional_key: set[type] = {str, type(None)}
    if not (_only(refs, optional_key) and _only(ref_mirrors, optional_key) and "" not in refs
            and "" not in ref_mirrors):
        return False
    return all((rm is not None) == (r is not None and m is not None) for m, r, rm in zip(mirrors, refs, ref_mirrors))


def _only(items: Iterable, types: set[type]) -> bool:
    return set(map(type, items)) <= types


def _checked_samples(p: str, lat: list, caps: list, reps: list, srcs: list, mirrors: list, masks: list,
                     empty: str | None, refs: list, ref_mirrors: list) -> list[Sample]:
    """The samples, each checked on its own: raises ``CacheCorruptError`` naming the first malformed one."""
    out: list[Sample] = []
    for i, (la, ca, re_, so, mi, ma, rf, rm) in enumerate(zip(lat, caps, reps, srcs, mirrors, masks, refs,
                                                              ref_mirrors)):
        if (type(la) is not str or type(ca) is not list or not ca or any(type(c) is not str for c in ca)
                or type(re_) is not int or re_ < 1 or (so is not None and type(so) is not str)
                or any(k is not None and type(k) is not str for k in (mi, ma, rf, rm))):
            raise CacheCorruptError(p, f"sample {i} is malformed")
        if re_ > MAX_REPEATS:  # before the sampler allocates per occurrence
            raise CacheCorruptError(p, f"sample {i} ({so or la}) repeats {re_} times, above the limit of "
                                       f"{MAX_REPEATS}; re-encode or re-save the dataset with sensible repeats")
        try:
            out.append(Sample(la, tuple(ca), re_, so, mi, ma, empty, rf, rm))
        except ValueError as exc:
            raise CacheCorruptError(p, f"sample {i} is malformed ({exc})") from None
    return out
