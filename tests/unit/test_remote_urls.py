"""Cache URLs (dataset_cache.remote.urls) and the missing-extra message: no object store needed."""

from __future__ import annotations

import sys

import pytest

from dataset_cache.errors import RemoteExtraMissingError
from dataset_cache.format.reader import open_cache
from dataset_cache.remote.urls import CacheURL, is_remote_url, parse_cache_url


@pytest.mark.parametrize("url, expected", [
    ("s3://bucket/caches/cats", "s3://bucket/caches/cats"),
    ("S3://bucket/caches/cats/", "s3://bucket/caches/cats"),
    ("gs://b", "gs://b"),
    ("az://container/prefix", "az://container/prefix"),
    ("https://data.example.com/caches/cats", "https://data.example.com/caches/cats"),
    ("http://127.0.0.1:9000/bucket/c", "http://127.0.0.1:9000/bucket/c"),
])
def test_good_urls_are_normalised(url: str, expected: str) -> None:
    parsed = parse_cache_url(url)
    assert parsed == expected and isinstance(parsed, CacheURL) and is_remote_url(url)
    assert parsed / "shards/x.safetensors" == f"{expected}/shards/x.safetensors"


@pytest.mark.parametrize("url, says", [
    ("ftp://host/x", "scheme"),
    ("s3://", "bucket"),
    ("s3://user:secret@bucket/x", "credentials"),
    ("https://host/x?X-Amz-Signature=abc", "credentials"),
    ("https://host/x#frag", "credentials"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/a//b", "empty"),
    ("s3://bu\ncket/x", "control characters"),
    ("https:///nohost", "no host"),
    ("s3://" + "b" * 3000, "longer than"),
])
def test_bad_urls_are_refused_naming_the_problem(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="cache URL") as err:
        parse_cache_url(url)
    assert says in str(err.value)


def test_folders_are_not_urls() -> None:
    for value in ("/data/caches/cats", "caches/cats", "C:\\caches\\cats", "file:///x", 3, None):
        assert not is_remote_url(value)


def test_a_missing_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # what an install without the extra looks like
    with pytest.raises(RemoteExtraMissingError) as err:
        open_cache("s3://bucket/cache")
    message = str(err.value)
    assert "obstore" in message and "pip install" in message and sys.executable in message
    assert "requirements-remote.txt" in message
