"""Durable, link-refusing file operations that every cache file shares, and the errors they raise naming the file.

A cache file is published by temp + fsync + rename with the folder fsynced after (:func:`atomic_write`), so a
crash leaves the old file or the complete new one; a writer opens a file without following a link out of the
cache (:func:`open_nofollow`); and an ``OSError`` on a file becomes one that says which file and what failed
(:func:`named_os_error` writing, :func:`read_error` reading). The manifest, journal, dataset files, shards,
recovery log, lock and sources record all go through these, so the rules are kept in one place.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..errors import CacheCorruptError, CacheLinkError, CacheUnreadableError
from .layout import NOFOLLOW

__all__ = [
    "new_id",
    "named_os_error",
    "read_error",
    "atomic_write",
    "open_nofollow",
    "fsync_dir",
]

_T = TypeVar("_T")


def new_id() -> str:
    """A random 16-hex-digit file id (unique without coordination; never reused)."""
    return secrets.token_hex(8)


def named_os_error(exc: OSError, path: str | os.PathLike[str], action: str) -> OSError:
    """``exc`` with the file named: an ``OSError`` of the same errno whose message says what failed where.

    ``os.write``/``os.fsync`` on a descriptor raise errors that name no file (``[Errno 28] No space left on
    device``); callers re-raise this instead so the user learns which cache file it was.
    """
    if isinstance(exc, CacheUnreadableError) or exc.filename is not None:
        return exc
    err = OSError(exc.errno, f"{exc.strerror or exc} while {action}", os.fspath(path))
    return err


def read_error(path: str | os.PathLike[str], what: str, exc: OSError) -> Exception:
    """An ``OSError`` reading a cache file: not damage (permissions, I/O, a link), unless it was no regular file."""
    if isinstance(exc, CacheUnreadableError):
        return exc
    if exc.errno is None:  # open_regular: a FIFO, device or folder in its place
        return CacheCorruptError(str(path), f"cannot read {what} ({exc.strerror})")
    return CacheUnreadableError(str(path), f"cannot read {what} ({exc.strerror or exc})", errno=exc.errno)


def atomic_write(path: Path, write: Callable[[BinaryIO], _T]) -> _T:
    """Write ``path`` via a temp file in the same folder: write, fsync, rename over ``path``, fsync the folder.

    A crash at any point leaves either no file (or the old one) or the complete new one; an interrupted temp
    file (``.<name>.<id>.tmp``) is an orphan that readers ignore and compaction deletes.
    """
    tmp = path.parent / f".{path.name}.{new_id()}.tmp"
    try:
        with open(tmp, "xb") as f:  # O_EXCL: never follows a link
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a link itself, never what it points to
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise named_os_error(exc, path, "writing") from exc
        raise
    fsync_dir(path.parent)
    return result


def open_nofollow(path: Path, flags: int) -> int:
    """``os.open`` that refuses a link (``CacheLinkError``) instead of writing to what it points to."""
    try:
        return os.open(str(path), flags | NOFOLLOW | getattr(os, "O_BINARY", 0), 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise CacheLinkError(str(path)) from None
        raise named_os_error(exc, path, "opening") from exc


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create in it is durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
