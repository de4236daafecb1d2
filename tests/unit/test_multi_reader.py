"""MultiCacheReader: several real caches (written with CacheWriter in tmp dirs) read as one.

Routing (each key from the first cache holding it), a missing or damaged entry named as a CacheReader names it,
plans equal to reading each cache alone, the caller's buffer reused for the first group, and the loader + sampler
over two caches delivering the very batches (values) of one cache holding everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dataset_cache import MultiCacheReader
from dataset_cache.dataset import Sample
from dataset_cache.dataset_mix import DatasetPart, Regularization, mix_datasets
from dataset_cache.errors import CacheCorruptError
from dataset_cache.format.reader import CacheReader, ReadBuffer, open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.latent_buckets import buckets_from_reader
from dataset_cache.loader import PrefetchLoader
from dataset_cache.sampler import BucketSampler


def _write(root: Path, entries: dict[str, Any]) -> CacheReader:
    with CacheWriter(root) as w:
        for key, value in entries.items():
            w.add(key, value, kind="conditioning" if isinstance(value, list) else "latent")
    return open_cache(root)


def _latent(value: float, h: int = 4, w: int = 4) -> dict[str, torch.Tensor]:
    return {"samples": torch.full((1, 4, h, w), value)}


def _cond(value: float) -> list:
    return [[torch.full((1, 3, 8), value), {"pooled_output": torch.full((1, 8), -value)}]]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _in(t: torch.Tensor, buf: ReadBuffer) -> bool:
    """``t``'s memory lies in ``buf``'s."""
    start = buf.tensor.untyped_storage().data_ptr()
    return start <= t.untyped_storage().data_ptr() < start + buf.tensor.untyped_storage().nbytes()


@pytest.fixture
def two(tmp_path: Path) -> tuple[CacheReader, CacheReader]:
    """Cache A holds a0..a2 and "both"; cache B holds b0, b1 and "both" (with another value, so the reader that
    served it shows: real caches never differ on a content key)."""
    a = _write(tmp_path / "a", {"a0": _latent(0.0), "a1": _latent(1.0), "a2": _cond(2.0), "both": _latent(100.0)})
    b = _write(tmp_path / "b", {"b0": _latent(10.0), "b1": _cond(11.0), "both": _latent(200.0)})
    yield a, b
    a.close()
    b.close()


def test_each_key_comes_from_the_first_cache_that_holds_it(two: tuple[CacheReader, CacheReader]) -> None:
    a, b = two
    multi = MultiCacheReader([a, b])
    assert multi.roots == (str(a.root), str(b.root))
    assert all(k in multi for k in ("a0", "b1", "both")) and "zz" not in multi
    assert multi.reader_of("a1") is a and multi.reader_of("b0") is b and multi.reader_of("both") is a
    assert MultiCacheReader([b, a]).reader_of("both") is b
    values = multi.read(["b0", "both", "a1", "b1"])
    assert _same(values, [_latent(10.0), _latent(100.0), _latent(1.0), _cond(11.0)])
    assert MultiCacheReader([b, a]).read(["both"])[0]["samples"][0, 0, 0, 0] == 200.0
    assert multi.kind("b1") == "conditioning" and multi.kind("a0") == "latent"
    assert multi.tensor_shapes("b0") == {"samples": torch.Size([1, 4, 4, 4])}
    lazy = multi.get("b0")["samples"]  # a lazy tensor bound to the cache that holds it
    assert lazy.shape == (1, 4, 4, 4) and torch.equal(lazy.materialize(), _latent(10.0)["samples"])
    assert buckets_from_reader(multi, [Sample("a0", ("a2",)), Sample("b0", ("b1",))]) == [(4, 4, 4), (4, 4, 4)]


def test_a_key_in_no_cache_is_named_with_every_cache(two: tuple[CacheReader, CacheReader]) -> None:
    a, b = two
    multi = MultiCacheReader([a, b])
    pattern = rf"entry 'nope' is not in any of the caches at {a.root}, {b.root}"
    for call in (lambda: multi.plan(["a0", "nope"]), lambda: multi.read(["b0", "nope"]),
                 lambda: multi.get("nope"), lambda: multi.tensor_shapes("nope"), lambda: multi.kind("nope")):
        with pytest.raises(KeyError, match=pattern):
            call()
    with pytest.raises(ValueError, match="at least one"):
        MultiCacheReader([])


def test_a_damaged_entry_of_the_second_cache_is_named(two: tuple[CacheReader, CacheReader], tmp_path: Path) -> None:
    a, _ = two
    damaged = _write(tmp_path / "c", {"only": _latent(5.0)})
    shard = damaged.shards[0].path
    damaged.close()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of its only row
    shard.write_bytes(bytes(data))
    multi = MultiCacheReader([a, open_cache(tmp_path / "c")])
    with pytest.raises(CacheCorruptError, match="checksum mismatch") as info:
        multi.read(["a0", "only"])
    assert info.value.entry == "only" and info.value.path == str(shard)
    assert _same(multi.read(["a0"]), [_latent(0.0)])  # the other cache still reads
    multi.close()


def test_plan_announce_and_read_plan_equal_reading_each_cache_alone(two: tuple[CacheReader, CacheReader]) -> None:
    a, b = two
    multi = MultiCacheReader([a, b])
    keys = ["b0", "a0", "both", "b1", "a2", "b0"]  # duplicates allowed, as CacheReader's
    plan = multi.plan(keys)
    assert plan.keys == tuple(keys)
    assert [(g.reader, g.plan.keys, g.positions) for g in plan.groups] == [
        (0, ("a0", "both", "a2"), (1, 2, 4)), (1, ("b0", "b1", "b0"), (0, 3, 5))]
    assert plan.groups[0].plan == a.plan(["a0", "both", "a2"]) and plan.groups[1].plan == b.plan(["b0", "b1", "b0"])
    assert plan.nbytes == sum(g.plan.nbytes for g in plan.groups)
    announced = multi.announce(plan)
    assert isinstance(announced, bool) and announced == any(plan.announced) and len(plan.announced) == 2
    got = multi.read_plan(plan, announced=announced)
    alone_a, alone_b = a.read(["a0", "both", "a2"]), b.read(["b0", "b1", "b0"])
    assert _same(got, [alone_b[0], alone_a[0], alone_a[1], alone_b[1], alone_a[2], alone_b[2]])
    assert _same(multi.read(keys), got)
    assert multi.read_plan(multi.plan([])) == []


def test_one_cache_batches_are_read_as_that_cache_reads_them(two: tuple[CacheReader, CacheReader]) -> None:
    a, b = two
    multi = MultiCacheReader([a, b])
    plan = multi.plan(["b0", "b1"])
    assert len(plan.groups) == 1 and plan.groups[0].plan == b.plan(["b0", "b1"])
    out = ReadBuffer()
    values = multi.read_plan(plan, out=out)
    assert _in(values[0]["samples"], out) and _in(values[1][0][0], out)
    assert _same(values, b.read(["b0", "b1"]))


def test_the_first_group_reuses_the_callers_buffer_and_the_others_one_kept_with_it(
        two: tuple[CacheReader, CacheReader]) -> None:
    a, b = two
    multi = MultiCacheReader([a, b])
    out = ReadBuffer()
    first = multi.read(["b0", "a0"], out=out)
    assert _in(first[1]["samples"], out) and not _in(first[0]["samples"], out)
    extra_ptr = first[0]["samples"].untyped_storage().data_ptr()
    del first  # nothing refers to the extra buffer any more: the next read into `out` reuses it
    second = multi.read(["b1", "a1"], out=out)
    assert _in(second[1]["samples"], out)
    assert second[0][0][0].untyped_storage().data_ptr() == extra_ptr
    kept = second[0][0][0].clone()
    third = multi.read(["b0", "a0"], out=out)  # `second` is still alive: its extra buffer is not overwritten
    assert torch.equal(second[0][0][0], kept) and _same(third, [_latent(10.0), _latent(0.0)])
    assert third[0]["samples"].untyped_storage().data_ptr() != extra_ptr
    without = multi.read(["b0", "a0"])  # no buffer given: new ones, as CacheReader.read
    assert _same(without, third)


def test_close_closes_every_cache(two: tuple[CacheReader, CacheReader], monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    for r in two:
        real = r.close
        monkeypatch.setattr(r, "close", lambda real=real, r=r: (closed.append(str(r.root)), real()))
    with MultiCacheReader(list(two)) as multi:
        assert _same(multi.read(["a0", "b0"]), [_latent(0.0), _latent(10.0)])
    assert closed == [str(two[0].root), str(two[1].root)]
    multi.close()  # idempotent; the readers stay usable (files opened per read)
    assert _same(multi.read(["a1", "b1"]), [_latent(1.0), _cond(11.0)])


# ------------------------------------------------------------------------------ loader + sampler over two caches
def _variety(prefix: str, n: int, h: int, w: int, seed: int) -> tuple[list[Sample], dict[str, Any]]:
    """``n`` samples with mirrors, masks on every other one, two captions each, and the shared empty caption."""
    g = torch.Generator().manual_seed(seed)
    entries: dict[str, Any] = {"empty": _cond(0.5)}
    samples = []
    for i in range(n):
        latent = torch.randn(1, 4, h, w, generator=g)
        entries[f"{prefix}l{i}"] = {"samples": latent}
        entries[f"{prefix}m{i}"] = {"samples": latent.flip(-1)}
        entries[f"{prefix}c{i}"] = [[torch.randn(1, 3, 8, generator=g), {}]]
        entries[f"{prefix}d{i}"] = [[torch.randn(1, 3, 8, generator=g), {}]]
        mask = None
        if i % 2 == 0:
            mask = f"{prefix}k{i}"
            entries[mask] = {"mask": torch.randint(0, 256, (1, 1, h, w), generator=g, dtype=torch.uint8)}
        samples.append(Sample(f"{prefix}l{i}", (f"{prefix}c{i}", f"{prefix}d{i}"), mirror=f"{prefix}m{i}",
                              mask=mask, empty_caption="empty"))
    return samples, entries


def _batches(reader: Any, main: list[Sample], extra: list[Sample], reg: list[Sample], prefetch: int,
             threads: int | None) -> list[Any]:
    mix = mix_datasets([DatasetPart("main", main, 2), DatasetPart("extra", extra, 1)])
    regularization = Regularization(reg, buckets_from_reader(reader, reg), 0.5, 0.25, name="reg")
    sampler = BucketSampler(mix, buckets_from_reader(reader, mix.samples), 3, seed=5, tail="wrap",
                            caption_dropout=0.3, reg=regularization)
    out = []
    with PrefetchLoader(reader, sampler, prefetch_batches=prefetch, threads=threads, epochs=3) as loader:
        for batch in loader:
            out.append((batch.plan, batch.latents.clone(), [_clone(c) for c in batch.conditioning],
                        None if batch.masks is None else batch.masks.clone()))
    return out


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("prefetch,threads,reg_height", [(0, None, 6), (2, 2, 6), (2, 2, 4), (3, 1, 4)])
def test_the_loader_over_two_caches_delivers_the_batches_of_one_cache_holding_everything(
        tmp_path: Path, prefetch: int, threads: int | None, reg_height: int) -> None:
    """Main datasets in cache A, the regularization set in cache B (a bucket of its own, or the main one's, so
    that batches mix latents of both caches), the empty caption in both; 3 epochs with caption dropout, mirrors
    and masks: the same plans and the same values as from one cache holding everything."""
    main, main_entries = _variety("p", 5, 4, 4, seed=1)
    extra, extra_entries = _variety("s", 2, 4, 4, seed=2)
    reg, reg_entries = _variety("r", 4, reg_height, 4, seed=3)
    a = _write(tmp_path / "a", {**main_entries, **extra_entries})
    b = _write(tmp_path / "b", reg_entries)
    one = _write(tmp_path / "one", {**main_entries, **extra_entries, **reg_entries})
    try:
        multi = MultiCacheReader([a, b])
        got = _batches(multi, main, extra, reg, prefetch, threads)
        want = _batches(one, main, extra, reg, prefetch, threads)
    finally:
        for r in (a, b, one):
            r.close()
    assert len(got) == len(want) > 6
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, latents, conds, masks), (_, w_latents, w_conds, w_masks) in zip(got, want):
        assert torch.equal(latents, w_latents) and _same(conds, w_conds)
        assert (masks is None and w_masks is None) or torch.equal(masks, w_masks)
    plans = [g[0] for g in got]
    assert any(r >= 7 for p in plans for r in p.sample_indices)  # regularization rows (cache B) were trained
    assert any(any(p.dropped) for p in plans) and any(any(p.mirrored) for p in plans)
    if reg_height == 4:  # some batch read latents from both caches (stacked, not one block)
        assert any(min(p.sample_indices) < 7 <= max(p.sample_indices) for p in plans)
