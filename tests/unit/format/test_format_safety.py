"""What compaction and clean may delete, links in a cache, caches inside caches, and journal names.

Each rule of docs/FORMAT.md "Links, nesting and what may be deleted" has a test here that fails on the code
before the rule: an unreadable shard used to be dropped and deleted, a linked ``shards/`` swept, a linked journal
truncated, ``base/shards`` accepted as a cache, and a generation at the edge of the journal pattern rolled over
to a name the reader refuses.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataset_cache.cli import main
from dataset_cache.clean import clean, preview_clean
from dataset_cache.dataset import Sample
from dataset_cache.errors import CacheCorruptError, CacheError, CacheLinkError, CacheUnreadableError
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.format.layout import CacheNestingError
from dataset_cache.format.manifest import (
    JOURNAL_RE,
    MAX_GENERATION,
    journal_name,
    next_generation,
    read_state,
)
from dataset_cache.lock import WRITE_LOCK, CacheLock
from support.faults import FaultInjector

N = 6
REFERENCED = ("k0", "k2", "k4")  # the dataset of _fill; clean may remove the others


def _value(i: int) -> dict[str, torch.Tensor]:
    return {"samples": torch.full((1, 4, 8, 8), float(i))}


def _fill(root: Path, n: int = N) -> dict[str, torch.Tensor]:
    """One small shard per entry (underfull: compaction rewrites them) and a dataset of the even ones."""
    with CacheWriter(root, shard_bytes=1 << 20) as w:
        for i in range(n):
            w.add(f"k{i}", _value(i), kind="latent")
            w.commit()
        w.set_dataset("d", [Sample(f"k{i}", (f"k{i}",)) for i in range(0, n, 2)])
    return {f"k{i}": _value(i)["samples"] for i in range(n)}


def _readable(root: Path) -> dict[str, torch.Tensor]:
    """Every entry that can be read now, with its value (entry by entry: one bad one hides no other)."""
    out = {}
    with open_cache(root, strict=False) as r:
        for k in list(r.keys()):
            try:
                out[k] = r.read([k])[0]["samples"].clone()
            except (CacheCorruptError, CacheUnreadableError):
                pass
    return out


def _shard_of(root: Path, key: str) -> Path:
    with open_cache(root) as r:
        return next(sh.path for sh in r.shards if key in sh.keys)


def _assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert set(before) <= set(after), f"lost: {sorted(set(before) - set(after))}"
    for k, v in before.items():
        assert torch.equal(after[k], v), k


# ------------------------------------------------------------------------------------- unreadable is not damage
@pytest.mark.parametrize("err", [errno.EACCES, errno.EMFILE, errno.EIO])
def test_compaction_keeps_a_shard_it_cannot_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    values = _fill(tmp_path)
    victim = _shard_of(tmp_path, "k3")
    faults = FaultInjector(victim, monkeypatch)
    with faults.active(rule=lambda op, path: err if op == "open" else None):  # every open of that shard
        with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
            report = w.compact()
    assert victim.is_file(), "the shard that could not be opened was deleted"
    assert any(str(victim) in u for u in report.unreadable) and not report.damaged
    assert "could not be read and were left untouched" in report.findings()
    assert str(victim.relative_to(tmp_path)) in {r.file for r in read_state(tmp_path).shards}
    _assert_same(values, _readable(tmp_path))  # the cause gone, every entry reads again


def test_compaction_keeps_a_shard_whose_rows_fail_to_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _fill(tmp_path)
    victim = _shard_of(tmp_path, "k2")
    faults = FaultInjector(victim, monkeypatch)
    with faults.active(rule=lambda op, path: errno.EIO if op in ("pread", "preadv", "read") else None):
        with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
            report = w.compact()
    assert victim.is_file() and report.unreadable
    _assert_same(values, _readable(tmp_path))


def test_damaged_shard_is_kept_without_repair_and_moved_aside_with_it(tmp_path: Path) -> None:
    values = _fill(tmp_path)
    victim = _shard_of(tmp_path, "k1")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte in the last row: the checksum no longer matches
    victim.write_bytes(bytes(data))
    with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
        report = w.compact()
    assert victim.is_file() and report.damaged and not report.quarantined
    assert "kept as they are" in report.findings()
    healthy = {k: v for k, v in values.items() if k != "k1"}
    _assert_same(healthy, _readable(tmp_path))

    with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
        report = w.compact(repair=True)
    assert not victim.exists() and (tmp_path / "damaged" / victim.name).is_file()
    assert report.quarantined == (f"damaged/{victim.name}",)
    assert "moved 1 shard file(s) to damaged/" in report.findings()
    assert "k1" not in open_cache(tmp_path) and open_cache(tmp_path).verify() == []
    _assert_same(healthy, _readable(tmp_path))


def test_truncated_shard_is_dropped_only_by_an_explicit_repair(tmp_path: Path) -> None:
    _fill(tmp_path)
    victim = _shard_of(tmp_path, "k5")
    victim.write_bytes(victim.read_bytes()[:40])
    with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
        report = w.compact()
    assert victim.is_file() and report.damaged
    assert str(victim.relative_to(tmp_path)) in {r.file for r in read_state(tmp_path).shards}
    clean_report = clean(tmp_path, dry_run=False)
    assert victim.is_file() and "damaged shard(s), kept as they are" in clean_report.summary()
    clean_report = clean(tmp_path, dry_run=False, repair=True)
    assert (tmp_path / "damaged" / victim.name).is_file() and not victim.exists()
    assert open_cache(tmp_path).verify() == []


def test_repair_of_a_referenced_damaged_entry_says_which_dataset_must_be_re_encoded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = _fill(tmp_path)
    victim = _shard_of(tmp_path, "k4")  # k4 is referenced by dataset d
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["clean", str(tmp_path)]) == 0  # without --repair: reported, kept
    assert victim.is_file() and "kept as they are" in capsys.readouterr().out
    assert main(["clean", str(tmp_path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert "moved 1 shard file(s) to damaged/" in out and "used by a dataset (first: k4): re-encode" in out
    assert (tmp_path / "damaged" / victim.name).is_file() and "k4" not in open_cache(tmp_path)
    _assert_same({k: values[k] for k in ("k0", "k2")}, _readable(tmp_path))


def test_compaction_and_clean_delete_only_files_of_the_cache_s_own_patterns(tmp_path: Path) -> None:
    _fill(tmp_path)
    foreign = {tmp_path / "shards" / "notes.txt", tmp_path / "shards" / "manifest.json",
               tmp_path / "datasets" / "README", tmp_path / "sources" / "manifest.json",
               tmp_path / "my.tmp", tmp_path / "damaged" / "old.safetensors"}
    for p in foreign:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"not the cache's")
    orphan = tmp_path / "shards" / "00000000000000ff.safetensors"  # a shard written but never committed
    orphan.write_bytes(b"x")
    assert "shards/00000000000000ff.safetensors" in preview_clean(tmp_path).orphan_files
    assert not {str(p.relative_to(tmp_path)) for p in foreign} & set(preview_clean(tmp_path).orphan_files)
    clean(tmp_path, dry_run=False)
    assert all(p.read_bytes() == b"not the cache's" for p in foreign) and not orphan.exists()


# ------------------------------------------------------------------------------------- links
def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    (out / "0123456789abcdef.safetensors").write_text("not a shard of this cache")
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("part", ["shards", "datasets", "sources"])
def test_a_cache_whose_folder_is_a_link_is_refused_and_nothing_outside_changes(tmp_path: Path, part: str) -> None:
    cache = tmp_path / "cache"
    _fill(cache)
    outside = _outside(tmp_path)
    real = cache / part
    if real.exists():
        for p in real.iterdir():
            os.replace(p, outside / p.name)
        real.rmdir()
    real.symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)
    for action in (lambda: CacheWriter(cache).compact(), lambda: clean(cache, dry_run=False),
                   lambda: open_cache(cache), lambda: preview_clean(cache)):
        with pytest.raises(CacheLinkError, match=f"{part} is a symbolic link"):
            action()
    assert _snapshot(outside) == before


def test_a_linked_journal_is_never_truncated_or_appended_to(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _fill(cache)
    outside = _outside(tmp_path)
    journal = cache / read_state(cache).journal
    target = outside / "journal.jsonl"
    target.write_bytes(journal.read_bytes() + b"other data")
    journal.unlink()
    journal.symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(CacheLinkError, match=journal.name):
        with CacheWriter(cache) as w:
            w.add("new", _value(9), kind="latent")
    assert target.read_bytes() == before


def test_a_linked_lock_or_shard_is_not_followed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    values = _fill(cache)
    outside = _outside(tmp_path)
    (cache / WRITE_LOCK).unlink(missing_ok=True)
    (cache / WRITE_LOCK).symlink_to(outside / "made-by-the-lock")
    with pytest.raises(CacheLinkError, match=WRITE_LOCK):
        CacheLock(cache, WRITE_LOCK).acquire()
    assert not (outside / "made-by-the-lock").exists()
    (cache / WRITE_LOCK).unlink()

    victim = _shard_of(cache, "k4")  # a shard replaced by a link to an identical copy outside
    copy = outside / victim.name
    os.replace(victim, copy)
    victim.symlink_to(copy)
    with pytest.raises(CacheLinkError):
        open_cache(cache).read(["k4"])
    with CacheWriter(cache, shard_bytes=1 << 20) as w:
        report = w.compact()
    assert victim.is_symlink() and copy.is_file() and report.unreadable
    stray = cache / "shards" / "00000000000000aa.safetensors"  # an unreferenced link of a shard's name
    stray.symlink_to(outside / "0123456789abcdef.safetensors")
    clean(cache, dry_run=False)  # removes the unreferenced odd entries, and nothing it does not own
    assert stray.is_symlink() and (outside / "0123456789abcdef.safetensors").is_file()
    _assert_same({"k0": values["k0"], "k2": values["k2"]}, _readable(cache))
    victim.unlink()
    os.replace(copy, victim)  # the link replaced by the file: the entry it held was never lost
    _assert_same({k: values[k] for k in REFERENCED}, _readable(cache))


# ------------------------------------------------------------------------------------- nesting
@pytest.mark.parametrize("inner", ["shards", "shards/x", "datasets", "sources/deep/er", "other"])
def test_no_cache_is_created_inside_a_cache(tmp_path: Path, inner: str) -> None:
    _fill(tmp_path / "base")
    with pytest.raises(CacheNestingError, match="inside the cache"):
        CacheWriter(tmp_path / "base" / inner)
    assert open_cache(tmp_path / "base").verify() == []


def test_no_cache_is_created_over_folders_a_cache_would_sweep(tmp_path: Path) -> None:
    (tmp_path / "c" / "shards").mkdir(parents=True)
    (tmp_path / "c" / "shards" / "mine.bin").write_bytes(b"user data")
    with pytest.raises(CacheNestingError, match="non-empty shards/"):
        CacheWriter(tmp_path / "c")
    assert (tmp_path / "c" / "shards" / "mine.bin").read_bytes() == b"user data"
    assert not (tmp_path / "c" / "manifest.json").exists()


# ------------------------------------------------------------------------------------- journal names
@given(st.one_of(st.integers(0, 10), st.integers(MAX_GENERATION - 10, MAX_GENERATION), st.integers(0, MAX_GENERATION)))
def test_every_generation_the_reader_accepts_has_a_successor_it_accepts(gen: int) -> None:
    assert JOURNAL_RE.fullmatch(journal_name(gen))
    assert JOURNAL_RE.fullmatch(journal_name(next_generation(gen)))


def test_a_compaction_at_the_last_generation_writes_a_cache_its_reader_opens(tmp_path: Path) -> None:
    values = _fill(tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    old = tmp_path / m["journal"]
    m["generation"], m["journal"] = MAX_GENERATION, journal_name(MAX_GENERATION)
    os.replace(old, tmp_path / m["journal"])
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with CacheWriter(tmp_path, shard_bytes=1 << 20) as w:
        w.compact()
    assert read_state(tmp_path).generation == 1
    _assert_same(values, _readable(tmp_path))
    m["generation"] = MAX_GENERATION + 1  # beyond the pattern: refused as corrupt, never rolled over
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheCorruptError, match="bad generation"):
        read_state(tmp_path)


# ------------------------------------------------------------------------------------- the property
FILE_KINDS = ("shard", "dataset", "journal", "manifest")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(targets=st.lists(st.tuples(st.sampled_from(FILE_KINDS), st.integers(0, N - 1),
                                  st.sampled_from([errno.EACCES, errno.EMFILE, errno.EIO]),
                                  st.sampled_from(["open", "pread", "preadv", "read", "scandir"])),
                        min_size=1, max_size=3),
       operation=st.sampled_from(["compact", "clean", "repair"]))
def test_no_pattern_of_os_errors_reduces_the_readable_entries(tmp_path_factory: pytest.TempPathFactory,
                                                             monkeypatch: pytest.MonkeyPatch, targets: list,
                                                             operation: str) -> None:
    root = tmp_path_factory.mktemp("prop")
    _fill(root)
    before = _readable(root)
    if operation != "compact":  # clean removes what no dataset references, by design
        before = {k: before[k] for k in REFERENCED}
    shards = sorted(p for p in (root / "shards").iterdir())
    paths = {"shard": lambda i: shards[i % len(shards)], "manifest": lambda i: root / "manifest.json",
             "journal": lambda i: root / read_state(root).journal,
             "dataset": lambda i: next((root / "datasets").iterdir())}
    failing = {(str(paths[kind](i)), op): err for kind, i, err, op in targets}
    with monkeypatch.context() as mp:
        faults = FaultInjector(root, mp)
        with faults.active(rule=lambda op, path: failing.get((path, op))):
            try:
                if operation == "compact":
                    with CacheWriter(root, shard_bytes=1 << 20) as w:
                        w.compact()
                else:
                    clean(root, dry_run=False, repair=operation == "repair")
            except (OSError, CacheError) as exc:  # failing is allowed; failing without naming a file is not
                assert str(root) in str(exc), exc
    _assert_same(before, _readable(root))
