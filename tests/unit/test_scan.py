"""Tests of dataset_cache.scan: listing, kohya repeats, caption variants, header sizes, failures."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from dataset_cache import scan as scan_mod
from dataset_cache.errors import DatasetFolderError
from dataset_cache.listing import FolderListing, list_folder
from dataset_cache.scan import read_captions, scan_folder



def _image_bytes(size: tuple[int, int], color: str, fmt: str = "PNG", orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    if orientation is None:
        img.save(buf, fmt)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, fmt, exif=exif.tobytes())
    return buf.getvalue()


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)


def make_dataset(root: Path) -> Path:
    """Write a small kohya-style dataset exercising every scan rule; return its root."""
    red = _image_bytes((64, 48), "red")
    _write(root / "10_alpha/a.png", red)
    _write(root / "10_alpha/a.txt", "a red square\n\n   second line  \n")
    _write(root / "10_alpha/b.JPG", _image_bytes((48, 64), "blue", "JPEG"))
    _write(root / "10_alpha/b.txt", "a red square")  # same line as a.txt's first
    _write(root / "10_alpha/2024_nested/c.webp", _image_bytes((64, 64), "green", "WEBP"))
    _write(root / "3_beta/d.png", red)  # same bytes as a.png, other path
    _write(root / "3_beta/d.txt", "\ufeffbom caption\r\nwindows line\r\n")
    _write(root / "3_beta/rot.jpg", _image_bytes((64, 32), "white", "JPEG", orientation=6))
    _write(root / "e.bmp", _image_bytes((32, 32), "black", "BMP"))
    _write(root / "e.txt", "")
    _write(root / "latin1.png", _image_bytes((32, 32), "yellow"))
    _write(root / "latin1.txt", b"caf\xe9 au lait")
    _write(root / "corrupt.png", b"\x89PNG\r\n\x1a\nthis is not a png")
    _write(root / ".hidden/x.png", red)
    _write(root / ".y.png", red)
    _write(root / "notes.md", "not an image")
    _write(root / "orphan.txt", "no image")
    _write(root / "0_off/z.png", red)
    return root


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "data")


def test_listing_pairs_captions_and_reads_repeats(dataset: Path) -> None:
    listing = list_folder(dataset)
    rel = {i.relpath: i for i in listing.images}
    assert list(rel) == sorted(rel)
    assert set(rel) == {
        "10_alpha/a.png", "10_alpha/b.JPG", "10_alpha/2024_nested/c.webp", "3_beta/d.png", "3_beta/rot.jpg",
        "e.bmp", "latin1.png", "corrupt.png",
    }
    assert rel["10_alpha/a.png"].repeats == 10
    assert rel["10_alpha/2024_nested/c.webp"].repeats == 10  # nested names never set repeats
    assert rel["3_beta/d.png"].repeats == 3
    assert rel["e.bmp"].repeats == 1
    assert rel["10_alpha/a.png"].caption_relpath == "10_alpha/a.txt"
    assert rel["3_beta/rot.jpg"].caption_relpath is None
    a = rel["10_alpha/a.png"]
    assert a.size == (dataset / "10_alpha/a.png").stat().st_size
    assert a.mtime_ns == (dataset / "10_alpha/a.png").stat().st_mtime_ns
    assert [f.relpath for f in listing.failures] == ["0_off"]
    assert "repeat count is 0" in listing.failures[0].reason


def test_listing_files_include_captions_once(dataset: Path) -> None:
    (dataset / "10_alpha/a.jpg").write_bytes(_image_bytes((8, 8), "red", "JPEG"))
    files = [f[0] for f in list_folder(dataset).files()]
    assert files.count("10_alpha/a.txt") == 1
    assert "orphan.txt" not in files and "notes.md" not in files


def test_scan_reads_sizes_captions_and_reports_failures(dataset: Path) -> None:
    result = scan_folder(dataset)
    imgs = {i.relpath: i for i in result.images}
    assert list(imgs) == sorted(imgs)
    assert (imgs["10_alpha/a.png"].width, imgs["10_alpha/a.png"].height) == (64, 48)
    assert (imgs["10_alpha/b.JPG"].width, imgs["10_alpha/b.JPG"].height) == (48, 64)
    assert (imgs["3_beta/rot.jpg"].width, imgs["3_beta/rot.jpg"].height) == (32, 64)  # EXIF 6 swaps W/H
    assert imgs["10_alpha/a.png"].captions == ("a red square", "second line")
    assert imgs["10_alpha/b.JPG"].captions == ("a red square",)
    assert imgs["3_beta/d.png"].captions == ("bom caption", "windows line")
    assert imgs["10_alpha/2024_nested/c.webp"].captions == ("",)
    assert imgs["e.bmp"].captions == ("",)
    assert imgs["e.bmp"].path == str(dataset / "e.bmp")
    failures = {f.relpath: f.reason for f in result.failures}
    assert set(failures) == {"0_off", "corrupt.png", "latin1.txt"}
    assert "not valid UTF-8" in failures["latin1.txt"] and "0xe9" in failures["latin1.txt"]
    assert "not a readable image" in failures["corrupt.png"]
    assert "latin1.png" not in imgs and "corrupt.png" not in imgs  # never trained with a replaced caption


def test_scan_is_deterministic_and_threads_agree(dataset: Path) -> None:
    for i in range(70):  # past the threshold at which the pool is used
        (dataset / f"many/{i % 7}/{i:03d}.png").parent.mkdir(parents=True, exist_ok=True)
        (dataset / f"many/{i % 7}/{i:03d}.png").write_bytes(_image_bytes((8 + i, 8), "red"))
    one = scan_folder(dataset, threads=1)
    many = scan_folder(dataset, threads=4)
    assert one == many
    assert scan_folder(dataset) == one
    serial, pooled = list_folder(dataset, threads=1), list_folder(dataset, threads=8)
    assert (serial.images, serial.failures) == (pooled.images, pooled.failures)
    assert serial.started_ns <= pooled.started_ns


def test_known_sizes_skip_header_reads_only_when_stat_matches(dataset: Path, monkeypatch) -> None:
    listing = list_folder(dataset)
    a = next(i for i in listing.images if i.relpath == "10_alpha/a.png")
    calls: list[str] = []
    real = scan_mod.read_image_size
    monkeypatch.setattr(scan_mod, "read_image_size", lambda p: calls.append(p) or real(p))
    known = {a.relpath: (a.size, a.mtime_ns, 999, 111)}
    imgs = {i.relpath: i for i in scan_folder(listing, known_sizes=known, threads=1).images}
    assert (imgs[a.relpath].width, imgs[a.relpath].height) == (999, 111)
    assert str(dataset / "10_alpha" / "a.png") not in calls
    stale = {a.relpath: (a.size, a.mtime_ns + 1, 999, 111)}
    imgs = {i.relpath: i for i in scan_folder(listing, known_sizes=stale, threads=1).images}
    assert (imgs[a.relpath].width, imgs[a.relpath].height) == (64, 48)


def test_known_captions_skip_caption_reads_only_when_stat_matches(dataset: Path, monkeypatch) -> None:
    listing = list_folder(dataset)
    a = next(i for i in listing.images if i.caption_relpath is not None)
    monkeypatch.setattr(scan_mod, "read_captions", lambda p: pytest.fail(f"read {p}"))
    known = {i.caption_relpath: (i.caption_size, i.caption_mtime_ns, ("known",))
             for i in listing.images if i.caption_relpath is not None}
    imgs = {i.relpath: i for i in scan_folder(listing, known_captions=known, threads=1).images}
    assert imgs[a.relpath].captions == ("known",)
    monkeypatch.undo()
    known[a.caption_relpath] = (a.caption_size + 1, a.caption_mtime_ns, ("stale",))
    imgs = {i.relpath: i for i in scan_folder(listing, known_captions=known, threads=1).images}
    assert imgs[a.relpath].captions == read_captions(str(dataset / a.caption_relpath))


def test_read_captions_rules(tmp_path: Path) -> None:
    p = tmp_path / "c.txt"
    p.write_bytes(b"  one  \r\n\r\n two\rthree\n\n")
    assert read_captions(str(p)) == ("one", "two", "three")
    p.write_bytes(b"\n \n\t\n")
    assert read_captions(str(p)) == ("",)
    p.write_bytes(b"dup\ndup\n")
    assert read_captions(str(p)) == ("dup", "dup")


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetFolderError, match="does not exist"):
        list_folder(tmp_path / "nope")


def test_file_instead_of_folder_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "file.png"
    f.write_bytes(b"x")
    with pytest.raises(DatasetFolderError, match="is a file, not a folder"):
        scan_folder(f)


def test_folder_without_images_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "cap.txt").write_text("caption only")
    (tmp_path / ".hidden.png").write_bytes(b"x")
    with pytest.raises(DatasetFolderError, match="no images found"):
        scan_folder(tmp_path)


def test_folder_of_only_bad_images_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"garbage")
    with pytest.raises(DatasetFolderError, match="none of the 1 images is usable.*bad.png"):
        scan_folder(tmp_path)


def test_dataset_folder_error_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        list_folder(tmp_path / "nope")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_symlink_loops_are_cut_and_linked_folders_inside_followed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _write(data / "a.png", _image_bytes((8, 8), "red"))
    _write(data / "pool" / "b.png", _image_bytes((8, 8), "blue"))
    os.symlink(data, data / "loop")
    (data / "sub").mkdir()
    os.symlink(data, data / "sub" / "up")
    os.symlink(data / "pool", data / "2_linked")
    os.symlink("pool", data / "3_again")  # relative target, still inside
    os.symlink(data / "missing.png", data / "broken.png")  # inside, but nothing there
    for threads in (1, 4):
        listing = list_folder(data, threads=threads)
        assert [(i.relpath, i.repeats) for i in listing.images] == [
            ("2_linked/b.png", 2), ("3_again/b.png", 3), ("a.png", 1), ("pool/b.png", 1)
        ]
        assert [(f.relpath, f.reason.split(":")[0]) for f in listing.failures] == [("broken.png", "cannot stat")]


def test_links_leading_outside_the_folder_are_reported_and_not_followed(tmp_path: Path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    _write(data / "a.png", _image_bytes((8, 8), "red"))
    _write(data / "b.png", _image_bytes((8, 8), "green"))
    _write(data / "in.png", _image_bytes((8, 8), "white"))
    _write(outside / "secret.png", _image_bytes((8, 8), "blue"))
    _write(outside / "secret.txt", "private text")
    _write(outside / "dir" / "c.png", _image_bytes((8, 8), "black"))
    os.symlink(outside / "secret.png", data / "stolen.png")  # an image leading out
    os.symlink(outside / "secret.txt", data / "b.txt")  # a caption leading out: b.png is left out with it
    os.symlink(outside / "dir", data / "5_linked")  # a folder leading out
    os.symlink("../outside/secret.png", data / "rel.png")  # relative, still out
    os.symlink(data / "in.png", data / "alias.png")  # stays inside: followed
    for threads in (1, 4):
        listing = list_folder(data, threads=threads)
        assert [i.relpath for i in listing.images] == ["a.png", "alias.png", "in.png"]
        failures = {f.relpath: f.reason for f in listing.failures}
        assert sorted(failures) == ["5_linked", "b.png", "b.txt", "rel.png", "stolen.png"]
        for name in ("5_linked", "b.txt", "rel.png", "stolen.png"):
            assert "symbolic link to" in failures[name] and "outside the dataset folder" in failures[name]
            assert str(outside) in failures[name]
        assert "its caption b.txt is a symbolic link outside the dataset folder" in failures["b.png"]
    result = scan_folder(data, threads=1)
    assert [i.relpath for i in result.images] == ["a.png", "alias.png", "in.png"]
    assert "private text" not in repr(result)


def test_a_folder_given_through_a_link_reads_what_is_inside_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    _write(real / "a.png", _image_bytes((8, 8), "red"))
    _write(real / "a.txt", "inside")
    os.symlink(real / "a.png", real / "alias.png")
    os.symlink(real, tmp_path / "via_link")
    listing = list_folder(tmp_path / "via_link")
    assert [i.relpath for i in listing.images] == ["a.png", "alias.png"] and not listing.failures


def test_extensions_are_case_insensitive(tmp_path: Path) -> None:
    for name in ("a.PNG", "b.Jpeg", "c.TIF", "d.tiff", "e.WebP", "f.gif"):
        _write(tmp_path / name, b"x")
    _write(tmp_path / "a.TXT", "upper")
    listing = list_folder(tmp_path)
    assert isinstance(listing, FolderListing)
    assert [i.relpath for i in listing.images] == ["a.PNG", "b.Jpeg", "c.TIF", "d.tiff", "e.WebP"]
    assert listing.images[0].caption_relpath == "a.TXT"


def test_scan_agrees_with_the_shared_kohya_generator(tmp_path: Path) -> None:
    from support.datasets import make_kohya_folder

    folder = make_kohya_folder(tmp_path / "k")
    result = scan_folder(folder.root)
    assert not result.failures
    by_path = {img.path: img for img in result.images}
    assert len(by_path) == len(folder.images)
    for expected in folder.images:
        got = by_path[str(expected.path)]
        assert (got.width, got.height) == expected.size
        assert got.repeats == expected.repeats
        assert got.captions == tuple(line.strip() for line in expected.caption.splitlines() if line.strip())


def test_utf16_caption_gets_a_hint(tmp_path: Path) -> None:
    p = tmp_path / "c.txt"
    p.write_bytes("caption".encode("utf-16"))
    with pytest.raises(scan_mod.SourceError, match="not valid UTF-8 \\(it looks like UTF-16\\).*re-save it as UTF-8"):
        read_captions(str(p))


def test_folders_without_inode_numbers_are_still_walked(tmp_path: Path, monkeypatch) -> None:
    """Windows' DirEntry.stat() and some network filesystems report inode 0: that must not look like a loop."""
    _write(tmp_path / "1_a/b/c.png", b"x")
    real_stat = os.stat

    def no_inode(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        return os.stat_result((st.st_mode, 0, 0, *tuple(st)[3:]))

    monkeypatch.setattr(scan_mod.os, "stat", no_inode)
    assert [i.relpath for i in list_folder(tmp_path).images] == ["1_a/b/c.png"]


def test_threaded_scan_with_partly_known_items_matches_serial(tmp_path: Path) -> None:
    for i in range(150):
        Image.new("RGB", (1 + i % 7, 3)).save(tmp_path / f"{i:03d}.png")
        (tmp_path / f"{i:03d}.txt").write_text(f"caption {i}\n")
    listing = list_folder(tmp_path)
    sizes = {i.relpath: (i.size, i.mtime_ns, 99, 99) for i in listing.images[::2]}
    caps = {i.caption_relpath: (i.caption_size, i.caption_mtime_ns, ("known",)) for i in listing.images[::3]}
    serial = scan_folder(listing, known_sizes=sizes, known_captions=caps, threads=1)
    pooled = scan_folder(listing, known_sizes=sizes, known_captions=caps, threads=4)
    assert serial == pooled
    assert serial.images[0].width == 99 and serial.images[0].captions == ("known",)
    assert serial.images[1].width == 2 and serial.images[1].captions == ("caption 1",)
