"""Manifest and journal: torn last lines, damaged middle lines, versions, atomic compaction switch."""

from __future__ import annotations

import json

import pytest
import torch

from dataset_cache.errors import CacheCorruptError, CacheFormatError
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.format.manifest import encode_line, read_state


def make(tmp_path, commits=3):
    with CacheWriter(tmp_path) as w:
        for i in range(commits):
            w.add(f"k{i}", [torch.full((2,), float(i))])
            w.commit()
    state = read_state(tmp_path)
    return tmp_path / state.journal


def test_journal_lines_are_checksummed_json(tmp_path):
    journal = make(tmp_path)
    lines = journal.read_bytes().splitlines()
    assert len(lines) == 3
    for line in lines:
        obj = json.loads(line)
        assert set(obj) == {"xxh3_64", "record"} and len(obj["xxh3_64"]) == 16


@pytest.mark.parametrize("cut", [1, 10, 40, -3, -2, -1])
def test_torn_last_line_is_ignored_and_truncated_by_next_writer(tmp_path, cut):
    journal = make(tmp_path)
    data = journal.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    journal.write_bytes(data[:last + cut] if cut > 0 else data[:len(data) + cut])
    r = open_cache(tmp_path)
    assert set(r.keys()) == {"k0", "k1"} and r.state.journal_torn
    assert r.verify() == []
    with CacheWriter(tmp_path) as w:
        w.add("k9", [torch.ones(1)])
    r = open_cache(tmp_path)
    assert set(r.keys()) == {"k0", "k1", "k9"} and not r.state.journal_torn


def test_zero_filled_last_line_is_ignored(tmp_path):
    journal = make(tmp_path)
    with open(journal, "ab") as f:
        f.write(b"\0" * 100 + b"\n")
    assert set(open_cache(tmp_path).keys()) == {"k0", "k1", "k2"}


def test_invalid_middle_line_is_corruption(tmp_path):
    journal = make(tmp_path)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"file"', b'"fILE"')
    journal.write_bytes(b"".join(lines))
    with pytest.raises(CacheCorruptError, match="invalid journal line at byte"):
        open_cache(tmp_path)


def test_valid_checksum_but_bad_record_is_corruption(tmp_path):
    journal = make(tmp_path, commits=1)
    with open(journal, "ab") as f:
        f.write(encode_line({"shards": [{"file": "../../etc/passwd", "bytes": 10, "entries": 1}]}))
    with pytest.raises(CacheCorruptError, match="bad shard file name"):
        open_cache(tmp_path)


def test_missing_journal_is_corruption(tmp_path):
    journal = make(tmp_path, commits=1)
    journal.unlink()
    with pytest.raises(CacheCorruptError, match="journal named by the manifest is missing"):
        open_cache(tmp_path)


@pytest.mark.parametrize("patch, error, match", [
    ({"version": 2}, CacheFormatError, "reads version 1"),
    ({"format": "other"}, CacheFormatError, "expected 'streamcache'"),
    ({"shards": {}}, CacheCorruptError, "not a list"),
    ({"journal": "../x.jsonl"}, CacheCorruptError, "journal name"),
    ({"datasets": {"d": {"file": "/etc/passwd", "samples": 1}}}, CacheCorruptError, "bad file name"),
])
def test_manifest_claims_are_checked(tmp_path, patch, error, match):
    make(tmp_path, commits=1)
    m = json.loads((tmp_path / "manifest.json").read_text())
    m.update(patch)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(error, match=match):
        open_cache(tmp_path)


def test_manifest_not_json(tmp_path):
    make(tmp_path, commits=1)
    (tmp_path / "manifest.json").write_bytes(b"[" * 100000)
    with pytest.raises(CacheCorruptError):
        open_cache(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(CacheCorruptError, match="not valid JSON"):
        open_cache(tmp_path)


def test_orphan_files_are_ignored_and_compaction_removes_them(tmp_path):
    make(tmp_path, commits=2)
    (tmp_path / "shards" / "deadbeef.safetensors").write_bytes(b"garbage")
    (tmp_path / "shards" / ".x.safetensors.0000000000000123.tmp").write_bytes(b"garbage")
    (tmp_path / "datasets" / "old-1.json").write_bytes(b"{}")
    r = open_cache(tmp_path)
    assert len(r) == 2 and r.verify() == []
    with CacheWriter(tmp_path) as w:
        rep = w.compact()
    assert rep.files_deleted >= 4  # 3 orphans + old journal (+ replaced shards)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["datasets", "journal-000002.jsonl", "manifest.json",
                                                          "shards"]
    assert len(open_cache(tmp_path)) == 2
