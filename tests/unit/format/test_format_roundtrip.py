"""Writer -> reader round trips: exact values, dtypes and shapes; safetensors compatibility; writer semantics."""

from __future__ import annotations

import math
import gc
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheNotFoundError, UnstorableValueError
from dataset_cache.format import CacheWriter, ReadBuffer, open_cache
from dataset_cache.format.read_plan import plan_rows
from dataset_cache.format.shard_files import ReadAhead
from dataset_cache.refs import LazyTensor, is_lazy

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
SHAPES = [(), (0,), (3,), (2, 0, 4), (1, 4, 5, 3), (1, 77, 8)]


def rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def values():
    out = {}
    for i, dt in enumerate(DTYPES):
        for j, sh in enumerate(SHAPES):
            out[f"t{i}_{j}"] = rand(sh, dt, seed=i * 10 + j)
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1.0])
    out["special"] = {"f32": special, "f16": special.half(), "bf16": special.bfloat16(), "py": [math.nan, -0.0]}
    cond = torch.randn(1, 77, 32).half()
    out["cond"] = [[cond, {"pooled_output": torch.randn(1, 32).half(), "guidance": 3.5, "area": (64, 64, 0, 0),
                           "strength": 1.0, "set_area_to_bounds": False}]]
    out["latent"] = {"samples": torch.randn(1, 4, 8, 8), "noise_mask": torch.rand(1, 1, 8, 8),
                     "batch_index": [0], "type": "audio"}
    out["nested"] = {"$tensor": (1, [2.0, {"$tuple": None, "ok": "x"}]), "list": [1, 2], "tuple": (1, 2),
                     "one": 1, "one_f": 1.0, "big": 2**62, "empty": {}, "": ""}
    out["shared"] = [cond, cond]  # the same tensor twice is stored twice and read back equal
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    vals = values()
    with CacheWriter(root, shard_bytes=20_000) as w:
        for k, v in vals.items():
            w.add(k, v, kind="test", name=k)
    return root, vals


def test_every_value_round_trips_exactly(cache, same):
    root, vals = cache
    r = open_cache(root)
    assert len(r) == len(vals) and set(r.keys()) == set(vals)
    keys = list(vals)
    for k, got in zip(keys, r.read(keys)):
        same(vals[k], got, k)
    assert r.verify() == []


def test_single_reads_and_lazy_materialize_match(cache, same):
    root, vals = cache
    r = open_cache(root)
    for k in ("cond", "latent", "t3_0", "t0_1"):
        same(vals[k], r.read([k])[0], k)
        lazy = r.get(k)
        assert is_lazy(lazy) or not is_lazy(vals[k])
        same(vals[k], r.materialize(lazy), k)


def test_get_exposes_shapes_and_dtypes_without_io(cache):
    root, vals = cache
    r = open_cache(root)
    lat = r.get("latent")
    assert isinstance(lat["samples"], LazyTensor)
    assert lat["samples"].shape == torch.Size([1, 4, 8, 8]) and lat["samples"].dtype == torch.float32
    assert lat["samples"].nbytes == 4 * 64 * 4
    assert lat["batch_index"] == [0] and lat["type"] == "audio"
    assert r.tensor_shapes("cond")[0][1]["pooled_output"] == torch.Size([1, 32])
    assert r.kind("cond") == "test"


def test_every_shard_is_valid_safetensors_with_our_columns(cache):
    root, vals = cache
    r = open_cache(root)
    n = 0
    for sh in r._shards:
        loaded = load_file(str(sh.path))
        with safe_open(str(sh.path), "pt") as f:
            assert set(f.keys()) == {c.tensor for c in sh.columns}
            assert "streamcache" in f.metadata()
            for c, col in enumerate(sh.columns):
                t = f.get_tensor(col.tensor)
                assert torch.equal(t.view(torch.uint8), loaded[col.tensor].view(torch.uint8))
                assert t.dtype == col.dtype and tuple(t.shape) == (col.rows, *col.row_shape)
                s = r._shards.index(sh)
                ours = r._read_rows(plan_rows(r.shards, [(s, c, i) for i in range(col.rows)]), ["x"] * col.rows,
                                    False, None, False)
                for i, v in enumerate(ours):
                    assert torch.equal(v.reshape(-1).view(torch.uint8), t[i].reshape(-1).view(torch.uint8))
                n += 1
    assert n >= len(DTYPES)


def test_row_view_of_a_batch_stores_only_its_row(tmp_path):
    batch = torch.randn(16, 4, 32, 32)
    with CacheWriter(tmp_path) as w:
        w.add("row3", {"samples": batch[3:4]})
        w.add("row5", {"samples": batch[5]})
        w.add("col", {"samples": batch[:, 0]})  # non-contiguous view
    shard = next((tmp_path / "shards").iterdir())
    row_bytes = 4 * 32 * 32 * 4
    assert shard.stat().st_size < 2 * row_bytes + 16 * 32 * 32 * 4 + 4096
    r = open_cache(tmp_path)
    assert torch.equal(r.read(["row3"])[0]["samples"], batch[3:4])
    assert torch.equal(r.read(["col"])[0]["samples"], batch[:, 0])


def test_add_clones_so_later_mutation_does_not_leak(tmp_path):
    t = torch.zeros(4)
    with CacheWriter(tmp_path) as w:
        w.add("k", [t])
        t += 1
    assert torch.equal(open_cache(tmp_path).read(["k"])[0][0], torch.zeros(4))


def test_unstorable_value_names_path_and_leaves_writer_usable(tmp_path):
    class HookGroup:
        pass

    with CacheWriter(tmp_path) as w:
        with pytest.raises(UnstorableValueError, match=r"conditioning\[3\]\[1\]\['hooks'\]: HookGroup is not storable"):
            w.add("bad", [0, 1, 2, [torch.ones(1), {"hooks": HookGroup()}]], name="conditioning")
        assert not w.has("bad")
        w.add("good", [torch.ones(1)])
    r = open_cache(tmp_path)
    assert "good" in r and "bad" not in r


def test_duplicate_key_is_a_no_op(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("k", [torch.ones(1)])
        w.add("k", [torch.zeros(1)])
    with CacheWriter(tmp_path) as w:
        assert w.has("k")
        w.add("k", [torch.zeros(1)])
    r = open_cache(tmp_path)
    assert len(r) == 1 and r.state.journal_commits == 1
    assert torch.equal(r.read(["k"])[0][0], torch.ones(1))


def test_exception_in_block_discards_uncommitted_entries(tmp_path):
    with CacheWriter(tmp_path, shard_bytes=64) as w:
        w.add("a", [torch.ones(32)])
        w.commit()
    with pytest.raises(RuntimeError):
        with CacheWriter(tmp_path, shard_bytes=64) as w:
            w.add("b", [torch.ones(32)])  # flushed to a shard file (>= shard_bytes) but not committed
            w.add("c", [torch.ones(1)])
            raise RuntimeError("boom")
    r = open_cache(tmp_path)
    assert set(r.keys()) == {"a"}
    assert len(list((tmp_path / "shards").iterdir())) == 1


def test_shards_are_split_at_shard_bytes_and_rows_keep_insertion_order(tmp_path):
    with CacheWriter(tmp_path, shard_bytes=4 * 100 * 10) as w:
        for i in range(35):
            w.add(f"k{i:02d}", {"samples": torch.full((100,), float(i))})
    r = open_cache(tmp_path)
    assert len(r._shards) == 4
    for sh in r._shards:
        assert len(sh.columns) == 1
        got = r.read(sh.keys)
        assert [int(v["samples"][0]) for v in got] == [int(k[1:]) for k in sh.keys]
        assert sh.keys == sorted(sh.keys)


def test_read_into_a_reused_buffer(tmp_path):
    with CacheWriter(tmp_path) as w:
        for i in range(8):
            w.add(f"k{i}", {"samples": torch.full((1, 4, 8, 8), float(i), dtype=torch.float16)})
    r = open_cache(tmp_path)
    buf = ReadBuffer(pin_memory=True)  # pinned only when CUDA is available
    first = r.read(["k1", "k7", "k3"], out=buf)
    assert [float(v["samples"].flatten()[0]) for v in first] == [1.0, 7.0, 3.0]
    storage = buf.tensor.data_ptr()
    second = r.read(["k2", "k0"], out=buf)
    assert buf.tensor.data_ptr() == storage  # no reallocation
    assert [float(v["samples"].flatten()[0]) for v in second] == [2.0, 0.0]
    assert r.read([]) == []


def test_datasets_round_trip_and_are_replaced(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("l1", {"samples": torch.ones(1)}, kind="latent")
        w.add("c1", [[torch.ones(1), {}]], kind="conditioning")
        w.add("c2", [[torch.zeros(1), {}]], kind="conditioning")
        samples = [Sample("l1", ("c1", "c2"), 3, "a/b.png"), Sample("l1", ("c1",))]
        w.set_dataset("my set/ü", samples, info={"vae": "abc"})
        with pytest.raises(ValueError, match="not in the cache"):
            w.set_dataset("bad", [Sample("nope", ("c1",))])
    r = open_cache(tmp_path)
    assert r.dataset("my set/ü") == samples
    info = r.datasets()["my set/ü"]
    assert info.samples == 2 and info.info == {"vae": "abc"} and info.file.startswith("datasets/my_set_")
    with pytest.raises(KeyError, match="no dataset 'x'"):
        r.dataset("x")
    with CacheWriter(tmp_path) as w:
        w.set_dataset("my set/ü", samples[:1])
    assert open_cache(tmp_path).dataset("my set/ü") == samples[:1]
    with CacheWriter(tmp_path) as w:
        w.remove_dataset("my set/ü")
    assert open_cache(tmp_path).datasets() == {}


def test_stats_and_errors_for_missing_things(tmp_path):
    with pytest.raises(CacheNotFoundError, match="no cache here"):
        open_cache(tmp_path / "none")
    with pytest.raises(CacheNotFoundError):
        CacheWriter(tmp_path / "none", create=False)
    with CacheWriter(tmp_path) as w:
        w.add("a", {"samples": torch.ones(2)}, kind="latent")
    r = open_cache(tmp_path)
    s = r.stats()
    assert s["entries"] == 1 and s["kinds"] == {"latent": 1} and s["shards"] == 1 and s["version"] == 1
    with pytest.raises(KeyError, match="not in the cache"):
        r.read(["zz"])
    with pytest.raises(ValueError, match="closed"):
        w.add("b", 1)


def test_bad_keys_are_refused(tmp_path):
    with CacheWriter(tmp_path) as w:
        for bad in ("", "a\nb", 5, "x" * 300):
            with pytest.raises(ValueError, match="entry key"):
                w.add(bad, 1)


def _open_paths() -> list[str]:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_shard_files_stay_open_until_close_and_reads_still_work_after(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("a", [torch.ones(3)])
    r = open_cache(tmp_path)
    shard = str(r._shards[0].path)
    assert shard not in _open_paths()  # opening reads headers only and keeps nothing open
    assert torch.equal(r.read(["a"])[0][0], torch.ones(3))
    assert _open_paths().count(shard) == 1  # kept for the next batch
    r.read(["a"])
    assert _open_paths().count(shard) == 1  # reused, not reopened
    r.close()
    assert shard not in _open_paths()
    assert torch.equal(r.read(["a"])[0][0], torch.ones(3))  # still usable: opens per read now
    assert shard not in _open_paths()
    r.close()  # idempotent


def test_reader_dropped_without_close_releases_its_files(tmp_path):
    with CacheWriter(tmp_path) as w:
        w.add("a", [torch.ones(3)])
    r = open_cache(tmp_path)
    shard = str(r._shards[0].path)
    r.read(["a"])
    del r
    gc.collect()
    assert shard not in _open_paths()


def test_windows_friendly_no_open_handles_after_read(tmp_path, monkeypatch):
    """Where a kept handle would block replacing the file (Windows), every read opens and closes its files."""
    from dataset_cache.format import shard_files

    monkeypatch.setattr(shard_files, "KEEP_FILES_OPEN", False)
    with CacheWriter(tmp_path) as w:
        w.add("a", [torch.ones(3)])
    r = open_cache(tmp_path)
    assert torch.equal(r.read(["a"])[0][0], torch.ones(3))
    assert str(r._shards[0].path) not in _open_paths()


def test_kept_file_reads_the_opened_snapshot_after_a_compaction_deletes_it(tmp_path):
    """A compaction by another process swaps shards; a reader that already read keeps its consistent snapshot."""
    with CacheWriter(tmp_path) as w:
        w.add("a", [torch.arange(4.0)])
    with CacheWriter(tmp_path) as w:
        w.add("b", [torch.ones(2)])
    r = open_cache(tmp_path)
    r.read(["a", "b"])  # both shard files now kept open
    old = [sh.path for sh in r.shards]
    with CacheWriter(tmp_path) as w:
        w.compact()
    assert not any(p.exists() for p in old)
    a, b = r.read(["a", "b"])
    assert torch.equal(a[0], torch.arange(4.0)) and torch.equal(b[0], torch.ones(2))
    r.close()


def test_kept_files_are_shared_safely_by_threads(tmp_path):
    import threading

    with CacheWriter(tmp_path, shard_bytes=4096) as w:
        for i in range(64):
            w.add(f"k{i}", {"x": torch.full((100,), float(i))})
    r = open_cache(tmp_path)
    assert len(r.shards) > 4
    errors = []

    def work(seed: int) -> None:
        try:
            for j in range(200):
                i = (seed * 31 + j * 7) % 64
                (v,) = r.read([f"k{i}"])
                assert torch.equal(v["x"], torch.full((100,), float(i)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    r.close()  # closing while reads are in flight: they finish (files close after the last one)
    for t in threads:
        t.join()
    assert not errors
    assert not any(str(sh.path) in _open_paths() for sh in r.shards)


def test_public_shard_view_and_entry_nbytes(cache):
    root, vals = cache
    r = open_cache(root)
    assert sum(len(sh.keys) for sh in r.shards) == len(vals)
    assert r.entry_nbytes("latent") == 4 * 64 * 4 + 64 * 4  # samples + noise_mask, float32
    assert r.entry_nbytes("cond") == 77 * 32 * 2 + 32 * 2
    assert all(sh.file.startswith("shards/") and sh.size > 8 for sh in r.shards)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or os.name != "posix", reason="POSIX readahead hints")
def test_ranges_are_announced_to_the_kernel_only_while_batches_come_slowly(tmp_path, monkeypatch):
    from dataset_cache.format import reader as reader_mod

    with CacheWriter(tmp_path) as w:
        for i in range(8):
            w.add(f"k{i}", [torch.full((20000,), float(i)), torch.zeros(20001)])  # rows > 64 KiB apart
        w.add("one", torch.ones(5))
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(reader_mod.os, "posix_fadvise",
                        lambda fd, off, n, advice: (calls.append((off, n, advice)), real(fd, off, n, advice)))
    r = open_cache(tmp_path)
    keys = ["k1", "k5"]
    monkeypatch.setattr(ReadAhead, "COLD_BYTES_PER_S", 1e18)  # every batch counts as slow (from the disk)
    r.read(keys)  # a new reader starts as if cold
    assert len(calls) == 4 and {a for *_, a in calls} == {os.POSIX_FADV_WILLNEED}  # 2 entries x 2 rows
    calls.clear()
    (v,) = r.read(["one"])  # a single range: nothing to overlap, no hint
    assert calls == [] and torch.equal(v, torch.ones(5))
    monkeypatch.setattr(ReadAhead, "COLD_BYTES_PER_S", 0.0)  # from now on batches count as fast (page cache)
    r.read(keys)  # announced (the previous multi-range batch was slow), measured fast
    assert len(calls) == 4
    calls.clear()
    a, b = r.read(keys)
    assert calls == []  # hints are off after a fast batch
    assert torch.equal(a[0], torch.full((20000,), 1.0)) and torch.equal(b[0], torch.full((20000,), 5.0))
    r.close()


def _hint_cache(tmp_path, monkeypatch, *, quick_hints: bool):
    """A cache whose rows lie apart, and a record of the readahead hints the reader gives. ``quick_hints``: every
    hint counts as quick (its pages in the page cache), or none does."""
    from dataset_cache.format import reader as reader_mod

    if quick_hints:
        monkeypatch.setattr(ReadAhead, "WARM_S_PER_RANGE", 10.0)
    else:
        monkeypatch.setattr(ReadAhead, "WARM_S_PER_RANGE", 0.0)
        monkeypatch.setattr(ReadAhead, "WARM_BYTES_PER_S", float("inf"))

    with CacheWriter(tmp_path) as w:
        for i in range(8):
            w.add(f"k{i}", [torch.full((20000,), float(i)), torch.zeros(20001)])  # rows > 64 KiB apart
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(reader_mod.os, "posix_fadvise",
                        lambda fd, off, n, advice: (calls.append((off, n, advice)), real(fd, off, n, advice)))
    return reader_mod, open_cache(tmp_path), calls


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or os.name != "posix", reason="POSIX readahead hints")
def test_a_hinted_batch_is_announced_once_and_its_quick_read_keeps_the_hints_on(tmp_path, monkeypatch):
    _reader_mod, r, calls = _hint_cache(tmp_path, monkeypatch, quick_hints=False)  # no hint counts as quick
    monkeypatch.setattr(ReadAhead, "COLD_BYTES_PER_S", 0.0)  # and every read as fast
    keys = ["k1", "k5"]
    plan = r.plan(keys)
    assert r.announce(plan)  # a new reader starts as if cold
    assert len(calls) == 4 and {a for *_, a in calls} == {os.POSIX_FADV_WILLNEED}  # 2 entries x 2 rows
    calls.clear()
    a, b = r.read_plan(plan, announced=True)
    assert calls == []  # already announced
    assert torch.equal(a[0], torch.full((20000,), 1.0)) and torch.equal(b[0], torch.full((20000,), 5.0))
    other = r.plan(["k2", "k6"])
    assert r.announce(other)  # the fast read was announced: it says nothing about the page cache, hints stay on
    assert len(calls) == 4
    r.read_plan(other, announced=True)
    calls.clear()
    r.read(keys)  # not announced ahead: announced by the read itself, and measured fast
    assert len(calls) == 4
    calls.clear()
    assert not r.announce(plan)  # an unannounced fast read means the page cache serves: hints are off
    r.read_plan(plan, announced=False)
    assert calls == []
    r.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or os.name != "posix", reason="POSIX readahead hints")
def test_a_plan_is_made_once_announced_and_read_without_planning_again(tmp_path, monkeypatch):
    reader_mod, r, calls = _hint_cache(tmp_path, monkeypatch, quick_hints=False)
    planned = []
    real_plan = reader_mod.plan_read
    monkeypatch.setattr(reader_mod, "plan_read", lambda shards, index, keys: (planned.append(tuple(keys)),
                                                                            real_plan(shards, index, keys))[1])
    plan = r.plan(["k5", "k1", "k5"])
    assert planned == [("k5", "k1", "k5")] and plan.keys == ("k5", "k1", "k5")
    assert r.announce(plan) and len(calls) == 4
    calls.clear()
    a, b, c = r.read_plan(plan, announced=True)  # not planned again, not announced again
    assert planned == [("k5", "k1", "k5")] and calls == []
    assert torch.equal(a[0], torch.full((20000,), 5.0)) and torch.equal(b[0], torch.full((20000,), 1.0))
    assert torch.equal(c[0], a[0])
    assert [float(v[0][0]) for v in r.read_plan(plan)] == [5.0, 1.0, 5.0]  # a plan can be read again
    assert r.plan(k for k in ["k2", "k6"]).keys == ("k2", "k6")  # any iterable of keys, to plan as to read
    assert [float(v[0][0]) for v in r.read(k for k in ["k2", "k6"])] == [2.0, 6.0]
    assert r.read([]) == [] and r.read(k for k in []) == []
    r.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or os.name != "posix", reason="POSIX readahead hints")
def test_a_quick_hint_means_the_page_cache_holds_the_batch(tmp_path, monkeypatch):
    _reader_mod, r, calls = _hint_cache(tmp_path, monkeypatch, quick_hints=True)
    assert r.announce(r.plan(["k1", "k5"]))
    assert len(calls) == 4
    calls.clear()
    assert not r.announce(r.plan(["k2", "k6"]))
    assert calls == []
    r.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or os.name != "posix", reason="POSIX readahead hints")
def test_announcements_never_fail_and_leave_nothing_behind(tmp_path, monkeypatch):
    _reader_mod, r, calls = _hint_cache(tmp_path, monkeypatch, quick_hints=False)
    with pytest.raises(KeyError, match="no such entry"):
        r.plan(["k1", "no such entry"])  # planning names the unknown key; nothing is announced
    assert calls == []
    for i in range(7):  # announced batches that are never read (an abandoned iteration): the reader keeps nothing
        assert r.announce(r.plan([f"k{i}", f"k{(i + 4) % 8}"]))
    assert len(calls) == 7 * 4 and not hasattr(r, "_hinted_plans")  # a plan is the caller's value, not the reader's
    with pytest.raises(KeyError, match="no such entry"):
        r.read(["k1", "no such entry"])
    plan = r.plan(["k1", "k5"])
    r.close()
    calls.clear()
    assert not r.announce(plan) and calls == []  # closed: files are no longer kept, nothing to announce
    assert [float(v[0][0]) for v in r.read(["k1", "k5"])] == [1.0, 5.0]


@pytest.mark.skipif(os.name != "posix", reason="POSIX readahead hints")
def test_a_refused_hint_does_not_fail_the_read(tmp_path, monkeypatch):
    from dataset_cache.format import reader as reader_mod

    with CacheWriter(tmp_path) as w:
        for i in range(4):
            w.add(f"k{i}", [torch.full((100,), float(i))])

    def refuse(*_args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(reader_mod.os, "posix_fadvise", refuse, raising=False)
    r = open_cache(tmp_path)
    r._files.read_ahead = ReadAhead(enabled=True)
    values = r.read(["k0", "k2"])
    assert [float(v[0][0]) for v in values] == [0.0, 2.0]
    r.close()


@pytest.mark.parametrize("name", ["uint16", "uint32", "uint64"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_unsigned_wide_integers_round_trip_through_shard_and_log(tmp_path, name, checkpointed):
    """torch >= 2.3 has uint16/32/64 (safetensors U16/U32/U64); numpy cannot view them from torch, so their bytes
    take the uint8-view path, in a shard and in the recovery log alike."""
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    top = {"uint16": 65535, "uint32": 2**32 - 1, "uint64": 2**63 - 1}[name]
    value = {"t": torch.tensor([[0, 1, top], [7, top - 1, 2]], dtype=dtype).t(), "s": torch.tensor(top, dtype=dtype)}
    w = CacheWriter(tmp_path, checkpoints=True)
    w.add("k", value)
    if checkpointed:
        w.checkpoint()
        w.abort()
        CacheWriter(tmp_path).close()
    else:
        w.close()
    got = open_cache(tmp_path).read(["k"])[0]
    for key in ("t", "s"):
        assert got[key].dtype == dtype and got[key].shape == value[key].shape
        signed = {"uint16": torch.int16, "uint32": torch.int32, "uint64": torch.int64}[name]  # exact bits
        assert got[key].view(signed).tolist() == value[key].view(signed).tolist()
