"""Compaction: merges underfull shards, drops unkept entries, keeps dataset entries, orders by dataset."""

from __future__ import annotations

import torch

from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter, open_cache


def fill(root, n=12, per_commit=1):
    with CacheWriter(root, shard_bytes=10_000) as w:
        for i in range(n):
            w.add(f"k{i:02d}", {"samples": torch.full((100,), float(i))}, kind="latent")
            if (i + 1) % per_commit == 0:
                w.commit()


def test_compact_merges_small_shards_and_keeps_values(tmp_path):
    fill(tmp_path)
    before = open_cache(tmp_path)
    assert before.stats()["shards"] == 12
    with CacheWriter(tmp_path, shard_bytes=10_000) as w:
        rep = w.compact()
    assert rep.shards_before == 12 and rep.shards_after == 1 and rep.entries_kept == 12 and rep.entries_dropped == 0
    r = open_cache(tmp_path)
    assert r.verify() == [] and r.state.generation == 2 and r.state.journal_commits == 0
    vals = r.read([f"k{i:02d}" for i in range(12)])
    assert [int(v["samples"][0]) for v in vals] == list(range(12))


def test_compact_drops_unkept_but_never_dataset_entries(tmp_path):
    fill(tmp_path)
    with CacheWriter(tmp_path, shard_bytes=10_000) as w:
        w.set_dataset("d", [Sample("k05", ("k07",)), Sample("k01", ("k00",))])
        rep = w.compact(keep={"k03"})
        assert not w.has("k02") and w.has("k05")
    r = open_cache(tmp_path)
    assert sorted(r.keys()) == ["k00", "k01", "k03", "k05", "k07"]
    assert rep.entries_dropped == 7
    # rewritten entries follow dataset order: latent, captions, next sample, ...
    assert r._shards[0].keys[:4] == ["k05", "k07", "k01", "k00"]
    assert r.verify() == []


def test_reader_opened_before_compaction_gets_a_clear_error(tmp_path):
    fill(tmp_path, n=4)
    old = open_cache(tmp_path)
    with CacheWriter(tmp_path, shard_bytes=10_000) as w:
        w.compact()
    import pytest

    from dataset_cache.errors import CacheCorruptError

    with pytest.raises(CacheCorruptError, match="reopen the cache"):
        old.read(["k01"])
    assert len(open_cache(tmp_path).read(["k01"])) == 1


def test_full_shards_are_left_alone_and_writes_continue_after_compaction(tmp_path):
    with CacheWriter(tmp_path, shard_bytes=2000) as w:
        for i in range(10):
            w.add(f"k{i}", [torch.full((100,), float(i))])  # 400 B each: 5 per shard
        w.commit()
        w.add("small", [torch.ones(1)])
        w.commit()
        rep = w.compact(min_fill=0.5)
        assert rep.shards_rewritten == 0 and rep.shards_after == 3
        w.add("after", [torch.zeros(2)])
    r = open_cache(tmp_path)
    assert len(r) == 12 and r.verify() == []


def test_damaged_cache_is_repaired_by_compaction_then_re_encode(tmp_path):
    import pytest

    from dataset_cache.errors import CacheCorruptError

    with CacheWriter(tmp_path, shard_bytes=800) as w:
        for i in range(8):
            w.add(f"k{i}", [torch.full((100,), float(i))])  # 400 B: two entries per shard
    r = open_cache(tmp_path)
    (first, second) = r._shards[0], r._shards[1]
    first.path.write_bytes(first.path.read_bytes()[:-4])  # truncated shard: cannot be opened
    data = bytearray(second.path.read_bytes())
    data[-1] ^= 0xFF  # bad row in the other entry of the second shard
    second.path.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError):
        open_cache(tmp_path)
    with CacheWriter(tmp_path, shard_bytes=800) as w:
        assert not w.has(first.keys[0]) and w.has(second.keys[1])
        rep = w.compact(repair=True)
    assert len(rep.damaged) == 2
    r = open_cache(tmp_path)
    assert r.verify() == [] and len(r) == 5
    with CacheWriter(tmp_path, shard_bytes=800) as w:  # the next encode re-creates what was lost
        for i in range(8):
            w.add(f"k{i}", [torch.full((100,), float(i))])
    r = open_cache(tmp_path)
    assert len(r) == 8 and r.verify() == []
    assert [float(v[0][0]) for v in r.read([f"k{i}" for i in range(8)])] == [float(i) for i in range(8)]


def test_entries_without_tensors_and_shards_without_columns(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("a", {"x": 1, "y": [None, "s"]})
        w.add("b", [])
    r = open_cache(tmp_path)
    assert r.read(["a", "b"]) == [{"x": 1, "y": [None, "s"]}, []]
    assert r._shards[0].columns == [] and r.verify() == []


def test_open_during_concurrent_compactions_never_fails(tmp_path):
    import threading

    fill(tmp_path, n=6)
    stop = threading.Event()
    errors = []

    def churn():
        try:
            with CacheWriter(tmp_path, shard_bytes=10_000) as w:
                i = 100
                while not stop.is_set():
                    w.add(f"x{i}", [torch.ones(3)])
                    w.commit()
                    w.compact(min_fill=1.0)
                    i += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(100):
            r = open_cache(tmp_path)
            assert len(r) >= 6
    finally:
        stop.set()
        t.join()
    assert not errors


def test_open_retries_when_a_compaction_switches_the_manifest_midway(tmp_path, monkeypatch):
    from dataset_cache.format import reader as reader_mod

    fill(tmp_path, n=6)
    real = reader_mod.open_shard
    calls = []

    def open_shard_racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            monkeypatch.setattr(reader_mod, "open_shard", real)
            with CacheWriter(tmp_path, shard_bytes=10_000) as w:
                w.compact()  # deletes the shard we are about to open
            monkeypatch.setattr(reader_mod, "open_shard", open_shard_racing)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "open_shard", open_shard_racing)
    r = open_cache(tmp_path)
    assert len(r) == 6 and r.state.generation == 2 and len(calls) == 2  # failed once, then retried
