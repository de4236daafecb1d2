"""Inter-process locks on a cache directory.

Shards are immutable, so readers never need to exclude writers: a writer only ever adds files and appends to
the journal. Two locks capture the rules that remain:

* the **write lock** (``.write.lock``, exclusive) serialises writers, so two processes encoding into one cache
  take turns instead of racing on the journal;
* the **read lock** (``.read.lock``) is held *shared* by every open reader (a training run) and taken
  *exclusive* by operations that delete files (clean, compaction), which therefore refuse to run while
  anybody reads the cache.

Locks are advisory (``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows) and are released by the OS when a
process dies, so a kill -9 never leaves a cache locked.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from types import TracebackType

from .errors import CacheLinkError, CacheLockedError
from .format.layout import NOFOLLOW
from .format.durable import named_os_error

__all__ = ["CacheLock", "WRITE_LOCK", "READ_LOCK"]

log = logging.getLogger("dataset_cache.lock")

WRITE_LOCK = ".write.lock"
READ_LOCK = ".read.lock"

if sys.platform != "win32":  # POSIX
    import fcntl

    def _try_lock(fd: int, exclusive: bool) -> bool:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

else:  # pragma: no cover - Windows
    import msvcrt

    def _try_lock(fd: int, exclusive: bool) -> bool:  # Windows has no shared byte-range lock via msvcrt
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


class CacheLock:
    """An advisory lock on one lock file of a cache directory.

    Args:
        root: the cache directory (created if missing).
        name: ``WRITE_LOCK`` or ``READ_LOCK``.
        exclusive: exclusive (writer, cleaner) or shared (reader) mode.
        timeout: seconds to wait; ``None`` waits forever, ``0`` tries once.
        purpose: named in the waiting message and in the error, e.g. ``"encode"``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        name: str = WRITE_LOCK,
        *,
        exclusive: bool = True,
        timeout: float | None = None,
        purpose: str = "write",
    ) -> None:
        self.path = Path(root) / name
        self.exclusive = exclusive
        self.timeout = timeout
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> "CacheLock":
        """Take the lock, waiting (with one log message) up to ``timeout`` seconds."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a link: that would create or lock a file outside the cache
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
        except OSError as exc:
            if os.path.islink(self.path):
                raise CacheLinkError(str(self.path)) from None
            raise named_os_error(exc, self.path, f"opening the lock for {self.purpose}") from exc
        start = time.monotonic()
        told = False
        delay = 0.01
        while not _try_lock(fd, self.exclusive):
            waited = time.monotonic() - start
            if self.timeout is not None and waited >= self.timeout:
                os.close(fd)
                raise CacheLockedError(
                    f"{self.path.parent}: another process is using this cache ({self.path.name} is held); "
                    f"{self.purpose} needs it {'exclusively' if self.exclusive else 'shared'}. Wait for the other "
                    "run (encode, training or clean) to finish, then retry."
                )
            if not told:
                log.warning("%s: waiting for another process to release %s", self.path.parent, self.path.name)
                told = True
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            _unlock(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "CacheLock":
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten lock must not outlive its owner object
        try:
            self.release()
        except Exception:
            pass
