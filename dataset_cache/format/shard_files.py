"""The shard files of an open cache: positional reads, descriptors kept open, and the read-ahead policy.

``ShardFiles`` does the file handling (open once and check, ``preadv``, close when no read is in flight);
``ReadAhead`` decides when ranges are worth announcing to the kernel (``posix_fadvise(WILLNEED)``): only while
batches come from the disk. Why each choice was made, and what it gained, is in docs/ARCHITECTURE.md and
docs/BENCHMARKS.md (L4).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ..errors import CacheCorruptError, CacheError, CacheUnreadableError
from .read_plan import FileRange
from .safetensors_io import open_regular
from .shard import ShardIndex

__all__ = ["ShardSource", "ShardFiles", "ReadAhead", "read_exact", "open_checked", "unreadable"]

_HAVE_PREADV = hasattr(os, "preadv")
KEEP_FILES_OPEN = os.name == "posix" and _HAVE_PREADV
CAN_ADVISE = KEEP_FILES_OPEN and hasattr(os, "posix_fadvise")
MAX_KEPT_FILES = 512  # beyond this many shards, the rest are opened per read (stays far below ulimit -n)


class ShardSource(Protocol):
    """Where a reader's shard bytes come from: :class:`ShardFiles` for a cache on the disk, or a remote cache's
    ranged GETs (``dataset_cache.remote.remote_files.RemoteShardFiles``). The reader, its plans and checksums are
    the same for both."""

    def read(self, ranges: Sequence[FileRange], mv: memoryview, *, announced: bool = False) -> None:
        """Fill ``mv[pos:pos + end - begin]`` with shard ``s``'s bytes ``[begin, end)``, for each range."""
        ...

    def announce_ahead(self, ranges: Sequence[FileRange]) -> bool:
        """Ask for the ranges of a later read now, when worth it; whether they were asked for. Never raises."""
        ...

    def close(self) -> None:
        """Release what the source holds (idempotent); reads still work after it."""
        ...


class ReadAhead:
    """When a read's ranges are announced to the kernel before they are read.

    Cold (the recent batches came from the disk): announcing lets the kernel fetch all of a batch's rows at
    once instead of one disk round trip per row. Warm (the page cache serves): announcing only adds syscalls.
    A reader starts cold. A plain read measures its own speed; a read that was announced ahead is fast because
    of the announcement, so it proves nothing, and the announcement measures instead: the kernel accepts one for
    pages it already holds about ten times faster than one that must go to the disk.
    """

    COLD_BYTES_PER_S = 2e9  # a read slower than this came (partly) from the disk
    WARM_S_PER_RANGE = 4e-6  # an announcement quicker than this per range plus per byte found its pages cached
    WARM_BYTES_PER_S = 10e9

    def __init__(self, enabled: bool = CAN_ADVISE) -> None:
        self.enabled = enabled
        self.cold = enabled

    def read_done(self, ranges: Sequence[FileRange], seconds: float, *, announced: bool) -> None:
        """Learn from a read of ``ranges`` that took ``seconds``."""
        if not self.enabled or len(ranges) < 2:
            return
        slow = sum(e - b for _, b, e, _ in ranges) < self.COLD_BYTES_PER_S * seconds
        if slow or not announced:  # a fast announced read says nothing about the page cache
            self.cold = slow

    def announcement_done(self, ranges: Sequence[FileRange], seconds: float) -> None:
        """Learn from an announcement of ``ranges`` that took ``seconds``: quick means the pages were cached."""
        if len(ranges) < 2:
            return
        nbytes = sum(e - b for _, b, e, _ in ranges)
        if seconds < len(ranges) * self.WARM_S_PER_RANGE + nbytes / self.WARM_BYTES_PER_S:
            self.cold = False


class ShardFiles:
    """Positional reads from a reader's shard files, each file opened once and kept open until the reader closes.

    A kept descriptor also pins the snapshot: a compaction by another process that deletes a shard we opened
    cannot change or remove the bytes we read (POSIX keeps an unlinked file alive while it is open). Windows
    cannot delete a file that is open, and a cleaner there must not be blocked by an idle reader, so there (and
    after :meth:`close`, and beyond ``MAX_KEPT_FILES``) each read opens and closes its files. Thread-safe:
    ``preadv`` is positional, and descriptors are closed only when no read is in flight.
    """

    def __init__(self, shards: Sequence[ShardIndex], read_ahead: ReadAhead | None = None) -> None:
        self._shards = shards
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._keep = KEEP_FILES_OPEN
        self._active = 0
        self.read_ahead = read_ahead or ReadAhead()

    @property
    def announcing(self) -> bool:
        """Whether announcements are worth making now: reads come from the disk, and the files are kept open."""
        return self.read_ahead.cold and self._keep

    def read(self, ranges: Sequence[FileRange], mv: memoryview, *, announced: bool = False) -> None:
        """Fill ``mv[pos:pos + end - begin]`` from shard ``s``'s bytes ``[begin, end)`` for each range.

        ``announced``: :meth:`announce` was called for these ranges already (not again, and a fast read proves
        nothing about the page cache).
        """
        if not self._keep:
            self._read_transient(ranges, mv)
            return
        with self._lock:
            self._active += 1
        try:
            fds = self._fds
            if not announced and self.read_ahead.cold and len(ranges) > 1:
                self.announce(ranges)
            t0 = time.perf_counter()
            for s, begin, end, pos in ranges:
                fd = fds.get(s)
                if fd is None:
                    fd = self._open_kept(s)
                    if fd is None:  # over the limit of kept files, or closed meanwhile
                        self._read_transient([(s, begin, end, pos)], mv)
                        continue
                view = mv[pos:pos + end - begin]
                try:
                    got = os.preadv(fd, [view], begin)
                except OSError as exc:
                    raise unreadable(self._shards[s], exc) from None
                if got != len(view):
                    read_exact(fd, view, begin, str(self._shards[s].path))  # short read: finish or raise
            self.read_ahead.read_done(ranges, time.perf_counter() - t0, announced=announced)
        finally:
            with self._lock:
                self._active -= 1
                if not self._keep and not self._active:
                    self._close_all()

    def announce_ahead(self, ranges: Sequence[FileRange]) -> bool:
        """Announce the ranges of a read that comes later, when reads come from the disk; ``True`` if announced."""
        if not ranges or not self.announcing:
            return False
        t0 = time.perf_counter()
        self.announce(ranges)
        self.read_ahead.announcement_done(ranges, time.perf_counter() - t0)
        return True

    def announce(self, ranges: Sequence[FileRange]) -> None:
        """Ask the kernel to start reading every range now (asynchronously; a hint, never an error)."""
        fds = self._fds
        try:
            for s, begin, end, _pos in ranges:
                fd = fds.get(s)
                if fd is None:
                    fd = self._open_kept(s)  # a missing shard is reported by the read, not here
                if fd is not None:
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        except (OSError, CacheError):
            return

    def _open_kept(self, s: int) -> int | None:
        with self._lock:
            if not self._keep or len(self._fds) >= MAX_KEPT_FILES:
                return None
            fd = self._fds.get(s)
            if fd is None:
                fd = self._fds[s] = open_checked(self._shards[s])
            return fd

    def _read_transient(self, ranges: Sequence[FileRange], mv: memoryview) -> None:
        i = 0
        while i < len(ranges):
            s = ranges[i][0]
            sh = self._shards[s]
            fd = open_checked(sh)
            try:
                while i < len(ranges) and ranges[i][0] == s:
                    _, begin, end, pos = ranges[i]
                    read_exact(fd, mv[pos:pos + end - begin], begin, str(sh.path))
                    i += 1
            finally:
                os.close(fd)

    def close(self) -> None:
        """Stop keeping files open; descriptors close now, or when the last read in flight ends."""
        with self._lock:
            self._keep = False
            if not self._active:
                self._close_all()

    def _close_all(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def open_checked(sh: ShardIndex) -> int:
    """Open a shard file for reading and check it still has the size it had when the cache was opened."""
    p = str(sh.path)
    try:
        fd = open_regular(p)
    except FileNotFoundError:
        raise CacheCorruptError(p, "shard file is missing (deleted, or the cache was compacted since it was "
                                   "opened); reopen the cache, and run verify if it persists") from None
    except CacheUnreadableError:
        raise
    except OSError as exc:
        raise unreadable(sh, exc) from None
    size = os.fstat(fd).st_size
    if size != sh.size:
        os.close(fd)
        raise CacheCorruptError(p, f"shard is now {size} bytes, {sh.size} when opened (truncated or replaced); "
                                   "reopen the cache, and run verify if it persists")
    return fd


def unreadable(sh: ShardIndex, exc: OSError) -> CacheError:
    """The error for an ``OSError`` on a shard: not damage, unless it was no regular file (``errno`` None)."""
    if exc.errno is None:
        return CacheCorruptError(str(sh.path), f"cannot open shard ({exc.strerror})")
    return CacheUnreadableError(str(sh.path), f"cannot read the shard ({exc.strerror or exc})", errno=exc.errno)


def read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a file that ends first is a truncated shard."""
    try:
        _read_exact_raw(fd, view, offset, path)
    except CacheError:
        raise
    except OSError as exc:
        raise CacheUnreadableError(path, f"cannot read the shard ({exc.strerror or exc})", errno=exc.errno) from None


def _read_exact_raw(fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    n = len(view)
    while got < n:
        if _HAVE_PREADV:
            k = os.preadv(fd, [view[got:]], offset + got)
        else:  # Windows, macOS < 11: the descriptor is private to this call, so seek + read is safe
            os.lseek(fd, offset + got, os.SEEK_SET)
            chunk = os.read(fd, min(n - got, 16 << 20))
            k = len(chunk)
            view[got:got + k] = chunk
        if not k:
            raise CacheCorruptError(path, f"file ends before byte {offset + n} (truncated)")
        got += k
