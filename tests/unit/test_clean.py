"""Tests of dataset_cache.clean and ``python -m dataset_cache clean``: unreferenced data goes, the rest stays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataset_cache.clean import LOW_FILL, clean, preview_clean
from dataset_cache.cli import main
from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheLockedError, CacheNotFoundError
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.encode_plan import sources_record_path
from dataset_cache.lock import READ_LOCK, WRITE_LOCK, CacheLock
from support.paths import TESTS_DIR


def _key(i: int) -> str:
    return f"{i:032x}"


def _latent(i: int) -> dict[str, torch.Tensor]:
    return {"samples": torch.full((1, 4, 8, 8), float(i))}


def _cond(i: int) -> list:
    return [[torch.full((1, 7, 16), float(i)), {"pooled_output": torch.full((1, 16), float(i))}]]


def _make_cache(root: Path) -> tuple[set[str], set[str]]:
    """Datasets 'keep' (samples 0-3) and 'drop' (samples 4-7, then removed). Returns (kept keys, dropped keys)."""
    kept, dropped = set(), set()
    with CacheWriter(root) as w:
        for name, rng, into in (("keep", range(0, 4), kept), ("drop", range(4, 8), dropped)):
            samples = []
            for i in rng:
                w.add(_key(i), _latent(i), kind="latent")
                w.add(_key(100 + i), _cond(i), kind="conditioning")
                w.commit()  # one small shard per sample, like per-batch encode commits
                samples.append(Sample(_key(i), (_key(100 + i), _key(999)), 1, f"{i}.png"))
                into.update({_key(i), _key(100 + i)})
            w.add(_key(999), _cond(999), kind="conditioning")  # shared by both datasets
            w.set_dataset(name, samples)
        w.remove_dataset("drop")
    kept.add(_key(999))
    return kept, dropped


def test_preview_lists_unreferenced_entries_and_orphans_without_changing_anything(tmp_path: Path) -> None:
    kept, dropped = _make_cache(tmp_path)
    (tmp_path / "shards" / "0123456789abcdef.safetensors").write_bytes(b"x" * 100)  # killed before commit
    (tmp_path / ".manifest.json.0123456789abcdef.tmp").write_bytes(b"y")
    sources_record_path(tmp_path, "gone").parent.mkdir()
    sources_record_path(tmp_path, "gone").write_text("{}")
    sources_record_path(tmp_path, "keep").write_text("{}")
    files = sorted(p for p in tmp_path.rglob("*"))
    preview = preview_clean(tmp_path)
    assert set(preview.unreferenced) == dropped and preview.referenced == len(kept)
    assert preview.unreferenced_bytes == 4 * (4 * 8 * 8 * 4 + (7 * 16 + 16) * 4)
    orphans = set(preview.orphan_files)
    removed_dataset = {f for f in orphans if f.startswith("datasets/drop-")}  # the removed dataset's file
    assert len(removed_dataset) == 1
    assert orphans - removed_dataset == {"shards/0123456789abcdef.safetensors", ".manifest.json.0123456789abcdef.tmp",
                                         f"sources/{sources_record_path(tmp_path, 'gone').name}"}
    assert preview.datasets == ("keep",) and preview.entries == len(kept | dropped)
    assert all(s.live_fraction < LOW_FILL for s in preview.low_fill_shards) and len(preview.low_fill_shards) == 4
    assert "4 entries" not in preview.summary() and "unreferenced: 8 entries" in preview.summary()
    assert sorted(p for p in tmp_path.rglob("*")) == files
    assert clean(tmp_path).dry_run and sorted(p for p in tmp_path.rglob("*")) == files  # dry run by default


def test_clean_removes_unreferenced_entries_and_orphans_and_keeps_referenced_ones(tmp_path: Path) -> None:
    kept, dropped = _make_cache(tmp_path)
    (tmp_path / "shards" / "0123456789abcdef.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "datasets" / ".x.json.00000000000000aa.tmp").write_bytes(b"y")
    sources_record_path(tmp_path, "gone").parent.mkdir()
    sources_record_path(tmp_path, "gone").write_text("{}")
    sources_record_path(tmp_path, "keep").write_text("{}")
    before = open_cache(tmp_path).read(sorted(kept))
    report = clean(tmp_path, dry_run=False)
    assert report.entries_removed == len(dropped) and report.bytes_freed > 0 and report.files_deleted >= 3
    reader = open_cache(tmp_path)
    assert set(reader.keys()) == kept and reader.verify() == []
    for a, b in zip(before, reader.read(sorted(kept))):
        assert torch.equal(a["samples"] if isinstance(a, dict) else a[0][0],
                           b["samples"] if isinstance(b, dict) else b[0][0])
    assert reader.stats()["shards"] == 1
    assert not (tmp_path / "shards" / "0123456789abcdef.safetensors").exists()
    assert not sources_record_path(tmp_path, "gone").exists() and sources_record_path(tmp_path, "keep").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert (tmp_path / WRITE_LOCK).exists()  # lock files stay
    again = preview_clean(tmp_path)
    assert not again.unreferenced and not again.orphan_files


def test_clean_never_removes_an_entry_a_dataset_references(tmp_path: Path) -> None:
    _make_cache(tmp_path)
    with CacheWriter(tmp_path) as w:  # 'drop' comes back: every entry is referenced again
        w.set_dataset("again", [Sample(_key(i), (_key(100 + i),)) for i in range(4, 8)])
    n = len(open_cache(tmp_path))
    report = clean(tmp_path, dry_run=False)
    assert report.entries_removed == 0 and len(open_cache(tmp_path)) == n
    assert open_cache(tmp_path).verify() == []


_HOLD = r"""
import sys, time
sys.path.insert(0, {tests!r})
from support.pack import import_library
import_library()
from dataset_cache.lock import CacheLock
with CacheLock(sys.argv[1], sys.argv[2], exclusive=False):
    print("locked", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.parametrize("name", [READ_LOCK, WRITE_LOCK])
def test_clean_refuses_while_another_process_holds_the_cache(tmp_path: Path, name: str) -> None:
    kept, dropped = _make_cache(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD.format(tests=str(TESTS_DIR)), str(tmp_path), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(CacheLockedError, match="another process is using this cache"):
            clean(tmp_path, dry_run=False)
        assert clean(tmp_path, dry_run=True).preview.unreferenced  # a preview needs no lock
    finally:
        proc.communicate("\n", timeout=10)
    assert len(open_cache(tmp_path)) == len(kept | dropped)  # nothing was touched
    assert clean(tmp_path, dry_run=False).entries_removed == len(dropped)


def test_clean_of_a_missing_cache_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(CacheNotFoundError):
        clean(tmp_path / "nope", dry_run=False)
    assert not (tmp_path / "nope").exists()


def test_cli_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make_cache(tmp_path)
    assert main(["clean", str(tmp_path), "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out and len(open_cache(tmp_path)) == 17
    assert main(["clean", str(tmp_path)]) == 0
    assert "removed 8 entries" in capsys.readouterr().out and len(open_cache(tmp_path)) == 9
    assert main(["clean", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    with CacheLock(tmp_path, READ_LOCK, exclusive=False):
        assert main(["clean", str(tmp_path)]) == 2
        assert "another process is using this cache" in capsys.readouterr().err
