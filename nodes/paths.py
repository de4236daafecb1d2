"""Where caches live, and turning a cache name typed into a node into a path that cannot escape that place.

Caches are kept in ComfyUI's model folder ``streamcache``: ``<models>/streamcache`` by default, plus any
folder listed under ``streamcache:`` in ``extra_model_paths.yaml`` (listed first, so a configured big disk is
where new caches go). A cache is addressed by its name relative to one of those folders (``my_set`` or
``people/my_set``), or by an absolute path inside one of them. Anything else (``..`` segments, absolute paths
elsewhere) is refused: workflows are shared files, and a node must not read or write outside the folders the
user gave ComfyUI.

Caches in object storage are named, not typed: ``remote.json`` in a StreamCache folder maps names to URLs
(``{"team-cats": "s3://bucket/caches/cats"}``), and a workflow names one as ``remote:team-cats``. So a shared
workflow can only read from (or publish to) the places this machine's owner listed, and a URL in a workflow never
carries credentials; those come from the environment or the provider's usual files (README, "Training from a
bucket").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

import folder_paths

from ..dataset_cache.remote import CacheURL, RemoteOptions, parse_cache_url
from ..dataset_cache.units import format_bytes
from ..dataset_cache.format.layout import (
    INTERNAL_DIRS,
    CacheNestingError,
    check_new_cache_location,
    enclosing_cache,
    is_cache_folder,
)

__all__ = ["FOLDER_NAME", "REMOTE_CONFIG", "REMOTE_PREFIX", "cache_roots", "register_cache_folder", "resolve_cache",
           "resolve_cache_to_write", "resolve_under", "explain_disk_full", "RemoteConfig", "remote_config",
           "remote_choices", "resolve_remote", "remote_options", "env_flag"]

log = logging.getLogger("streamcache.paths")


def env_flag(name: str, default: bool) -> bool:
    """An on/off setting from ComfyUI's environment (``0``, ``false``, ``no``, ``off``: off; unset or empty:
    ``default``): the pack's few escape hatches (absolute dataset folders, trusting recorded encoders)."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")

MAX_NAME_BYTES = 255
"""Bytes in one folder name (Linux, macOS and Windows file systems all stop at 255)."""

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
        ValueError: the name is empty, contains a ``..`` segment or a part longer than 255 bytes, or is an
            absolute path outside every root; the message lists the allowed folders and how to add one.
    """
    name = (name or "").strip()
    allowed = ", ".join(str(r) for r in roots) or "(none)"
    how = (f"Use a cache name relative to one of the StreamCache folders ({allowed}), or add a folder under "
           f"`{FOLDER_NAME}:` in ComfyUI's extra_model_paths.yaml.")
    if not name:
        raise ValueError(f"cache name is empty. {how}")
    if "\x00" in name:
        raise ValueError(f"cache name {name!r} contains a NUL character. {how}")
    long = next((p for p in re.split(r"[\\/]+", name) if len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES),
                None)
    if long is not None:  # checked before any stat: the OS refuses such a name with an OSError, not a message
        raise ValueError(f"cache name {name[:40]!r}...: the part {long[:40]!r}... is "
                         f"{len(long.encode('utf-8', 'surrogatepass'))} bytes; a folder name may have at most "
                         f"{MAX_NAME_BYTES}")
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


def resolve_cache_to_write(name: str) -> Path:
    """Resolve the name of a cache a node creates or writes into, refusing up front what would fail or do harm.

    Raises:
        ValueError: one message for the first problem: what :func:`resolve_cache` refuses; a part of the name
            that is a folder every cache uses (``shards``, ``datasets``, ``sources``, ``damaged``); a name that
            is an existing file; a name inside an existing cache (its compaction would delete the inner one); a
            folder that holds another cache's folders.
    """
    path = resolve_cache(name)
    roots = [r for r in cache_roots() if _within(str(path), r)]
    parts = path.relative_to(os.path.normpath(os.path.abspath(roots[0]))).parts if roots else path.parts[-1:]
    internal = next((p for p in parts if p in INTERNAL_DIRS), None)
    if internal is not None:
        raise ValueError(f"cache name {name!r}: {internal!r} is the name of a folder inside every cache; choose "
                         "a name without it")
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache name {name!r}: {path} is a file, not a cache folder; choose another name")
    outer = enclosing_cache(path)
    if outer is not None:
        raise ValueError(f"cache name {name!r} lies inside the cache {outer.name!r} ({outer}); a cache inside a "
                         "cache would be deleted by the outer one's next compaction. Choose a name outside it")
    if not is_cache_folder(path):
        try:
            check_new_cache_location(path)
        except CacheNestingError as exc:
            raise ValueError(f"cache name {name!r}: {exc}") from exc
    return path


@contextmanager
def explain_disk_full(root: Path, action: str) -> Iterator[None]:
    """Turn a full disk while writing the cache at ``root`` into a message that says which disk and that what was
    committed is safe (the library's own error names only the file it was writing)."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        probe = Path(root)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = f"{format_bytes(shutil.disk_usage(probe).free)} free"
        except OSError:
            free = "free space unknown"
        raise OSError(errno.ENOSPC, f"the disk holding the cache {root} is full ({free}) while {action} ({exc}). "
                      "Everything committed before this point is kept and the cache is intact: free some space "
                      "(or clean the cache) and queue again; only the rest is encoded", str(root)) from exc


REMOTE_CONFIG = "remote.json"
"""The file, in a StreamCache folder, that names the caches in object storage: ``{"name": "s3://bucket/prefix"}``."""
REMOTE_PREFIX = "remote:"
"""Marks a cache choice that is a name of :data:`REMOTE_CONFIG` (``remote:team-cats``)."""
FETCHED_FOLDER = ".fetched"
"""Folder (inside the first StreamCache folder) that keeps the bytes fetched from remote caches, unless
``STREAMCACHE_FETCH_CACHE`` names another; hidden, so the cache lists never show it."""
_MAX_CONFIG_BYTES = 1 << 20
_MAX_REMOTE_NAME = 100
_WARNED: set[str] = set()


@dataclass(frozen=True)
class RemoteConfig:
    """The remote caches of every ``remote.json`` (the first StreamCache folder's entry wins for a name).

    Attributes:
        caches: name → URL of each valid entry.
        problems: name (``""`` for a whole file) → what is wrong with it, naming the file: an entry left out.
    """

    caches: dict[str, CacheURL] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def remote_config() -> RemoteConfig:
    """Read and check every StreamCache folder's ``remote.json``; a bad file or entry is left out and named (and
    logged), never fatal: the node lists must load whatever the file holds."""
    config = RemoteConfig()
    for root in cache_roots():
        path = root / REMOTE_CONFIG
        try:
            if not path.is_file():
                continue
            if path.stat().st_size > _MAX_CONFIG_BYTES:
                raise ValueError(f"larger than {_MAX_CONFIG_BYTES} bytes")
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            config.problems.setdefault("", f"{path}: cannot be read as JSON ({exc}); it should be an object "
                                           '{"name": "s3://bucket/prefix", ...}')
            continue
        if not isinstance(data, dict):
            config.problems.setdefault("", f"{path}: must be a JSON object {{\"name\": \"s3://bucket/prefix\"}}, "
                                           f"not {type(data).__name__}")
            continue
        for name, url in data.items():
            if name in config.caches or name in config.problems:
                continue
            problem = _check_remote_entry(name, url)
            if problem:
                config.problems[name] = f"{path}: entry {name!r:.80}: {problem}"
            else:
                config.caches[name] = parse_cache_url(url)
    for problem in config.problems.values():
        if problem not in _WARNED:  # the lists are rebuilt often: say it once per process
            _WARNED.add(problem)
            log.warning("StreamCache: %s (left out of the cache list)", problem)
    return config


def _check_remote_entry(name: str, url: object) -> str:
    """What is wrong with one ``remote.json`` entry ("" when nothing)."""
    if not name.strip() or len(name) > _MAX_REMOTE_NAME or any(ord(ch) < 32 for ch in name):
        return f"a name needs 1-{_MAX_REMOTE_NAME} printable characters"
    if not isinstance(url, str):
        return f"the value must be the cache's URL as a string, not {type(url).__name__}"
    try:
        parse_cache_url(url)
    except ValueError as exc:
        return str(exc)
    return ""


def remote_choices() -> list[str]:
    """``remote:<name>`` for every valid entry of the ``remote.json`` files, sorted."""
    return sorted(REMOTE_PREFIX + name for name in remote_config().caches)


def resolve_remote(choice: str) -> CacheURL:
    """The URL a ``remote:<name>`` choice names.

    Raises:
        ValueError: no such entry (listing those there are, and why a bad entry of that name was left out).
    """
    name = choice[len(REMOTE_PREFIX):]
    config = remote_config()
    if name in config.caches:
        return config.caches[name]
    if name in config.problems:
        raise ValueError(f"cache {choice!r}: {config.problems[name]}")
    files = ", ".join(str(r / REMOTE_CONFIG) for r in cache_roots())
    there = ", ".join(REMOTE_PREFIX + n for n in sorted(config.caches)) or "none"
    raise ValueError(f"cache {choice!r}: no remote cache of that name in {files} (remote caches there: {there}). "
                     f'Add it as "{name}": "s3://bucket/prefix" to {cache_roots()[0] / REMOTE_CONFIG}, then press R')


def remote_options() -> RemoteOptions:
    """How the nodes fetch remote caches: the fetched bytes kept in ``<first StreamCache folder>/.fetched`` (or
    ``STREAMCACHE_FETCH_CACHE``), bounded by ``STREAMCACHE_FETCH_CACHE_GB``; the library's defaults otherwise."""
    if os.environ.get("STREAMCACHE_FETCH_CACHE"):
        return RemoteOptions()
    return RemoteOptions(fetch_dir=cache_roots()[0] / FETCHED_FOLDER)
