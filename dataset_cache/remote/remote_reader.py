"""Opening a cache at a URL: the manifest pinned by its ETag, the journal, the shard headers; then a reader.

A remote cache is read by the same :class:`~dataset_cache.format.reader.CacheReader` as a local one — the same
plans, checksums (verified on every read), lazy values and errors — with its shard bytes coming from a
:class:`~.remote_files.RemoteShardFiles` instead of the disk, and its dataset files fetched whole. What is checked
on open is what a local open checks (docs/FORMAT.md §9), from the same parsing functions; in addition:

* the manifest's ETag is pinned: after the journal and headers are read, the manifest must still be the same
  object (else the open is retried, as a local open retries after a compaction), and every later read that goes to
  the network checks it again, so a cache replaced mid-run is named (``CacheReplacedError``), never mixed;
* each shard object's size is checked against the manifest and its ETag pinned for every later GET
  (``If-Match``), so a truncated object is named at open and a replaced one at its next read.

Headers are fetched exactly (not as blocks: opening a large cache moves its headers, not 4 MiB per shard) and kept
in the fetch cache, so the next open of the same cache fetches only the manifest, the journal and a HEAD per shard.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ..constants import MAX_HEADER_BYTES
from ..dataset import DatasetInfo, Sample
from ..errors import CacheCorruptError, CacheError, CacheNotFoundError, CacheReplacedError, CacheUnreadableError
from ..format.dataset_file import parse_dataset
from ..format.layout import MANIFEST
from ..format.manifest import CacheState, ShardRecord, parse_manifest, replay_journal
from ..format.read_plan import ReadPlan, RowRef
from ..format.reader import CacheReader
from ..format.verify import check_rows, entry_owners
from ..format.safetensors_io import parse_header
from ..format.shard import ShardIndex, index_shard
from ..gcpause import gc_paused
from ..hashing import checksum64
from .client import ObjectClient, RemoteOptions, default_fetch_dir
from .fetch_cache import FetchCache, header_name
from .remote_files import ManifestPin, ManifestVersion, RemoteShard, RemoteShardFiles
from .urls import CacheURL, parse_cache_url

__all__ = ["open_remote_cache", "ManifestVersion", "RemoteCacheReader"]

_OPEN_RETRIES = 3
_HEADER_GUESS = 64 << 10
"""Bytes asked for by a header's first GET: a shard's header is ~150 bytes per entry (a 128 MiB SD1.5 shard's is
~250 KiB), so small caches' headers come in one request and larger ones in two."""


def open_remote_cache(url: str, *, verify: bool = True, strict: bool = True,
                      options: RemoteOptions | None = None,
                      version: ManifestVersion | None = None) -> RemoteCacheReader:
    """Open the cache at ``url`` (``s3://``, ``gs://``, ``az://``, ``https://``): manifest, journal, headers.

    Args: as :func:`dataset_cache.format.reader.open_cache`; ``options`` sets the fetch cache, the request sizes,
    the retries and the timeouts (:class:`~.client.RemoteOptions`); ``version``, another reader's
    :attr:`RemoteCacheReader.version`, is the manifest this open must find (the ranks of one run read one version:
    a cache published again meanwhile is refused, not read).

    Raises:
        ValueError: a bad URL. CacheNotFoundError: no manifest at the URL. CacheFormatError, CacheCorruptError
        (naming the object's URL). RemoteUnreachableError: the store could not be reached (naming the URL).
        CacheReplacedError: the cache kept changing while it was opened, or is not ``version``.
        RemoteExtraMissingError.
    """
    cache_url = parse_cache_url(url)
    options = options or RemoteOptions()
    client = ObjectClient(cache_url, options)
    fetch = FetchCache(options.fetch_dir or default_fetch_dir(), options.fetch_bytes)
    for attempt in range(_OPEN_RETRIES):
        try:
            return _open_once(client, fetch, verify, strict, version)
        except CacheReplacedError:
            if attempt + 1 == _OPEN_RETRIES or version is not None:  # a pinned version cannot come back
                raise
    raise AssertionError("unreachable")


def _open_once(client: ObjectClient, fetch: FetchCache, verify: bool, strict: bool,
               version: ManifestVersion | None) -> RemoteCacheReader:
    url = client.url
    try:
        got = client.get(MANIFEST)
    except FileNotFoundError:
        if version is not None:
            raise CacheReplacedError(url / MANIFEST, "the manifest was removed since this run opened the "
                                                     "cache") from None
        raise CacheNotFoundError(f"{url}: no cache here ({MANIFEST} is missing); publish one with "
                                 f"`python -m dataset_cache push CACHE {url}`") from None
    pin = ManifestPin(client, got.etag, got.size)
    if version is not None and pin.version != version:
        raise CacheReplacedError(url / MANIFEST, f"the cache was published again since this run opened it (ETag "
                                                 f"{version.etag} then, {got.etag} now): run again to train on "
                                                 "the new version")
    with gc_paused():
        state = parse_manifest(url, str(url / MANIFEST), bytes(got.data))
        try:
            journal = client.get(state.journal)
        except FileNotFoundError:
            pin.check()  # replaced meanwhile (its journal gone with it), or damaged
            raise CacheCorruptError(url / state.journal, "the journal named by the manifest is missing") from None
        replay_journal(state, str(url / state.journal), bytes(journal.data))
        specs = [RemoteShard(rec.file, rec.bytes, _key(rec.header_xxh3, rec.bytes)) for rec in state.shards]
        files = RemoteShardFiles(client, specs, fetch, pin)
        try:
            shards, problems = _open_shards(url, state.shards, files, strict)
            pin.check()  # everything read belongs to the manifest pinned above
        except BaseException:
            files.close()
            raise
    return RemoteCacheReader(state, shards, files, client, verify=verify, problems=problems)


def _key(header_xxh3: str | None, size: int) -> str | None:
    """A shard's content address (the fetch cache's name for it): its header checksum (which covers every row's
    checksum) and its size."""
    return f"{header_xxh3}-{size}" if header_xxh3 else None


def _open_shards(url: CacheURL, records: Sequence[ShardRecord], files: RemoteShardFiles,
                 strict: bool) -> tuple[list[ShardIndex], list[CacheError]]:
    """Read and check every shard's header (in parallel), and each object's size and ETag."""
    shards: list[ShardIndex] = []
    problems: list[CacheError] = []
    if not records:
        return shards, problems
    with ThreadPoolExecutor(min(len(records), files.client.options.requests_in_flight)) as pool:
        results = list(pool.map(lambda s: _open_shard(url, records[s], s, files), range(len(records))))
    for result in results:
        if isinstance(result, ShardIndex):
            shards.append(result)
        elif strict:
            raise result
        else:
            problems.append(result)
    return shards, problems


def _open_shard(url: CacheURL, rec: ShardRecord, s: int, files: RemoteShardFiles) -> ShardIndex | CacheError:
    """One shard's header and object check; a problem is returned (damage or unreadable), never raised."""
    where = url / rec.file
    try:
        if rec.bytes < 8:
            raise CacheCorruptError(where, f"file is {rec.bytes} bytes, shorter than the 8-byte header length")
        raw, kept = _header(files, rec, s, where)
        head = parse_header(where, raw, rec.bytes - 8 - len(raw))
        index = index_shard(where, rec.file, rec.bytes, head, rec)  # checks the header against the manifest
        sh = files.shards[s]
        if sh.key is None:  # no header checksum in the manifest: the fetched header's own
            sh.key = _key(checksum64(raw), rec.bytes)
        if not kept and sh.key is not None:
            files.cache.put(header_name(sh.key), raw)
        return index
    except (CacheCorruptError, CacheUnreadableError, CacheReplacedError) as exc:
        return exc
    except FileNotFoundError:
        return CacheCorruptError(where, "the shard object is missing; publish the cache again")
    except CacheError as exc:  # a format error: named, never skipped silently
        return CacheCorruptError(where, str(exc))


def _header(files: RemoteShardFiles, rec: ShardRecord, s: int, where: CacheURL) -> tuple[bytes, bool]:
    """A shard's header bytes (after the 8-byte length), and whether they were kept locally: else fetched, in one
    ranged GET of the first ``_HEADER_GUESS`` bytes (a second one when the header is longer), which also checks the
    object's size and pins its ETag; a kept header is checked with a HEAD instead."""
    sh = files.shards[s]
    if sh.key is not None:
        raw = files.cache.get(header_name(sh.key), MAX_HEADER_BYTES)
        if raw is not None and checksum64(raw) == rec.header_xxh3:
            _check_object(files, s)
            return raw, True
    first = files.fetch(s, 0, min(rec.bytes, _HEADER_GUESS))
    (n,) = struct.unpack("<Q", first[:8])
    limit = min(MAX_HEADER_BYTES, rec.bytes - 8)
    if n > limit:
        raise CacheCorruptError(where, f"header length {n} exceeds the limit {limit} (file size {rec.bytes})")
    if 8 + n <= len(first):
        return bytes(first[8:8 + n]), False
    return bytes(first[8:]) + bytes(files.fetch(s, len(first), 8 + n)), False


def _check_object(files: RemoteShardFiles, s: int) -> None:
    """Check the shard object's size against the manifest and pin its ETag (its header was kept locally, so no GET
    did that yet)."""
    sh = files.shards[s]
    head = files.client.head(sh.file)
    if head.size != sh.size:
        raise CacheCorruptError(files.client.where(sh.file), f"the object is {head.size} bytes but the manifest "
                                                              f"says {sh.size} (truncated or replaced)")
    sh.etag = sh.etag or head.etag


class RemoteCacheReader(CacheReader):
    """A :class:`CacheReader` of a remote cache: ``root`` is its URL, reads fetch through the local fetch cache,
    dataset files are fetched whole, ``verify()`` reads every row over the network (or from the fetch cache).

    Attributes:
        client: the cache's object-store client.
        files: its shard source (fetch counters for tests and benchmarks: ``files.requests``).
    """

    def __init__(self, state: CacheState, shards: list[ShardIndex], files: RemoteShardFiles, client: ObjectClient, *,
                 verify: bool = True, problems: Sequence[CacheError] | None = None) -> None:
        super().__init__(state, shards, verify=verify, problems=problems, files=files)
        self.client = client
        self.files = files

    @property
    def version(self) -> ManifestVersion:
        """The manifest this reader opened (another process opens the same with it)."""
        pin = self.files.pin
        assert pin is not None  # always set by open_remote_cache
        return pin.version

    @property
    def options(self) -> RemoteOptions:
        """How this reader fetches (another process fetches the same way, into the same fetch cache)."""
        return self.client.options

    def _load_dataset(self, info: DatasetInfo) -> list[Sample]:
        where = self.client.where(info.file)
        try:
            got = self.client.get(info.file)
        except FileNotFoundError:
            if self.files.pin is not None:
                self.files.pin.check()  # replaced (the old dataset file gone with it), or damaged
            raise CacheCorruptError(where, f"the file of dataset {info.name!r} is missing; publish the cache "
                                           "again") from None
        return parse_dataset(str(where), bytes(got.data), info)

    def _raise_corrupt(self, bad: Sequence[RowRef], plan: ReadPlan, owners: Sequence[str] | None) -> None:
        # the rows' blocks kept locally are forgotten first, so the next read fetches them again
        self.files.discard([(s, *self._shards[s].columns[c].row_range(row), 0) for s, c, row in bad])
        super()._raise_corrupt(bad, plan, owners)

    def _verify_shard(self, sh: ShardIndex) -> list[CacheError]:
        s = self._shards.index(sh)
        owner, problems = entry_owners(sh)

        def read(c: int, start: int, buf: memoryview) -> None:
            col = sh.columns[c]
            last = start + len(buf) // col.row_nbytes - 1
            self.files.read([(s, col.row_range(start)[0], col.row_range(last)[1], 0)], buf)

        return problems + check_rows(sh, owner, read, (CacheCorruptError, CacheUnreadableError, CacheReplacedError))

    def __repr__(self) -> str:
        return f"RemoteCacheReader({str(self.root)!r}, entries={len(self)}, shards={len(self._shards)})"
