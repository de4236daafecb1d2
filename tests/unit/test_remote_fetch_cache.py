"""The local disk cache of fetched blocks (dataset_cache.remote.fetch_cache): content names, whole writes, the
bound, nothing deleted that it did not name, nothing read or written through a link, and a folder deleted while in use
made again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dataset_cache.remote.fetch_cache import FetchCache, block_name

KEY = "0123456789abcdef-1048576"


def _kept(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.blk"))


def test_a_block_is_kept_whole_under_its_content_name(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "f", 1 << 20)
    name = block_name(KEY, 4096, 3)
    assert name == "0123456789abcdef-1048576-4096-3.blk"
    assert not cache.has(name, 4096)
    assert cache.put(name, bytes(range(256)) * 16)
    assert cache.has(name, 4096) and not cache.has(name, 4095)  # a block of another length is not this one
    out = bytearray(10)
    assert cache.read_into(name, 4096, 250, memoryview(out))
    assert bytes(out) == bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3])
    assert [p.name for p in (tmp_path / "f").rglob("*")] == ["01", name]  # no temporary file left behind


def test_names_outside_the_pattern_are_never_written(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "f", 1 << 20)
    for bad in ("../escape.blk", "x.blk", "0123456789abcdef-1-2-3.blk/../../x"):
        assert not cache.put(bad, b"data")
    assert not any((tmp_path).rglob("escape.blk")) and _kept(tmp_path / "f") == []


def test_the_bound_evicts_least_recently_used_blocks_and_nothing_else(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    cache = FetchCache(folder, 10 * 4096)
    foreign = folder / "01" / "notes.txt"  # a file the cache did not name, inside its folder
    foreign.parent.mkdir(parents=True)
    foreign.write_text("keep me")
    outside = tmp_path / "0123456789abcdef-1048576-4096-99.blk"  # its pattern, outside its folder
    outside.write_bytes(b"x" * 4096)
    names = [block_name(KEY, 4096, i) for i in range(14)]
    for i, name in enumerate(names):
        assert cache.put(name, bytes([i]) * 4096)
        os.utime(folder / name[:2] / name, (1000 + i, 1000 + i))  # a distinct age each, oldest first
    total = sum(p.stat().st_size for p in _kept(folder))
    assert total <= 10 * 4096
    assert cache.has(names[-1], 4096) and not cache.has(names[0], 4096)  # the newest stay, the oldest went
    assert foreign.read_text() == "keep me" and outside.exists()


def test_a_linked_folder_is_refused_and_links_inside_are_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match="not a link"):
        FetchCache(tmp_path / "link", 1 << 20)
    folder = tmp_path / "f"
    cache = FetchCache(folder, 4096)
    victim = target / block_name(KEY, 4096, 0)
    victim.write_bytes(b"v" * 4096)
    (folder / "01").symlink_to(target)  # a sub-folder that is a link: its files are not the cache's
    for i in range(1, 4):
        cache.put(block_name("1123456789abcdef-1048576", 4096, i), b"z" * 4096)
    assert victim.exists()
    # nothing is read, written or deleted through the linked sub-folder
    assert not cache.has(victim.name, 4096) and cache.get(victim.name, 1 << 20) is None
    assert not cache.read_into(victim.name, 4096, 0, memoryview(bytearray(8)))
    assert not cache.put(block_name(KEY, 4096, 1), b"w" * 4096)
    cache.discard(victim.name)
    assert sorted(p.name for p in target.iterdir()) == [victim.name]


def test_a_folder_deleted_while_in_use_is_made_again(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    cache = FetchCache(folder, 1 << 20)
    assert cache.put(block_name(KEY, 4096, 0), b"a" * 4096)
    shutil.rmtree(folder)  # the user freed the disk while ComfyUI runs
    assert not cache.has(block_name(KEY, 4096, 0), 4096)
    assert cache.put(block_name(KEY, 4096, 1), b"b" * 4096)  # kept again, not "reads go on from the network"
    assert cache.has(block_name(KEY, 4096, 1), 4096) and _kept(folder) == [folder / "01" / block_name(KEY, 4096, 1)]
    shutil.rmtree(folder)
    target = tmp_path / "elsewhere"
    target.mkdir()
    folder.symlink_to(target)  # replaced by a link while in use: nothing is written through it
    assert not cache.put(block_name(KEY, 4096, 2), b"c" * 4096)
    assert cache.claim(block_name(KEY, 4096, 3), 60.0)  # no claim can be made there: fetch, as without claims
    assert list(target.iterdir()) == []


def test_a_bound_of_zero_keeps_nothing(tmp_path: Path) -> None:
    cache = FetchCache(tmp_path / "f", 0)
    assert not cache.enabled and not cache.put(block_name(KEY, 4096, 0), b"x" * 4096)
    assert not (tmp_path / "f").exists()
