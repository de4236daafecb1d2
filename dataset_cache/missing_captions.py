"""What an image or clip without a caption file is captioned with (``missing_caption``).

The empty prompt by default, as before the setting existed. kohya's DreamBooth-style datasets name the concept in
the repeats folder instead (``10_ohwx woman/``) and caption every image there that has no caption file with that
name (its "class tokens"); OneTrainer can caption from the file name. Only a *missing* caption file is filled in:
an empty one was written on purpose and stays the empty prompt. The text filled in is a caption line like one read
from a file (prefix, suffix and tag shuffles apply), so it is keyed, encoded once and re-encoded only when it
changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from .frames import FRAMES_SUFFIX
from .listing import repeats_folder_name
from .scan import ScanResult, SourceClip, SourceImage

__all__ = ["MISSING_CAPTIONS", "missing_caption_line", "fill_missing_captions"]

MISSING_CAPTIONS = ("empty", "folder name", "file name")
"""``empty``: the empty prompt; ``folder name``: the name of the ``<repeats>_<name>`` folder holding the source,
after the repeats (kohya's class tokens); ``file name``: the source's file name without its extension (a clip
folder's without ``.frames``)."""

_EXAMPLES = 3
_Source = TypeVar("_Source", SourceImage, SourceClip)


def missing_caption_line(relpath: str, mode: str) -> str | None:
    """The caption line of the source at ``relpath`` (POSIX, relative to the dataset folder) that has no caption
    file, under ``mode``; ``None``: the empty prompt (``empty``, or no ``<repeats>_<name>`` folder holds it)."""
    if mode == "folder name":
        top, sep, _rest = relpath.partition("/")
        return repeats_folder_name(top) if sep else None
    if mode == "file name":
        name = relpath.rpartition("/")[2]
        if name.lower().endswith(FRAMES_SUFFIX):
            return name[: -len(FRAMES_SUFFIX)].strip() or None
        stem = name.rpartition(".")[0] if "." in name.lstrip(".") else name
        return stem.strip() or None
    return None


def fill_missing_captions(scan: ScanResult, mode: str) -> tuple[ScanResult, tuple[str, ...]]:
    """``scan`` with each source without a caption file captioned under ``mode``, and the report's notes: sources
    left with the empty prompt that ``mode`` meant to caption, or (``empty``) kohya repeats folders whose images
    train with the empty prompt, with the setting that would caption them.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in MISSING_CAPTIONS:
        raise ValueError(f"missing_caption must be one of {', '.join(MISSING_CAPTIONS)}, got {mode!r:.40}")
    uncaptioned = [s.relpath for s in scan.images if s.caption_relpath is None] + \
        [c.relpath for c in scan.clips if c.caption_relpath is None]
    if mode == "empty":
        return scan, _kohya_note([p for p in uncaptioned if missing_caption_line(p, "folder name") is not None])
    images = tuple(_filled(s, mode) for s in scan.images)
    clips = tuple(_filled(s, mode) for s in scan.clips)
    left = [p for p in uncaptioned if missing_caption_line(p, mode) is None]
    why = "are in no kohya <repeats>_<name> folder" if mode == "folder name" else "have no name to caption with"
    notes = (f"{len(left)} source(s) without a caption file {why}, so missing_caption {mode!r} leaves them the "
             f"empty prompt ({_examples(left)})",) if left else ()
    return dataclasses.replace(scan, images=images, clips=clips), notes


def _filled(source: _Source, mode: str) -> _Source:
    if source.caption_relpath is not None:
        return source
    line = missing_caption_line(source.relpath, mode)
    return source if line is None else dataclasses.replace(source, captions=(line,))


def _kohya_note(paths: Sequence[str]) -> tuple[str, ...]:
    if not paths:
        return ()
    return (f"{len(paths)} source(s) in kohya <repeats>_<name> folders have no caption file and train with the "
            f"empty prompt ({_examples(paths)}); missing_caption 'folder name' captions them with their folder's "
            "name, as kohya does",)


def _examples(paths: Sequence[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:_EXAMPLES])
    return shown + (f" and {len(paths) - _EXAMPLES} more" if len(paths) > _EXAMPLES else "")
