"""Scanning an image + caption folder: kohya layout, caption variants, image sizes from headers.

Two steps, so that "did anything change?" never pays for more than a directory listing:

* :func:`list_folder` walks the folder with one ``os.scandir`` per directory and takes every size and mtime from
  ``DirEntry.stat()``; it pairs images with same-stem ``.txt`` captions and reads kohya repeat counts from folder
  names. It opens no file. :mod:`.sources` validates this listing against the previous run's record.
* :func:`scan_folder` adds what needs file contents: image sizes from headers (no pixel decoding) and caption
  variants; sizes and variants the caller already knows for unchanged files are reused.

Layout rules:

* Images: ``.png .jpg .jpeg .webp .bmp .tiff .tif``, any case. Names starting with ``.`` (files and folders) are
  skipped. Folders are walked recursively; symlinked folders are followed (a link back to a containing
  folder is skipped, so loops end; two links to one folder list its images twice, as laid out).
* Links: a symbolic link (file or folder) whose target lies outside the dataset folder is never followed: it is
  reported as a failure naming the link and its target, and skipped (with ``on_failure = stop`` the encode stops
  on it), so a shared workflow cannot read outside the folders the user gave ComfyUI through a planted link. An
  image whose caption is such a link is left out with it. Links whose target stays inside the folder are followed.
* Repeats: a folder directly under the root named ``<repeats>_<name>`` (e.g. ``10_mychar``) gives every image
  below it, at any depth, that repeat count; images elsewhere repeat once. Deeper folder names never set repeats,
  so a nested ``2024_photos`` is just a folder. ``0_<name>`` folders are reported and skipped (nothing to train).
* Clips (:mod:`.video`): a video file (``.mp4 .webm .mov .mkv``) is one sample, listed like an image; a folder
  named ``<stem>.frames`` is one sample whose frames are its images (its subfolders and text files are ignored,
  and its name never sets repeats). Their caption is ``<stem>.txt`` beside the video or the folder.
* Masks: ``<stem>-masklabel.<image ext>`` (OneTrainer / kohya; ``-masklabel`` in any case) is the loss mask of
  the images named ``<stem>.<image ext>`` in the same folder. Mask files are never samples, whatever the
  ``masks`` setting: they are listed apart (:attr:`FolderListing.masks`, paired with their images by
  :attr:`FolderListing.mask_of`), so the sources record tracks them like any source file; a mask that matches no
  image is unused (:attr:`FolderListing.unused_masks`, counted in the report). A mask that is a link out of the
  folder is refused like a caption: the link is a failure and its images are listed in
  :attr:`FolderListing.refused_masks` (left out when masks are used). Inside a ``.frames`` folder a mask file is
  no frame (clips get no mask).
* Captions: ``<stem>.txt`` (any case of ``.txt``) next to the image, decoded as UTF-8 (a BOM is allowed). Each
  non-empty line, stripped, is one caption variant (duplicates kept: they weight that line). A missing or empty
  caption file means one empty-prompt variant. An undecodable caption is a failure and its image is left out.

Everything returned is sorted by relative path (POSIX separators) and does not depend on directory order.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from fractions import Fraction
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

from .dataset import MAX_REPEATS
from .errors import DatasetFolderError, SourceError, SourceFailure
from .imaging import read_image_size
from .threads import resolve_threads
from .video import FRAMES_SUFFIX, VIDEO_EXTENSIONS, clip_folder_of, frame_order, probe_video

__all__ = [
    "IMAGE_EXTENSIONS",
    "CAPTION_EXTENSION",
    "MASK_SUFFIX",
    "ListedImage",
    "FolderListing",
    "SourceImage",
    "SourceClip",
    "ScanResult",
    "list_folder",
    "scan_folder",
    "read_captions",
    "decode_captions",
]

log = logging.getLogger("dataset_cache.scan")

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tiff", ".tif"})
"""Image file extensions (compared lowercased)."""

CAPTION_EXTENSION = ".txt"
"""Caption file extension (compared lowercased)."""

MASK_SUFFIX = "-masklabel"
"""End of a mask file's stem (compared lowercased): ``a-masklabel.png`` is the loss mask of ``a.png``."""

_REPEAT_DIR = re.compile(r"^(\d+)_(.+)$")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class ListedImage(NamedTuple):
    """One image found by :func:`list_folder`, with its caption file's stat when it has one. Videos and the
    frames of ``.frames`` folders are listed the same way (a frame carries its clip's caption)."""

    relpath: str
    size: int
    mtime_ns: int
    repeats: int
    caption_relpath: str | None = None
    caption_size: int = 0
    caption_mtime_ns: int = 0


@dataclass(frozen=True)
class FolderListing:
    """What :func:`list_folder` found: images (sorted by relpath) and per-file failures.

    Attributes:
        root: the dataset folder, absolute.
        images: listed images, sorted by ``relpath``.
        failures: folders or files that could not be listed.
        started_ns: wall-clock time (``time.time_ns()``) when listing began: every stat in it is at least this
            recent, which :mod:`.sources` relies on to spot edits made in the same timestamp tick.
    """

    root: str
    images: tuple[ListedImage, ...]
    failures: tuple[SourceFailure, ...] = ()
    started_ns: int = 0
    masks: tuple[tuple[str, int, int], ...] = ()
    mask_of: Mapping[str, str] = field(default_factory=dict)
    refused_masks: frozenset[str] = frozenset()

    def files(self) -> Iterator[tuple[str, int, int]]:
        """Yield ``(relpath, size, mtime_ns)`` of every source file: each image, then its caption (if any); then
        every mask file."""
        seen: set[str] = set()
        for img in self.images:
            yield img.relpath, img.size, img.mtime_ns
            cap = img.caption_relpath
            if cap is not None and cap not in seen:  # a.png and a.jpg share a.txt
                seen.add(cap)
                yield cap, img.caption_size, img.caption_mtime_ns
        yield from self.masks

    @property
    def unused_masks(self) -> tuple[str, ...]:
        """Mask files that are no image's mask (no image of their stem, or a second mask of one stem)."""
        used = set(self.mask_of.values())
        return tuple(m[0] for m in self.masks if m[0] not in used)

    def abspath(self, relpath: str) -> str:
        """Return the absolute path of a listed relative path."""
        return os.path.join(self.root, *relpath.split("/"))


@dataclass(frozen=True)
class SourceImage:
    """One usable training image and its caption variants.

    Attributes:
        relpath: path relative to the dataset folder (POSIX separators); reports and records use it.
        path: absolute path.
        size: file size in bytes.
        mtime_ns: modification time in nanoseconds.
        width: width after EXIF orientation, from the header.
        height: height after EXIF orientation, from the header.
        repeats: kohya repeat count (>= 1).
        caption_relpath: the caption file, or ``None`` when there is none.
        captions: caption variants (>= 1; ``("",)`` for a missing or empty caption).
    """

    relpath: str
    path: str
    size: int
    mtime_ns: int
    width: int
    height: int
    repeats: int
    caption_relpath: str | None
    captions: tuple[str, ...]


@dataclass(frozen=True)
class SourceClip:
    """One usable clip (see :mod:`.video`): a video file or a ``.frames`` folder, and its caption variants.

    Attributes:
        relpath: the video's or the folder's path relative to the dataset folder.
        path: absolute path.
        kind: ``"video"`` or ``"frames"``.
        width: frame width (a video's from its header; a folder's, which all its frames share).
        height: frame height.
        frame_count: frames in the clip.
        rate: a video's frame rate (``None`` for a folder, or a video that states none).
        repeats: kohya repeat count (>= 1).
        caption_relpath: the caption file, or ``None`` when there is none.
        captions: caption variants (>= 1).
        frames: a folder's frames in order (empty for a video).
        size: a video's size in bytes (0 for a folder: its frames carry theirs).
        mtime_ns: a video's modification time (0 for a folder).
    """

    relpath: str
    path: str
    kind: str
    width: int
    height: int
    frame_count: int
    rate: Fraction | None
    repeats: int
    caption_relpath: str | None
    captions: tuple[str, ...]
    frames: tuple[SourceImage, ...] = ()
    size: int = 0
    mtime_ns: int = 0


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan_folder` found.

    Attributes:
        root: the dataset folder, absolute.
        images: usable images, sorted by ``relpath``.
        failures: unusable files (unreadable image header, undecodable caption, unlistable folder), sorted.
        clips: usable clips (videos and ``.frames`` folders), sorted by ``relpath``.
    """

    root: str
    images: tuple[SourceImage, ...]
    failures: tuple[SourceFailure, ...]
    clips: tuple[SourceClip, ...] = ()

    def sample_count(self) -> int:
        """Samples found: images and clips."""
        return len(self.images) + len(self.clips)


def _check_root(root: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(root))
    if not os.path.exists(path):
        raise DatasetFolderError(path, "dataset folder does not exist; check the path (it is resolved on this machine)")
    if not os.path.isdir(path):
        raise DatasetFolderError(path, "is a file, not a folder; give the folder that holds the images")
    name = os.path.basename(path)
    if name.lower().endswith(FRAMES_SUFFIX) and len(name) > len(FRAMES_SUFFIX):
        raise DatasetFolderError(path, "is a clip (a <name>.frames folder holds the frames of one video clip), not "
                                       "a dataset folder; give the folder that holds it")
    return path


def _repeats_of(dirname: str) -> int | None:
    match = _REPEAT_DIR.match(dirname)
    return int(match.group(1)) if match else None


_Caption = tuple[str, int, int]  # (relpath, size, mtime_ns) of a caption file
_Pending = tuple[str, int, frozenset[tuple[int, int]], _Caption | None]
_Masks = tuple[list[_Caption], list[tuple[str, str]], list[str]]
"""A folder's mask files, (image, mask) pairs, and images whose mask is a link out of the dataset folder."""
"""(reldir, repeats, (st_dev, st_ino) of it and its ancestors, the caption of a ``.frames`` folder)"""


def _link_outside(path: str, real_root: str) -> str | None:
    """The target of link ``path`` when it resolves outside ``real_root`` (the dataset folder's real path), else
    ``None``. Only links reach here (``DirEntry.is_symlink`` costs no syscall), so plain files pay nothing."""
    target = os.path.realpath(path)
    inside = target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep)
    return None if inside else target


def _is_mask_name(name: str, dot: int) -> bool:
    return dot > len(MASK_SUFFIX) and name[dot - len(MASK_SUFFIX):dot].lower() == MASK_SUFFIX


@dataclass
class _Entries:
    """What one pass over a directory found (:func:`_scan_entries`), before images are paired with captions; the
    steps after it add their failures and drop subfolders here too."""

    failures: list[SourceFailure] = field(default_factory=list)
    subdirs: list[_Pending] = field(default_factory=list)  # subfolders still to list
    images: list[tuple[str, str, os.DirEntry[str]]] = field(default_factory=list)  # (name, stem, entry)
    captions: dict[str, os.DirEntry[str]] = field(default_factory=dict)
    mask_entries: dict[str, os.DirEntry[str]] = field(default_factory=dict)  # image stem -> its mask (first name)
    mask_files: list[_Caption] = field(default_factory=list)
    refused_captions: set[str] = field(default_factory=set)  # stems whose caption links outside the folder
    refused_masks: set[str] = field(default_factory=set)  # image stems whose mask links outside the folder


def _list_dir(root: str, real_root: str, reldir: str, repeats: int, ancestors: frozenset[tuple[int, int]],
              clip_caption: _Caption | None = None
              ) -> tuple[list[ListedImage], list[SourceFailure], list[_Pending], _Masks]:
    """List one directory: its images (with caption stats), failures, subfolders still to list, and its mask
    files paired with their images. A ``.frames`` folder lists its images only, each with the clip's caption
    ``clip_caption`` (its mask files are unused)."""
    frames_dir = clip_folder_of(reldir + "/x") is not None if reldir else False
    absdir = os.path.join(root, *reldir.split("/")) if reldir else root
    prefix = reldir + "/" if reldir else ""
    found = _Entries()
    masks: _Masks = (found.mask_files, [], [])
    try:
        _scan_entries(found, root, real_root, reldir, absdir, prefix, repeats, ancestors, frames_dir)
    except OSError as exc:
        found.failures.append(SourceFailure(reldir or ".", absdir, f"cannot list folder: {exc.strerror or exc}"))
        return [], found.failures, found.subdirs, masks
    if frames_dir:
        return _frame_images(found, prefix, repeats, clip_caption), found.failures, found.subdirs, masks
    _clip_captions(found, prefix, absdir)
    _pair_masks(found, prefix, masks)
    return _captioned_images(found, prefix, repeats), found.failures, found.subdirs, masks


def _scan_entries(found: _Entries, root: str, real_root: str, reldir: str, absdir: str, prefix: str, repeats: int,
                  ancestors: frozenset[tuple[int, int]], frames_dir: bool) -> None:
    """One pass over the directory's entries (``absdir``, ``reldir`` in the dataset folder ``root``) into ``found``
    (links out of the folder and unreadable entries among its failures). Raises the ``OSError`` of listing the
    directory itself."""
    failures, subdirs = found.failures, found.subdirs
    images, captions, mask_entries, mask_files = found.images, found.captions, found.mask_entries, found.mask_files
    with os.scandir(absdir) as it:
        for entry in it:  # hot loop: one pass, d_type checks only, no syscall per entry
            name = entry.name
            if name[0] == ".":
                continue
            dot = name.rfind(".")
            ext = name[dot:].lower() if dot > 0 else ""
            try:
                if entry.is_symlink():
                    target = _link_outside(entry.path, real_root)
                    if target is not None:
                        failures.append(SourceFailure(prefix + name, entry.path, (
                            f"is a symbolic link to {target}, outside the dataset folder {root}; links out of "
                            "the folder are not followed (the pack reads only inside the folders you gave "
                            "ComfyUI): copy the file into the folder instead")))
                        if ext == CAPTION_EXTENSION:
                            found.refused_captions.add(name[:dot])
                        elif ext in IMAGE_EXTENSIONS and _is_mask_name(name, dot):
                            found.refused_masks.add(name[:dot - len(MASK_SUFFIX)])
                        continue
                if entry.is_dir():
                    if not frames_dir:  # a clip's folder holds frames only
                        _add_subdir(entry, reldir, prefix, repeats, ancestors, failures, subdirs)
                    continue
            except OSError as exc:
                failures.append(SourceFailure(prefix + name, entry.path, f"cannot inspect: {exc.strerror}"))
                continue
            if ext in IMAGE_EXTENSIONS and _is_mask_name(name, dot):  # never a sample
                try:
                    mst = entry.stat()
                except OSError as exc:
                    failures.append(SourceFailure(prefix + name, entry.path, f"cannot stat: {exc.strerror}"))
                    continue
                mask_files.append((prefix + name, mst.st_size, mst.st_mtime_ns))
                stem = name[:dot - len(MASK_SUFFIX)]
                if not frames_dir and (stem not in mask_entries or name < mask_entries[stem].name):
                    mask_entries[stem] = entry
            elif ext in IMAGE_EXTENSIONS or (ext in VIDEO_EXTENSIONS and not frames_dir):
                images.append((name, name[:dot], entry))
            elif ext == CAPTION_EXTENSION and not frames_dir:
                stem = name[:dot]
                # a.txt wins over a.TXT; otherwise the first name in sorted order, so the choice is stable
                if stem not in captions or _caption_rank(name) < _caption_rank(captions[stem].name):
                    captions[stem] = entry


_new = tuple.__new__  # builds the NamedTuple without its Python-level __new__: ~1 us less per image


def _frame_images(found: _Entries, prefix: str, repeats: int, clip_caption: _Caption | None) -> list[ListedImage]:
    """A ``.frames`` folder's images, each with the clip's caption."""
    out: list[ListedImage] = []
    failures = found.failures
    cap_rel, cap_size, cap_mtime = clip_caption if clip_caption is not None else (None, 0, 0)
    for name, _stem, entry in found.images:
        try:
            st = entry.stat()
        except OSError as exc:
            failures.append(SourceFailure(prefix + name, entry.path, f"cannot stat: {exc.strerror or exc}"))
            continue
        out.append(_new(ListedImage, (prefix + name, st.st_size, st.st_mtime_ns, repeats, cap_rel, cap_size,
                                      cap_mtime)))
    return out


def _clip_captions(found: _Entries, prefix: str, absdir: str) -> None:
    """Give each clip folder (``<stem>.frames``) among the subfolders the caption beside it; drop a clip folder whose
    caption is a link out of the dataset folder."""
    subdirs, failures = found.subdirs, found.failures
    for i, (sub, sub_repeats, sub_ancestors, _) in enumerate(subdirs):
        folder = sub.rpartition("/")[2]
        if folder.lower().endswith(FRAMES_SUFFIX):
            stem = folder[:-len(FRAMES_SUFFIX)]
            if stem in found.refused_captions:
                failures.append(SourceFailure(sub, os.path.join(absdir, folder), (
                    f"left out: its caption {prefix}{stem}{CAPTION_EXTENSION} is a symbolic link outside the "
                    "dataset folder (see that file's line)")))
                subdirs[i] = ("", 0, sub_ancestors, None)  # dropped below
                continue
            cap = found.captions.get(stem)
            if cap is not None:
                try:
                    cst = cap.stat()
                    subdirs[i] = (sub, sub_repeats, sub_ancestors, (prefix + cap.name, cst.st_size, cst.st_mtime_ns))
                except OSError as exc:
                    failures.append(SourceFailure(prefix + cap.name, cap.path, f"cannot stat: {exc.strerror or exc}"))
    subdirs[:] = [s for s in subdirs if s[0]]


def _pair_masks(found: _Entries, prefix: str, masks: _Masks) -> None:
    """Pair each image (not video) with its mask file, or name it among those whose mask links out of the folder."""
    if not (found.mask_entries or found.refused_masks):
        return
    for name, stem, _entry in found.images:
        if name[len(stem):].lower() not in IMAGE_EXTENSIONS:  # a video: clips get no mask
            continue
        if stem in found.refused_masks:
            masks[2].append(prefix + name)
        elif stem in found.mask_entries:
            masks[1].append((prefix + name, prefix + found.mask_entries[stem].name))


def _captioned_images(found: _Entries, prefix: str, repeats: int) -> list[ListedImage]:
    """The folder's images and videos with their captions' stats; one whose caption links out of the folder is
    left out, and said so."""
    out: list[ListedImage] = []
    captions, refused, failures = found.captions, found.refused_captions, found.failures
    for name, stem, entry in found.images:
        if stem in refused:
            failures.append(SourceFailure(prefix + name, entry.path, (
                f"left out: its caption {prefix}{stem}{CAPTION_EXTENSION} is a symbolic link outside the dataset "
                "folder (see that file's line)")))
            continue
        try:
            st = entry.stat()
            cap = captions.get(stem)
            if cap is None:
                out.append(_new(ListedImage, (prefix + name, st.st_size, st.st_mtime_ns, repeats, None, 0, 0)))
            else:
                cst = cap.stat()
                out.append(_new(ListedImage, (prefix + name, st.st_size, st.st_mtime_ns, repeats,
                                              prefix + cap.name, cst.st_size, cst.st_mtime_ns)))
        except OSError as exc:  # broken symlink, or removed while listing
            failures.append(SourceFailure(prefix + name, entry.path, f"cannot stat: {exc.strerror or exc}"))
    return out


def _caption_rank(name: str) -> tuple[bool, str]:
    return (not name.endswith(CAPTION_EXTENSION), name)


def _add_subdir(entry: os.DirEntry[str], reldir: str, prefix: str, repeats: int,
                ancestors: frozenset[tuple[int, int]], failures: list[SourceFailure], subdirs: list[_Pending]) -> None:
    # One stat per folder (not per file) to cut symlink loops. os.stat, not DirEntry.stat(): on Windows the
    # latter reports st_ino = st_dev = 0 for every entry. Filesystems without inode numbers (0) are not checked.
    st = os.stat(entry.path)
    ident = (st.st_dev, st.st_ino)
    if st.st_ino and ident in ancestors:  # only loops are cut: the result never depends on directory order
        log.warning("%s: links back to a folder that contains it (symlink loop); skipped", entry.path)
        return
    if not reldir and not entry.name.lower().endswith(FRAMES_SUFFIX):  # only folders under the root set repeats
        count = _repeats_of(entry.name)
        if count == 0:
            failures.append(SourceFailure(entry.name, entry.path,
                                          "folder repeat count is 0, so its images are skipped; rename it to 1_..."))
            return
        if count is not None and count > MAX_REPEATS:
            failures.append(SourceFailure(entry.name, entry.path,
                                          f"folder repeat count {count} is above the limit of {MAX_REPEATS}, so its "
                                          "images are skipped; rename the folder with a smaller count"))
            return
        repeats = count if count is not None else 1
    subdirs.append((prefix + entry.name, repeats, ancestors | {ident}, None))


def _walk(root: str, threads: int) -> tuple[list[ListedImage], list[SourceFailure], _Masks]:
    """List every folder under ``root``; with ``threads > 1`` folders are listed concurrently (their stat calls
    release the GIL, which pays off on network filesystems and cold caches)."""
    st = os.stat(root)
    real_root = os.path.realpath(root)
    first: _Pending = ("", 1, frozenset({(st.st_dev, st.st_ino)}), None)
    out: list[ListedImage] = []
    failures: list[SourceFailure] = []
    masks: _Masks = ([], [], [])

    def add_masks(found: _Masks) -> None:
        for mine, theirs in zip(masks, found):
            mine += theirs  # type: ignore[operator]

    if threads <= 1:
        pending = [first]
        while pending:
            imgs, fails, subs, found = _list_dir(root, real_root, *pending.pop())
            out += imgs
            failures += fails
            pending += subs
            add_masks(found)
        return out, failures, masks
    with ThreadPoolExecutor(threads, thread_name_prefix="list") as pool:
        running = {pool.submit(_list_dir, root, real_root, *first)}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                imgs, fails, subs, found = fut.result()
                out += imgs
                failures += fails
                add_masks(found)
                running.update(pool.submit(_list_dir, root, real_root, *sub) for sub in subs)
    return out, failures, masks


def list_folder(root: str | os.PathLike[str], *, threads: int | None = 1) -> FolderListing:
    """List the images and captions under ``root`` (stat only, no file opened).

    Args:
        root: the dataset folder.
        threads: folders listed concurrently; ``None`` chooses from the CPUs this process may use. The default,
            1, is fastest on a local disk with a warm page cache (the work is then GIL-bound: measured on 100k
            files, threads cost CPU and gained nothing); raise it for network filesystems or cold caches, where
            each stat waits on I/O. The result is the same whatever the count.

    Raises:
        DatasetFolderError: ``root`` is missing, not a folder, or holds no image.
    """
    started_ns = time.time_ns()
    path = _check_root(root)
    n = resolve_threads(threads, purpose="listing threads", per_cpu=2.0, maximum=8)
    out, failures, (masks, pairs, refused) = _walk(path, n)
    if not out:
        detail = f" ({len(failures)} entries could not be read, first: {failures[0].reason})" if failures else ""
        raise DatasetFolderError(
            path,
            f"no images found{detail}; put .png/.jpg/.jpeg/.webp/.bmp/.tiff files, videos (.mp4/.webm/.mov/.mkv) "
            "or <name>.frames folders of frames (with optional same-name .txt captions) in it or in "
            "<repeats>_<name> subfolders",
        )
    out.sort()  # relpaths are unique, so tuple order is relpath order (and cheaper than a key function)
    failures.sort(key=lambda f: f.relpath)
    masks.sort()
    return FolderListing(path, tuple(out), tuple(failures), started_ns, tuple(masks), dict(sorted(pairs)),
                         frozenset(refused))


def read_captions(path: str) -> tuple[str, ...]:
    """Return the caption variants of one caption file (see the module docstring for the rules).

    Raises:
        SourceError: the file cannot be read or is not UTF-8.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SourceError(path, f"cannot read caption: {exc.strerror or exc}") from exc
    return decode_captions(raw, path)


def decode_captions(raw: bytes, path: str) -> tuple[str, ...]:
    """Return the caption variants held in ``raw``, the bytes of caption file ``path`` (named in errors).

    Raises:
        SourceError: ``raw`` is not UTF-8.
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        utf16 = " (it looks like UTF-16)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise SourceError(
            path,
            f"caption is not valid UTF-8{utf16} (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "re-save it as UTF-8",
        ) from exc
    lines = tuple(line.strip() for line in _LINE_BREAK.split(text))
    variants = tuple(line for line in lines if line)
    return variants or ("",)


def _join(root: str, relpath: str) -> str:
    """``os.path.join(root, *relpath.split("/"))``, without its cost per call where ``/`` is the separator."""
    if os.sep != "/":
        return os.path.join(root, *relpath.split("/"))
    return root + relpath if root.endswith("/") else root + "/" + relpath


def _scan_one(root: str, item: ListedImage, known: Mapping[str, tuple[int, int, int, int]] | None,
              known_captions: Mapping[str, tuple[int, int, tuple[str, ...]]] | None
              ) -> SourceImage | SourceClip | SourceFailure:
    abspath = _join(root, item.relpath)
    video = item.relpath[item.relpath.rfind("."):].lower() in VIDEO_EXTENSIONS
    try:
        hit = known.get(item.relpath) if known and not video else None
        info = probe_video(abspath) if video else None
        if info is not None:
            width, height = info.width, info.height
        elif hit is not None and hit[0] == item.size and hit[1] == item.mtime_ns:
            width, height = hit[2], hit[3]
        else:
            width, height = read_image_size(abspath)
        cap = known_captions.get(item.caption_relpath) if known_captions and item.caption_relpath else None
        if item.caption_relpath is None:
            captions: tuple[str, ...] = ("",)
        elif cap is not None and cap[0] == item.caption_size and cap[1] == item.caption_mtime_ns:
            captions = cap[2]
        else:
            try:
                captions = read_captions(os.path.join(root, *item.caption_relpath.split("/")))
            except SourceError as exc:
                return SourceFailure(item.caption_relpath, exc.path, exc.reason)
    except SourceError as exc:
        return SourceFailure(item.relpath, abspath, exc.reason)
    if info is not None:
        return SourceClip(item.relpath, abspath, "video", width, height, info.frames, info.rate, item.repeats,
                          item.caption_relpath, captions, size=item.size, mtime_ns=item.mtime_ns)
    return SourceImage(item.relpath, abspath, item.size, item.mtime_ns, width, height, item.repeats,
                       item.caption_relpath, captions)


def _is_known(item: ListedImage, sizes: Mapping[str, tuple[int, int, int, int]],
              caps: Mapping[str, tuple[int, int, tuple[str, ...]]]) -> bool:
    """Whether :func:`_scan_one` can do without opening any file of ``item``."""
    hit = sizes.get(item.relpath)
    if hit is None or hit[0] != item.size or hit[1] != item.mtime_ns:
        return False
    if item.caption_relpath is None:
        return True
    cap = caps.get(item.caption_relpath)
    return cap is not None and cap[0] == item.caption_size and cap[1] == item.caption_mtime_ns


def scan_folder(
    root: str | os.PathLike[str] | FolderListing,
    *,
    known_sizes: Mapping[str, tuple[int, int, int, int]] | None = None,
    known_captions: Mapping[str, tuple[int, int, tuple[str, ...]]] | None = None,
    threads: int | None = None,
) -> ScanResult:
    """Scan a dataset folder: list it, read image sizes from headers and caption variants.

    Args:
        root: the folder, or a :class:`FolderListing` already made by :func:`list_folder`.
        known_sizes: ``relpath -> (size, mtime_ns, width, height)`` from a previous run (e.g.
            ``SourcesRecord.image_sizes()``); images whose size and mtime match are not opened.
        known_captions: ``caption relpath -> (size, mtime_ns, variants)`` from a previous run (e.g.
            ``SourcesRecord.caption_lines()``); caption files whose size and mtime match are not opened.
        threads: header/caption reader threads; ``None`` chooses from the CPUs this process may use. (Pass a
            listing made with :func:`list_folder` to choose listing threads.)

    Returns:
        Usable images and the failures (an image whose caption failed is left out and its caption reported).

    Raises:
        DatasetFolderError: the folder is missing, not a folder, holds no image, or no image is usable.
    """
    listing = root if isinstance(root, FolderListing) else list_folder(root)
    n = resolve_threads(threads, purpose="scan threads", per_cpu=2.0, maximum=16)
    items = listing.images
    def scan_chunk(chunk: tuple[ListedImage, ...]) -> list[SourceImage | SourceClip | SourceFailure]:
        return [_scan_one(listing.root, item, known_sizes, known_captions) for item in chunk]

    # items whose size and captions are all known open no file: threads would only contend for the GIL
    sizes, caps = known_sizes or {}, known_captions or {}
    slow = [item for item in items if not _is_known(item, sizes, caps)] if n > 1 and len(items) >= 64 else []
    if len(slow) < 64:
        results = scan_chunk(items)
    else:  # chunks keep the per-task overhead small next to a header read
        chunks = [slow[i:i + 64] for i in range(0, len(slow), 64)]
        with ThreadPoolExecutor(n, thread_name_prefix="scan") as pool:
            read = {r_item.relpath: r for part, chunk in zip(pool.map(scan_chunk, chunks), chunks)
                    for r_item, r in zip(chunk, part)}
        results = [read[item.relpath] if item.relpath in read else _scan_one(listing.root, item, sizes, caps)
                   for item in items]
    found: list[SourceFailure] = [*listing.failures, *(r for r in results if isinstance(r, SourceFailure))]
    images, clips = _group_clips(listing, results, found)
    # a caption shared by a.png and a.jpg fails once, not twice
    unique = {(f.relpath, f.reason): f for f in found}
    failures = [unique[k] for k in sorted(unique)]
    if not images and not clips:
        raise DatasetFolderError(
            listing.root,
            f"none of the {len(items)} images is usable; first problem: {failures[0].relpath}: {failures[0].reason}",
        )
    return ScanResult(listing.root, images, tuple(failures), clips)


def _group_clips(listing: FolderListing, results: list[SourceImage | SourceClip | SourceFailure],
                 failures: list[SourceFailure]) -> tuple[tuple[SourceImage, ...], tuple[SourceClip, ...]]:
    """Split scan results into images and clips: the frames of each ``.frames`` folder become one clip (left
    out, with a failure naming it, when a frame failed or the frames differ in size)."""
    images: list[SourceImage] = []
    clips: list[SourceClip] = []
    folders: dict[str, list[SourceImage]] = {}
    for r in results:
        if isinstance(r, SourceClip):
            clips.append(r)
        elif isinstance(r, SourceImage):
            folder = clip_folder_of(r.relpath)
            if folder is None:
                images.append(r)
            else:
                folders.setdefault(folder, []).append(r)
    broken = {f.relpath: f for f in failures if clip_folder_of(f.relpath) is not None}
    for f in broken.values():
        folder = clip_folder_of(f.relpath)
        assert folder is not None
        if folder not in folders or folders[folder]:
            failures.append(SourceFailure(folder, listing.abspath(folder), (
                f"clip left out: its frame {f.relpath.rpartition('/')[2]} cannot be used ({f.reason})")))
            folders[folder] = []  # dropped
    for folder, frames in sorted(folders.items()):
        if not frames:
            continue
        frames.sort(key=lambda img: frame_order(img.relpath.rpartition("/")[2]))
        first = frames[0]
        odd = next((img for img in frames if (img.width, img.height) != (first.width, first.height)), None)
        if odd is not None:
            failures.append(SourceFailure(folder, listing.abspath(folder), (
                f"clip left out: its frames differ in size ({first.relpath.rpartition('/')[2]} is "
                f"{first.width}x{first.height}, {odd.relpath.rpartition('/')[2]} is {odd.width}x{odd.height}); "
                "give every frame of a clip one size")))
            continue
        clips.append(SourceClip(folder, listing.abspath(folder), "frames", first.width, first.height, len(frames),
                                None, first.repeats, first.caption_relpath, first.captions, tuple(frames)))
    clips.sort(key=lambda c: c.relpath)
    return tuple(images), tuple(clips)
