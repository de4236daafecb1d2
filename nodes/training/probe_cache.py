"""Probe results remembered by what they depend on, so a second Train LoRA run on the same model and shapes starts
its first step without the fake forward pass again (it costs seconds on a large model: one dispatch through the
fake-tensor machinery per operator of the forward).

What the probe measures depends on the model's structure, never on its weight values: the module tree (classes,
names, the plain attributes that steer a forward), every parameter's and buffer's shape, dtype and device type, and
which of them require gradients; on the batch shape, the conditioning (shapes and dtypes, and the values of integer
tensors such as attention masks, whose length becomes part of the model's arguments); on the training
dtype, the blocks, checkpointing and the trainable bytes. The key is a digest of all of that. Anything it cannot
describe as plain data (a callable in the model options, an object in a conditioning) makes the run uncacheable:
it is probed, as before. A ComfyUI server keeps the same process between runs, so an in-process cache of a few
entries is what re-runs hit; nothing is written to disk.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import xxhash

__all__ = ["ProbeCache", "Uncacheable", "structure_digest", "value_digest"]

T = TypeVar("T")

SMALL_FLOAT = 64
"""Integer and boolean tensors enter the key with their values (attention masks, token ids: a mask's length becomes
an argument of the model), floating-point ones only up to this many elements (a guidance or timestep value);
larger ones by shape and dtype (latents, embeddings, pooled outputs: their values change nothing the probe
measures, and keying on them would miss a re-run on another dataset)."""
_PLAIN = (bool, int, float, str, type(None))


class Uncacheable(Exception):
    """A value the key cannot describe as plain data: the run is probed instead of looked up."""


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return True
    if isinstance(value, (tuple, list)):
        return len(value) <= 64 and all(_plain(v) for v in value)
    return False


def structure_digest(module: torch.nn.Module) -> str:
    """A digest of ``module``'s structure: every submodule's name, class and plain attributes (flags, sizes, head
    counts), and every parameter's and buffer's name, shape, dtype, device type and ``requires_grad``. Weight
    values are left out: they change nothing the probe measures."""
    h = xxhash.xxh3_128()
    for name, m in module.named_modules():
        cls = type(m)
        h.update(f"\0M{name}\0{cls.__module__}.{cls.__qualname__}".encode())
        for attr, value in sorted(vars(m).items()):
            if not attr.startswith("_") and _plain(value):
                h.update(f"\0a{attr}={value!r}".encode())
        for kind, tensors in (("p", m._parameters), ("b", m._buffers)):
            for key, t in tensors.items():
                if t is None:
                    h.update(f"\0{kind}{key}=None".encode())
                else:
                    h.update(f"\0{kind}{key}:{tuple(t.shape)}:{t.dtype}:{t.device.type}:{t.requires_grad}".encode())
    return h.hexdigest()


def _update(h: Any, value: Any, depth: int = 0) -> None:
    if depth > 16:
        raise Uncacheable("nested too deep")
    if isinstance(value, torch.Tensor):
        h.update(f"T{tuple(value.shape)}:{value.dtype}:{value.device.type};".encode())
        if not value.is_floating_point() or value.numel() <= SMALL_FLOAT:
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(f"D{len(value)};".encode())
        for key in sorted(value, key=repr):
            if not isinstance(key, _PLAIN):
                raise Uncacheable(f"a key of type {type(key).__name__}")
            h.update(f"k{key!r};".encode())
            _update(h, value[key], depth + 1)
    elif isinstance(value, (list, tuple)):
        h.update(f"L{type(value).__name__}{len(value)};".encode())
        for v in value:
            _update(h, v, depth + 1)
    elif _plain(value):
        h.update(f"v{value!r};".encode())
    else:
        raise Uncacheable(f"a value of type {type(value).__name__}")


def value_digest(*values: Any) -> str:
    """A digest of plain values, tensors (see :data:`SMALL_FLOAT`), and dicts/lists of them.

    Raises:
        Uncacheable: a value is none of these (a callable, a module, an object of its own kind).
    """
    h = xxhash.xxh3_128()
    for value in values:
        _update(h, value)
    return h.hexdigest()


class ProbeCache:
    """The last few probe results by key; each lookup hands out a copy (callers may change what they get)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return copy.deepcopy(found)

    def put(self, key: str, value: T) -> T:
        """Remember ``value`` (a copy: it must hold no tensor, or the cache would keep it alive)."""
        with self._lock:
            self._entries[key] = copy.deepcopy(value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterable[str]:
        return list(self._entries)
