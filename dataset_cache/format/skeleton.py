"""Nested Python values ⇄ JSON skeletons with tensor references.

A stored entry is a nested value (a ComfyUI latent dict, a conditioning list, ...). Its *skeleton* is the JSON
form of that value in which every tensor is replaced by ``{"$tensor": [column, row]}``, a reference to one row of
a column of the same shard. JSON (not pickle) keeps opening a shared cache free of code execution, and the
``$``-markers keep the round trip exact: tuples stay tuples, ``1.0`` stays a float, ``nan`` survives, and a user
dict whose keys start with ``$`` is wrapped so it can never be mistaken for a marker. The encoding is specified
in docs/FORMAT.md ("Skeletons").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..constants import MAX_SKELETON_DEPTH
from ..errors import UnstorableValueError
from .safetensors_io import DTYPE_TO_ST

__all__ = ["SkeletonError", "NotLean", "encode", "encode_lean", "decode", "decode_text", "split", "fill", "dumps",
           "loads", "format_path"]

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_FLOAT_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class SkeletonError(ValueError):
    """A stored skeleton is malformed; callers turn it into ``CacheCorruptError`` naming file and entry."""


def format_path(base: str, key: Any) -> str:
    """Return ``base`` extended by a list index (``[3]``) or a dict key (``['hooks']``)."""
    return f"{base}[{key!r}]"


def encode(value: Any, name: str, on_tensor: Callable[[torch.Tensor, str], Any]) -> Any:
    """Return the JSON-able skeleton of ``value``.

    Args:
        value: the nested value to store.
        name: the root's name in error messages, e.g. ``"conditioning"``.
        on_tensor: called with each tensor and its path; returns the JSON value of its ``$tensor`` reference.

    Raises:
        UnstorableValueError: ``value`` holds something the format cannot store; ``where`` is its path.
    """
    return _encode(value, name, on_tensor, 0)


def _encode(v: Any, where: str, on_tensor: Callable[[torch.Tensor, str], Any], depth: int) -> Any:
    if depth > MAX_SKELETON_DEPTH:
        raise UnstorableValueError(where, type(v).__name__, f"nested deeper than {MAX_SKELETON_DEPTH} levels")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise UnstorableValueError(where, "int", "outside the signed 64-bit range")
        return v
    if t is float:
        if math.isfinite(v):
            return v
        return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, torch.Tensor):
        return {"$tensor": on_tensor(_check_tensor(v, where), where)}
    if t is list:
        return [_encode(x, format_path(where, i), on_tensor, depth + 1) for i, x in enumerate(v)]
    if t is tuple:
        return {"$tuple": [_encode(x, format_path(where, i), on_tensor, depth + 1) for i, x in enumerate(v)]}
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise UnstorableValueError(format_path(where, k), f"dict key of type {type(k).__name__}",
                                           "only str keys are storable")
            out[k] = _encode(x, format_path(where, k), on_tensor, depth + 1)
        return {"$dict": out} if any(k.startswith("$") for k in out) else out
    hint = ""
    if isinstance(v, (int, float, str, list, tuple, dict)):
        hint = f"subclasses are not stored; convert it to a plain {t.__mro__[1].__name__} first"
    raise UnstorableValueError(where, t.__name__, hint)


class NotLean(Exception):
    """:func:`encode_lean` met something only :func:`encode` handles (an error to name by its path, or an unusual
    value such as a non-finite float inside a ``$``-keyed dict)."""


def encode_lean(value: Any, on_tensor: Callable[[torch.Tensor], Any]) -> Any:
    """:func:`encode` for ordinary values, without building a path string per element (the checked encoder spends
    most of its time on those, for error messages that are almost never needed): the same JSON for every value it
    accepts. Raises :class:`NotLean` for anything it does not accept; call :func:`encode` then, which returns the
    skeleton or raises the exact error. ``on_tensor`` is called with each tensor in document order, as by
    :func:`encode`; on ``NotLean`` the calls made so far are void.
    """
    return _lean(value, on_tensor, 0)


def _lean(v: Any, on_tensor: Callable[[torch.Tensor], Any], depth: int) -> Any:
    if depth > MAX_SKELETON_DEPTH:
        raise NotLean
    t = type(v)
    if t is torch.Tensor:
        if v.dtype not in DTYPE_TO_ST or v.layout is not torch.strided or v.is_meta:
            raise NotLean
        return {"$tensor": on_tensor(v)}
    if t is dict:
        out = {k: _lean(x, on_tensor, depth + 1) for k, x in v.items()}
        marked = False
        for k in out:
            if type(k) is not str:
                raise NotLean
            marked = marked or k[:1] == "$"
        return {"$dict": out} if marked else out
    if t is list:
        return [_lean(x, on_tensor, depth + 1) for x in v]
    if v is None or t is bool or t is str:
        return v
    if t is int:
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise NotLean
        return v
    if t is float:
        return v if math.isfinite(v) else {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if t is tuple:
        return {"$tuple": [_lean(x, on_tensor, depth + 1) for x in v]}
    raise NotLean


def _check_tensor(v: torch.Tensor, where: str) -> torch.Tensor:
    if v.dtype not in DTYPE_TO_ST:
        raise UnstorableValueError(where, f"Tensor of dtype {v.dtype}", "no safetensors dtype for it")
    if v.layout != torch.strided or v.device.type == "meta" or v.is_quantized:
        raise UnstorableValueError(where, f"Tensor ({v.layout}, {v.device})", "only dense tensors with data")
    return v


def decode(obj: Any, on_ref: Callable[[int, int], Any]) -> Any:
    """Return the value of a parsed skeleton; each ``$tensor`` reference is replaced by ``on_ref(column, row)``.

    Raises:
        SkeletonError: unknown marker, malformed reference, or nesting deeper than ``MAX_SKELETON_DEPTH``.
    """
    return _decode(obj, on_ref, 0)


def _decode(o: Any, on_ref: Callable[[int, int], Any], depth: int) -> Any:
    if depth > MAX_SKELETON_DEPTH:
        raise SkeletonError(f"skeleton nested deeper than {MAX_SKELETON_DEPTH} levels")
    t = type(o)
    if o is None or t in (bool, int, float, str):
        return o
    if t is list:
        return [_decode(x, on_ref, depth + 1) for x in o]
    if t is not dict:
        raise SkeletonError(f"unexpected JSON value of type {t.__name__}")
    if not any(k.startswith("$") for k in o):
        return {k: _decode(x, on_ref, depth + 1) for k, x in o.items()}
    if len(o) != 1:
        raise SkeletonError("a $-marker object must have exactly one member")
    (marker, arg), = o.items()
    if marker == "$tensor":
        if (type(arg) is not list or len(arg) != 2 or type(arg[0]) is not int or type(arg[1]) is not int):
            raise SkeletonError(f"malformed tensor reference {arg!r:.60}")
        return on_ref(arg[0], arg[1])
    if marker == "$tuple":
        if type(arg) is not list:
            raise SkeletonError("$tuple must hold a list")
        return tuple(_decode(x, on_ref, depth + 1) for x in arg)
    if marker == "$float":
        if type(arg) is not str or arg not in _FLOAT_NAMES:
            raise SkeletonError(f"unknown $float value {arg!r:.30}")
        return _FLOAT_NAMES[arg]
    if marker == "$dict":
        if type(arg) is not dict:
            raise SkeletonError("$dict must hold an object")
        return {k: _decode(x, on_ref, depth + 1) for k, x in arg.items()}
    raise SkeletonError(f"unknown marker {marker!r:.30}")


def dumps(obj: Any) -> str:
    """Serialize a skeleton (or any header JSON) compactly, ASCII-only, refusing non-finite floats."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def loads(text: str | bytes) -> Any:
    """Parse JSON written by :func:`dumps`; malformed or too deeply nested text raises ``SkeletonError``.

    ``NaN``/``Infinity`` literals are refused (the format spells them ``{"$float": ...}``).
    """
    try:
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        return _DECODER.decode(text)
    except RecursionError:
        raise SkeletonError("JSON nested too deeply") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise SkeletonError(f"invalid JSON ({exc})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


# --------------------------------------------------------------------------------------------- fast decoding
# Entries of one kind share a skeleton *shape* and differ only in their tensor references (every latent is
# ``{"samples":{"$tensor":[c,r]}}``). Parsing JSON per entry dominated batch reads, so a skeleton is split into
# a template (the text with its references replaced by numbered slots), parsed once and shared, plus its list of
# references, found with one regex pass. Inside JSON strings a quote is always escaped, so the pattern below can
# only match real ``$tensor`` markers; texts holding a ``$dict`` (whose user keys may spell "$tensor") take the
# exact slow path instead.

import re as _re  # noqa: E402

_REF_RE = _re.compile(r'\{\s*"\$tensor"\s*:\s*\[\s*(\d{1,18})\s*,\s*(\d{1,18})\s*\]\s*\}')
_TEMPLATE_CACHE_LIMIT = 4096


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_SLOT_COLUMN = 1 << 62  # no real column index can be this large (a shard has a handful of columns)
_SLOT_TEXT = f'{{"$tensor":[{_SLOT_COLUMN},0]}}'
_templates: dict[tuple[str, ...], Any] = {}  # keyed by the text around the references


def _compile(obj: Any, canonical: bool) -> tuple[Any, list[tuple[int, int]]]:
    """Decode a parsed skeleton into a template whose tensor positions are numbered slots (document order)."""
    refs: list[tuple[int, int]] = []

    def slot(c: int, r: int) -> _Slot:
        if canonical and c != _SLOT_COLUMN:
            raise SkeletonError("tensor reference not in canonical form")
        refs.append((c, r))
        return _Slot(len(refs) - 1)

    return _decode(obj, slot, 0), refs


def split(text: str) -> tuple[Any, list[tuple[int, int]]]:
    """Split skeleton JSON text into a shared parsed template and its tensor references ``(column, row)``.

    Templates are cached by shape, so entries of one kind cost one regex pass each instead of a JSON parse.
    Fill a template with :func:`fill`.

    Raises:
        SkeletonError: malformed skeleton.
    """
    if "$dict" not in text:
        parts = _REF_RE.split(text)  # [literal, column, row, literal, column, row, ..., literal]: one regex pass
        literals = tuple(parts[0::3])
        template = _templates.get(literals)
        if template is None:
            try:
                template, _ = _compile(loads(_SLOT_TEXT.join(literals)), True)
            except SkeletonError as exc:
                if "canonical form" not in str(exc):
                    raise
                template = None  # an unusual spelling of a reference: decode exactly below
            else:
                if len(_templates) < _TEMPLATE_CACHE_LIMIT:
                    _templates[literals] = template
        if template is not None:
            return template, list(zip(map(int, parts[1::3]), map(int, parts[2::3])))
    return _compile(loads(text), False)


def fill(template: Any, values: Sequence[Any]) -> Any:
    """Build a fresh value from a template, putting ``values[i]`` at slot ``i``."""
    k = type(template)
    if k is _Slot:
        return values[template.index]
    if k is list:
        return [fill(x, values) for x in template]
    if k is dict:
        return {key: fill(x, values) for key, x in template.items()}
    if k is tuple:
        return tuple(fill(x, values) for x in template)
    return template


def decode_text(text: str, on_ref: Callable[[int, int], Any]) -> Any:
    """Like ``decode(loads(text), on_ref)`` (``on_ref`` called in document order), via the template cache."""
    template, refs = split(text)
    return fill(template, [on_ref(c, r) for c, r in refs])
