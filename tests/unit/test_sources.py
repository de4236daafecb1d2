"""Tests of dataset_cache.sources: the stat/hash record and exact validation of a folder against it."""

from __future__ import annotations

import json
import os
import threading
from typing import Any
from pathlib import Path

import pytest

from dataset_cache import sources as sources_mod
from dataset_cache.keys import hash_file
from dataset_cache.scan import scan_folder
from dataset_cache.sources import build_record, validate_sources
from dataset_cache.sources_record import (
    SourceEntry,
    SourcesRecord,
    SourcesRecordError,
    load_record,
    save_record,
)

OLD_NS = 1_600_000_000 * 10**9  # long before any scan: never "racy"


def _set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def _make_folder(root: Path, n: int = 6) -> Path:
    """Images are plain bytes: validation never decodes them."""
    for i in range(n):
        sub = root / ("2_sub" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"img{i}.png").write_bytes(b"png" + bytes([i]) * (10 + i))
        (sub / f"img{i}.txt").write_text(f"caption {i}\nshared\n")
    for p in root.rglob("*"):
        if p.is_file():
            _set_mtime(p, OLD_NS)
    return root


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    return _make_folder(tmp_path / "data")


@pytest.fixture()
def record(folder: Path) -> SourcesRecord:
    return build_record(folder)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_build_record_hashes_images_and_captions(folder: Path, record: SourcesRecord) -> None:
    assert len(record) == 12
    e = record.get("img0.png")
    assert e is not None and e.hash == hash_file(str(folder / "img0.png"))
    assert e.size == 13 and e.mtime_ns == OLD_NS
    assert "2_sub/img1.txt" in record
    assert record.root == str(folder)


def test_unchanged_folder_reads_no_file(folder: Path, record: SourcesRecord, monkeypatch) -> None:
    monkeypatch.setattr(sources_mod, "hash_file", lambda p: pytest.fail(f"hashed {p}"))
    monkeypatch.setattr(sources_mod, "_read_image", lambda p: pytest.fail(f"read {p}"))
    v = validate_sources(folder, record)
    assert v.clean
    assert v.counts() == {"new": 0, "changed": 0, "unchanged": 12, "removed": 0, "refreshed": 0, "hashed": 0,
                          "failures": 0}
    assert v.record.entries == record.entries


def test_touching_every_file_changes_nothing_but_refreshes_stats(folder: Path, record: SourcesRecord) -> None:
    for p in _files(folder):
        _set_mtime(p, OLD_NS + 5 * 10**9)
    v = validate_sources(folder, record)
    assert v.clean and len(v.unchanged) == 12
    assert len(v.refreshed) == 12 and v.hashed == 12
    assert all(e.mtime_ns == OLD_NS + 5 * 10**9 for e in v.record.entries.values())
    again = validate_sources(folder, v.record)
    assert again.clean and again.hashed == 0 and not again.refreshed


def test_editing_one_caption_is_one_change(folder: Path, record: SourcesRecord) -> None:
    cap = folder / "2_sub/img3.txt"
    cap.write_text("caption 3 edited\n")
    v = validate_sources(folder, record)
    assert v.changed == ("2_sub/img3.txt",)
    assert not v.new and not v.removed and len(v.unchanged) == 11
    assert v.record.get("2_sub/img3.txt").hash == hash_file(str(cap))


def test_added_and_removed_images_are_counted(folder: Path, record: SourcesRecord) -> None:
    (folder / "new.jpg").write_bytes(b"jpeg bytes")
    (folder / "new.txt").write_text("new caption")
    (folder / "img2.png").unlink()
    (folder / "2_sub/img5.txt").unlink()
    v = validate_sources(folder, record)
    assert v.new == ("new.jpg", "new.txt")
    assert v.removed == ("2_sub/img5.txt", "img2.png", "img2.txt")  # img2.txt is now an orphan: not a source
    assert not v.changed
    assert "img2.png" not in v.record and "new.jpg" in v.record


def test_same_size_same_mtime_edit_is_trusted(folder: Path, record: SourcesRecord) -> None:
    """Documented blind spot: an edit that keeps size and mtime_ns is not detected (see sources docstring)."""
    p = folder / "img0.png"
    old = p.read_bytes()
    p.write_bytes(old[::-1])
    _set_mtime(p, OLD_NS)
    v = validate_sources(folder, record)
    assert v.clean and v.hashed == 0
    assert v.record.get("img0.png").hash == record.get("img0.png").hash
    # rebuilding the record (no previous one) does see it
    assert build_record(folder).get("img0.png").hash != record.get("img0.png").hash


def test_files_modified_near_the_previous_scan_are_rehashed(folder: Path) -> None:
    p = folder / "img0.png"
    rec = build_record(folder)
    _set_mtime(p, rec.scanned_ns - 10**9)  # within the racy window of that scan
    rec.entries["img0.png"] = rec.entries["img0.png"]._replace(mtime_ns=rec.scanned_ns - 10**9)
    p.write_bytes(b"png" + b"X" * 10)  # same size as before
    _set_mtime(p, rec.scanned_ns - 10**9)
    v = validate_sources(folder, rec)
    assert v.changed == ("img0.png",) and v.hashed == 1


def test_validation_with_threads_matches_serial(folder: Path, record: SourcesRecord) -> None:
    for p in _files(folder)[:7]:
        p.write_bytes(p.read_bytes() + b"!")
    serial = validate_sources(folder, record, threads=1)
    pooled = validate_sources(folder, record, threads=4)
    assert serial.changed == pooled.changed and len(serial.changed) == 7
    assert serial.record.entries == pooled.record.entries


@pytest.mark.parametrize("threshold, pooled", [(0.0, True), (float("inf"), False)])
def test_slow_files_are_hashed_on_the_pool_and_quick_ones_on_the_caller(tmp_path: Path, monkeypatch, threshold,
                                                                       pooled) -> None:
    folder = _make_folder(tmp_path / "data", n=40)  # 80 files: more than the probe
    reference = build_record(folder, threads=1)
    monkeypatch.setattr(sources_mod, "_POOL_MIN_SECONDS_PER_FILE", threshold)
    seen: set[str] = set()
    chunk = sources_mod._hash_chunk

    def spy(root, items):
        seen.add(threading.current_thread().name)
        return chunk(root, items)

    monkeypatch.setattr(sources_mod, "_hash_chunk", spy)
    got = build_record(folder, threads=4)
    assert got.entries == reference.entries and len(got) == 80
    assert any(name.startswith("source-hash") for name in seen) == pooled
    assert threading.current_thread().name in seen  # the probe runs on the caller


@pytest.mark.parametrize("content, claimed", [(b"", 0), (b"abc", 3), (b"x" * 3_000_000, 3_000_000),
                                              (b"grew after fstat" * 100_000, 10), (b"y" * (1 << 20), 1 << 20)])
def test_whole_file_reads_get_every_byte_whatever_the_claimed_size(tmp_path: Path, content, claimed) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert sources_mod._read_whole(fd, claimed) == content
    finally:
        os.close(fd)


def test_unreadable_files_are_failures_not_removals(folder: Path, record: SourcesRecord, monkeypatch) -> None:
    (folder / "img0.png").write_bytes(b"changed")

    def deny(path: str) -> str:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(sources_mod, "hash_file", deny)
    monkeypatch.setattr(sources_mod, "_read_image", deny)
    v = validate_sources(folder, record)
    assert [f.relpath for f in v.failures] == ["img0.png"]
    assert "Permission denied" in v.failures[0].reason
    assert not v.removed and "img0.png" not in v.record


def test_scan_reuses_recorded_image_sizes(tmp_path: Path) -> None:
    from PIL import Image

    root = tmp_path / "d"
    root.mkdir()
    Image.new("RGB", (20, 10)).save(root / "a.png")
    v = validate_sources(root, None)
    scan = scan_folder(v.listing)
    rec = v.record.with_image_sizes(scan.images)
    assert rec.get("a.png").width == 20 and rec.get("a.png").height == 10
    assert rec.image_sizes() == {"a.png": (rec.get("a.png").size, rec.get("a.png").mtime_ns, 20, 10)}
    _set_mtime(root / "a.png", OLD_NS)
    v2 = validate_sources(root, rec)
    assert v2.record.get("a.png").width == 20  # same hash after a touch: size kept


def test_save_load_round_trip(tmp_path: Path, record: SourcesRecord) -> None:
    rec = SourcesRecord(dict(record.entries), record.scanned_ns, record.root)
    rec.entries["ünïcode/\udcff.png"] = SourceEntry(1, 2, "f" * 32, 640, 480)
    path = tmp_path / "sources" / "rec.json"
    save_record(rec, path)
    loaded = load_record(path)
    assert loaded == rec
    assert os.listdir(path.parent) == ["rec.json"]  # no temp file left behind
    doc = json.loads(path.read_text())
    assert doc["format"] == "streamcache-sources" and doc["version"] == 2
    assert doc["paths"] == sorted(doc["paths"])


def test_missing_record(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_record(tmp_path / "none.json")
    assert len(load_record(tmp_path / "none.json", missing_ok=True)) == 0


def _valid_doc() -> dict:
    return {"format": "streamcache-sources", "version": 1, "root": None, "scanned_ns": 5, "paths": ["a.png"],
            "size": [1], "mtime_ns": [2], "hash": ["0" * 32], "width": [None], "height": [None]}


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(format="other"), "not a sources record"),
        (lambda d: d.update(version=3), "version 3 is not supported \\(expected 1 or 2\\)"),
        (lambda d: d.pop("hash"), "column\\(s\\) hash missing"),
        (lambda d: d.update(size=[1, 2]), "columns differ in length"),
        (lambda d: d.update(hash=["xyz"]), "row 0 of column hash"),
        (lambda d: d.update(size=[-1]), "row 0 of column size"),
        (lambda d: d.update(size=[True]), "row 0 of column size"),
        (lambda d: d.update(width=[0]), "row 0 of column width"),
        (lambda d: d.update(paths=["a", "a"], size=[1, 1], mtime_ns=[1, 1], hash=["0" * 32] * 2,
                            width=[None] * 2, height=[None] * 2), "lists a file twice"),
        (lambda d: d.update(scanned_ns="now"), "scanned_ns must be an int"),
    ],
)
def test_corrupt_records_are_refused(tmp_path: Path, mutate, match: str) -> None:
    doc = _valid_doc()
    mutate(doc)
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SourcesRecordError, match=match):
        load_record(path)


def test_truncated_record_is_refused_with_the_fix(tmp_path: Path, record: SourcesRecord) -> None:
    path = tmp_path / "rec.json"
    save_record(record, path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(SourcesRecordError, match="not valid JSON.*Delete this file to rebuild it"):
        load_record(path)
    assert isinstance(SourcesRecordError("p", "r"), ValueError)


def test_pending_changes_round_trip_and_a_record_without_them_has_none(tmp_path: Path,
                                                                      record: SourcesRecord) -> None:
    pending = {"img0.png": None, "gone.png": "0f" * 16}
    with_pending = SourcesRecord(dict(record.entries), record.scanned_ns, record.root, pending)
    save_record(with_pending, tmp_path / "a.json")
    assert load_record(tmp_path / "a.json").pending == pending
    save_record(record, tmp_path / "b.json")  # nothing pending: the file is laid out as before the field existed
    assert "pending" not in json.loads((tmp_path / "b.json").read_text())
    assert load_record(tmp_path / "b.json").pending == {}
    assert with_pending.settled().pending == {} and with_pending.settled().entries == record.entries


@pytest.mark.parametrize("bad", [[], {"a.png": "not a hash"}, {"": None}, {"a.png": 5}, "x"])
def test_a_record_with_a_hostile_pending_field_is_refused_with_the_fix(tmp_path: Path, record: SourcesRecord,
                                                                      bad: Any) -> None:
    path = tmp_path / "rec.json"
    save_record(record, path)
    doc = json.loads(path.read_text())
    doc["pending"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(SourcesRecordError, match="field pending must map paths to a content hash or null.*Delete"):
        load_record(path)


def test_validation_counts_against_the_pending_changes_of_the_previous_record(folder: Path,
                                                                             record: SourcesRecord) -> None:
    first = validate_sources(folder, None)  # nothing stored yet: every file is new, and stays new until settled
    assert len(first.new) == 12 and len(first.record.pending) == 12
    again = validate_sources(folder, first.record)
    assert len(again.new) == 12 and again.hashed == 0 and not again.record_changed
    (folder / "img0.png").write_bytes(b"edited")
    (folder / "img2.txt").unlink()
    stored = validate_sources(folder, record)  # against a settled record: an edit and a removal
    assert (stored.changed, stored.removed) == (("img0.png",), ("img2.txt",)) and stored.record_changed
    assert stored.record.pending == {"img0.png": record.entries["img0.png"].hash,
                                     "img2.txt": record.entries["img2.txt"].hash}
    (folder / "img0.png").write_bytes(b"png" + bytes([0]) * 10)  # edited back: as in the stored dataset
    back = validate_sources(folder, stored.record)
    assert (back.changed, back.removed) == ((), ("img2.txt",)) and "img0.png" in back.unchanged


def test_second_run_reads_no_image_header(tmp_path: Path, monkeypatch) -> None:
    """The intended flow: validate → scan with recorded sizes → store sizes → save; a rerun opens no image."""
    from PIL import Image

    from dataset_cache import scan as scan_mod

    root = tmp_path / "d"
    (root / "2_x").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (10 + i, 20)).save(root / f"2_x/{i}.png")
        _set_mtime(root / f"2_x/{i}.png", OLD_NS)
    path = tmp_path / "sources" / "rec.json"
    first = validate_sources(root, load_record(path, missing_ok=True))
    scanned = scan_folder(first.listing, known_sizes=first.record.image_sizes())
    save_record(first.record.with_image_sizes(scanned.images).settled(), path)  # settled: the dataset is stored

    monkeypatch.setattr(scan_mod, "read_image_size", lambda p: pytest.fail(f"opened {p}"))
    for p in (root / "2_x").iterdir():
        _set_mtime(p, OLD_NS + 10**9)  # touched: re-hashed, same content, sizes kept
    second = validate_sources(root, load_record(path))
    assert second.clean and len(second.refreshed) == 3
    again = scan_folder(second.listing, known_sizes=second.record.image_sizes())
    assert [(i.width, i.height) for i in again.images] == [(10, 20), (11, 20), (12, 20)]


def test_record_time_is_the_listing_time_not_the_validation_time(folder: Path) -> None:
    """A listing made earlier must not let edits between listing and validation be trusted later."""
    from dataset_cache.listing import list_folder

    listing = list_folder(folder)
    v = validate_sources(listing, None)
    assert v.record.scanned_ns == listing.started_ns


def test_caption_shared_by_two_images_is_one_source(folder: Path, record: SourcesRecord) -> None:
    (folder / "img0.jpg").write_bytes(b"jpeg with the same stem as img0.png")
    _set_mtime(folder / "img0.jpg", OLD_NS)
    v = validate_sources(folder, record)
    assert v.new == ("img0.jpg",) and not v.changed and not v.removed
    assert sorted(v.record.entries) == sorted([*record.entries, "img0.jpg"])
    (folder / "img0.txt").write_text("edited shared caption")
    v2 = validate_sources(folder, v.record)
    assert v2.changed == ("img0.txt",) and v2.hashed == 1  # the caption once, though two images name it


def test_caption_variants_are_recorded_from_the_hashed_bytes(folder: Path, record: SourcesRecord) -> None:
    assert record.get("img0.txt").captions == ("caption 0", "shared")
    assert record.get("img0.png").captions is None
    (folder / "img0.txt").write_bytes(b"caf\xe9")  # not UTF-8: no variants stored, the scan reports it
    v = validate_sources(folder, record)
    assert v.changed == ("img0.txt",) and v.record.get("img0.txt").captions is None
    assert v.record.get("img0.txt").hash == hash_file(str(folder / "img0.txt"))
    assert v.record.caption_lines()["2_sub/img1.txt"][2] == ("caption 1", "shared")


def test_version_1_record_loads_and_gets_its_captions_once(tmp_path: Path, folder: Path,
                                                           record: SourcesRecord) -> None:
    path = tmp_path / "rec.json"
    save_record(record, path)
    doc = json.loads(path.read_text())
    del doc["captions"]
    doc["version"] = 1
    path.write_text(json.dumps(doc))
    old = load_record(path)
    assert all(e.captions is None for e in old.entries.values())
    v = validate_sources(folder, old)
    assert v.clean and v.hashed == 0 and v.captions_added == 6
    assert v.record.entries == record.entries
    (folder / "img0.txt").write_text("same size edit!!!")  # trusted by stat, content differs: not stored
    _set_mtime(folder / "img0.txt", OLD_NS)
    v = validate_sources(folder, old)
    assert v.captions_added == 5 and v.record.get("img0.txt").captions is None


def test_captions_column_is_checked(tmp_path: Path) -> None:
    doc = _valid_doc()
    doc.update(version=2, captions=[["a", 1]])
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SourcesRecordError, match="row 0 of column captions"):
        load_record(path)
    doc.update(captions=[])
    path.write_text(json.dumps(doc))
    with pytest.raises(SourcesRecordError, match="columns differ in length"):
        load_record(path)


def test_new_images_are_read_once_for_hash_and_size(tmp_path: Path, monkeypatch) -> None:
    """The bytes that are hashed also give the image's size, so the scan that follows opens no image again."""
    from PIL import Image

    import dataset_cache.scan as scan_mod
    from dataset_cache.scan import scan_folder

    root = tmp_path / "d"
    root.mkdir()
    Image.new("RGB", (20, 10)).save(root / "a.png")
    Image.new("RGB", (8, 12)).save(root / "b.jpg")
    (root / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    v = validate_sources(root, None)
    assert v.record.get("a.png").hash == hash_file(str(root / "a.png"))
    assert (v.record.get("a.png").width, v.record.get("a.png").height) == (20, 10)
    assert (v.record.get("b.jpg").width, v.record.get("b.jpg").height) == (8, 12)
    assert v.record.get("c.png").width is None  # unreadable header: the scan reads it again and reports it
    opened: list[str] = []
    real = scan_mod.read_image_size
    monkeypatch.setattr(scan_mod, "read_image_size", lambda p: opened.append(str(p)) or real(p))
    r = v.record
    scan = scan_folder(v.listing, known_sizes=r.image_sizes(), known_captions=r.caption_lines(), threads=1)
    assert opened == [str(root / "c.png")]
    assert [f.relpath for f in scan.failures] == ["c.png"]
    assert {(i.relpath, i.width, i.height) for i in scan.images} == {("a.png", 20, 10), ("b.jpg", 8, 12)}


def test_large_images_are_hashed_in_chunks_without_a_size(tmp_path: Path, monkeypatch) -> None:
    from PIL import Image

    root = tmp_path / "d"
    root.mkdir()
    Image.new("RGB", (20, 10)).save(root / "a.png")
    monkeypatch.setattr(sources_mod, "_WHOLE_IMAGE_BYTES", 16)
    v = validate_sources(root, None)
    e = v.record.get("a.png")
    assert e.hash == hash_file(str(root / "a.png")) and e.width is None


def _png_variants(tmp: Path) -> dict[str, bytes]:
    """PNGs of every kind the fast header parser must agree with Pillow on (or hand to Pillow)."""
    import io as _io
    import struct as _struct
    import zlib as _zlib

    from PIL import Image, PngImagePlugin

    def save(img: "Image.Image", **kw: Any) -> bytes:
        buf = _io.BytesIO()
        img.save(buf, "PNG", **kw)
        return buf.getvalue()

    def chunk(cid: bytes, data: bytes) -> bytes:
        return _struct.pack(">I", len(data)) + cid + data + _struct.pack(">I", _zlib.crc32(cid + data))

    out: dict[str, bytes] = {}
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        out[f"mode_{mode}"] = save(Image.new(mode, (13, 7)))
    info = PngImagePlugin.PngInfo()
    info.add_text("prompt", '{"workflow": 1}')
    info.add_text("Comment", "x" * 1000, zip=True)
    out["text_and_ztxt"] = save(Image.new("RGB", (9, 4)), pnginfo=info)
    plain = PngImagePlugin.PngInfo()
    plain.add_text("parameters", "a photo")
    out["text_only"] = save(Image.new("RGB", (9, 4)), pnginfo=plain)
    exif_key = PngImagePlugin.PngInfo()
    exif_key.add_text("exif", "junk")
    out["text_exif_key"] = save(Image.new("RGB", (9, 4)), pnginfo=exif_key)
    exif = Image.Exif()
    exif[0x0112] = 6
    out["exif_rotated"] = save(Image.new("RGB", (20, 10)), exif=exif.tobytes())
    out["dpi_and_icc"] = save(Image.new("RGB", (5, 6)), dpi=(300, 300), icc_profile=b"\0" * 200)
    out["dpi"] = save(Image.new("RGB", (5, 6)), dpi=(72, 72))
    out["transparent_p"] = save(Image.new("P", (4, 4)), transparency=0)
    out["apng"] = b""
    buf = _io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG", save_all=True, append_images=[Image.new("RGB", (8, 8), "red")])
    out["apng"] = buf.getvalue()
    base = save(Image.new("RGB", (11, 3)))
    out["bad_ihdr_crc"] = base[:29] + b"\0\0\0\0" + base[33:]
    out["truncated_before_idat"] = base[:40]
    out["zero_width"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 0, 3, 8, 2, 0, 0, 0)) + base[33:])
    out["bad_filter"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 11, 3, 8, 2, 0, 1, 0)) + base[33:])
    out["bad_mode"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 11, 3, 16, 3, 0, 0, 0)) + base[33:])
    out["interlaced_flag"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 11, 3, 8, 2, 0, 0, 1)) + base[33:])
    out["long_ihdr"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 11, 3, 8, 2, 0, 0, 0) + b"xy")
                        + base[33:])
    out["private_chunk"] = base[:33] + chunk(b"prVt", b"hello") + base[33:]
    out["bad_private_crc"] = base[:33] + chunk(b"prVt", b"hello")[:-1] + b"\0" + base[33:]
    out["short_gama"] = base[:33] + chunk(b"gAMA", b"\0\0") + base[33:]
    out["good_gama_chrm_srgb"] = (base[:33] + chunk(b"gAMA", _struct.pack(">I", 45455)) + chunk(b"cHRM", b"\1" * 32)
                                  + chunk(b"sRGB", b"\0") + base[33:])
    out["bad_cid"] = base[:33] + chunk(b"a b!", b"") + base[33:]
    out["iend_first"] = base[:33] + chunk(b"IEND", b"") + base[33:]
    out["huge"] = (base[:8] + chunk(b"IHDR", _struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
                   + base[33:])
    return out


def test_png_fast_header_agrees_with_pillow_or_defers_to_it(tmp_path: Path) -> None:
    import warnings

    from dataset_cache.imaging import _png_size, read_image_size

    fast_ok = 0
    for name, raw in _png_variants(tmp_path).items():
        path = tmp_path / f"{name}.png"
        path.write_bytes(raw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                want: Any = read_image_size(str(path))
            except Exception as exc:
                want = type(exc)
            fast = _png_size(raw)
            got = sources_mod._read_image(str(path))[2]
        if fast is not None:
            fast_ok += 1
            assert fast == want, name
        assert got == (want if isinstance(want, tuple) else None), name
    assert fast_ok >= 10  # the common kinds really take the fast path
    assert _png_size(_png_variants(tmp_path)["exif_rotated"]) is None  # orientation: Pillow decides
