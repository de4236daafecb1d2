"""The local disk cache of bytes fetched from remote caches, so a second epoch (or run) reads locally.

Blocks are kept under names made of their content address — the shard's header checksum and size (the header
holds every row's checksum, so it stands for the shard's bytes), the block size and the block's number; a shard's
header bytes under the same address (``.hdr``) —, so a kept block is never stale: a shard with other bytes has
another name, and every row read from a block is checked against its checksum anyway. A block is written to a
temporary name and renamed, so a reader never sees half of one. The folder is bounded: past ``max_bytes`` the
least recently used blocks are deleted, and only files this module names (``<16 hex>-<size>-<block size>-<n>.blk``,
``<16 hex>-<size>.hdr`` and its own temporary files), regular files, never through a link, inside the folder:
nothing else there or outside it is ever deleted. Nothing is read or written through a link either (a sub-folder
that is one holds nothing of the cache's), and a folder deleted while in use is made again by the next write.

Processes sharing the folder (the ranks of a run on several devices) fetch a block once: a process about to fetch
one claims it (``.<name>.claim``, made only if absent), and another that wants it meanwhile waits for the block
instead of fetching it too; a claim older than the wait is taken over (its process died or stalled).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

from ..format.layout import NOFOLLOW

__all__ = ["FetchCache", "block_name", "header_name"]

log = logging.getLogger("dataset_cache.remote.fetch_cache")

_NAME = r"[0-9a-f]{16}-[0-9]{1,20}(?:-[0-9]{1,12}-[0-9]{1,12}\.blk|\.hdr)"
_BLOCK_RE = re.compile(_NAME)
_TEMP_RE = re.compile(rf"\.{_NAME}\.[0-9a-f]{{16}}\.tmp")
_CLAIM_RE = re.compile(rf"\.{_NAME}\.claim")
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a process that died while writing it
_TOUCH_S = 600.0  # a read refreshes a block's time (its place in the eviction order) at most this often
_KEEP_AFTER_EVICTION = 0.9  # evict down to 90% of the bound, so a full cache does not scan on every write


def block_name(shard_key: str, block_bytes: int, index: int) -> str:
    """The file name of block ``index`` (of ``block_bytes`` bytes) of the shard whose key is ``shard_key``
    (``<header xxh3-64>-<size>``)."""
    return f"{shard_key}-{block_bytes}-{index}.blk"


def header_name(shard_key: str) -> str:
    """The file name of the header bytes of the shard whose key is ``shard_key`` (what opening a cache reads)."""
    return f"{shard_key}.hdr"


class FetchCache:
    """Blocks of remote shards on the local disk, bounded by ``max_bytes`` (least recently used go first).

    Thread-safe, and safe with other processes sharing the folder (each block is written whole, then renamed; a
    block deleted by another process is simply fetched again).

    Raises:
        ValueError: the folder is a symbolic link or not a folder.
    """

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes kept, counted on the first write
        self._warned = False
        if self.enabled:
            self._make_folder()

    def _make_folder(self) -> None:
        """Make the folder (again, when it was deleted while in use), never through a link.

        Raises:
            ValueError: it is a link or a file. OSError: it cannot be made.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        st = os.lstat(self.folder)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{self.folder}: the fetch cache must be a folder, not a link or a file")

    @property
    def enabled(self) -> bool:
        """Whether anything is kept (a bound of 0 keeps nothing)."""
        return self.max_bytes > 0

    def _path(self, name: str) -> Path | None:
        """Where the file ``name`` is kept, or ``None`` when its sub-folder is not a folder of ours (missing, or a
        link: a block is never read or written through one)."""
        sub = self.folder / name[:2]
        try:
            st = os.lstat(sub)
        except OSError:
            return None
        return sub / name if stat.S_ISDIR(st.st_mode) else None

    def _path_to_write(self, name: str) -> Path | None:
        """:meth:`_path`, making the sub-folder (and the folder, deleted while in use) when missing."""
        path = self._path(name)
        if path is not None:
            return path
        sub = self.folder / name[:2]
        try:
            self._make_folder()  # deleted while in use, or replaced by a link (refused)
            sub.mkdir(exist_ok=True)
        except (OSError, ValueError):
            return None
        return self._path(name)

    def has(self, name: str, nbytes: int) -> bool:
        """Whether the block ``name`` is kept whole (``nbytes`` long)."""
        path = self._path(name) if self.enabled else None
        if path is None:
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == nbytes

    def read_into(self, name: str, nbytes: int, offset: int, view: memoryview) -> bool:
        """Fill ``view`` from the block ``name`` (``nbytes`` long) at ``offset``; ``False`` when it is not kept
        whole (evicted meanwhile, or cut short), so the caller fetches it again."""
        path = self._path(name) if self.enabled else None
        if path is None:
            return False
        try:
            fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_BINARY", 0))
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
                return False
            got = 0
            while got < len(view):
                k = os.preadv(fd, [view[got:]], offset + got) if hasattr(os, "preadv") else \
                    _pread_into(fd, view[got:], offset + got)
                if not k:
                    return False
                got += k
            if time.time() - st.st_mtime > _TOUCH_S:
                _touch(fd)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def get(self, name: str, limit: int) -> bytes | None:
        """The whole kept file ``name`` (at most ``limit`` bytes; a header), or ``None``."""
        path = self._path(name) if self.enabled else None
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | NOFOLLOW | getattr(os, "O_BINARY", 0))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            data = os.read(fd, st.st_size)
            if time.time() - st.st_mtime > _TOUCH_S:
                _touch(fd)
            return data if len(data) == st.st_size else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def put(self, name: str, data: memoryview | bytes) -> bool:
        """Keep a block (written to a temporary name, then renamed); ``False`` when it could not be written (a
        full disk: reads go on from the network, and a warning says so once)."""
        if not self.enabled or not _BLOCK_RE.fullmatch(name):
            return False
        path = self._path_to_write(name)
        if path is None:
            self._warn(f"{self.folder / name[:2]} is not a folder of the fetch cache (a link, or it cannot be made)")
            return False
        tmp = path.parent / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | getattr(os, "O_BINARY", 0), 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._warn(str(exc))
            return False
        self._added(len(data))
        return True

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("cannot keep fetched bytes in %s (%s); reads go on from the network", self.folder, why)

    # ------------------------------------------------------------------ claims: one process fetches a block
    def claim(self, name: str, stale_s: float) -> bool:
        """Say that this process fetches the block ``name`` now (a claim file beside it, made only if absent);
        ``False`` when another process said so less than ``stale_s`` seconds ago: wait for its block
        (:meth:`claimed`, :meth:`has`) rather than fetching it too. An older claim was left by a process that died
        or stalled, and is taken over. ``True`` also when nothing is kept (there is nothing to share)."""
        path = self._claim_path(name, make=True)
        if path is None:
            return True
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644))
                return True
            except FileExistsError:
                try:
                    age = time.time() - os.lstat(path).st_mtime
                except OSError:
                    continue  # released meanwhile: try again
                if age < stale_s:
                    return False
                _remove_regular(path)
            except OSError:
                return True  # claims cannot be made here (a read-only folder): fetch, as without them
        return True

    def claimed(self, name: str, stale_s: float) -> bool:
        """Whether a process claimed the block ``name`` less than ``stale_s`` seconds ago."""
        path = self._claim_path(name)
        try:
            return path is not None and time.time() - os.lstat(path).st_mtime < stale_s
        except OSError:
            return False

    def release(self, name: str) -> None:
        """Withdraw this process's claim on the block ``name`` (after keeping it, or failing to fetch it)."""
        path = self._claim_path(name)
        if path is not None:
            _remove_regular(path)

    def _claim_path(self, name: str, *, make: bool = False) -> Path | None:
        if not self.enabled or not _BLOCK_RE.fullmatch(name):
            return None
        path = self._path_to_write(name) if make else self._path(name)
        return None if path is None else path.parent / f".{name}.claim"

    def discard(self, name: str) -> None:
        """Forget a block (its rows failed their checksums: fetch it again next time)."""
        path = self._path(name) if _BLOCK_RE.fullmatch(name) else None
        if path is not None:
            _remove_regular(path)

    def _added(self, nbytes: int) -> None:
        with self._lock:
            if self._total is None:
                self._total = sum(size for _, size, _ in self._scan())
            else:
                self._total += nbytes
            if self._total > self.max_bytes:
                self._evict()

    def _scan(self) -> list[tuple[float, int, Path]]:
        """``(time, size, path)`` of every block kept (and stale temporary files are removed)."""
        found: list[tuple[float, int, Path]] = []
        now = time.time()
        try:
            with os.scandir(self.folder) as top:
                subs = [e.path for e in top if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        except OSError:
            return found
        for sub in subs:
            try:
                with os.scandir(sub) as it:
                    for e in it:
                        try:
                            if not e.is_file(follow_symlinks=False):
                                continue
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if _BLOCK_RE.fullmatch(e.name):
                            found.append((st.st_mtime, st.st_size, Path(e.path)))
                        elif (_TEMP_RE.fullmatch(e.name) or _CLAIM_RE.fullmatch(e.name)) and \
                                now - st.st_mtime > _STALE_TEMP_S:
                            _remove_regular(Path(e.path))
            except OSError:
                continue
        return found

    def _evict(self) -> None:
        """Delete the least recently used blocks until the folder holds 90% of its bound (lock held)."""
        blocks = sorted(self._scan())
        total = sum(size for _, size, _ in blocks)
        target = int(self.max_bytes * _KEEP_AFTER_EVICTION)
        for _, size, path in blocks:
            if total <= target:
                break
            if _remove_regular(path):
                total -= size
        self._total = total


def _remove_regular(path: Path) -> bool:
    """Delete ``path`` if it is a regular file (never through a link); whether it was deleted."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def _touch(fd: int) -> None:
    """Mark a block as used now (its place in the eviction order); where descriptors cannot be touched, the
    order stays that of writing."""
    if os.utime in os.supports_fd:
        try:
            os.utime(fd)
        except OSError:
            pass


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """``preadv`` where the OS lacks it (Windows; the descriptor is private to the caller, so seeking is safe)."""
    os.lseek(fd, offset, os.SEEK_SET)
    chunk = os.read(fd, len(view))
    view[:len(chunk)] = chunk
    return len(chunk)
