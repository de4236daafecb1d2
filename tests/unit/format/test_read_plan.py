"""``ReadPlan`` is planned from shard headers alone: these tests build headers in memory, with no file at all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dataset_cache.errors import CacheCorruptError
from dataset_cache.format import skeleton
from dataset_cache.format.read_plan import ReadPlan, plan_read, plan_rows
from dataset_cache.format.shard import Column, ShardIndex


def _column(name: str, dtype: torch.dtype, row_shape: tuple[int, ...], rows: int, offset: int) -> Column:
    nbytes = torch.Size(row_shape).numel() * dtype.itemsize
    return Column(name, dtype, torch.Size(row_shape), rows, nbytes, offset, "0" * 16 * rows)


def _ref(c: int, r: int) -> str:
    return f'{{"$tensor": [{c}, {r}]}}'


@pytest.fixture
def shards() -> list[ShardIndex]:
    """Two shards that exist only in memory: latents (fp32 [4, 8, 8]) and a conditioning (fp16 [7, 16])."""
    lat = _column("lat", torch.float32, (4, 8, 8), 3, 1000)  # 1024 bytes a row
    cond = _column("cond", torch.float16, (7, 16), 3, 1000 + 3 * 1024)  # 224 bytes a row
    first = ShardIndex(Path("/nonexistent/a.safetensors"), "shards/a.safetensors", 10**6, [lat, cond],
                       ["l0", "l1", "l2", "c0"], ["latent"] * 3 + ["conditioning"],
                       [f'{{"samples": {_ref(0, i)}}}' for i in range(3)] + [f"[[{_ref(1, 0)}, {{}}]]"])
    lat2 = _column("lat", torch.float32, (4, 8, 8), 2, 500)
    second = ShardIndex(Path("/nonexistent/b.safetensors"), "shards/b.safetensors", 10**6, [lat2],
                        ["m0", "m1"], ["latent"] * 2, [f'{{"samples": {_ref(0, i)}}}' for i in range(2)])
    return [first, second]


def _index(shards: list[ShardIndex]) -> dict[str, tuple[int, int]]:
    return {k: (s, i) for s, sh in enumerate(shards) for i, k in enumerate(sh.keys)}


def test_a_plan_is_a_frozen_value_made_without_files(shards):
    plan = plan_read(shards, _index(shards), ["l2", "c0", "m1", "l0"])
    assert isinstance(plan, ReadPlan) and plan.keys == ("l2", "c0", "m1", "l0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nbytes = 0  # type: ignore[misc]
    assert plan.rows == ((0, 0, 2), (0, 1, 0), (1, 0, 1), (0, 0, 0))
    assert [n for _, n in plan.templates] == [1, 1, 1, 1]
    assert plan == plan_read(shards, _index(shards), iter(["l2", "c0", "m1", "l0"]))  # any iterable; same value


def test_latents_lie_back_to_back_in_the_order_asked_and_groups_are_aligned(shards):
    plan = plan_read(shards, _index(shards), ["l2", "c0", "m1", "l0"])
    lat_group, cond_group = plan.groups
    assert lat_group.rows == ((0, 0, 2), (1, 0, 1), (0, 0, 0)) and lat_group.start == 0  # one [3, 4, 8, 8] view
    assert cond_group.rows == ((0, 1, 0),) and cond_group.start == 3 * 1024 and cond_group.start % 64 == 0
    assert plan.nbytes == 3 * 1024 + 224
    positions = {ref: pos for ref, pos, _ in plan.placed}
    assert positions == {(0, 0, 2): 0, (1, 0, 1): 1024, (0, 0, 0): 2048, (0, 1, 0): 3072}


def test_rows_adjacent_in_file_and_buffer_share_one_read(shards):
    plan = plan_read(shards, _index(shards), ["l0", "l1", "l2"])
    assert plan.ranges == ((0, 1000, 1000 + 3 * 1024, 0),)  # three rows, one positional read
    reversed_plan = plan_read(shards, _index(shards), ["l2", "l1", "l0"])
    assert len(reversed_plan.ranges) == 3  # adjacent in the file but not in the buffer
    assert reversed_plan.range_bytes == 3 * 1024


def test_a_row_asked_twice_is_read_once(shards):
    plan = plan_read(shards, _index(shards), ["l1", "l1", "c0"])
    assert plan.rows == ((0, 0, 1), (0, 0, 1), (0, 1, 0))
    assert [ref for ref, _, _ in plan.placed] == [(0, 0, 1), (0, 1, 0)]
    assert plan.range_bytes == 1024 + 224


def test_loose_rows_and_the_empty_plan(shards):
    plan = plan_rows(shards, [(1, 0, 0), (0, 1, 2)])
    assert plan.keys == () and plan.templates == () and len(plan.ranges) == 2
    empty = plan_read(shards, _index(shards), [])
    assert empty.nbytes == 0 and empty.ranges == () and empty.groups == ()


def test_bad_references_and_unknown_keys_are_refused(shards):
    with pytest.raises(KeyError):
        plan_read(shards, _index(shards), ["l0", "nope"])
    with pytest.raises(CacheCorruptError, match=r"reference \[0, 3\] outside the columns"):
        plan_rows(shards, [(0, 0, 3)])
    with pytest.raises(CacheCorruptError, match=r"reference \[5, 0\] outside the columns"):
        plan_rows(shards, [(0, 5, 0)])
    bad = dataclasses.replace(shards[1], skeletons=["{not json"] * 2)
    with pytest.raises(skeleton.SkeletonError):
        plan_read([shards[0], bad], _index(shards), ["m0"])


def test_read_ahead_policy_learns_from_reads_and_announcements():
    from dataset_cache.format.shard_files import ReadAhead

    ranges = [(0, 0, 1 << 20, 0), (0, 2 << 20, 3 << 20, 1 << 20)]  # 2 MiB in two ranges
    policy = ReadAhead(enabled=True)
    assert policy.cold  # a new reader starts as if cold
    policy.read_done(ranges, seconds=1e-6, announced=True)  # fast because announced: proves nothing
    assert policy.cold
    policy.read_done(ranges, seconds=1e-6, announced=False)  # fast on its own: the page cache serves
    assert not policy.cold
    policy.read_done(ranges[:1], seconds=10.0, announced=False)  # one range says nothing either way
    assert not policy.cold
    policy.read_done(ranges, seconds=10.0, announced=True)  # slow, announced or not: the disk
    assert policy.cold
    policy.announcement_done(ranges, seconds=1e-9)  # the kernel answered at once: pages cached
    assert not policy.cold
    off = ReadAhead(enabled=False)
    assert not off.cold
    off.read_done(ranges, seconds=10.0, announced=False)
    assert not off.cold  # where the kernel takes no hints, never cold
