"""Scanning a listed dataset folder: image sizes from headers and caption variants, the samples an encode plans.

The second of two steps, so that "did anything change?" never pays for more than the first, :mod:`.listing`
(names and stats only; the folder layout rules are there): :func:`scan_folder` adds what needs file contents,
image sizes from headers (no pixel decoding) and caption variants, and makes each ``<name>.frames`` folder's
frames one clip; sizes and variants the caller already knows for unchanged files are reused.

Captions: a caption file (``<stem>.txt`` next to the image) is decoded as UTF-8 (a BOM is allowed). Each non-empty
line, stripped, is one caption variant (duplicates kept: they weight that line). A missing or empty caption file
means one empty-prompt variant. An undecodable caption is a failure and its image is left out.

Everything returned is sorted by relative path (POSIX separators) and does not depend on directory order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

from .errors import DatasetFolderError, SourceError, SourceFailure
from .frames import VIDEO_EXTENSIONS, clip_folder_of, frame_order
from .imaging import read_image_size
from .listing import FolderListing, ListedImage, list_folder
from .threads import resolve_threads
from .video import probe_video

__all__ = [
    "SourceImage",
    "SourceClip",
    "ScanResult",
    "scan_folder",
    "read_captions",
    "decode_captions",
]

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


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
    """One usable clip (see :mod:`.frames`): a video file or a ``.frames`` folder, and its caption variants.

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
