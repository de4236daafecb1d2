"""Exceptions raised by :mod:`dataset_cache`.

Each error subclasses the built-in exception that callers already catch for the same kind of problem
(``ValueError`` for bad data, ``TypeError`` for a value of the wrong kind, ``FileNotFoundError`` for a
missing cache), so generic handlers keep working, while :class:`CacheError` catches them all.
Messages name the file, entry or field at fault and say what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CacheCorruptError",
    "CacheFormatError",
    "CacheNotFoundError",
    "CacheLockedError",
    "UnstorableValueError",
    "MaterializeRequired",
    "SourceError",
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
