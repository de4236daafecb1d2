"""Opening again, as another process does, the caches a reader reads: a folder by its path, a bucket with the
first reader's fetch settings (so both keep their blocks in one fetch cache) and at its manifest version (a cache
published again in between is refused by name). The bucket is moto's S3 server (skipped with one line without
moto or obstore)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheReplacedError
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.multi_reader import MultiCacheReader
from dataset_cache.reopen import CacheAddress, addresses_of, reopen
from support.s3server import S3Server, start_s3

BUCKET = "reopen"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with start_s3(BUCKET) as server:
        yield server


def _write(root: Path, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    with CacheWriter(root) as w:
        for i in range(6):
            w.add(f"lat{i}", {"samples": torch.randn(1, 4, 8, 8, generator=g)}, kind="latent")
            w.add(f"cap{i}", [[torch.randn(1, 6, 32, generator=g), {}]], kind="conditioning")
        w.set_dataset("train", [Sample(f"lat{i}", (f"cap{i}",), 1, f"{i}.png") for i in range(6)])
    return root


def _options(tmp: Path) -> Any:
    from dataset_cache.remote import RemoteOptions

    return RemoteOptions(fetch_dir=tmp / "fetched", block_bytes=4096, request_bytes=16384, retries=2,
                         backoff_s=0.01, max_backoff_s=0.05, retry_timeout_s=10.0)


def _same_values(a: Any, b: Any, keys: list[str]) -> bool:
    return all(torch.equal(x["samples"] if isinstance(x, dict) else x[0][0], y["samples"] if isinstance(y, dict)
                           else y[0][0]) for x, y in zip(a.read(keys), b.read(keys), strict=True))


def test_a_folder_is_reopened_by_its_path(tmp_path: Path) -> None:
    root = _write(tmp_path / "cache", 1)
    with open_cache(root) as reader:
        (address,) = addresses_of(reader)
        assert address == CacheAddress(str(root))
        assert pickle.loads(pickle.dumps(address)) == address  # it travels to a worker process
        with reopen(address) as again:
            assert sorted(again.keys()) == sorted(reader.keys())
            assert _same_values(reader, again, sorted(reader.keys()))


def test_several_caches_are_reopened_in_their_order(tmp_path: Path) -> None:
    a, b = _write(tmp_path / "a", 1), _write(tmp_path / "b", 2)
    multi = MultiCacheReader([open_cache(a), open_cache(b)])
    with multi:
        assert [x.root for x in addresses_of(multi)] == [str(a), str(b)]


def test_a_reader_of_another_kind_is_refused_by_name() -> None:
    class Custom:
        pass

    with pytest.raises(ValueError, match="Custom.*Load Lazy Cache"):
        addresses_of(Custom())


def test_a_bucket_is_reopened_at_the_same_version_into_the_same_fetch_cache(s3: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    url = f"s3://{BUCKET}/{tmp_path.name}/cats"
    push(_write(tmp_path / "local", 1), url)
    options = _options(tmp_path)
    with open_cache(url, remote=options) as reader:
        keys = sorted(reader.keys())
        reader.read(keys)  # every block kept in the fetch cache
        (address,) = addresses_of(reader)
        assert address.root == url and address.remote == options and address.version is not None
        assert address.version.etag  # moto sends ETags: the version is the manifest's ETag
        s3.clear()
        with reopen(pickle.loads(pickle.dumps(address))) as again:
            assert _same_values(reader, again, keys)
        assert not [r for r in s3.seen("GET", ".safetensors") if r.range]  # read from the shared fetch cache


def test_a_bucket_published_again_is_refused_by_name_not_read(s3: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    url = f"s3://{BUCKET}/{tmp_path.name}/cats"
    push(_write(tmp_path / "first", 1), url)
    with open_cache(url, remote=_options(tmp_path)) as reader:
        (address,) = addresses_of(reader)
        push(_write(tmp_path / "second", 2), url)  # another version under the same URL
        s3.clear()
        with pytest.raises(CacheReplacedError) as err:
            reopen(address)
        assert f"{url}/manifest.json" in str(err.value) and "published again" in str(err.value)
        assert len(s3.seen("GET", "manifest.json")) == 1  # refused at once, not retried
        with open_cache(url, remote=_options(tmp_path)) as newest:  # an open without a version takes the new one
            assert newest.version != address.version


def test_a_bucket_whose_manifest_is_gone_is_refused_by_name(s3: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    url = f"s3://{BUCKET}/{tmp_path.name}/gone"
    push(_write(tmp_path / "local", 1), url)
    with open_cache(url, remote=_options(tmp_path)) as reader:
        (address,) = addresses_of(reader)
    s3.boto3().delete_object(Bucket=BUCKET, Key=f"{tmp_path.name}/gone/manifest.json")
    with pytest.raises(CacheReplacedError, match="removed since this run opened"):
        reopen(address)
