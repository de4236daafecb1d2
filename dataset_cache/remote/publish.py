"""Publishing a local cache to object storage (``push``), and copying a remote cache to the local disk (``pull``).

A published cache is an ordinary cache (docs/FORMAT.md) whose files are named by their content — a shard by the
xxh3-128 of its bytes, a dataset file by that of its JSON — and whose journal is empty, so:

* an upload never overwrites anything (create-only puts; a name that exists already holds the same bytes, checked
  by its size), and a reader of the previous version keeps reading the objects it opened;
* the manifest goes last, with ``If-Match`` on the version the publisher found (or create-only when there was
  none), so a reader never sees a half-published cache and two publishers never silently overwrite each other.

``push`` publishes the cache's state as it is (all its datasets), replacing the cache at the URL; rows are checked
against their checksums as they are uploaded, so damage is never published. ``pull`` copies datasets of a remote
cache into a local one through the ordinary writer (``saving.copy_dataset``): under the local cache's write lock,
every row verified on the way, entries the local cache has already not fetched again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..dataset import DatasetInfo
from ..errors import CacheCorruptError
from ..format.layout import MANIFEST
from ..format.manifest import ShardRecord, journal_name, manifest_bytes
from ..format.reader import CacheReader, open_cache
from ..format.safetensors_io import read_regular
from ..format.shard import ShardIndex
from ..hashing import checksum64
from ..lock import READ_LOCK, CacheLock
from ..saving import SaveResult, copy_dataset
from .client import ObjectClient, RemoteOptions
from .urls import parse_cache_url

__all__ = ["PushReport", "push", "pull", "PUBLISHED_GENERATION"]

log = logging.getLogger("dataset_cache.remote.publish")

PUBLISHED_GENERATION = 0
"""A published manifest's generation: its journal is ``journal-000000.jsonl``, empty, the same object for every
push (an empty file is its own content address)."""


@dataclass(frozen=True)
class PushReport:
    """What a push did: the URL, shards and dataset files uploaded or found there already, bytes uploaded."""

    url: str
    shards_uploaded: int
    shards_present: int
    datasets: tuple[str, ...]
    bytes_uploaded: int

    def summary(self) -> str:
        return (f"published {len(self.datasets)} dataset(s) ({', '.join(self.datasets) or 'none'}) to {self.url}: "
                f"{self.shards_uploaded} shard(s) uploaded, {self.shards_present} already there, "
                f"{self.bytes_uploaded} bytes sent")


def push(cache: str | os.PathLike[str], url: str, *, options: RemoteOptions | None = None,
         on_file: Callable[[str], None] | None = None) -> PushReport:
    """Publish the local cache ``cache`` as the cache at ``url`` (see the module docstring).

    Holds the cache's shared read lock meanwhile, so a clean or compaction elsewhere cannot delete a shard while it
    is uploaded. ``on_file`` is called with each object's name before it is uploaded (progress).

    Raises:
        ValueError: a bad URL. CacheNotFoundError and the other open errors of the local cache.
        CacheCorruptError: a local row fails its checksum (nothing of the new version is published then), or an
            object of the same content name at the URL has another size. CacheReplacedError: someone else published
            to the URL meanwhile. RemoteUnreachableError, RemoteExtraMissingError.
    """
    target = parse_cache_url(url)
    client = ObjectClient(target, options)
    root = Path(cache)
    with CacheLock(root, READ_LOCK, exclusive=False, purpose="publishing"), open_cache(root) as reader:
        before = _current_etag(client)
        records, uploaded, present, sent = _push_shards(client, root, reader, on_file)
        datasets, dsent = _push_datasets(client, root, reader, on_file)
        journal = journal_name(PUBLISHED_GENERATION)
        if not client.create(journal, b""):
            head = client.head(journal)
            if head.size:
                raise CacheCorruptError(client.where(journal), f"{head.size} bytes where a published cache's journal "
                                                               "is empty: the URL holds a cache that was not "
                                                               "published by push; publish to another URL")
        if on_file is not None:
            on_file(MANIFEST)
        client.replace(MANIFEST, manifest_bytes(PUBLISHED_GENERATION, journal, records, datasets), before)
    return PushReport(str(target), uploaded, present, tuple(datasets), sent + dsent)


def _current_etag(client: ObjectClient) -> str | None:
    """The ETag of the manifest at the URL now (``None``: no cache there yet)."""
    try:
        return client.head(MANIFEST).etag
    except FileNotFoundError:
        return None


def _push_shards(client: ObjectClient, root: Path, reader: CacheReader,
                 on_file: Callable[[str], None] | None) -> tuple[list[ShardRecord], int, int, int]:
    """Upload every shard under its content name (verified first); their records for the new manifest."""
    records: list[ShardRecord] = []
    uploaded = present = sent = 0
    for sh in reader.shards:
        data = read_regular(root / sh.file)
        _check_rows(sh, data)
        name = f"shards/{xxhash.xxh3_128_hexdigest(data)}.safetensors"
        if on_file is not None:
            on_file(name)
        if client.create(name, data):
            uploaded += 1
            sent += len(data)
        else:
            _check_present(client, name, len(data))
            present += 1
        records.append(ShardRecord(name, len(data), len(sh.keys), _header_xxh3(data)))
    return records, uploaded, present, sent


def _check_rows(sh: ShardIndex, data: bytes) -> None:
    """Every row of the shard matches its checksum (and the file its size), or the push stops naming it."""
    if len(data) != sh.size:
        raise CacheCorruptError(str(sh.path), f"shard is now {len(data)} bytes, {sh.size} when opened; run verify")
    view = memoryview(data)
    for col in sh.columns:
        n = col.row_nbytes
        for row in range(col.rows):
            begin = col.offset + row * n
            if checksum64(view[begin:begin + n]) != col.checksum(row):
                raise CacheCorruptError(str(sh.path), f"checksum mismatch in {col.tensor} row {row}; nothing was "
                                                      "published. Run `python -m dataset_cache verify` on the cache")


def _header_xxh3(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    return checksum64(memoryview(data)[8:8 + n])


def _check_present(client: ObjectClient, name: str, size: int) -> None:
    """An object already at a content name must be those bytes: its size is compared (a different object under our
    name was not put there by a push)."""
    head = client.head(name)
    if head.size != size:
        raise CacheCorruptError(client.where(name), f"{head.size} bytes where the content it is named after has "
                                                    f"{size}: the object was not put there by push; delete it")


def _push_datasets(client: ObjectClient, root: Path, reader: CacheReader,
                   on_file: Callable[[str], None] | None) -> tuple[dict[str, DatasetInfo], int]:
    datasets: dict[str, DatasetInfo] = {}
    sent = 0
    for name, info in reader.datasets().items():
        reader.dataset(name)  # parses and checks the file before it is published
        raw = read_regular(root / info.file)
        stem = Path(info.file).stem.rsplit("-", 1)[0]
        file = f"datasets/{stem}-{xxhash.xxh3_128_hexdigest(raw)}.json"
        if on_file is not None:
            on_file(file)
        if client.create(file, raw):
            sent += len(raw)
        else:
            _check_present(client, file, len(raw))
        datasets[name] = DatasetInfo(name, file, info.samples, info.info)
    return datasets, sent


def pull(url: str, cache: str | os.PathLike[str], *, datasets: Sequence[str] | None = None,
         options: RemoteOptions | None = None,
         on_dataset: Callable[[str], None] | None = None) -> dict[str, SaveResult]:
    """Copy datasets of the cache at ``url`` (all, or ``datasets``) into the local cache ``cache`` (created when
    missing), each under its own name; returns each dataset's save result.

    Raises:
        KeyError: a dataset named in ``datasets`` is not in the remote cache (naming those it has). The errors of
        :func:`~dataset_cache.format.reader.open_cache` for the URL, and of ``saving.copy_dataset`` locally.
    """
    results: dict[str, SaveResult] = {}
    with open_cache(url, remote=options) as reader:
        names = list(reader.datasets()) if datasets is None else list(datasets)
        missing = [n for n in names if n not in reader.datasets()]
        if missing:
            raise KeyError(f"{url} has no dataset {', '.join(map(repr, missing))}; it has "
                           f"{', '.join(map(repr, reader.datasets())) or 'none'}")
        for name in names:
            if on_dataset is not None:
                on_dataset(name)
            results[name] = copy_dataset(reader, name, cache, name, source_label=str(reader.root))
    return results

