"""Exceptions raised by :mod:`dataset_cache`, and :class:`SourceFailure`, a source error reported instead.

Each error subclasses the built-in exception that callers already catch for the same kind of problem
(``ValueError`` for bad data, ``TypeError`` for a value of the wrong kind, ``FileNotFoundError`` for a
missing cache), so generic handlers keep working, while :class:`CacheError` catches them all.
Messages name the file, entry or field at fault and say what to do about it. Listing, scanning and validating a
dataset folder report each unusable file as a :class:`SourceFailure` and go on; it lives here so that all three
(and the encode) share it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CacheError",
    "CacheCorruptError",
    "CacheFormatError",
    "CacheNotFoundError",
    "CacheLockedError",
    "CacheUnreadableError",
    "CacheLinkError",
    "RemoteUnreachableError",
    "CacheReplacedError",
    "RemoteExtraMissingError",
    "UnstorableValueError",
    "MaterializeRequired",
    "SourceError",
    "DatasetFolderError",
    "SourceFailure",
]


class CacheError(Exception):
    """Base class of every error this library raises on purpose."""


class CacheCorruptError(CacheError, ValueError):
    """Bytes on disk do not match what the cache claims (checksum, truncation, impossible header).

    Attributes:
        path: the file at fault.
        entry: the entry key (or tensor name) involved, when known.
        reason: what was wrong, in words.
    """

    def __init__(self, path: str, reason: str, *, entry: str | None = None) -> None:
        self.path = str(path)
        self.entry = entry
        self.reason = reason
        where = f"{self.path}" + (f" (entry {entry})" if entry else "")
        super().__init__(
            f"{where}: {reason}. The cache is damaged: run `python -m dataset_cache verify <cache>` to list "
            "every bad entry, then re-encode (bad entries are re-created by the next encode) or rebuild the cache."
        )


class CacheFormatError(CacheError, ValueError):
    """The directory or file is not a cache of a format version this library reads."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """No cache exists at the given location."""


class CacheLockedError(CacheError, RuntimeError):
    """Another process holds the cache's lock for longer than we were willing to wait."""


class CacheUnreadableError(CacheError, OSError):
    """A cache file could not be opened or read because of its environment, not its bytes.

    Permission denied, too many open files, an I/O error or a link are not damage: the file may be perfectly
    healthy once the cause is gone, so nothing that raises this is ever dropped or deleted by compaction or
    repair.

    Attributes:
        path: the file at fault.
        entry: the entry key involved, when known.
        reason: what went wrong, in words.
        errno: the operating system's error number, when there was one.
    """

    def __init__(self, path: str, reason: str, *, entry: str | None = None, errno: int | None = None) -> None:
        self.path = str(path)
        self.entry = entry
        self.reason = reason
        where = f"{self.path}" + (f" (entry {entry})" if entry else "")
        super().__init__(f"{where}: {reason}. The file was left as it is; fix the cause (permissions, open-file "
                         "limit, disk) and retry")
        self.errno = errno


class CacheLinkError(CacheUnreadableError):
    """A part of a cache (or of a source folder) is a symbolic link, which StreamCache never follows.

    Caches are copied between machines; a link inside one could make a writer delete or overwrite files
    outside the cache, or a reader read them.
    """

    def __init__(self, path: str) -> None:
        CacheError.__init__(self)
        self.path = str(path)
        self.entry = None
        self.errno = None
        self.reason = "is a symbolic link"
        self.args = (f"{self.path} is a symbolic link. StreamCache never follows a link inside a cache (it could "
                     "make a write or a clean reach files outside the cache). Replace the link by a copy of what "
                     "it points to (e.g. `cp -rL` or `rsync -L` when copying a cache), then retry",)


class RemoteUnreachableError(CacheUnreadableError):
    """A remote cache's file could not be fetched (network, server error after the retries, a timeout, refused
    credentials): not damage, the cache may be perfectly healthy once the cause is gone.

    Attributes:
        path: the URL of the file (or of the cache).
        reason: what went wrong, in words.
    """

    def __init__(self, path: str, reason: str, *, entry: str | None = None) -> None:
        CacheError.__init__(self)
        self.path = str(path)
        self.entry = entry
        self.errno = None
        self.reason = reason
        where = f"{self.path}" + (f" (entry {entry})" if entry else "")
        self.args = (f"{where}: {reason}. Nothing was changed; check the URL, the network and the credentials "
                     "(environment variables or the provider's usual files), then retry",)


class CacheReplacedError(CacheError, RuntimeError):
    """A remote cache was replaced (its manifest, or a shard file, changed) while a reader read it.

    The reader's snapshot is the state it opened; reading on from a newer one would mix two versions of the
    cache, so the read stops instead. Attributes: ``path``, the URL of the file that changed.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}. The cache was replaced while this run read it, and nothing of the "
                         "two versions was mixed: run again to read the new version")


class RemoteExtraMissingError(CacheError, ImportError):
    """Reading or publishing a remote cache needs the optional object-store client, which is not installed."""


class UnstorableValueError(CacheError, TypeError):
    """A value cannot be stored in the format (e.g. a hook object inside a conditioning dict).

    Attributes:
        where: the path of the value inside the structure, e.g. ``conditioning[3][1]['hooks']``.
        type_name: the offending value's type name.
    """

    def __init__(self, where: str, type_name: str, hint: str = "") -> None:
        self.where = where
        self.type_name = type_name
        msg = f"{where}: {type_name} is not storable"
        super().__init__(msg + (f" ({hint})" if hint else ""))


class MaterializeRequired(CacheError, TypeError):
    """A lazy value was used as if it were real data; call ``materialize()`` first."""


class SourceError(CacheError, ValueError):
    """A source file (image or caption) could not be read or decoded.

    Attributes:
        path: the source file.
        reason: what went wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class DatasetFolderError(CacheError, ValueError):
    """The dataset folder is missing, not a folder, or holds no usable image.

    Attributes:
        path: the folder.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


@dataclass(frozen=True)
class SourceFailure:
    """A source file that could not be used; the scan goes on without it.

    Attributes:
        relpath: path relative to the dataset folder (POSIX separators).
        path: absolute path.
        reason: what went wrong and, where possible, how to fix it.
    """

    relpath: str
    path: str
    reason: str

    def error(self) -> SourceError:
        """Return this failure as an exception, for callers whose policy is to stop."""
        return SourceError(self.path, self.reason)
