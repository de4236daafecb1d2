"""Lazy tensor references: values that know their shape and dtype but refuse every use until materialized.

``CacheReader.get()`` returns an entry's structure with :class:`LazyTensor` leaves so code can inspect shapes
(bucketing by latent size) without any tensor I/O. Using a lazy leaf as data — arithmetic, indexing, ``bool``,
``len``, iteration, pickling, copying, any ``torch`` function — raises :class:`MaterializeRequired` at the point of
misuse instead of silently reading one tensor at a time or failing far away. :func:`materialize` replaces every
lazy leaf of a structure, grouping them per reader so each reader does one coalesced batch read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .constants import MAX_SKELETON_DEPTH
from .errors import MaterializeRequired

__all__ = ["LazyTensor", "materialize", "is_lazy"]


class _LazySource(Protocol):
    def _read_lazy(self, lazies: Sequence[LazyTensor]) -> list[torch.Tensor]: ...


class _LazyAttributeError(MaterializeRequired, AttributeError):
    """Raised for tensor attributes (``.to``, ``.float``, ...) so ``hasattr`` stays well-behaved."""


def _refuse(what: str) -> MaterializeRequired:
    return MaterializeRequired(
        f"{what} on a LazyTensor: it holds no data yet; call materialize() first "
        "(dataset_cache.materialize(value) or reader.read(keys) for many entries at once)"
    )


class LazyTensor:
    """A reference to one stored tensor row. Only metadata (shape, dtype, nbytes) is available without I/O."""

    __slots__ = ("_source", "_loc", "shape", "dtype", "entry")

    def __init__(self, source: _LazySource, loc: Any, shape: torch.Size, dtype: torch.dtype, entry: str) -> None:
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_loc", loc)
        object.__setattr__(self, "shape", torch.Size(shape))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "entry", entry)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel() * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def dim(self) -> int:
        """Number of dimensions (as ``Tensor.dim()``)."""
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """The shape, or one dimension of it (as ``Tensor.size()``)."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """Number of elements."""
        return self.shape.numel()

    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    def materialize(self) -> torch.Tensor:
        """Read the tensor (checksum-verified when the reader verifies) and return it."""
        return self._source._read_lazy([self])[0]

    def __repr__(self) -> str:
        return f"LazyTensor(shape={list(self.shape)}, dtype={self.dtype}, entry={self.entry!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse(f"setting .{name}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise _LazyAttributeError(f"LazyTensor has no .{name}; call materialize() first")

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _refuse(f"torch function {getattr(func, '__name__', func)}")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _refuse("pickling")

    def __copy__(self) -> Any:
        raise _refuse("copy.copy")

    def __deepcopy__(self, memo: Any) -> Any:
        raise _refuse("copy.deepcopy")


def _make_refusal(name: str) -> Any:
    def refuse(self: LazyTensor, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"{name}()")

    refuse.__name__ = name
    return refuse


_BINARY = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow", "lshift", "rshift",
           "and", "xor", "or")
_REFUSED = (
    [f"__{op}__" for op in _BINARY] + [f"__r{op}__" for op in _BINARY] + [f"__i{op}__" for op in _BINARY]
    + ["__neg__", "__pos__", "__abs__", "__invert__", "__complex__", "__int__", "__float__", "__index__",
       "__round__", "__trunc__", "__floor__", "__ceil__", "__lt__", "__le__", "__eq__", "__ne__", "__gt__",
       "__ge__", "__bool__", "__len__", "__iter__", "__reversed__", "__contains__", "__getitem__", "__setitem__",
       "__delitem__", "__array__", "__dlpack__", "__dlpack_device__", "__buffer__", "__getstate__", "__reduce__",
       "__call__", "__enter__", "__exit__"]
)
for _n in _REFUSED:
    setattr(LazyTensor, _n, _make_refusal(_n))
setattr(LazyTensor, "__hash__", object.__hash__)  # noqa: B010 - __eq__ above would otherwise reset it


def is_lazy(value: Any) -> bool:
    """Whether ``value`` is, or (in nested lists, tuples and dicts) contains, a :class:`LazyTensor`."""
    return _contains_lazy(value, 0)


def _contains_lazy(v: Any, depth: int) -> bool:
    if type(v) is LazyTensor:
        return True
    if depth > MAX_SKELETON_DEPTH:
        return False
    if type(v) in (list, tuple):
        return any(_contains_lazy(x, depth + 1) for x in v)
    if type(v) is dict:
        return any(_contains_lazy(x, depth + 1) for x in v.values())
    return False


def materialize(value: Any) -> Any:
    """Return ``value`` with every LazyTensor leaf (in lists, tuples, dicts) replaced by its tensor.

    Leaves from the same reader are read in one batch (sorted, coalesced ranges). Other values are returned as
    they are; the input structure is not modified.
    """
    found: list[LazyTensor] = []
    _collect(value, found, 0)
    if not found:
        return value
    by_source: dict[int, list[LazyTensor]] = {}
    for lz in found:
        by_source.setdefault(id(lz._source), []).append(lz)
    done: dict[int, torch.Tensor] = {}
    for group in by_source.values():
        for lz, t in zip(group, group[0]._source._read_lazy(group)):
            done[id(lz)] = t
    return _replace(value, done, 0)


def _collect(v: Any, out: list[LazyTensor], depth: int) -> None:
    if type(v) is LazyTensor:
        out.append(v)
    elif depth <= MAX_SKELETON_DEPTH:
        if type(v) in (list, tuple):
            for x in v:
                _collect(x, out, depth + 1)
        elif type(v) is dict:
            for x in v.values():
                _collect(x, out, depth + 1)


def _replace(v: Any, done: dict[int, torch.Tensor], depth: int) -> Any:
    if type(v) is LazyTensor:
        return done[id(v)]
    if depth > MAX_SKELETON_DEPTH:
        return v
    if type(v) is list:
        return [_replace(x, done, depth + 1) for x in v]
    if type(v) is tuple:
        return tuple(_replace(x, done, depth + 1) for x in v)
    if type(v) is dict:
        return {k: _replace(x, done, depth + 1) for k, x in v.items()}
    return v
