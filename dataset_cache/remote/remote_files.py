"""The shard files of a remote cache: a read plan's ranges served by ranged GETs and the local fetch cache.

:class:`RemoteShardFiles` is what :class:`~dataset_cache.format.shard_files.ShardFiles` is for a local cache (the
reader's file source: ``read``, ``announce_ahead``, ``close``), so the reader, its plans, its checksums and the
loader are the same for both. A shard is fetched in fixed blocks: a plan's ranges name the blocks their rows lie
in; blocks kept on the local disk are read there, the missing ones are fetched — adjacent missing blocks of a shard
in one GET of one byte range, up to ``request_bytes``, several GETs in flight — and kept. ``announce_ahead`` (the
loader announces batch N+1 while batch N is read) starts those GETs without waiting for them, so a batch's
fetches overlap the previous batch's training step.

Every GET of a shard carries ``If-Match`` with the ETag the shard had when first fetched, and checks the object's
size against the manifest; every read that goes to the network also checks that the manifest is still the one the
reader opened (:class:`ManifestPin`). A cache replaced mid-run therefore stops the read with a
``CacheReplacedError`` that names it, and no batch ever holds bytes of two versions.

Processes sharing a fetch cache (the ranks of a run on several devices) claim each block before fetching it
(:meth:`~.fetch_cache.FetchCache.claim`); a block another process claimed is awaited in the fetch cache instead of
fetched again, so N ranks reading the same blocks fetch each once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from typing import Any, NamedTuple

from ..errors import CacheCorruptError, CacheReplacedError
from ..format.layout import MANIFEST
from ..format.read_plan import FileRange
from .client import ObjectClient
from .fetch_cache import FetchCache, block_name

__all__ = ["RemoteShard", "ManifestPin", "RemoteShardFiles"]

_CLAIM_POLL_S = 0.01
"""How often a process waiting for a block another process claimed looks for it in the fetch cache."""
_KEEP_UNSTORED = 64
"""Fetches whose blocks could not be kept on disk (no fetch cache, a full disk) stay in memory until a read uses
them, at most this many: an announced batch's bytes are not fetched twice."""


@dataclass
class RemoteShard:
    """One shard object of a remote cache.

    Attributes:
        file: its name in the cache (``shards/<id>.safetensors``).
        size: its size, as the manifest says.
        key: its content address, ``<header xxh3-64>-<size>`` (the fetch cache's name for its blocks); ``None``
            until the header is known (a manifest record without ``header_xxh3``), and then nothing is kept.
        etag: the ETag of the object, pinned by the first GET (``None`` before, or when the server sends none).
    """

    file: str
    size: int
    key: str | None
    etag: str | None = None


class ManifestVersion(NamedTuple):
    """Which manifest of a cache a reader opened: its ETag (``None`` from a server that sends none) and its size.
    Another process opens the same version with it (``open_remote_cache(..., version=...)``)."""

    etag: str | None
    size: int


class ManifestPin:
    """The manifest a reader opened, by its ETag: :meth:`check` raises when the cache's manifest is another now."""

    def __init__(self, client: ObjectClient, etag: str | None, size: int) -> None:
        self.client, self.etag, self.size = client, etag, size

    @property
    def version(self) -> ManifestVersion:
        return ManifestVersion(self.etag, self.size)

    def check(self) -> None:
        """Raises:
            CacheReplacedError: the manifest changed (or was removed) since the reader opened the cache.
            RemoteUnreachableError: it could not be checked.
        """
        where = self.client.where(MANIFEST)
        try:
            head = self.client.head(MANIFEST, if_match=self.etag)
        except FileNotFoundError:
            raise CacheReplacedError(where, "the manifest was removed since this run opened the cache") from None
        except CacheReplacedError:
            raise CacheReplacedError(where, f"the manifest changed since this run opened the cache (ETag "
                                            f"{self.etag} when opened)") from None
        if self.etag is None and head.size != self.size:  # a server without ETags: the size is all we can compare
            raise CacheReplacedError(where, "the manifest changed since this run opened the cache")


class _Fetch:
    """One GET in flight or done: blocks ``first .. first + count - 1`` of shard ``shard``; or (``waits``) one block
    another process claimed, awaited in the fetch cache."""

    __slots__ = ("shard", "first", "count", "future", "check", "stored", "claimed", "waits")

    def __init__(self, shard: int, first: int, count: int, *, claimed: bool = False, waits: bool = False) -> None:
        self.shard, self.first, self.count = shard, first, count
        self.future: Future[Any] = Future()
        self.check: Future[Any] | None = None
        self.stored = False
        self.claimed = claimed  # its blocks' claims are this process's, withdrawn when it settles
        self.waits = waits

    def result(self) -> memoryview:
        """The fetched bytes (re-raising the fetch's error, or the manifest check's)."""
        data = self.future.result()
        if self.check is not None and not self.check.cancelled():  # cancelled: by close(), nothing was checked
            self.check.result()
        return data


class RemoteShardFiles:
    """Ranged reads of a remote cache's shards through a local fetch cache (see the module docstring).

    Thread-safe: reads may run in parallel (the loader's workers); a block is fetched once however many reads
    want it. :meth:`close` stops the background fetches; later reads fetch in the calling thread.
    """

    def __init__(self, client: ObjectClient, shards: Sequence[RemoteShard], cache: FetchCache,
                 pin: ManifestPin | None) -> None:
        self.client = client
        self.shards = list(shards)
        self.cache = cache
        self.pin = pin
        opts = client.options
        self.block = opts.block_bytes
        self.max_blocks = max(1, opts.request_bytes // opts.block_bytes)
        self.claim_wait_s = opts.claim_wait_s
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int], _Fetch] = {}
        self._unstored: OrderedDict[int, _Fetch] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(opts.requests_in_flight,
                                                                   thread_name_prefix="streamcache-fetch")
        self.requests = 0  # GETs of shard bytes sent (for the benchmark and the tests)
        self.fetched_bytes = 0  # shard bytes those GETs brought

    # ----------------------------------------------------------------------------------------- the file source
    def read(self, ranges: Sequence[FileRange], mv: memoryview, *, announced: bool = False) -> None:
        """Fill ``mv[pos:pos + end - begin]`` with bytes ``[begin, end)`` of shard ``s``, for each range.

        Raises:
            RemoteUnreachableError, CacheReplacedError, CacheCorruptError (a truncated object).
        """
        sources = self._acquire(ranges)
        used: list[_Fetch] = []
        b = self.block
        for s, begin, end, pos in ranges:
            for k in range(begin // b, (end - 1) // b + 1) if end > begin else ():
                lo, hi = max(begin, k * b), min(end, (k + 1) * b)
                dst = mv[pos + lo - begin:pos + hi - begin]
                src = sources[(s, k)]
                if src is None:
                    if self.cache.read_into(self._name(s, k), self._nbytes(s, k), lo - k * b, dst):
                        continue
                    src = self._refetch(s, k)  # evicted since it was found
                try:
                    data = src.result()
                except CancelledError:  # announced, then cancelled by close(): fetch it now
                    src = self._refetch(s, k)
                    data = src.result()
                used.append(src)
                at = lo - src.first * b
                dst[:] = data[at:at + hi - lo]
        if used:
            self._release(used)

    def announce_ahead(self, ranges: Sequence[FileRange]) -> bool:
        """Start fetching whatever of ``ranges`` is not kept locally, without waiting; ``True`` when something is
        on its way (the read then waits for it instead of asking again)."""
        try:
            sources = self._acquire(ranges)
        except Exception:  # an announcement never fails: the read reports the problem
            return False
        return any(src is not None for src in sources.values())

    def close(self) -> None:
        """Stop the background fetches (those not started are cancelled); later reads fetch in their own thread."""
        with self._lock:
            pool, self._pool = self._pool, None
            pending = list({id(f): f for f in self._inflight.values()}.values())
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for fetch in pending:
            fetch.future.cancel()  # only those not running yet; their readers fetch them again

    def discard(self, ranges: Sequence[FileRange]) -> None:
        """Forget the kept blocks holding ``ranges`` (rows that failed their checksums are fetched again)."""
        b = self.block
        for s, begin, end, _pos in ranges:
            if self.shards[s].key is not None:
                for k in range(begin // b, (end - 1) // b + 1) if end > begin else ():
                    self.cache.discard(self._name(s, k))

    # ----------------------------------------------------------------------------------------- blocks
    def _name(self, s: int, k: int) -> str:
        return block_name(self.shards[s].key or "", self.block, k)

    def _nbytes(self, s: int, k: int) -> int:
        return min(self.block, self.shards[s].size - k * self.block)

    def _acquire(self, ranges: Sequence[FileRange]) -> dict[tuple[int, int], _Fetch | None]:
        """Each block of ``ranges``: its fetch (in flight or done), or ``None`` when it is kept on disk; the
        missing ones are fetched, adjacent ones of a shard together."""
        b = self.block
        needed = sorted({(s, k) for s, begin, end, _ in ranges if end > begin
                         for k in range(begin // b, (end - 1) // b + 1)})
        out: dict[tuple[int, int], _Fetch | None] = {}
        missing: list[tuple[int, int]] = []
        waits: list[_Fetch] = []
        with self._lock:
            for sk in needed:
                fetch = self._inflight.get(sk)
                if fetch is not None:
                    out[sk] = fetch
                elif self.shards[sk[0]].key is not None and self.cache.has(self._name(*sk), self._nbytes(*sk)):
                    out[sk] = None
                elif self._claimed_elsewhere(*sk):
                    waits.append(self._register(sk[0], [sk[1]], waits=True))
                    out[sk] = waits[-1]
                else:
                    missing.append(sk)
            started: list[_Fetch] = []
            for s, group in groupby(missing, key=lambda sk: sk[0]):
                run: list[int] = []
                for _, k in group:
                    if run and (k != run[-1] + 1 or len(run) >= self.max_blocks):
                        started.append(self._register(s, run, claimed=True))
                        run = []
                    run.append(k)
                if run:
                    started.append(self._register(s, run, claimed=True))
            for fetch in started:
                for k in range(fetch.first, fetch.first + fetch.count):
                    out[(fetch.shard, k)] = fetch
        if started:
            check = self._submit(self.pin.check) if self.pin is not None else None
            for fetch in started:
                fetch.check = check
                self._launch(fetch)
        for fetch in waits:
            self._launch(fetch)
        return out

    def _claimed_elsewhere(self, s: int, k: int) -> bool:
        """Claim block ``k`` of shard ``s`` for this process's fetch (lock held); ``True`` when another process
        sharing the fetch cache is fetching it, so this one waits for it instead."""
        if self.shards[s].key is None or not self.cache.enabled:
            return False
        return not self.cache.claim(self._name(s, k), self.claim_wait_s)

    def _register(self, s: int, blocks: list[int], *, claimed: bool = False, waits: bool = False) -> _Fetch:
        """Enter the GET of ``blocks`` (consecutive) of shard ``s`` (``claimed``: their claims are this process's,
        made by :meth:`_claimed_elsewhere`) — or, ``waits``, the wait for one block another process claimed — in the
        in-flight table (lock held); the caller launches it once the lock is released."""
        fetch = _Fetch(s, blocks[0], len(blocks), claimed=claimed, waits=waits)
        fetch.future.add_done_callback(lambda _f: self._settle(fetch))  # pending: never called here
        for k in blocks:
            self._inflight[(s, k)] = fetch
        if not waits:
            self.requests += 1
        return fetch

    def _launch(self, fetch: _Fetch) -> None:
        """Run the fetch on the pool (in this thread once closed)."""
        pool = self._pool
        if pool is not None:
            try:
                pool.submit(self._run, fetch)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self._run(fetch)

    def _run(self, fetch: _Fetch) -> None:
        future = fetch.future
        if not future.set_running_or_notify_cancel():  # cancelled by close() before it started
            return
        try:
            data = self._await(fetch) if fetch.waits else self._get(fetch)
        except BaseException as exc:
            self._withdraw(fetch)
            future.set_exception(exc)
        else:
            self._withdraw(fetch)  # kept: the waiting processes find the block before the claim is gone
            future.set_result(data)

    def _withdraw(self, fetch: _Fetch) -> None:
        """Withdraw this process's claims on the fetch's blocks (once), so other processes may fetch them."""
        if fetch.claimed:
            fetch.claimed = False
            for k in range(fetch.first, fetch.first + fetch.count):
                self.cache.release(self._name(fetch.shard, k))

    def _await(self, fetch: _Fetch) -> memoryview:
        """The block another process claimed, read from the fetch cache once it is kept there; fetched here after
        all when that process withdrew its claim without keeping it, or kept it past ``claim_wait_s``."""
        name, nbytes = self._name(fetch.shard, fetch.first), self._nbytes(fetch.shard, fetch.first)
        deadline = time.monotonic() + self.claim_wait_s
        while True:
            # the claim is looked at before the block: a claim withdrawn once its block was kept finds the block
            waiting = time.monotonic() <= deadline and self.cache.claimed(name, self.claim_wait_s)
            data = self.cache.get(name, nbytes)
            if data is not None and len(data) == nbytes:
                fetch.stored = True
                return memoryview(data)
            if not waiting:
                break
            time.sleep(_CLAIM_POLL_S)
        with self._lock:
            self.requests += 1
        return self._get(fetch)

    def _refetch(self, s: int, k: int) -> _Fetch:
        """The fetch of one block that was found kept and is gone now (or whose fetch was cancelled)."""
        with self._lock:
            fetch = self._inflight.get((s, k))
            if fetch is not None and not fetch.future.cancelled():
                return fetch
            fetch = self._register(s, [k])
        self._launch(fetch)
        return fetch

    def _submit(self, fn: Any) -> Future[Any]:
        pool = self._pool
        if pool is not None:
            try:
                return pool.submit(fn)
            except RuntimeError:
                pass
        done: Future[Any] = Future()
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def fetch(self, s: int, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` of shard ``s`` in one ranged GET, checked (the object's size against the
        manifest, ``If-Match`` once its ETag is pinned), not kept: for the headers read on open.

        Raises:
            CacheCorruptError: a truncated (or missing) object. CacheReplacedError, RemoteUnreachableError.
        """
        with self._lock:
            self.requests += 1
        return self._range(s, begin, end)

    def _range(self, s: int, begin: int, end: int) -> memoryview:
        sh = self.shards[s]
        where = self.client.where(sh.file)
        try:
            got = self.client.get_range(sh.file, begin, end, if_match=sh.etag)
        except FileNotFoundError:
            if self.pin is not None:
                self.pin.check()  # the cache was replaced and its old shards removed
            raise CacheCorruptError(where, "the shard object is missing (removed from the bucket since the cache "
                                           "was opened); publish the cache again") from None
        if got.size != sh.size:
            raise CacheCorruptError(where, f"the object is {got.size} bytes but the manifest says {sh.size} "
                                           "(truncated or replaced)")
        data = memoryview(got.data).cast("B")
        with self._lock:
            self.fetched_bytes += len(data)
        if len(data) != end - begin:
            raise CacheCorruptError(where, f"asked for bytes {begin}-{end}, the server sent {len(data)} bytes")
        if sh.etag is None and got.etag:
            sh.etag = got.etag
        return data

    def _get(self, fetch: _Fetch) -> memoryview:
        """One ranged GET of the fetch's blocks, each block then kept on disk."""
        sh = self.shards[fetch.shard]
        b = self.block
        data = self._range(fetch.shard, fetch.first * b, min((fetch.first + fetch.count) * b, sh.size))
        if sh.key is not None and self.cache.enabled:
            stored = True
            for k in range(fetch.first, fetch.first + fetch.count):
                at = (k - fetch.first) * b
                stored = self.cache.put(self._name(fetch.shard, k), data[at:at + self._nbytes(fetch.shard, k)]) \
                    and stored
            fetch.stored = stored
        return data

    def _settle(self, fetch: _Fetch) -> None:
        """A fetch is done: blocks kept on disk (or a failure or cancellation, retried by the next read) leave the
        in-flight table; the others stay until a read uses them (:meth:`_release`), at most ``_KEEP_UNSTORED``."""
        future = fetch.future
        failed = future.cancelled() or future.exception() is not None
        if future.cancelled():  # never ran: its claims are withdrawn here
            self._withdraw(fetch)
        with self._lock:
            if failed or fetch.stored:
                self._forget(fetch)
                return
            self._unstored[id(fetch)] = fetch
            while len(self._unstored) > _KEEP_UNSTORED:
                self._forget(self._unstored.popitem(last=False)[1])

    def _release(self, used: list[_Fetch]) -> None:
        with self._lock:
            for fetch in used:
                if self._unstored.pop(id(fetch), None) is not None:
                    self._forget(fetch)

    def _forget(self, fetch: _Fetch) -> None:
        for k in range(fetch.first, fetch.first + fetch.count):
            if self._inflight.get((fetch.shard, k)) is fetch:
                del self._inflight[(fetch.shard, k)]
