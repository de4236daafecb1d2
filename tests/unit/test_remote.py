"""A cache in a bucket, against a real S3 API started here (moto's threaded server on 127.0.0.1).

Publishing (content-addressed, never overwriting, the manifest last), opening and reading like a local cache
(the same values, the loader included), ranged GETs of one range each with If-Match, the fetch cache (a second
read goes to no server), injected 500s and timeouts retried, a truncated object and a replaced manifest named,
damage caught by the checksums, a dead server named, and ``pull`` back to a local cache. Skipped with one line when
moto or obstore is not installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache.dataset import Sample
from dataset_cache.errors import (
    CacheCorruptError,
    CacheNotFoundError,
    CacheReplacedError,
    RemoteUnreachableError,
)
from dataset_cache.format.reader import CacheReader, open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.remote.fetch_cache import block_name
from dataset_cache.sampler import BucketSampler
from support.s3server import S3Server, start_s3

BUCKET = "caches"
N = 24


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with start_s3(BUCKET) as server:
        yield server


@pytest.fixture
def server(s3: S3Server) -> S3Server:
    s3.clear()
    return s3


def _options(tmp: Path, **kw: Any) -> Any:
    from dataset_cache.remote import RemoteOptions

    # small blocks, so a tiny cache spans many of them (several GETs per read, coalescing visible)
    base = {"fetch_dir": tmp / "fetched", "block_bytes": 4096, "request_bytes": 16384, "retries": 3,
            "backoff_s": 0.01, "max_backoff_s": 0.05, "retry_timeout_s": 30.0}
    return RemoteOptions(**{**base, **kw})


def _entries(n: int = N) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    for i in range(n):
        out[f"lat{i:02d}"] = {"samples": torch.randn(1, 4, 8 + 8 * (i % 2), 8, generator=g)}
        out[f"cap{i:02d}"] = [[torch.randn(1, 6, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    return out


def _write(root: Path, entries: dict[str, Any], *, name: str = "default", shard_bytes: int = 12 << 10) -> Path:
    with CacheWriter(root, shard_bytes=shard_bytes) as w:
        for key, value in entries.items():
            w.add(key, value, kind="latent" if key.startswith("lat") else "conditioning")
        w.set_dataset(name, [Sample(f"lat{i:02d}", (f"cap{i:02d}",), 1, f"{i}.png") for i in range(len(entries) // 2)],
                      info={"note": name})
    return root


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.fixture
def published(server: S3Server, tmp_path: Path) -> tuple[Path, str]:
    """A local cache of several shards, published to a fresh prefix of the bucket."""
    from dataset_cache.remote.publish import push

    local = _write(tmp_path / "local", _entries())
    url = f"s3://{BUCKET}/{tmp_path.name}/cats"
    push(local, url)
    server.clear()
    return local, url


def _open(url: str, tmp: Path, **kw: Any) -> CacheReader:
    return open_cache(url, remote=_options(tmp, **kw))


def _ranges(server: S3Server) -> list[str]:
    return [r.range or "" for r in server.seen("GET", ".safetensors")]


# ------------------------------------------------------------------------------------------------ publish
def test_push_uploads_content_addressed_files_never_overwriting_and_the_manifest_last(
        server: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    local = _write(tmp_path / "local", _entries())
    url = f"s3://{BUCKET}/{tmp_path.name}/cats"
    report = push(local, url)
    puts = server.seen("PUT", "")
    assert [p.path.rsplit("/", 1)[-1] for p in puts][-1] == "manifest.json"  # the manifest last
    shards = [p for p in puts if p.path.endswith(".safetensors")]
    assert len(shards) == report.shards_uploaded == len(open_cache(local).shards) > 1
    assert all(re.fullmatch(r".*/shards/[0-9a-f]{32}\.safetensors", p.path) for p in shards)
    assert all(p.if_none_match == "*" for p in puts if not p.path.endswith("manifest.json"))  # create-only
    assert puts[-1].if_none_match == "*"  # no cache there before: the manifest is created, not overwritten

    server.clear()
    again = push(local, url)  # the same cache again: nothing uploaded but the manifest, which replaces its version
    assert again.shards_uploaded == 0 and again.shards_present == report.shards_uploaded
    new_puts = server.seen("PUT", "")
    assert [p.path.rsplit("/", 1)[-1] for p in new_puts if p.status == ""][-1] == "manifest.json"
    assert new_puts[-1].if_match  # replaced only if it still is the version found


def test_push_refuses_a_damaged_cache_and_publishes_nothing(server: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    local = _write(tmp_path / "local", _entries(4), shard_bytes=1 << 20)
    shard = local / open_cache(local).shards[0].file
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a row's byte: the header still checks out
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match="checksum mismatch"):
        push(local, f"s3://{BUCKET}/{tmp_path.name}/bad")
    assert not server.seen("PUT", "manifest.json")


def test_verify_names_the_entry_of_a_damaged_row_in_a_bucket(server: S3Server, tmp_path: Path) -> None:
    """A shard object damaged in the bucket after publishing (same size, a row's byte flipped): ``verify`` reads
    every row through ranged GETs and names the row's entry, as it does for a local cache."""
    from dataset_cache.remote.publish import push

    local = _write(tmp_path / "local", _entries(4), shard_bytes=1 << 20)
    url = f"s3://{BUCKET}/{tmp_path.name}/damaged"
    push(local, url)
    s3 = server.boto3()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{tmp_path.name}/damaged/shards/")["Contents"]
    (key,) = [o["Key"] for o in listed]
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-3] ^= 0xFF  # a row's byte: the header still checks out
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with open_cache(local) as lr:
        shard = local / lr.shards[0].file
    local_data = bytearray(shard.read_bytes())
    local_data[-3] ^= 0xFF  # the same damage on disk: the local verify names the entry to expect
    shard.write_bytes(bytes(local_data))
    with open_cache(local) as lr:
        (local_problem,) = lr.verify()
    with _open(url, tmp_path) as rr:
        (problem,) = rr.verify()
    assert isinstance(problem, CacheCorruptError) and "checksum mismatch" in str(problem)
    assert problem.entry is not None and problem.entry == local_problem.entry


def test_a_publisher_that_lost_a_race_is_refused(server: S3Server, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from dataset_cache.remote import publish

    local = _write(tmp_path / "local", _entries(4))
    url = f"s3://{BUCKET}/{tmp_path.name}/race"
    publish.push(local, url)
    monkeypatch.setattr(publish, "_current_etag", lambda client: '"stale-etag-seen-before-another-push"')
    with pytest.raises(CacheReplacedError, match="manifest.json"):
        publish.push(local, url)


# ------------------------------------------------------------------------------------------------ reading
def test_a_bucket_cache_reads_like_the_local_one(published: tuple[Path, str], server: S3Server,
                                                tmp_path: Path) -> None:
    local, url = published
    with open_cache(local) as lr, _open(url, tmp_path) as rr:
        assert str(rr.root) == url and rr.datasets().keys() == lr.datasets().keys()
        assert rr.dataset("default") == lr.dataset("default")
        assert rr.datasets()["default"].info == {"note": "default"}
        keys = sorted(lr.keys())
        assert sorted(rr.keys()) == keys
        for batch in (keys[:5], keys[7:19:3], list(reversed(keys)), [keys[3], keys[3]]):
            assert _same(rr.read(batch), lr.read(batch))
        lazy = rr.get("lat05")["samples"]
        assert _same(lazy.materialize(), lr.read(["lat05"])[0]["samples"])
        assert rr.verify() == []
    ranges = _ranges(server)
    assert ranges and all(re.fullmatch(r"bytes=\d+-\d+", r) for r in ranges)  # one range per GET, never several
    by_shard: dict[str, list[Any]] = {}
    for r in server.seen("GET", ".safetensors"):
        by_shard.setdefault(r.path, []).append(r)
    assert all(r.if_match for gets in by_shard.values() for r in gets[1:])  # after a shard's first GET: If-Match


def test_opening_fetches_headers_only_and_a_second_open_none(published: tuple[Path, str], server: S3Server,
                                                             tmp_path: Path) -> None:
    _local, url = published
    with _open(url, tmp_path) as rr:
        shards = rr.shards
    gets = server.seen("GET", ".safetensors")
    assert {r.path for r in gets} == {f"/{BUCKET}/{url.split('/', 3)[3]}/{sh.file}" for sh in shards}
    for r in gets:  # a header's bytes, never a data block: bytes=0-(n-1) with n <= 64 KiB
        first, last = map(int, r.range.removeprefix("bytes=").split("-"))
        assert first == 0 and last < 64 << 10
    server.clear()
    with _open(url, tmp_path):
        pass
    assert not server.seen("GET", ".safetensors") and len(server.seen("HEAD", ".safetensors")) == len(shards)


def test_a_cache_behind_plain_https_reads_the_same(published: tuple[Path, str], server: S3Server,
                                                    tmp_path: Path) -> None:
    """An ``https://``/``http://`` URL: a plain web server's ranged GETs (here moto's objects made public, fetched
    unsigned, path-style)."""
    local, url = published
    s3 = server.boto3()
    prefix = url.split("/", 3)[3]
    for obj in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]:
        s3.put_object_acl(Bucket=BUCKET, Key=obj["Key"], ACL="public-read")
    web = f"{server.endpoint}/{BUCKET}/{prefix}"
    server.clear()
    with open_cache(local) as lr, _open(web, tmp_path) as wr:
        assert str(wr.root) == web and wr.dataset("default") == lr.dataset("default")
        keys = sorted(lr.keys())
        assert _same(wr.read(keys), lr.read(keys))
    gets = server.seen("GET", ".safetensors")
    assert gets and all(r.key_id is None for r in server.seen())  # unsigned: no credentials sent anywhere
    assert all(re.fullmatch(r"bytes=\d+-\d+", r.range or "") for r in gets)


def test_a_second_read_goes_to_no_server_and_a_new_reader_reuses_the_fetched_bytes(
        published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    local, url = published
    with _open(url, tmp_path) as rr:
        keys = sorted(rr.keys())
        first = rr.read(keys)
        server.clear()
        assert _same(rr.read(keys), first) and not server.seen()  # epoch 2: all local
    with _open(url, tmp_path) as again:  # next run: the manifest, the journal, a HEAD per shard; no shard bytes
        assert _same(again.read(keys), first)
    assert not [r for r in server.seen("GET", ".safetensors") if r.range]


def test_adjacent_missing_blocks_share_one_get(published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    _local, url = published
    with _open(url, tmp_path, fetch_bytes=0) as rr:  # nothing kept: every read fetches
        sh = rr.shards[0]
        server.clear()
        rr.read(sh.keys)  # a whole shard: its blocks are adjacent, so ceil(size / request_bytes) GETs
        gets = [r for r in server.seen("GET", sh.file) if r.range]
        assert len(gets) == -(-sh.size // 16384)


def test_the_loader_over_a_bucket_delivers_the_local_batches(published: tuple[Path, str], tmp_path: Path) -> None:
    local, url = published

    def batches(reader: CacheReader) -> list[Any]:
        samples = reader.dataset("default")
        sampler = BucketSampler(samples, buckets_from_reader(reader, samples), batch_size=3, seed=5)
        with PrefetchLoader(reader, sampler, prefetch_batches=2, epochs=2) as loader:
            return [(b.plan.latent_keys, b.latents.clone()) for b in loader]

    with open_cache(local) as lr, _open(url, tmp_path) as rr:
        got, want = batches(rr), batches(lr)
    assert len(got) == len(want) > 0
    assert all(gk == wk and torch.equal(gl, wl) for (gk, gl), (wk, wl) in zip(got, want))


# ------------------------------------------------------------------------------------------------ faults
def test_server_errors_are_retried(published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    local, url = published
    server.fail("GET", "manifest.json", "500", times=2)
    server.fail("GET", ".safetensors", "500", times=3)
    with open_cache(local) as lr, _open(url, tmp_path) as rr:
        keys = sorted(rr.keys())
        assert _same(rr.read(keys), lr.read(keys))
    assert len([r for r in server.seen("GET") if r.status == "500"]) == 5


def test_timeouts_are_retried(published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    local, url = published
    with open_cache(local) as lr, _open(url, tmp_path, timeout_s=0.5) as rr:
        key = sorted(rr.keys())[0]
        server.fail("GET", ".safetensors", "hang", times=1, hang_s=1.5)  # past the client's timeout, once
        assert _same(rr.read([key]), lr.read([key]))
    hung = [r for r in server.seen("GET", ".safetensors") if r.status == "hang"]
    assert len(hung) == 1 and len([r for r in server.seen("GET", hung[0].path) if r.range == hung[0].range]) >= 2


def test_retries_have_an_end_and_the_error_names_the_url(published: tuple[Path, str], server: S3Server,
                                                         tmp_path: Path) -> None:
    _local, url = published
    with _open(url, tmp_path) as rr:
        server.fail("GET", ".safetensors", "500", times=1000)
        with pytest.raises(RemoteUnreachableError) as err:
            rr.read(sorted(rr.keys()))
    assert url in str(err.value) and "500" in str(err.value)
    server.clear()


def test_a_truncated_object_is_named(published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    _local, url = published
    key = f"{url.split('/', 3)[3]}/{open_cache(url, remote=_options(tmp_path / 'x')).shards[1].file}"
    s3 = server.boto3()
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=body[:len(body) // 2])
    with pytest.raises(CacheCorruptError) as err:
        _open(url, tmp_path / "fresh")
    assert f"{url}/{key.split('/', 2)[2]}" in str(err.value) and "truncated" in str(err.value)


def test_an_object_replaced_after_open_is_named_at_its_next_read(published: tuple[Path, str], server: S3Server,
                                                                 tmp_path: Path) -> None:
    _local, url = published
    with _open(url, tmp_path) as rr:
        sh = rr.shards[-1]
        key = f"{url.split('/', 3)[3]}/{sh.file}"
        s3 = server.boto3()
        body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        body[-1] ^= 0xFF
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
        with pytest.raises(CacheReplacedError) as err:
            rr.read(sh.keys)
    assert f"{url}/{sh.file}" in str(err.value)


def test_a_manifest_replaced_mid_run_is_detected_and_nothing_is_mixed(server: S3Server, tmp_path: Path) -> None:
    from dataset_cache.remote.publish import push

    first = _write(tmp_path / "first", _entries())
    url = f"s3://{BUCKET}/{tmp_path.name}/swap"
    push(first, url)
    g = torch.Generator().manual_seed(9)
    second = _write(tmp_path / "second", {k: ({"samples": torch.randn(v["samples"].shape, generator=g)}
                                              if isinstance(v, dict) else v) for k, v in _entries().items()})
    with open_cache(first) as lr, _open(url, tmp_path) as rr:
        keys = sorted(rr.keys())
        early = rr.read(keys[:4])
        push(second, url)  # another version of the cache under the same URL, while the reader reads
        assert _same(rr.read(keys[:4]), early)  # kept locally: the opened version, unchanged
        with pytest.raises(CacheReplacedError) as err:
            rr.read(keys)  # needs the network: the new manifest is seen before any byte is used
        assert f"{url}/manifest.json" in str(err.value) and "replaced" in str(err.value)
        assert _same(early, lr.read(keys[:4]))


def test_a_changed_row_fails_its_checksum_and_is_fetched_again_next_time(
        published: tuple[Path, str], server: S3Server, tmp_path: Path) -> None:
    local, url = published
    with open_cache(local) as lr, _open(url, tmp_path) as rr:
        sh = rr.shards[0]
        col = sh.columns[0]
        rr.read(sh.keys)  # the blocks are kept now
        block = next((tmp_path / "fetched").rglob(block_name(rr.files.shards[0].key, 4096, col.offset // 4096)))
        data = bytearray(block.read_bytes())
        data[col.offset % 4096] ^= 0xFF  # a kept byte of row 0 rots on the local disk
        block.write_bytes(bytes(data))
        with pytest.raises(CacheCorruptError, match="checksum mismatch") as err:
            rr.read(sh.keys)
        assert str(err.value).startswith(f"{url}/{sh.file}")
        assert _same(rr.read(sh.keys), lr.read(sh.keys))  # the bad block was dropped and fetched again


def test_no_manifest_is_no_cache(server: S3Server, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}/nothing"
    with pytest.raises(CacheNotFoundError, match=re.escape(url)):
        _open(url, tmp_path)


def test_a_dead_server_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from support.s3server import MISSING, s3_available

    if not s3_available():
        pytest.skip(MISSING)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(RemoteUnreachableError) as err:
        _open("s3://nowhere/cache", tmp_path, retries=1)
    assert "s3://nowhere/cache/manifest.json" in str(err.value)


def test_credentials_come_from_the_environment_or_the_shared_credentials_file(
        published: tuple[Path, str], server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3", reason="the shared ~/.aws files are read through boto3")
    _local, url = published
    with _open(url, tmp_path / "env") as rr:  # AWS_ACCESS_KEY_ID in the environment (start_s3 set "test")
        rr.read(sorted(rr.keys())[:2])
    assert {r.key_id for r in server.seen()} == {"test"}
    server.clear()
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = FROMFILE\naws_secret_access_key = secret\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    with _open(url, tmp_path / "file") as rr:  # the provider's usual file (what AWS_PROFILE / ~/.aws give)
        rr.read(sorted(rr.keys())[:2])
    assert {r.key_id for r in server.seen()} == {"FROMFILE"}


def test_gcs_and_azure_urls_make_their_stores_and_a_missing_setting_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No GCS or Azure emulator here: the stores are made (no request sent), and Azure without its account says so."""
    from support.s3server import MISSING, s3_available

    if not s3_available():
        pytest.skip(MISSING)
    from dataset_cache.remote.client import ObjectClient
    from dataset_cache.remote.urls import parse_cache_url

    assert "GCS" in type(ObjectClient(parse_cache_url("gs://bucket/caches/cats"))._store).__name__
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(RemoteUnreachableError, match=r"az://container/cats: cannot set up .*[Aa]ccount"):
        ObjectClient(parse_cache_url("az://container/cats"))
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "team")
    assert "Azure" in type(ObjectClient(parse_cache_url("az://container/cats"))._store).__name__


def test_a_manifest_without_header_checksums_opens_and_reads(server: S3Server, tmp_path: Path) -> None:
    """``header_xxh3`` is optional (docs/FORMAT.md §4): the content address then comes from the fetched header."""
    import json

    from dataset_cache.remote.publish import push

    local = _write(tmp_path / "local", _entries(6))
    manifest = json.loads((local / "manifest.json").read_text())
    for rec in manifest["shards"]:
        del rec["header_xxh3"]
    (local / "manifest.json").write_text(json.dumps(manifest))
    url = f"s3://{BUCKET}/{tmp_path.name}/plain"
    push(local, url)
    with open_cache(local) as lr, _open(url, tmp_path) as rr:
        keys = sorted(lr.keys())
        assert _same(rr.read(keys), lr.read(keys))
        server.clear()
        rr.read(keys)
        assert not server.seen("GET", ".safetensors")


# ------------------------------------------------------------------------------------------------ pull, cli
def test_pull_copies_the_datasets_into_a_local_cache(published: tuple[Path, str], tmp_path: Path) -> None:
    from dataset_cache.remote.publish import pull

    local, url = published
    results = pull(url, tmp_path / "copy", options=_options(tmp_path))
    assert results["default"].samples == N
    with open_cache(local) as lr, open_cache(tmp_path / "copy") as cr:
        keys = sorted(lr.keys())
        assert cr.dataset("default") == lr.dataset("default") and _same(cr.read(keys), lr.read(keys))
        assert cr.datasets()["default"].info["copied_from"]["cache"] == url
    with pytest.raises(KeyError, match="no dataset 'other'"):
        pull(url, tmp_path / "copy", datasets=["other"], options=_options(tmp_path))


def test_cli_push_info_verify_pull(server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from dataset_cache.cli import main

    monkeypatch.setenv("STREAMCACHE_FETCH_CACHE", str(tmp_path / "fetched"))
    local = _write(tmp_path / "local", _entries(6))
    url = f"s3://{BUCKET}/{tmp_path.name}/cli"
    assert main(["push", str(local), url]) == 0
    assert "published 1 dataset(s) (default)" in capsys.readouterr().out
    assert main(["info", url]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["root"] == url and info["datasets"] == {"default": 6}
    assert main(["verify", url]) == 0 and capsys.readouterr().out.startswith("OK: 12 entries")
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    assert "dataset 'default': 6 sample(s)" in capsys.readouterr().out
    assert main(["push", str(local), "s3://user:pw@bucket/x"]) == 2
    assert "credentials" in capsys.readouterr().err
    assert main(["pull", url, str(tmp_path / "copy"), "--dataset", "nope"]) == 2
    assert "no dataset 'nope'" in capsys.readouterr().err
