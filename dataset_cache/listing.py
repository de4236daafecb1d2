"""Listing a dataset folder: which files are samples, captions and masks, from names and stats alone.

"Did anything change?" must never cost more than a directory listing, so :func:`list_folder` walks the folder with
one ``os.scandir`` per directory, takes every size and mtime from ``DirEntry.stat()`` and opens no file; it pairs
images with same-stem ``.txt`` captions and reads kohya repeat counts from folder names. :mod:`.sources` validates
this listing against the previous run's record; :mod:`.scan` adds what needs file contents (image sizes, caption
variants).

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
* Clips (:mod:`.frames`): a video file (``.mp4 .webm .mov .mkv``) is one sample, listed like an image; a folder
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
* Captions: ``<stem>.txt`` (any case of ``.txt``) next to the image, or the extension a run names
  (``caption_extension``, kohya's: ``.caption``; then ``.txt`` files are no captions); how its lines become
  caption variants: :mod:`.scan`.

Everything returned is sorted by relative path (POSIX separators) and does not depend on directory order.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

from .dataset import MAX_REPEATS
from .errors import DatasetFolderError, SourceFailure
from .frames import FRAMES_SUFFIX, VIDEO_EXTENSIONS, clip_folder_of
from .threads import resolve_threads

__all__ = [
    "IMAGE_EXTENSIONS",
    "CAPTION_EXTENSION",
    "check_caption_extension",
    "MASK_SUFFIX",
    "ListedImage",
    "FolderListing",
    "list_folder",
    "repeats_folder_name",
]

log = logging.getLogger("dataset_cache.scan")  # the folder scan's logger: listing and scanning share one name

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tiff", ".tif"})
"""Image file extensions (compared lowercased)."""

CAPTION_EXTENSION = ".txt"
"""The caption files' extension unless a run names another (``caption_extension``; compared lowercased)."""
_EXTENSION_TEXT = re.compile(r"^\.[a-z0-9_-]{1,16}$")


def check_caption_extension(extension: object) -> str:
    """The caption files' extension, lowercased (``".caption"``; ``"caption"`` gains its dot): kohya's
    ``caption_extension``, for datasets whose captions are not ``.txt`` files.

    Raises:
        ValueError: naming ``caption_extension``: not a short extension of letters, digits, ``_`` and ``-``, or
            one the folder's images, videos or masks use.
    """
    text = extension.strip().lower() if isinstance(extension, str) else ""
    text = text if text.startswith(".") else "." + text
    if not _EXTENSION_TEXT.match(text):
        raise ValueError(f"caption_extension must be a file extension such as '.txt' or '.caption' (letters, digits, "
                         f"'_' or '-', at most 16), got {extension!r:.40}")
    if text in IMAGE_EXTENSIONS or text in VIDEO_EXTENSIONS or text == FRAMES_SUFFIX:
        raise ValueError(f"caption_extension {text!r} is the extension of images, videos or clip folders, which "
                         "are the samples; name the extension of the caption files, such as '.txt'")
    return text

MASK_SUFFIX = "-masklabel"
"""End of a mask file's stem (compared lowercased): ``a-masklabel.png`` is the loss mask of ``a.png``."""

_REPEAT_DIR = re.compile(r"^(\d+)_(.+)$")


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


def repeats_folder_name(dirname: str) -> str | None:
    """The name of a kohya ``<repeats>_<name>`` folder after its repeats (``10_ohwx woman`` → ``ohwx woman``: kohya's
    class tokens), stripped; ``None`` for a folder not named so."""
    match = _REPEAT_DIR.match(dirname)
    return (match.group(2).strip() or None) if match else None


_Caption = tuple[str, int, int]  # (relpath, size, mtime_ns) of a caption file
_Pending = tuple[str, int, frozenset[tuple[int, int]], _Caption | None]
"""(reldir, repeats, (st_dev, st_ino) of it and its ancestors, the caption of a ``.frames`` folder)"""
_Masks = tuple[list[_Caption], list[tuple[str, str]], list[str]]
"""A folder's mask files, (image, mask) pairs, and images whose mask is a link out of the dataset folder."""


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


def _list_dir(root: str, real_root: str, caption_ext: str, reldir: str, repeats: int,
              ancestors: frozenset[tuple[int, int]], clip_caption: _Caption | None = None
              ) -> tuple[list[ListedImage], list[SourceFailure], list[_Pending], _Masks]:
    """List one directory: its images (with the stats of their ``caption_ext`` captions), failures, subfolders
    still to list, and its mask files paired with their images. A ``.frames`` folder lists its images only, each
    with the clip's caption ``clip_caption`` (its mask files are unused)."""
    frames_dir = clip_folder_of(reldir + "/x") is not None if reldir else False
    absdir = os.path.join(root, *reldir.split("/")) if reldir else root
    prefix = reldir + "/" if reldir else ""
    found = _Entries()
    masks: _Masks = (found.mask_files, [], [])
    try:
        _scan_entries(found, root, real_root, reldir, absdir, prefix, repeats, ancestors, frames_dir, caption_ext)
    except OSError as exc:
        found.failures.append(SourceFailure(reldir or ".", absdir, f"cannot list folder: {exc.strerror or exc}"))
        return [], found.failures, found.subdirs, masks
    if frames_dir:
        return _frame_images(found, prefix, repeats, clip_caption), found.failures, found.subdirs, masks
    _clip_captions(found, prefix, absdir, caption_ext)
    _pair_masks(found, prefix, masks)
    return _captioned_images(found, prefix, repeats, caption_ext), found.failures, found.subdirs, masks


def _scan_entries(found: _Entries, root: str, real_root: str, reldir: str, absdir: str, prefix: str, repeats: int,
                  ancestors: frozenset[tuple[int, int]], frames_dir: bool, caption_ext: str) -> None:
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
                        if ext == caption_ext:
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
            elif ext == caption_ext and not frames_dir:
                stem = name[:dot]
                # a.txt wins over a.TXT; otherwise the first name in sorted order, so the choice is stable
                if stem not in captions or _caption_rank(name, ext) < _caption_rank(captions[stem].name, ext):
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


def _clip_captions(found: _Entries, prefix: str, absdir: str, caption_ext: str) -> None:
    """Give each clip folder (``<stem>.frames``) among the subfolders the caption beside it; drop a clip folder whose
    caption is a link out of the dataset folder."""
    subdirs, failures = found.subdirs, found.failures
    for i, (sub, sub_repeats, sub_ancestors, _) in enumerate(subdirs):
        folder = sub.rpartition("/")[2]
        if folder.lower().endswith(FRAMES_SUFFIX):
            stem = folder[:-len(FRAMES_SUFFIX)]
            if stem in found.refused_captions:
                failures.append(SourceFailure(sub, os.path.join(absdir, folder), (
                    f"left out: its caption {prefix}{stem}{caption_ext} is a symbolic link outside the "
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


def _captioned_images(found: _Entries, prefix: str, repeats: int, caption_ext: str) -> list[ListedImage]:
    """The folder's images and videos with their captions' stats; one whose caption links out of the folder is
    left out, and said so."""
    out: list[ListedImage] = []
    captions, refused, failures = found.captions, found.refused_captions, found.failures
    for name, stem, entry in found.images:
        if stem in refused:
            failures.append(SourceFailure(prefix + name, entry.path, (
                f"left out: its caption {prefix}{stem}{caption_ext} is a symbolic link outside the dataset "
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


def _caption_rank(name: str, caption_ext: str) -> tuple[bool, str]:
    return (not name.endswith(caption_ext), name)


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


def _walk(root: str, threads: int, caption_ext: str) -> tuple[list[ListedImage], list[SourceFailure], _Masks]:
    """List every folder under ``root`` (captions: the ``caption_ext`` files); with ``threads > 1`` folders are
    listed concurrently (their stat calls release the GIL, which pays off on network filesystems and cold
    caches)."""
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
            imgs, fails, subs, found = _list_dir(root, real_root, caption_ext, *pending.pop())
            out += imgs
            failures += fails
            pending += subs
            add_masks(found)
        return out, failures, masks
    with ThreadPoolExecutor(threads, thread_name_prefix="list") as pool:
        running = {pool.submit(_list_dir, root, real_root, caption_ext, *first)}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                imgs, fails, subs, found = fut.result()
                out += imgs
                failures += fails
                add_masks(found)
                running.update(pool.submit(_list_dir, root, real_root, caption_ext, *sub) for sub in subs)
    return out, failures, masks


def list_folder(root: str | os.PathLike[str], *, threads: int | None = 1,
                caption_extension: str = CAPTION_EXTENSION) -> FolderListing:
    """List the images and captions under ``root`` (stat only, no file opened).

    Args:
        root: the dataset folder.
        caption_extension: the caption files' extension (:func:`check_caption_extension`; ``.txt`` by default).
        threads: folders listed concurrently; ``None`` chooses from the CPUs this process may use. The default,
            1, is fastest on a local disk with a warm page cache (the work is then GIL-bound: measured on 100k
            files, threads cost CPU and gained nothing); raise it for network filesystems or cold caches, where
            each stat waits on I/O. The result is the same whatever the count.

    Raises:
        DatasetFolderError: ``root`` is missing, not a folder, or holds no image.
        ValueError: a bad ``caption_extension``.
    """
    started_ns = time.time_ns()
    caption_ext = check_caption_extension(caption_extension)
    path = _check_root(root)
    n = resolve_threads(threads, purpose="listing threads", per_cpu=2.0, maximum=8)
    out, failures, (masks, pairs, refused) = _walk(path, n, caption_ext)
    if not out:
        detail = f" ({len(failures)} entries could not be read, first: {failures[0].reason})" if failures else ""
        raise DatasetFolderError(
            path,
            f"no images found{detail}; put .png/.jpg/.jpeg/.webp/.bmp/.tiff files, videos (.mp4/.webm/.mov/.mkv) "
            f"or <name>.frames folders of frames (with optional same-name {caption_ext} captions) in it or in "
            "<repeats>_<name> subfolders",
        )
    out.sort()  # relpaths are unique, so tuple order is relpath order (and cheaper than a key function)
    failures.sort(key=lambda f: f.relpath)
    masks.sort()
    return FolderListing(path, tuple(out), tuple(failures), started_ns, tuple(masks), dict(sorted(pairs)),
                         frozenset(refused))
