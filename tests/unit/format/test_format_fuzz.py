"""Property tests: any damage to any cache file ends in a library error (or a harmless success), never in
another exception type, a hang, or an allocation beyond the files' size."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheError
from dataset_cache.format import CacheWriter, open_cache, reader as reader_mod
from dataset_cache.format.manifest import encode_line
from dataset_cache.hashing import checksum64

SETTINGS = settings(max_examples=120, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("golden")
    w = CacheWriter(root, shard_bytes=3000)
    for i in range(6):
        w.add(f"l{i}", {"samples": torch.randn(1, 4, 8, 8).half(), "batch_index": [i]}, kind="latent")
        w.add(f"c{i}", [[torch.randn(1, 5, 8), {"pooled_output": torch.randn(1, 8).bfloat16(), "g": 1.5}]],
              kind="conditioning")
    w._flush()
    w.set_dataset("ds", [Sample(f"l{i}", (f"c{i}",)) for i in range(6)])  # one journal line for everything
    w.close()
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def build(tmp: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return tmp


def trust(files: dict[str, bytes], shard: str) -> None:
    """Make the journal's record of ``shard`` match its (damaged) bytes, so header validation is exercised."""
    data = files[shard]
    jname = next(k for k in files if k.startswith("journal-"))
    rec = json.loads(files[jname].splitlines()[0])["record"]
    for s in rec["shards"]:
        if s["file"] == shard:
            s["bytes"] = max(8, len(data))
            if len(data) >= 8:
                (n,) = struct.unpack("<Q", data[:8])
                s["header_xxh3"] = checksum64(data[8:8 + n]) if n <= len(data) - 8 else "0" * 16
    files[jname] = encode_line(rec)


def exercise(root: Path, monkeypatch) -> None:
    limit = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    allocated = []
    orig = reader_mod.ReadBuffer._alloc
    monkeypatch.setattr(reader_mod.ReadBuffer, "_alloc", lambda self, n: allocated.append(n) or orig(self, n))
    tracemalloc.start()
    try:
        for strict in (True, False):
            try:
                r = open_cache(root, strict=strict)
            except CacheError:
                continue
            keys = list(r.keys())
            for call in (lambda: r.read(keys), lambda: [r.get(k) for k in keys],
                         lambda: [r.tensor_shapes(k) for k in keys], lambda: [r.dataset(n) for n in r.datasets()]):
                try:
                    call()
                except CacheError:
                    pass
            assert isinstance(r.verify(), list)
            r.stats()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(allocated, default=0) <= limit * 1.25 + 64
    assert peak < 20 * limit + (8 << 20), f"Python allocations peaked at {peak} for {limit} bytes of files"


@SETTINGS
@given(data=st.data())
def test_byte_damage_anywhere(golden, tmp_path_factory, monkeypatch, data):
    files = dict(golden)
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    buf = bytearray(files[name])
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "zero"]), label="op")
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        del buf[data.draw(st.integers(0, max(0, len(buf) - 1))):]
    elif op == "insert":
        i = data.draw(st.integers(0, len(buf)))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(buf)))
        buf[i:i + data.draw(st.integers(1, 4096))] = b"\0" * 16
    files[name] = bytes(buf)
    if name.startswith("shards/") and data.draw(st.booleans(), label="trusted"):
        trust(files, name)
    exercise(build(tmp_path_factory.mktemp("fz"), files), monkeypatch)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 2**63, 2**64 + 1])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    | st.sampled_from(["F32", "BOOL", "c0", "$tensor"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from paths(v, prefix + (i,))


def set_path(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


@SETTINGS
@given(data=st.data())
def test_structured_header_rewrites(golden, tmp_path_factory, monkeypatch, data):
    """Rewrite one field of a shard's safetensors header or of our metadata JSON (then trust the header)."""
    files = dict(golden)
    name = data.draw(st.sampled_from(sorted(k for k in files if k.startswith("shards/"))), label="shard")
    raw = files[name]
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    inner = data.draw(st.booleans(), label="inner")
    target = json.loads(head["__metadata__"]["streamcache"]) if inner else head
    path = data.draw(st.sampled_from([p for p in paths(target) if p]), label="path")
    set_path(target, path, data.draw(JSON, label="value"))
    if inner:
        head["__metadata__"]["streamcache"] = json.dumps(target)
    hraw = json.dumps(head).encode()
    hraw += b" " * (-(8 + len(hraw)) % 8)
    files[name] = struct.pack("<Q", len(hraw)) + hraw + raw[8 + n:]
    trust(files, name)
    exercise(build(tmp_path_factory.mktemp("fz"), files), monkeypatch)


@SETTINGS
@given(data=st.data())
def test_manifest_and_journal_rewrites(golden, tmp_path_factory, monkeypatch, data):
    """Rewrite one field of the manifest or of the journal record (with a valid line checksum)."""
    files = dict(golden)
    jname = next(k for k in files if k.startswith("journal-"))
    which = data.draw(st.sampled_from(["manifest.json", jname]), label="file")
    doc = json.loads(files[which]) if which == "manifest.json" else json.loads(files[which])["record"]
    path = data.draw(st.sampled_from([p for p in paths(doc) if p]), label="path")
    set_path(doc, path, data.draw(JSON, label="value"))
    files[which] = json.dumps(doc).encode() if which == "manifest.json" else encode_line(doc)
    exercise(build(tmp_path_factory.mktemp("fz"), files), monkeypatch)
