"""Readers sharing one fetch cache (as the ranks of a run on several devices do, each its own process with its own
:class:`FetchCache` over the same folder) fetch each block once: a block one claimed is awaited by the others in the
fetch cache, not fetched again; a claim never delivered, withdrawn, or left stale by a dead process delays nobody
for long. The bucket is moto's S3 server (skipped with one line without moto or obstore)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.format.reader import CacheReader, open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.remote.fetch_cache import block_name
from support.s3server import S3Server, start_s3

BUCKET = "claims"
BLOCK = 4096


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with start_s3(BUCKET) as server:
        yield server


@pytest.fixture
def published(s3: S3Server, tmp_path: Path) -> tuple[Path, str]:
    """A local cache of one shard spanning several blocks, published to a fresh prefix."""
    from dataset_cache.remote.publish import push

    g = torch.Generator().manual_seed(3)
    local = tmp_path / "local"
    with CacheWriter(local) as w:
        w.add("cap", [[torch.randn(1, 6, 32, generator=g), {}]], kind="conditioning")
        for i in range(16):
            w.add(f"lat{i:02d}", {"samples": torch.randn(1, 4, 8, 8, generator=g)}, kind="latent")
        w.set_dataset("train", [Sample(f"lat{i:02d}", ("cap",), 1, f"{i}.png") for i in range(16)])
    url = f"s3://{BUCKET}/{tmp_path.name}/cats"
    push(local, url)
    return local, url


def _open(url: str, fetch_dir: Path, **kw: Any) -> CacheReader:
    from dataset_cache.remote import RemoteOptions

    options = RemoteOptions(fetch_dir=fetch_dir, block_bytes=BLOCK, request_bytes=BLOCK, retries=2, backoff_s=0.01,
                            max_backoff_s=0.05, retry_timeout_s=10.0, **kw)
    return open_cache(url, remote=options)


def _shard_gets(s3: S3Server) -> list[tuple[str, str]]:
    return [(r.path, r.range or "") for r in s3.seen("GET", ".safetensors")]


def _claimed_elsewhere(reader: CacheReader, fetch_dir: Path, k: int, age_s: float = 0.0) -> Path:
    """Claim block ``k`` of the first shard as another process would (``age_s`` seconds ago); the claim file."""
    name = block_name(reader.files.shards[0].key, BLOCK, k)  # type: ignore[attr-defined]
    claim = fetch_dir / name[:2] / f".{name}.claim"
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.touch()
    if age_s:
        os.utime(claim, (time.time() - age_s, time.time() - age_s))
    return claim


def _values(reader: CacheReader, keys: list[str]) -> list[torch.Tensor]:
    return [v["samples"] for v in reader.read(keys)]


def _keys_of_block(reader: CacheReader, k: int) -> list[str]:
    """The entries whose rows lie wholly in block ``k`` of the first shard."""
    sh = reader.shards[0]
    out = []
    for i, key in enumerate(sh.keys):
        ranges = [sh.columns[c].row_range(r) for c, r in sh.parse(i)[1]]
        if key.startswith("lat") and all(b // BLOCK == k and (e - 1) // BLOCK == k for b, e in ranges):
            out.append(key)
    assert out, f"no entry lies wholly in block {k}"
    return out


def test_two_readers_sharing_a_fetch_cache_fetch_each_block_once(published: tuple[Path, str], s3: S3Server,
                                                                 tmp_path: Path) -> None:
    local, url = published
    shared = tmp_path / "fetched"
    a, b = _open(url, shared), _open(url, shared)
    keys = sorted(k for k in a.keys() if k.startswith("lat"))
    s3.clear()
    got: dict[str, list[torch.Tensor]] = {}
    start = threading.Barrier(2)

    def read(name: str, reader: CacheReader, order: list[str]) -> None:
        start.wait()
        got[name] = _values(reader, order)

    threads = [threading.Thread(target=read, args=("a", a, keys)),
               threading.Thread(target=read, args=("b", b, keys[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    gets = _shard_gets(s3)
    assert gets and len(gets) == len(set(gets)), f"a block was fetched twice: {sorted(gets)}"
    with open_cache(local) as lr:
        want = _values(lr, keys)
    assert all(torch.equal(x, y) for x, y in zip(got["a"], want, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(got["b"][::-1], want, strict=True))
    assert not list(shared.rglob("*.claim"))  # every claim withdrawn before the read returned
    a.close()
    b.close()


def test_a_claim_never_delivered_delays_the_read_by_the_wait_only(published: tuple[Path, str], s3: S3Server,
                                                                  tmp_path: Path) -> None:
    local, url = published
    shared = tmp_path / "fetched"
    with _open(url, shared, claim_wait_s=0.5) as reader:
        keys = _keys_of_block(reader, 1)
        _claimed_elsewhere(reader, shared, 1)  # another process claimed block 1, then stalled
        s3.clear()
        t0 = time.monotonic()
        values = _values(reader, keys)
        waited = time.monotonic() - t0
        assert waited >= 0.5 and len(_shard_gets(s3)) == 1  # waited its bound, then fetched the block itself
        with open_cache(local) as lr:
            assert all(torch.equal(x, y) for x, y in zip(values, _values(lr, keys), strict=True))


def test_a_withdrawn_claim_ends_the_wait_at_once(published: tuple[Path, str], s3: S3Server, tmp_path: Path) -> None:
    _, url = published
    shared = tmp_path / "fetched"
    with _open(url, shared, claim_wait_s=30.0) as reader:
        keys = _keys_of_block(reader, 1)
        claim = _claimed_elsewhere(reader, shared, 1)
        threading.Timer(0.3, claim.unlink).start()  # its fetch failed: the claim goes, no block kept
        t0 = time.monotonic()
        _values(reader, keys)
        assert time.monotonic() - t0 < 10.0  # not the 30 s bound


def test_a_block_kept_by_the_claiming_process_is_read_from_the_disk(published: tuple[Path, str], s3: S3Server,
                                                                    tmp_path: Path) -> None:
    local, url = published
    shared, elsewhere = tmp_path / "fetched", tmp_path / "other"
    with _open(url, shared, claim_wait_s=30.0) as reader, _open(url, elsewhere) as other:
        keys = _keys_of_block(reader, 1)
        other.read(keys)  # block 1 fetched into another folder: the bytes the claiming process will keep
        name = block_name(reader.files.shards[0].key, BLOCK, 1)  # type: ignore[attr-defined]
        block = (elsewhere / name[:2] / name).read_bytes()
        claim = _claimed_elsewhere(reader, shared, 1)
        s3.clear()

        def deliver() -> None:  # what the claiming process does: keep the block, then withdraw its claim
            tmp = claim.parent / f".{name}.0123456789abcdef.tmp"
            tmp.write_bytes(block)
            os.replace(tmp, claim.parent / name)
            claim.unlink()

        threading.Timer(0.3, deliver).start()
        values = _values(reader, keys)
        assert _shard_gets(s3) == []  # nothing fetched: the block came from the disk
        with open_cache(local) as lr:
            assert all(torch.equal(x, y) for x, y in zip(values, _values(lr, keys), strict=True))


def test_a_stale_claim_is_taken_over_without_waiting(published: tuple[Path, str], s3: S3Server,
                                                     tmp_path: Path) -> None:
    _, url = published
    shared = tmp_path / "fetched"
    with _open(url, shared, claim_wait_s=30.0) as reader:
        keys = _keys_of_block(reader, 1)
        claim = _claimed_elsewhere(reader, shared, 1, age_s=60.0)  # left by a process that died a minute ago
        s3.clear()
        t0 = time.monotonic()
        _values(reader, keys)
        assert time.monotonic() - t0 < 10.0 and len(_shard_gets(s3)) == 1
        assert not claim.exists()  # taken over, then withdrawn before the read returned


def test_a_block_fetched_again_withdraws_no_claim_it_did_not_make(published: tuple[Path, str], s3: S3Server,
                                                                  tmp_path: Path) -> None:
    """A block found kept and gone before it was read is fetched again without a claim; another process's claim on
    it stays (withdrawing it would let a third process fetch the block too)."""
    _, url = published
    shared = tmp_path / "fetched"
    with _open(url, shared) as reader:
        claim = _claimed_elsewhere(reader, shared, 1)
        reader.files._refetch(0, 1).result()  # type: ignore[attr-defined]
        assert claim.exists()
