"""The writer's recovery log: entries checkpointed by :meth:`.writer.CacheWriter.checkpoint` but not yet published.

Publishing a batch the ordinary way (a shard file, then a journal line; docs/FORMAT.md section 8) costs a file
creation, a rename and three fsyncs, and leaves one small shard per batch for the final compaction to rewrite.
An encode checkpoints every batch instead: the batch's entries are appended to this log with one ``write()`` —
which survives the death of the process (Cancel, an exception, ``kill -9``: the bytes are in the OS page cache)
— and the log is fsynced at most every ``sync_seconds``, which bounds what a power loss or an OS crash can take.
The entries are published in full-size shards as the writer fills them; the next writer to open the cache
publishes whatever a dead writer left in its log, then deletes the log.

The log is private to writers: readers never open it, so nothing in it, whole, torn or damaged, can make a cache
unreadable. Replay takes the longest valid prefix of each log; everything after the first invalid record (the
unsynced tail after a power loss) is simply encoded again. Values are stored exactly (the skeleton encoding of
``skeleton.py``, no pickle), so a replayed entry is byte-identical to what the encoder returned.

Layout (little-endian), one file ``wal-<16 hex digits>.log`` per writer and shard being filled, in the cache root:

* the 18-byte magic ``streamcache-wal 1\\n``;
* records: ``b"WREC"``, u32 header length H, u64 data length D, 16 ASCII hex digits (xxh3-64 of the header and
  data bytes), the header (JSON ``{"entries": [[key, kind, skeleton], ...], "tensors": [[dtype, shape], ...]}``,
  each skeleton (FORMAT.md section 7) holding ``$tensor`` references ``[0, i]``: the record's tensor ``i``),
  then the tensors' C-order bytes back to back (D bytes in all). A checkpoint appends one record.

A live writer holds an exclusive ``flock`` on its log (POSIX), so a writer that wrongly opens the same cache at the
same time leaves that log alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

from . import skeleton
from .durable import fsync_dir, named_os_error, new_id
from .safetensors_io import ST_ITEMSIZE, ST_TO_DTYPE
from .shard import StoredTensor

__all__ = ["WAL_RE", "MAGIC", "LogBuffer", "RecoveryLog", "replay", "log_files"]

log = logging.getLogger("dataset_cache.format.wal")

WAL_RE = re.compile(r"wal-[0-9a-f]{16}\.log")
MAGIC = b"streamcache-wal 1\n"
_HEAD = struct.Struct("<4sIQ16s")
_TAG = b"WREC"
_MAX_RANK = 32
_MAX_DIM = 1 << 53

_fdatasync = getattr(os, "fdatasync", os.fsync)  # the size is flushed too: enough for an appended file

try:  # POSIX: an advisory lock marks a log as live
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
except ImportError:  # pragma: no cover - Windows: an open file cannot be deleted, which protects a live log
    def _try_lock(fd: int) -> bool:
        return True


class LogBuffer:
    """Entries added since the last checkpoint, already serialized (the caller may reuse its tensors at once)."""

    __slots__ = ("entries", "tensors", "chunks", "nbytes")

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []
        self.tensors: list[list[Any]] = []
        self.chunks: list[bytes] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: str, kind: str, skel: Any, stored: list[StoredTensor]) -> None:
        """Buffer one entry as the shard builder serialized it (:meth:`.shard.ShardBuilder.add`): its skeleton and
        tensor bytes are shared, not encoded again. The skeleton's references are pointed at this record's tensors
        here; the builder re-points them when it writes its shard, which happens only after this buffer has been
        recorded or dropped."""
        for ref, st, shape, raw in stored:
            ref[0], ref[1] = 0, len(self.tensors)
            self.tensors.append([st, shape])
            self.chunks.append(raw)
            self.nbytes += len(raw)
        self.entries.append([key, kind, skel])

    def record(self) -> bytes:
        """The log record of the buffered entries (see the module docstring)."""
        header = json.dumps({"entries": self.entries, "tensors": self.tensors}, separators=(",", ":"),
                            ensure_ascii=True, allow_nan=False).encode("ascii")
        data = b"".join(self.chunks)
        h = xxhash.xxh3_64(header)
        h.update(data)
        return _HEAD.pack(_TAG, len(header), len(data), h.hexdigest().encode("ascii")) + header + data


class RecoveryLog:
    """One writer's log file: created on the first append, fsynced by time, deleted once its entries are published.

    Args:
        root: the cache directory.
        sync_seconds: fsync the log when at least this long has passed since the last fsync (``0``: every append).
        sync_bytes: ...or when this many bytes were appended since.
    """

    def __init__(self, root: Path, *, sync_seconds: float, sync_bytes: int) -> None:
        self.root = root
        self.sync_seconds = float(sync_seconds)
        self.sync_bytes = int(sync_bytes)
        self.path: Path | None = None
        self._fd: int | None = None
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._size = 0
        self._broken = False

    def append(self, buf: LogBuffer) -> bool:
        """Append the buffered entries as one record (one ``write()``), fsyncing when one is due (returns True)."""
        if not len(buf):
            return False
        data = buf.record()
        if self._broken:
            raise OSError(f"recovery log {self.path}: an earlier append failed; commit instead")
        if self._fd is None:
            self._create()
        fd = self._fd
        assert fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except BaseException as exc:
            try:  # a torn record would hide every later one from replay: cut it off
                os.ftruncate(fd, self._size)
            except OSError:
                self._broken = True
            if isinstance(exc, OSError):
                raise named_os_error(exc, self.path or self.root, "appending to the recovery log") from exc
            raise
        self._size += len(data)
        self._unsynced += len(data)
        if self._unsynced >= self.sync_bytes or time.monotonic() - self._last_sync >= self.sync_seconds:
            self.sync()
            return True
        return False

    @property
    def unsynced(self) -> int:
        """Bytes appended since the last fsync."""
        return self._unsynced

    def sync(self) -> None:
        """Make everything appended so far survive a power loss."""
        if self._fd is not None and self._unsynced:
            try:
                _fdatasync(self._fd)
            except OSError as exc:
                raise named_os_error(exc, self.path or self.root, "syncing the recovery log") from exc
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def _create(self) -> None:
        path = self.root / f"wal-{new_id()}.log"
        fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_BINARY", 0),
                     0o644)
        try:
            _try_lock(fd)
            os.write(fd, MAGIC)
            os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            _remove(path)
            if isinstance(exc, OSError):
                raise named_os_error(exc, path, "creating the recovery log") from exc
            raise
        fsync_dir(self.root)  # the file's name is durable before any record in it counts on it
        self.path, self._fd = path, fd
        self._size = len(MAGIC)
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Close the file (kept: its entries are recovered by the next writer)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close and delete the file: every entry in it is published."""
        self.close()
        if self.path is not None:
            _remove(self.path)
            self.path = None


def log_files(root: Path) -> list[Path]:
    """The recovery logs in the cache root, oldest first."""
    try:
        with os.scandir(root) as it:
            found = [(e.stat().st_mtime_ns, e.name) for e in it
                     if WAL_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return [root / name for _, name in sorted(found)]


def replay(path: Path, add: Callable[[str, str, Any], None]) -> tuple[bool, int]:
    """Call ``add(key, kind, value)`` for each entry of the longest valid prefix of the log at ``path``.

    Never raises for damage: an invalid record (torn, zero-filled, corrupt, or naming an unstorable value) ends
    the replay with a warning; ``add`` raising ``ValueError`` (a bad key or value) does too.

    Returns:
        ``(usable, entries)``: whether the file is ours and not in use by a live writer (False: leave it alone),
        and how many entries were passed to ``add``.
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        log.warning("cannot open recovery log %s (%s); its entries will be encoded again", path, exc)
        return False, 0
    with f:
        if not _try_lock(f.fileno()):
            log.warning("recovery log %s is held by a live writer; left alone", path)
            return False, 0
        size = os.fstat(f.fileno()).st_size
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            if MAGIC.startswith(magic):  # created, then killed before the magic was written: empty
                return True, 0
            log.warning("%s is not a recovery log of this version; left alone", path)
            return False, 0
        n = 0
        for entries in _records(f, size, path):
            for key, kind, value in entries:
                try:
                    add(key, kind, value)
                except (ValueError, TypeError, RuntimeError) as exc:  # a bad key or value; not an OSError
                    log.warning("recovery log %s: entry %.80r refused (%s); the rest is encoded again", path,
                                key, exc)
                    return True, n
                n += 1
        return True, n


def _records(f: Any, size: int, path: Path) -> Iterator[list[tuple[str, str, Any]]]:
    pos = len(MAGIC)
    while pos < size:
        head = f.read(_HEAD.size)
        problem = None
        if len(head) < _HEAD.size:
            problem = "torn record head"
        else:
            tag, hlen, dlen, digest = _HEAD.unpack(head)
            if tag != _TAG or pos + _HEAD.size + hlen + dlen > size:  # nothing beyond the file is allocated
                problem = "bad record head"
        if problem is None:
            header = f.read(hlen)
            data = bytearray(dlen)
            got = f.readinto(data) if dlen else 0
            h = xxhash.xxh3_64(header)
            h.update(data)
            if len(header) != hlen or got != dlen or h.hexdigest().encode("ascii") != digest:
                problem = "checksum mismatch"
            else:
                try:
                    entries = _decode(header, data)
                except (ValueError, TypeError, RuntimeError, OverflowError) as exc:  # SkeletonError is a ValueError
                    problem = f"bad record ({exc})"
        if problem is not None:
            log.warning("recovery log %s: %s at byte %d of %d; the %d bytes after it are dropped (their entries "
                        "are encoded again)", path, problem, pos, size, size - pos)
            return
        yield entries
        pos += _HEAD.size + hlen + dlen


def _decode(header: bytes, data: bytearray) -> list[tuple[str, str, Any]]:
    doc = skeleton.loads(header)
    if type(doc) is not dict or type(doc.get("entries")) is not list or type(doc.get("tensors")) is not list:
        raise ValueError("header is not {entries, tensors}")
    tensors: list[torch.Tensor] = []
    pos = 0
    for spec in doc["tensors"]:
        if (type(spec) is not list or len(spec) != 2 or type(spec[0]) is not str or spec[0] not in ST_TO_DTYPE
                or type(spec[1]) is not list or len(spec[1]) > _MAX_RANK
                or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in spec[1])):
            raise ValueError(f"bad tensor spec {spec!r:.60}")
        dtype, shape = ST_TO_DTYPE[spec[0]], spec[1]
        nbytes = math.prod(shape) * ST_ITEMSIZE[spec[0]]
        if pos + nbytes > len(data):
            raise ValueError("tensors overrun the data")
        if nbytes:
            raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=pos).clone()  # aligned copy
            t = raw.view(dtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        tensors.append(t)
        pos += nbytes
    if pos != len(data):
        raise ValueError("data length disagrees with the tensors")
    used = [False] * len(tensors)

    def on_ref(c: int, r: int) -> torch.Tensor:
        if c != 0 or not 0 <= r < len(tensors) or used[r]:
            raise skeleton.SkeletonError(f"bad tensor reference [{c}, {r}]")
        used[r] = True
        return tensors[r]

    out = []
    for e in doc["entries"]:
        if type(e) is not list or len(e) != 3 or type(e[0]) is not str or type(e[1]) is not str:
            raise ValueError("an entry is not [key, kind, skeleton]")
        out.append((e[0], e[1], skeleton.decode(e[2], on_ref)))
    return out


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # e.g. Windows: still open elsewhere; replaying it again later is harmless
        log.warning("could not delete recovery log %s (%s)", path, exc)
