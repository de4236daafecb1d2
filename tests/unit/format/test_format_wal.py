"""The writer's recovery log: checkpoints survive the death of the writer, power-loss damage only loses a tail,
nothing in a log can make a cache unreadable, and logs never outlive the shards that publish their entries."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from support.killing import fork_and_kill

from dataset_cache.dataset import Sample
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.format.wal import _HEAD, MAGIC, log_files

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
SHAPES = [(), (0,), (3,), (2, 0, 4), (1, 4, 5, 3)]


def values() -> dict:
    """Every dtype and awkward shape, and the value structures the skeleton encoding must keep exact."""
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for i, dt in enumerate(DTYPES):
        for j, sh in enumerate(SHAPES):
            x = torch.randn(sh, generator=g) * 3
            out[f"t{i}_{j}"] = x > 0 if dt == torch.bool else x.to(dt)
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1.0])
    out["special"] = {"f32": special, "bf16": special.bfloat16(), "py": [math.nan, -0.0, math.inf]}
    cond = torch.randn(1, 77, 32, generator=g).half()
    out["cond"] = [[cond, {"pooled_output": torch.randn(1, 32, generator=g).half(), "guidance": 3.5,
                           "area": (64, 64, 0, 0), "set_area_to_bounds": False}]]
    out["nested"] = {"$tensor": (1, [2.0, {"$tuple": None, "ok": "x"}]), "tuple": (1, 2), "one": 1, "one_f": 1.0,
                     "big": 2**62, "empty": {}, "": "", "none": None}
    out["shared"] = [cond, cond]
    return out


def value_for(key: str) -> dict:
    i = int(key.rsplit("-", 1)[1])
    return {"samples": torch.full((1, 2, 3, 3), float(i), dtype=torch.float16 if i % 2 else torch.float32)}


def logs(root: Path) -> list[Path]:
    return log_files(root)


def checkpoint_batches(w: CacheWriter, batches: list[list[str]]) -> None:
    """Add each batch's entries and checkpoint after each batch, as an encode does."""
    for batch in batches:
        for k in batch:
            w.add(k, value_for(k))
        w.checkpoint()


def checkpointed_then_dead(root: Path, batches: list[list[str]], *, shard_bytes: int = 1 << 30) -> None:
    """Add and checkpoint ``batches``, then leave as a dead writer would (abort keeps the log)."""
    w = CacheWriter(root, shard_bytes=shard_bytes, checkpoints=True)
    checkpoint_batches(w, batches)
    w.abort()
    w._closed = True


def record_offsets(path: Path) -> list[int]:
    """Byte offset of each record of a log, then its size."""
    data = path.read_bytes()
    pos, out = len(MAGIC), []
    while pos < len(data):
        out.append(pos)
        _, hlen, dlen, _ = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size + hlen + dlen
    return out + [pos]


def craft(header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    """A record with a valid checksum around arbitrary contents."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    x = xxhash.xxh3_64(h)
    x.update(data)
    return _HEAD.pack(b"WREC", len(h), len(data), x.hexdigest().encode()) + h + data


BATCHES = [[f"k-{b * 3 + i}" for i in range(3)] for b in range(4)]
ALL = [k for b in BATCHES for k in b]


def recovered(root: Path) -> list[str]:
    CacheWriter(root).close()
    return sorted(open_cache(root).keys(), key=lambda k: int(k.split("-")[1]))


def assert_values(root: Path) -> None:
    r = open_cache(root)
    assert r.verify() == []
    keys = list(r.keys())
    for k, v in zip(keys, r.read(keys)):
        want = value_for(k)["samples"]
        assert v["samples"].dtype == want.dtype and torch.equal(v["samples"], want), k


# ------------------------------------------------------------------------------------------ basic behaviour

def test_checkpoint_is_invisible_to_readers_until_a_writer_publishes_it(tmp_path):
    checkpointed_then_dead(tmp_path, BATCHES)
    assert len(open_cache(tmp_path)) == 0 and open_cache(tmp_path).verify() == []  # readers ignore the log
    assert len(logs(tmp_path)) == 1
    assert recovered(tmp_path) == ALL
    assert_values(tmp_path)
    assert logs(tmp_path) == []
    assert open_cache(tmp_path).stats()["shards"] == 1  # one shard for all checkpoints, not one per batch


def test_checkpoints_write_no_shard_and_commit_publishes_one_and_drops_the_log(tmp_path):
    w = CacheWriter(tmp_path, checkpoints=True, sync_seconds=0)
    checkpoint_batches(w, BATCHES)
    assert w.log_syncs == len(BATCHES)  # sync_seconds=0: every checkpoint is fsynced
    assert not list((tmp_path / "shards").iterdir())
    w.close()
    assert logs(tmp_path) == [] and len(open_cache(tmp_path)) == len(ALL)
    assert open_cache(tmp_path).stats()["shards"] == 1


def test_sync_seconds_bounds_the_fsyncs(tmp_path):
    w = CacheWriter(tmp_path, checkpoints=True, sync_seconds=3600)
    checkpoint_batches(w, BATCHES)
    assert w.log_syncs == 0
    w.sync_log()  # e.g. before a pause
    assert w.log_syncs == 1
    w.sync_log()  # nothing new to sync
    assert w.log_syncs == 1
    w.close()
    with pytest.raises(ValueError, match="sync_seconds"):
        CacheWriter(tmp_path, checkpoints=True, sync_seconds=-1)


def test_checkpoint_without_a_log_is_a_commit(tmp_path):
    w = CacheWriter(tmp_path)
    w.add("k-1", value_for("k-1"))
    w.checkpoint()
    assert list(open_cache(tmp_path).keys()) == ["k-1"] and logs(tmp_path) == []
    w.close()


def test_full_shards_are_published_at_checkpoints_and_their_logs_deleted(tmp_path):
    w = CacheWriter(tmp_path, shard_bytes=200, checkpoints=True)  # a shard fills every 2-3 entries
    published = []
    for i in range(41):
        k = f"k-{i}"
        w.add(k, value_for(k))
        w.checkpoint()
        assert len(logs(tmp_path)) <= 1  # a log holds only the entries of the shard being filled
        published.append(len(open_cache(tmp_path)))
    assert published == sorted(published) and 0 < published[-1] < 41  # full shards become visible as they fill
    w.abort()  # die with a partly filled shard: its entries are in the log
    assert recovered(tmp_path) == [f"k-{i}" for i in range(41)]
    assert_values(tmp_path)


def test_entries_added_after_the_last_checkpoint_are_lost_with_the_writer(tmp_path):
    w = CacheWriter(tmp_path, checkpoints=True)
    w.add("k-1", value_for("k-1"))
    w.checkpoint()
    w.add("k-2", value_for("k-2"))  # in flight
    w.abort()
    assert recovered(tmp_path) == ["k-1"]


def test_an_exception_in_the_with_block_keeps_checkpointed_entries(tmp_path):
    with pytest.raises(RuntimeError):
        with CacheWriter(tmp_path, checkpoints=True) as w:
            w.add("k-1", value_for("k-1"))
            w.checkpoint()
            w.add("k-2", value_for("k-2"))
            raise RuntimeError("boom")
    assert recovered(tmp_path) == ["k-1"]


def test_the_log_holds_a_copy_not_the_callers_tensor(tmp_path):
    w = CacheWriter(tmp_path, checkpoints=True)
    t = torch.zeros(1, 4)
    w.add("k-1", {"samples": t})
    t.fill_(7.0)  # the caller reuses its buffer at once
    w.checkpoint()
    w.abort()
    CacheWriter(tmp_path).close()
    assert torch.equal(open_cache(tmp_path).read(["k-1"])[0]["samples"], torch.zeros(1, 4))


def test_every_storable_value_survives_the_log_exactly(tmp_path, same):
    vals = values()
    w = CacheWriter(tmp_path, checkpoints=True)
    for k, v in vals.items():
        w.add(k, v, kind="test", name=k)
    w.checkpoint()
    w.abort()
    CacheWriter(tmp_path).close()
    r = open_cache(tmp_path)
    assert set(r.keys()) == set(vals)
    for k, v in vals.items():
        same(v, r.read([k])[0], k)
        assert r.kind(k) == "test"


def test_non_contiguous_and_strided_tensors_are_logged_in_c_order(tmp_path, same):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    vals = {"k-1": {"t": base.t()}, "k-2": {"t": base[:, ::2]}, "k-3": {"t": base.bfloat16().t()}}
    w = CacheWriter(tmp_path, checkpoints=True)
    for k, v in vals.items():
        w.add(k, v)
    w.checkpoint()
    w.abort()
    CacheWriter(tmp_path).close()
    r = open_cache(tmp_path)
    for k, v in vals.items():
        same({"t": v["t"].contiguous()}, r.read([k])[0], k)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_lazily_negated_grad_and_inference_tensors_are_stored_by_value(tmp_path, same, checkpointed):
    """Tensors whose bytes are not their values as they sit (the negative bit of a lazy view), that need grad, or
    were made under inference mode (as ComfyUI runs nodes) are stored by value, in a shard and in the log alike."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with torch.inference_mode():
        inference = torch.arange(6, dtype=torch.float16) * 2
    vals = {
        "neg": {"t": torch._neg_view(base), "bf16": torch._neg_view(base.bfloat16()).t()},
        "grad": [torch.ones(3, requires_grad=True) * 2, torch.nn.Parameter(torch.full((2,), 5.0))],
        "inference": ({"samples": inference},),
    }
    expected = {"neg": {"t": -base, "bf16": (-base.bfloat16()).t().contiguous()},
                "grad": [torch.full((3,), 2.0), torch.full((2,), 5.0)], "inference": ({"samples": inference.clone()},)}
    w = CacheWriter(tmp_path, checkpoints=True)
    for k, v in vals.items():
        w.add(k, v)
    if checkpointed:  # through the recovery log, replayed by the next writer
        w.checkpoint()
        w.abort()
        CacheWriter(tmp_path).close()
    else:
        w.close()
    r = open_cache(tmp_path)
    for k, v in expected.items():
        same(v, r.read([k])[0], k)


def test_a_live_writers_log_is_left_alone(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("POSIX flock")
    a = CacheWriter(tmp_path, checkpoints=True)
    a.add("k-1", value_for("k-1"))
    a.checkpoint()
    live = logs(tmp_path)
    b = CacheWriter(tmp_path)  # breaks the one-writer rule: must not steal or delete a's log
    b.close()
    assert logs(tmp_path) == live and "k-1" not in open_cache(tmp_path)
    a.close()
    assert logs(tmp_path) == [] and "k-1" in open_cache(tmp_path)


def test_recovery_after_a_published_log_was_not_deleted_is_harmless(tmp_path):
    w = CacheWriter(tmp_path, checkpoints=True)
    w.add("k-1", value_for("k-1"))
    w.checkpoint()
    kept = logs(tmp_path)[0].read_bytes()
    w.close()  # published; the log is deleted...
    (tmp_path / "wal-00000000000000aa.log").write_bytes(kept)  # ...but a crash could have left it
    assert recovered(tmp_path) == ["k-1"] and logs(tmp_path) == []
    assert open_cache(tmp_path).stats()["shards"] == 1  # nothing written twice


# ------------------------------------------------------------------------------------------ damage (power loss)

@pytest.fixture()
def dead(tmp_path):
    """A cache with one published entry and a dead writer's log of 4 records (3 entries each)."""
    root = tmp_path / "cache"
    with CacheWriter(root) as w:
        w.add("k-100", value_for("k-100"))
    checkpointed_then_dead(root, BATCHES)
    return root, logs(root)[0]


def records_recovered(root: Path) -> int:
    keys = [k for k in recovered(root) if k != "k-100"]
    assert len(keys) % 3 == 0 and keys == ALL[:len(keys)], keys  # whole records, in order: a prefix
    assert_values(root)
    assert logs(root) == []
    return len(keys) // 3


@pytest.mark.parametrize("where", ["magic", "after_magic", "head", "header", "data", "boundary", "last_byte"])
def test_a_torn_log_gives_back_the_records_before_the_tear(dead, where):
    root, log = dead
    offs = record_offsets(log)
    cut = {"magic": 5, "after_magic": len(MAGIC), "head": offs[2] + 7, "header": offs[2] + _HEAD.size + 3,
           "data": offs[3] - 5, "boundary": offs[2], "last_byte": offs[4] - 1}[where]
    with open(log, "r+b") as f:
        f.truncate(cut)
    want = {"magic": 0, "after_magic": 0, "head": 2, "header": 2, "data": 2, "boundary": 2, "last_byte": 3}[where]
    assert records_recovered(root) == want


@pytest.mark.parametrize("record", [0, 1, 3])
def test_a_zero_filled_tail_loses_only_the_records_from_it(dead, record):
    root, log = dead
    offs = record_offsets(log)
    data = bytearray(log.read_bytes())
    data[offs[record] + 3:] = bytes(len(data) - offs[record] - 3)  # size kept, blocks never written
    log.write_bytes(bytes(data))
    assert records_recovered(root) == record


def test_flipped_byte_or_garbage_tail_stops_the_replay_there(dead):
    root, log = dead
    offs = record_offsets(log)
    data = bytearray(log.read_bytes())
    data[offs[2] + _HEAD.size + 20] ^= 0x01
    log.write_bytes(bytes(data) + os.urandom(100))
    assert records_recovered(root) == 2


def test_garbage_after_the_last_record_is_ignored(dead):
    root, log = dead
    with open(log, "ab") as f:
        f.write(os.urandom(57))
    assert records_recovered(root) == 4


@pytest.mark.parametrize("bad", [
    "huge_length", "bad_tag", "bad_json", "not_object", "bad_dtype", "bad_shape", "negative_dim", "data_short",
    "data_long", "ref_out_of_range", "ref_twice", "ref_column", "bad_marker", "entry_not_list", "bad_key",
    "key_too_long", "deep", "int_too_big", "bool_dim",
])
def test_a_corrupt_or_hostile_record_ends_the_replay_without_an_error(dead, bad, caplog):
    root, log = dead
    offs = record_offsets(log)
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    good_t = [["F32", [4]]]
    ent = [["k-50", "latent", {"samples": {"$tensor": [0, 0]}}]]
    rec = {
        "huge_length": _HEAD.pack(b"WREC", 10, 1 << 60, b"0" * 16) + b"x" * 40,
        "bad_tag": craft({"entries": ent, "tensors": good_t}, f32).replace(b"WREC", b"WRXC", 1),
        "bad_json": craft(None, f32, raw_header=b"{not json"),
        "not_object": craft([1, 2], f32),
        "bad_dtype": craft({"entries": ent, "tensors": [["Q7", [4]]]}, f32),
        "bad_shape": craft({"entries": ent, "tensors": [["F32", "4"]]}, f32),
        "negative_dim": craft({"entries": ent, "tensors": [["F32", [-4]]]}, f32),
        "data_short": craft({"entries": ent, "tensors": [["F32", [5]]]}, f32),
        "data_long": craft({"entries": ent, "tensors": [["F32", [3]]]}, f32),
        "ref_out_of_range": craft({"entries": [["k-50", "l", {"s": {"$tensor": [0, 1]}}]], "tensors": good_t}, f32),
        "ref_twice": craft({"entries": [["k-50", "l", [{"$tensor": [0, 0]}, {"$tensor": [0, 0]}]]],
                            "tensors": good_t}, f32),
        "ref_column": craft({"entries": [["k-50", "l", {"$tensor": [1, 0]}]], "tensors": good_t}, f32),
        "bad_marker": craft({"entries": [["k-50", "l", {"$evil": 1}]], "tensors": []}),
        "entry_not_list": craft({"entries": ["k-50"], "tensors": []}),
        "bad_key": craft({"entries": [["", "latent", 1]], "tensors": []}),
        "key_too_long": craft({"entries": [["k" * 300, "latent", 1]], "tensors": []}),
        "int_too_big": craft({"entries": [["k-50", "l", {"x": 2**70}]], "tensors": []}),
        "bool_dim": craft({"entries": ent, "tensors": [["F32", [True, 4]]]}, f32),
        "deep": craft(None, raw_header=b'{"entries":[["k-50","l",' + b"[" * 5000 + b"]" * 5000 + b']],"tensors":[]}'),
    }[bad]
    data = log.read_bytes()
    log.write_bytes(data[:offs[2]] + rec + data[offs[2]:])  # records 2.. come after the bad one
    with caplog.at_level(logging.WARNING, "dataset_cache.format.wal"):
        assert records_recovered(root) == 2
    assert "recovery log" in caplog.text


def test_a_file_that_is_not_a_log_of_ours_is_left_alone(tmp_path, caplog):
    with CacheWriter(tmp_path) as w:
        w.add("k-1", value_for("k-1"))
    other = tmp_path / "wal-00000000000000bb.log"
    other.write_bytes(b"streamcache-wal 9\n" + b"x" * 100)
    empty = tmp_path / "wal-00000000000000cc.log"
    empty.write_bytes(MAGIC[:4])  # created, then killed before the magic was complete
    with caplog.at_level(logging.WARNING, "dataset_cache.format.wal"):
        CacheWriter(tmp_path).close()
    assert other.exists() and not empty.exists()
    assert "not a recovery log of this version" in caplog.text
    assert list(open_cache(tmp_path).keys()) == ["k-1"]


# ------------------------------------------------------------------------------------------ kill -9 at random points

RUNS = 30


def child(root: Path, run: int, wfd: int) -> None:
    rng = random.Random(run)
    w = CacheWriter(root, shard_bytes=rng.choice([300, 600, 5000, 1 << 20]), checkpoints=True,
                    sync_seconds=rng.choice([0.0, 0.01, 3600.0]))
    os.write(wfd, b"ready\n")
    added: list[str] = []
    i = 0
    while True:
        for _ in range(rng.randint(1, 4)):
            k = f"r{run:02d}-{i}"
            w.add(k, value_for(k))
            added.append(k)
            i += 1
        op = rng.random()
        if op < 0.05:
            w.compact(min_fill=0.9)
        elif op < 0.12:
            w.set_dataset(f"ds{run % 3}", [Sample(k, (k,)) for k in added[-5:]])
        elif op < 0.2:
            w.commit()
        else:
            w.checkpoint()
        os.write(wfd, f"{added[-1]}\n".encode())


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork()")
def test_kill_9_at_random_points_loses_no_checkpoint(tmp_path):
    root = tmp_path / "cache"
    rng = random.Random(4321)
    checkpointed: set[str] = set()
    attempted: set[str] = set()
    recoveries = 0
    for run in range(RUNS):
        lines = fork_and_kill(root, run, child, rng)
        attempted.update(f"r{run:02d}-{i}" for i in range(5000))
        if lines:
            last = int(lines[-1].split("-")[1])
            checkpointed.update(f"r{run:02d}-{i}" for i in range(last + 1))
        if not (root / "manifest.json").exists():
            continue
        before = open_cache(root)  # the published state opens and is consistent whatever the log holds
        assert before.verify() == [] and set(before.keys()) <= attempted
        recoveries += bool(logs(root))
        if rng.random() < 0.5:
            CacheWriter(root).close()  # else the next child's writer recovers it
            r = open_cache(root)
            present = set(r.keys())
            assert checkpointed <= present, f"lost checkpointed entries: {sorted(checkpointed - present)[:5]}"
            assert present <= attempted and logs(root) == []
            assert r.verify() == []
            keys = sorted(present)
            for k, v in zip(keys, r.read(keys)):
                want = value_for(k)["samples"]
                assert torch.equal(v["samples"], want) and v["samples"].dtype == want.dtype, k
            for name in r.datasets():
                assert all(s.latent in present for s in r.dataset(name))
    CacheWriter(root).close()
    assert checkpointed <= set(open_cache(root).keys())
    assert recoveries >= RUNS // 4  # kills did land while logs held unpublished checkpoints


def test_copy_of_a_dead_cache_recovers_in_its_new_place(dead, tmp_path):
    root, _ = dead
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    assert len(recovered(moved)) == len(ALL) + 1


def test_a_failed_append_leaves_no_torn_record_before_later_ones(tmp_path, monkeypatch):
    import dataset_cache.format.wal as wal

    w = CacheWriter(tmp_path, checkpoints=True)
    w.add("k-1", value_for("k-1"))
    w.checkpoint()
    real = os.write
    calls = {"n": 0}

    def short_then_fail(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, bytes(data)[:10])  # part of the record reaches the file...
        raise OSError(28, "No space left on device")  # ...then the disk is full

    monkeypatch.setattr(wal.os, "write", short_then_fail)
    w.add("k-2", value_for("k-2"))
    with pytest.raises(OSError, match="No space"):
        w.checkpoint()
    monkeypatch.setattr(wal.os, "write", real)
    w.add("k-3", value_for("k-3"))
    w.checkpoint()  # the caller carried on: this record must not sit behind a torn one
    w.abort()
    assert recovered(tmp_path) == ["k-1", "k-2", "k-3"]  # k-2 went with the next checkpoint
