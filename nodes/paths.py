"""Where caches live, and turning a cache name typed into a node into a path that cannot escape that place.

Caches are kept in ComfyUI's model folder ``streamcache``: ``<models>/streamcache`` by default, plus any
folder listed under ``streamcache:`` in ``extra_model_paths.yaml`` (listed first, so a configured big disk is
where new caches go). A cache is addressed by its name relative to one of those folders (``my_set`` or
``people/my_set``), or by an absolute path inside one of them. Anything else (``..`` segments, absolute paths
elsewhere) is refused: workflows are shared files, and a node must not read or write outside the folders the
user gave ComfyUI.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path, PureWindowsPath

import folder_paths

__all__ = ["FOLDER_NAME", "cache_roots", "register_cache_folder", "resolve_cache", "resolve_under"]

FOLDER_NAME = "streamcache"
"""The ``folder_paths`` key (and the default folder name under ComfyUI's ``models/``)."""


def register_cache_folder() -> None:
    """Add ``<models>/streamcache`` to the ``streamcache`` folder list (idempotent; extra paths stay first)."""
    folder_paths.add_model_folder_path(FOLDER_NAME, os.path.join(folder_paths.models_dir, FOLDER_NAME))


def cache_roots() -> list[Path]:
    """The folders caches may live in, in priority order (the first one receives new caches)."""
    register_cache_folder()
    return [Path(p) for p in folder_paths.get_folder_paths(FOLDER_NAME)]


def resolve_cache(name: str) -> Path:
    """Resolve a cache name or path against :func:`cache_roots` (see :func:`resolve_under`)."""
    return resolve_under(name, cache_roots())


def _is_absolute(name: str) -> bool:
    return os.path.isabs(name) or bool(PureWindowsPath(name).drive)


def _within(path: str, root: Path) -> bool:
    root_s = os.path.normpath(os.path.abspath(root))
    return os.path.commonpath([path, root_s]) == root_s and path != root_s


def resolve_under(name: str, roots: Sequence[Path]) -> Path:
    """Turn ``name`` into a cache path inside one of ``roots``.

    A relative name resolves to the first root where it exists, else to the first root (where a new cache
    would be created). An absolute path is accepted only inside a root.

    Raises:
        ValueError: the name is empty, contains a ``..`` segment, or is an absolute path outside every root;
            the message lists the allowed folders and how to add one.
    """
    name = (name or "").strip()
    allowed = ", ".join(str(r) for r in roots) or "(none)"
    how = (f"Use a cache name relative to one of the StreamCache folders ({allowed}), or add a folder under "
           f"`{FOLDER_NAME}:` in ComfyUI's extra_model_paths.yaml.")
    if not name:
        raise ValueError(f"cache name is empty. {how}")
    if "\x00" in name:
        raise ValueError(f"cache name {name!r} contains a NUL character. {how}")
    if _is_absolute(name):
        path = os.path.normpath(os.path.abspath(name))
        for root in roots:
            if _within(path, root):
                return Path(path)
        raise ValueError(f"cache path {name!r} is outside the StreamCache folders. {how}")
    if ".." in re.split(r"[\\/]+", name):
        raise ValueError(f"cache name {name!r} must not contain '..'. {how}")
    if not roots:
        raise ValueError(f"no StreamCache folder is registered. {how}")
    candidates = [Path(os.path.normpath(os.path.join(os.path.abspath(root), name))) for root in roots]
    for root, candidate in zip(roots, candidates, strict=True):
        if not _within(str(candidate), root):
            raise ValueError(f"cache name {name!r} names a StreamCache folder itself, not a cache in it. {how}")
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return candidates[0]
