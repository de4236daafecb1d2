"""Reading and bounds-checking a safetensors header; writing a valid safetensors file.

We write shards ourselves instead of calling ``safetensors.torch.save_file`` so that we choose the order of
tensors in the data region (columns sorted for alignment, rows in insertion order) and can stream rows to disk
without first building one dict of tensors. The result is still a valid safetensors file: ``safe_open`` and
``load_file`` read it. The reader never trusts a claim of the header before checking it against the file size,
so a hostile file ends in ``CacheCorruptError`` and never in a huge allocation.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..constants import MAX_HEADER_BYTES
from ..errors import CacheCorruptError, CacheError, CacheLinkError
from .layout import NOFOLLOW

__all__ = [
    "DTYPE_TO_ST",
    "ST_TO_DTYPE",
    "ST_ITEMSIZE",
    "TensorSpan",
    "SafetensorsHeader",
    "read_header",
    "parse_header",
    "build_header",
    "write_safetensors",
    "open_regular",
    "read_regular",
]

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name in ("uint16", "uint32", "uint64"):  # torch >= 2.3
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = "U" + _name[4:]
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
ST_ITEMSIZE: dict[str, int] = {v: k.itemsize for k, v in DTYPE_TO_ST.items()}

MAX_NDIM = 32
"""Rank limit of a stored tensor; safetensors has none, but a bound keeps hostile shapes cheap to check."""
MAX_DIM = 1 << 53
"""Per-dimension limit: larger sizes cannot describe bytes in any real file and overflow tensor views."""


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors header; ``begin``/``end`` are offsets into the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header.

    Attributes:
        data_start: absolute file offset of the data region (8 + header length).
        tensors: name -> span, every span inside the data region, contiguous, non-overlapping.
        metadata: the ``__metadata__`` string map (empty when absent).
        raw: the header bytes exactly as stored (hashed by the manifest to detect header damage).
    """

    data_start: int
    tensors: dict[str, TensorSpan]
    metadata: dict[str, str]
    raw: bytes


def open_regular(path: str | os.PathLike) -> int:
    """Open a regular file read-only and return its fd; a FIFO or device in a hostile cache cannot block us.

    A symbolic link is never followed (see ``layout``).

    Raises:
        FileNotFoundError: the file is missing.
        CacheLinkError: the file is a symbolic link.
        OSError: it cannot be opened, or is not a regular file (``errno`` is ``None`` then).
    """
    try:
        fd = os.open(str(path), os.O_RDONLY | NOFOLLOW | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        if os.path.islink(path):
            raise CacheLinkError(str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(None, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike) -> bytes:
    """Read a whole regular file (see :func:`open_regular`)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        return _pread_exact(fd, size, 0, path, short_ok=True)
    except OSError as exc:
        if exc.filename is not None or isinstance(exc, CacheError):
            raise
        raise OSError(exc.errno, f"{exc.strerror or exc} while reading", str(path)) from exc  # name the file
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike, fd: int, file_size: int) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open as ``fd`` (``file_size`` bytes long)."""
    if file_size < 8:
        raise CacheCorruptError(str(path), f"file is {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
    limit = min(MAX_HEADER_BYTES, file_size - 8)
    if n > limit:
        raise CacheCorruptError(str(path), f"header length {n} exceeds the limit {limit} (file size {file_size})")
    raw = _pread_exact(fd, n, 8, path)
    return parse_header(path, raw, file_size - 8 - n)


def _pread_exact(fd: int, n: int, offset: int, path: Any, *, short_ok: bool = False) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < n:
        if hasattr(os, "pread"):
            b = os.pread(fd, n - got, offset + got)
        else:  # Windows: the fd is private to this call, so seek + read is safe
            os.lseek(fd, offset + got, os.SEEK_SET)
            b = os.read(fd, n - got)
        if not b:
            if short_ok:
                break
            raise CacheCorruptError(str(path), f"file ends at {offset + got}, expected {n - got} more bytes")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def load_json_object(where: str, raw: bytes, what: str = "") -> dict[str, Any]:
    """Parse UTF-8 JSON that must be an object; anything else (bad bytes, deep nesting, another JSON type) is a
    ``CacheCorruptError`` naming ``where`` — never a bare ``ValueError`` or ``RecursionError``."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CacheCorruptError(where, f"{what}JSON nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise CacheCorruptError(where, f"{what}not valid JSON ({exc})") from None
    if type(obj) is not dict:
        raise CacheCorruptError(where, f"{what}JSON is not an object")
    return obj


def parse_header(path: str | os.PathLike, raw: bytes, data_len: int) -> SafetensorsHeader:
    """Check the header bytes ``raw`` against a data region of ``data_len`` bytes; return the parsed header."""
    p = str(path)
    if not raw.startswith(b"{"):
        raise CacheCorruptError(p, "header does not begin with '{' (not a safetensors file)")
    obj = load_json_object(p, raw, "header ")
    meta = obj.pop("__metadata__", {})
    if type(meta) is not dict or any(type(k) is not str or type(v) is not str for k, v in meta.items()):
        raise CacheCorruptError(p, "__metadata__ must be an object of strings")
    spans = [_check_span(p, name, info, data_len) for name, info in obj.items()]
    spans.sort(key=lambda s: (s.begin, s.end))
    pos = 0
    for s in spans:
        if s.begin != pos:
            what = "overlaps the previous tensor" if s.begin < pos else f"leaves a hole at {pos}"
            raise CacheCorruptError(p, f"tensor {s.name!r:.80} {what}")
        pos = s.end
    if pos != data_len:
        raise CacheCorruptError(p, f"tensors cover {pos} bytes but the data region has {data_len}")
    return SafetensorsHeader(8 + len(raw), {s.name: s for s in spans}, meta, raw)


def _check_span(p: str, name: str, info: Any, data_len: int) -> TensorSpan:
    where = f"tensor {name!r:.80}"
    if type(info) is not dict:
        raise CacheCorruptError(p, f"{where}: entry is not an object")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in ST_ITEMSIZE:
        raise CacheCorruptError(p, f"{where}: unknown dtype {dtype!r:.40}")
    if (type(shape) is not list or len(shape) > MAX_NDIM
            or any(type(d) is not int or not 0 <= d <= MAX_DIM for d in shape)):
        raise CacheCorruptError(p, f"{where}: shape must be a list of at most {MAX_NDIM} non-negative ints")
    if type(offs) is not list or len(offs) != 2 or any(type(o) is not int for o in offs):
        raise CacheCorruptError(p, f"{where}: data_offsets must be two ints")
    begin, end = offs
    if not 0 <= begin <= end <= data_len:
        raise CacheCorruptError(p, f"{where}: data_offsets {offs} outside the data region of {data_len} bytes")
    if math.prod(shape) * ST_ITEMSIZE[dtype] != end - begin:
        raise CacheCorruptError(p, f"{where}: shape {shape} of {dtype} does not match {end - begin} bytes")
    return TensorSpan(name, dtype, tuple(shape), begin, end)


def build_header(tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str]) -> bytes:
    """Return the padded header (without the 8-byte length) for tensors laid out in the given order.

    Args:
        tensors: ``(name, safetensors dtype, shape)`` in data order; offsets follow with no holes.
        metadata: the ``__metadata__`` string map.
    """
    obj: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * ST_ITEMSIZE[dtype]
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return raw + b" " * (-(8 + len(raw)) % 8)


def write_safetensors(f: BinaryIO, header: bytes, chunks: Iterable[Any]) -> int:
    """Write the length, the header from :func:`build_header` and the data ``chunks`` (buffers) to ``f``.

    Returns:
        the number of bytes written. The caller checks it against the header's total.
    """
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    total = 8 + len(header)
    for c in chunks:
        f.write(c)
        total += memoryview(c).nbytes
    return total
