"""Damaged shards: checksum mismatches, truncation, missing files, hostile headers."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest
import torch

from dataset_cache.errors import CacheCorruptError, CacheError, CacheFormatError
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.format.safetensors_io import parse_header
from dataset_cache.hashing import checksum64


@pytest.fixture
def cache(tmp_path):
    with CacheWriter(tmp_path) as w:
        for i in range(6):
            w.add(f"k{i}", {"samples": torch.full((1, 4, 8, 8), float(i)), "cond": [torch.ones(3, dtype=torch.int8)]})
    r = open_cache(tmp_path)
    return tmp_path, r._shards[0].path


def flip_row_byte(reader, key):
    sh = reader._shards[0]
    i = sh.keys.index(key)
    col = sh.columns[0]
    row = json.loads(sh.skeletons[i])["samples"]["$tensor"][1]
    off = col.row_range(row)[0] + 5
    with open(sh.path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def test_checksum_mismatch_names_shard_and_entry(cache):
    root, shard = cache
    r = open_cache(root)
    flip_row_byte(r, "k3")
    with pytest.raises(CacheCorruptError, match=r"entry k3\).*checksum mismatch") as info:
        r.read(["k1", "k3"])
    assert info.value.path == str(shard) and info.value.entry == "k3"
    assert r.read(["k1", "k2"])[0]["samples"].flatten()[0] == 1.0  # other entries still read
    with pytest.raises(CacheCorruptError):
        r.get("k3")["samples"].materialize()
    problems = open_cache(root).verify()
    assert [(p.path, p.entry) for p in problems] == [(str(shard), "k3")]
    unverified = open_cache(root, verify=False).read(["k3"])  # verify=False trades safety for speed
    assert unverified[0]["samples"].shape == (1, 4, 8, 8)


def test_truncated_shard(cache):
    root, shard = cache
    r = open_cache(root)
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CacheCorruptError, match="truncated"):
        r.read(["k5"])
    with pytest.raises(CacheCorruptError, match="manifest says"):
        open_cache(root)
    r2 = open_cache(root, strict=False)
    assert len(r2) == 0 and len(r2.verify()) == 1


def test_missing_shard_says_what_to_do(cache):
    root, shard = cache
    r = open_cache(root)
    shard.unlink()
    with pytest.raises(CacheCorruptError, match="missing.*reopen the cache"):
        r.read(["k0"])
    with pytest.raises(CacheCorruptError, match="shard file is missing"):
        open_cache(root)


def test_header_damage_is_caught_by_the_manifest_checksum(cache):
    root, shard = cache
    data = bytearray(shard.read_bytes())
    i = data.index(b"rows")
    data[i:i + 1] = b"R"
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match="header checksum"):
        open_cache(root)


def rewrite_header(shard, root, edit):
    """Apply ``edit`` to the parsed header, rewrite the shard, and fix the manifest so the header is trusted."""
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8:8 + n])
    edit(head)
    raw = json.dumps(head).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    new = struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    shard.write_bytes(new)
    journal = next(root.glob("journal-*.jsonl"))
    from dataset_cache.format.manifest import encode_line

    line = json.loads(journal.read_bytes().splitlines()[0])["record"]
    line["shards"][0].update(bytes=len(new), header_xxh3=checksum64(raw))
    journal.write_bytes(encode_line(line))


def meta_edit(fn):
    def edit(head):
        meta = json.loads(head["__metadata__"]["streamcache"])
        fn(meta)
        head["__metadata__"]["streamcache"] = json.dumps(meta)
    return edit


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["c0"].update(data_offsets=[0, 10**15]), "outside the data region"),
    (lambda h: h["c0"].update(shape=[2**40, 2**40]), "does not match"),
    (lambda h: h["c0"].update(shape=[-1]), "non-negative"),
    (lambda h: h["c0"].update(dtype="F128"), "unknown dtype"),
    (lambda h: h.update(c9={"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}), "overlaps|hole|cover"),
    (lambda h: h["__metadata__"].update(streamcache="{"), "invalid JSON"),
    (meta_edit(lambda m: m["columns"][0].update(rows=10**9)), "disagrees"),
    (meta_edit(lambda m: m["columns"][0].update(checksums=[])), "checksums"),
    (meta_edit(lambda m: m["columns"][0].update(checksums=m["columns"][0]["checksums"][:-1] + "X")), "hex digits"),
    (meta_edit(lambda m: m["entries"]["key"].pop()), "differ in length"),
    (meta_edit(lambda m: m["columns"].pop()), "no column describes"),
    (meta_edit(lambda m: m["entries"].__setitem__("skeleton", [1] * 6)), "must be a string"),
])
def test_hostile_header_claims(cache, edit, match):
    root, shard = cache
    rewrite_header(shard, root, edit)
    with pytest.raises(CacheCorruptError, match=match):
        open_cache(root)


def test_duplicate_keys_resolve_to_the_first_occurrence(cache):
    root, shard = cache
    rewrite_header(shard, root, meta_edit(lambda m: m["entries"]["key"].__setitem__(1, "k0")))
    r = open_cache(root)
    assert len(r) == 5 and float(r.read(["k0"])[0]["samples"].flatten()[0]) == 0.0


def test_shard_version_and_format_are_checked(cache):
    root, shard = cache
    rewrite_header(shard, root, meta_edit(lambda m: m.update(version=2)))
    with pytest.raises(CacheFormatError, match="reads version 1"):
        open_cache(root)


@pytest.mark.parametrize("skel, match", [
    ('{"samples":{"$tensor":[0,99]}}', "outside the shard"),
    ('{"samples":{"$tensor":[7,0]}}', "outside the shard"),
    ('{"samples":{"$bogus":1}}', "unknown marker"),
    ("[" * 10000, "bad skeleton"),
])
def test_bad_skeletons_fail_when_used_and_in_verify(cache, skel, match):
    root, shard = cache
    rewrite_header(shard, root, meta_edit(lambda m: m["entries"]["skeleton"].__setitem__(2, skel)))
    r = open_cache(root)  # skeletons are parsed lazily
    with pytest.raises(CacheCorruptError, match=match):
        r.get("k2")
    with pytest.raises(CacheCorruptError, match=match):
        r.read(["k2"])
    assert [p.entry for p in r.verify()] == ["k2"]


def test_huge_header_length_claim_allocates_nothing(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("a", [torch.ones(1)])
    shard = next((tmp_path / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**63)
    shard.write_bytes(bytes(data))
    tracemalloc.start()
    with pytest.raises(CacheError):
        open_cache(tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_parse_header_rejects_non_objects():
    for raw in (b"[]", b"{", b"\xff", b"nope", b'{"a": 1}', b'{"__metadata__": {"a": 1}}'):
        with pytest.raises(CacheCorruptError):
            parse_header("x", raw, 0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifos_and_directories_in_place_of_files_do_not_hang(cache):
    root, shard = cache
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CacheCorruptError, match="not a regular file"):
        open_cache(root)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CacheCorruptError):
        open_cache(root)
    journal = next(root.glob("journal-*.jsonl"))
    journal.unlink()
    os.mkfifo(journal)
    with pytest.raises(CacheCorruptError, match="cannot read the journal"):
        open_cache(root)
