"""The folder layout of a cache and the rules that keep writers inside it.

A cache is copied between machines, so archives and syncs will bring links into it. A writer that followed a
linked ``shards/`` would sweep someone else's folder, and a linked journal would be truncated wherever it
points; so no part of a cache may be a link, and files are opened with ``O_NOFOLLOW``. The cache root itself
may be a link (that is where the user put the cache). Caches never nest: the outer cache's sweeps would take
the inner one's files. The full rules are in docs/FORMAT.md ("Links, nesting and what may be deleted").
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from ..constants import FORMAT_NAME
from ..errors import CacheError, CacheLinkError

__all__ = [
    "is_cache_folder",
    "MANIFEST",
    "SHARDS_DIR",
    "DATASETS_DIR",
    "SOURCES_DIR",
    "DAMAGED_DIR",
    "INTERNAL_DIRS",
    "NOFOLLOW",
    "SHARD_FILE_RE",
    "DATASET_FILE_RE",
    "TEMP_FILE_RE",
    "CacheNestingError",
    "check_no_links",
    "enclosing_cache",
    "check_new_cache_location",
    "is_regular_file",
]

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
DATASETS_DIR = "datasets"
SOURCES_DIR = "sources"
DAMAGED_DIR = "damaged"
"""Where an explicit repair moves shards it takes out of the cache; nothing in the library deletes them."""
INTERNAL_DIRS = (SHARDS_DIR, DATASETS_DIR, SOURCES_DIR, DAMAGED_DIR)

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""Added to every ``os.open`` of a cache file: opening a link fails instead of reaching what it points to."""

SHARD_FILE_RE = re.compile(r"shards/[A-Za-z0-9_-]{1,64}\.safetensors")
DATASET_FILE_RE = re.compile(r"datasets/[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}\.json")
TEMP_FILE_RE = re.compile(r"\.[^/]{1,255}\.[0-9a-f]{16}\.tmp")
"""An interrupted ``atomic_write`` (``.<name>.<16 hex>.tmp``): the only temp files a sweep may delete."""


class CacheNestingError(CacheError, ValueError):
    """A cache would be created inside another cache, or over folders a cache uses."""


def check_no_links(root: str | os.PathLike[str]) -> None:
    """Refuse a cache whose internal folders or root files are symbolic links.

    Raises:
        CacheLinkError: naming the first linked part.
    """
    root = Path(root)
    try:
        with os.scandir(root) as it:
            for e in it:
                if e.is_symlink() and (e.name in INTERNAL_DIRS or e.name == MANIFEST or e.name.endswith(
                        (".jsonl", ".lock", ".log", ".tmp"))):
                    raise CacheLinkError(e.path)
    except (FileNotFoundError, NotADirectoryError):
        return


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_cache_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a cache: its manifest is a regular file there (a link is not followed)."""
    return is_regular_file(Path(path) / MANIFEST)


def _is_cache(folder: Path) -> bool:
    manifest = folder / MANIFEST
    if not is_regular_file(manifest):
        return False
    try:
        with open(manifest, "rb") as f:
            head = f.read(1 << 20)
        return json.loads(head).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def enclosing_cache(path: str | os.PathLike[str]) -> Path | None:
    """The cache that ``path`` lies inside (an ancestor folder holding a cache manifest), or None."""
    p = Path(os.path.abspath(os.fspath(path)))
    for parent in p.parents:
        if _is_cache(parent):
            return parent
    return None


def check_new_cache_location(root: str | os.PathLike[str]) -> None:
    """Refuse to create a cache where it would nest with another.

    Raises:
        CacheNestingError: ``root`` lies inside an existing cache, or already holds a ``shards/``,
            ``datasets/`` or ``damaged/`` folder with files in it (a cache created there would adopt and later
            sweep them).
    """
    root = Path(root)
    outer = enclosing_cache(root)
    if outer is not None:
        raise CacheNestingError(
            f"{root}: this folder is inside the cache {outer}; a cache inside a cache would be deleted by the "
            "outer cache's next compaction. Choose a cache name outside it")
    for name in (SHARDS_DIR, DATASETS_DIR, DAMAGED_DIR):  # sources/ may come first: plan_encode writes it
        sub = root / name
        try:
            with os.scandir(sub) as it:
                busy = any(True for _ in it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            busy = True
        if busy or os.path.islink(sub):
            raise CacheNestingError(
                f"{root}: holds a non-empty {name}/ folder but no cache; a new cache here would treat its files "
                "as its own. Choose an empty folder or a new cache name")
