"""How often each caption tag occurs in a dataset's folders: kohya's ``ss_tag_frequency``, counted when a folder is
encoded and kept in the dataset's info, so a LoRA trained from the cache can say what it was trained on.

Civitai and the LoRA browsers of A1111, Forge and ComfyUI's model managers show a LoRA's training tags from this
field of its metadata; kohya writes it for every LoRA. Here it is counted from the caption files as read (before
``caption_prefix`` and the tag shuffles), per kohya folder (``10_ohwx woman``) or, for images at the top of the
dataset folder, under the folder's own name; a tag counts once per image or clip whatever its lines hold.

Stored in a dataset's info (``tag_frequency``, docs/FORMAT.md §10): bounded, so a folder of ten thousand booru-tagged
images keeps the manifest small; read back through :func:`read_tag_frequency`, which accepts only what this module
writes (a stranger's cache cannot make a LoRA's metadata huge or malformed).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["MAX_FOLDERS", "MAX_TAG_CHARS", "MAX_TAGS", "MAX_TAGS_PER_FOLDER", "count_tags", "folder_name",
           "merge_tag_frequency", "read_tag_frequency", "source_folder"]

MAX_TAGS_PER_FOLDER = 1000
"""The most frequent tags kept per folder (ties by name): a LoRA page shows the top few dozen."""
MAX_FOLDERS = 64
"""The folders kept (those with the most images): kohya datasets have a handful."""
MAX_TAGS = 4000
"""The tags kept in all (each of many folders keeps its share of them): the info, in the manifest, stays under
~150 KB however the dataset is laid out."""
MAX_TAG_CHARS = 200
"""A longer tag is a sentence, not a tag: not counted."""


def folder_name(path: str) -> str:
    """The last part of a folder's path as written on POSIX or Windows (a dataset's info may come from either)."""
    return re.split(r"[\\/]", path.rstrip("\\/"))[-1]


def source_folder(relpath: str, top: str) -> str:
    """The folder a source counts under, in the tags and a LoRA's ``ss_dataset_dirs``: its kohya subfolder
    (``10_ohwx`` of ``10_ohwx/a.png``), or ``top`` (the dataset folder's name) for a source at the folder's top."""
    head, sep, _ = relpath.partition("/")
    return head if sep else top


def _tags(line: str) -> Iterable[str]:
    for tag in line.split(","):
        tag = tag.strip()
        if tag and len(tag) <= MAX_TAG_CHARS:
            yield tag


def count_tags(captions: Iterable[tuple[str, Sequence[str]]]) -> dict[str, dict[str, int]]:
    """``folder -> tag -> images`` from ``(folder, caption lines)`` per image or clip (see the module docstring),
    bounded by :data:`MAX_FOLDERS`, :data:`MAX_TAGS_PER_FOLDER` and :data:`MAX_TAGS` (each folder its share);
    folders and their tags in a fixed order (most images first, then by name), so the same folder gives the same
    info on every run."""
    counts: dict[str, Counter[str]] = {}
    images: Counter[str] = Counter()
    for folder, lines in captions:
        images[folder] += 1
        tags = {tag for line in lines for tag in _tags(line)}
        if tags:
            counts.setdefault(folder, Counter()).update(tags)
    folders = sorted(counts, key=lambda f: (-images[f], f))[:MAX_FOLDERS]
    return {folder: _top(counts[folder], len(folders)) for folder in folders}


def _share(folders: int) -> int:
    """The tags each of ``folders`` folders keeps."""
    return min(MAX_TAGS_PER_FOLDER, MAX_TAGS // max(folders, 1))


def _top(counter: Mapping[str, int], folders: int) -> dict[str, int]:
    ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))[:_share(folders)]
    return dict(ranked)


def read_tag_frequency(value: object) -> dict[str, dict[str, int]]:
    """A dataset info's ``tag_frequency`` as :func:`count_tags` writes it, or ``{}`` for anything else (an older
    cache has none; a malformed or oversized one is ignored rather than trusted): the metadata is a courtesy, never
    a reason to refuse training."""
    if not isinstance(value, dict) or len(value) > MAX_FOLDERS:
        return {}
    if sum(len(tags) if isinstance(tags, dict) else 0 for tags in value.values()) > MAX_TAGS:
        return {}
    out: dict[str, dict[str, int]] = {}
    for folder, tags in value.items():
        if not (isinstance(folder, str) and isinstance(tags, dict) and len(tags) <= MAX_TAGS_PER_FOLDER):
            return {}
        if not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG_CHARS and type(n) is int and n > 0
                   for t, n in tags.items()):
            return {}
        out[folder] = dict(tags)
    return out


def merge_tag_frequency(parts: Iterable[Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    """Several datasets' counts as one (a folder in two datasets sums), bounded as :func:`count_tags`: the
    ``ss_tag_frequency`` of a LoRA trained on a Combine Datasets output."""
    merged: dict[str, Counter[str]] = {}
    for part in parts:
        for folder, tags in part.items():
            merged.setdefault(folder, Counter()).update(tags)
    folders = sorted(merged, key=lambda f: (-max(merged[f].values(), default=0), f))[:MAX_FOLDERS]
    return {folder: _top(merged[folder], len(folders)) for folder in folders}
