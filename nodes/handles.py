"""The small handle objects that travel along the pack's custom sockets (``STREAM_DATASET``).

A handle names data; it never holds tensors, open files or threads, so ComfyUI can cache it, compare it and
pass it between nodes for free, and a node that consumes it opens what it needs for the length of its own
``execute`` and closes it again. A socket carries either one dataset (:class:`StreamDatasetHandle`) or several
datasets with repeats, each with its own cache (:class:`CombinedDatasetHandle`, from Combine Datasets); nodes that
train take both (:func:`open_caches` + ``load_mix``), nodes that work on one dataset take the first and refuse the
second by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from comfy_api.latest import io

from ..dataset_cache.dataset import MAX_REPEATS, Sample
from ..dataset_cache.errors import CacheNotFoundError
from ..dataset_cache.format.manifest import MANIFEST
from ..dataset_cache.format.reader import CacheReader, open_cache
from ..dataset_cache.multi_reader import MultiCacheReader
from ..dataset_cache.remote import is_remote_url
from ..dataset_cache.dataset_mix import DatasetMix, DatasetPart, mix_datasets

__all__ = ["CombinedDatasetHandle", "DatasetRef", "StreamDataset", "StreamDatasetHandle", "cache_roots", "combine",
           "open_caches", "require_caches", "training_reader"]

StreamDataset = io.Custom("STREAM_DATASET")
"""The socket type that carries a :class:`StreamDatasetHandle` between the pack's nodes."""


class DatasetRef(NamedTuple):
    """One dataset of a handle: where it is, its name and its repeats.

    Attributes:
        cache_root: the cache directory (absolute path).
        name: the dataset's name inside that cache.
        repeats: how many times each of its samples appears per epoch (times its own repeats).
    """

    cache_root: str
    name: str
    repeats: int = 1


@dataclass(frozen=True)
class StreamDatasetHandle:
    """One dataset of one cache: the value of a ``STREAM_DATASET`` socket.

    Attributes:
        cache_root: the cache directory (absolute path), or the URL of a cache in object storage.
        name: the dataset's name inside the cache.
    """

    cache_root: str
    name: str

    @property
    def parts(self) -> tuple[DatasetRef, ...]:
        """Each dataset the handle names: this one, once."""
        return (DatasetRef(self.cache_root, self.name, 1),)

    @property
    def cache_roots(self) -> tuple[str, ...]:
        """The caches the handle's datasets are in: this one's."""
        return (self.cache_root,)

    def where(self) -> str:
        """Where the dataset is, for messages: ``cache at <root>``."""
        return f"cache at {self.cache_root}"

    def open(self) -> tuple[CacheReader, list[Sample]]:
        """Open the cache (headers only) and load the dataset's sample list.

        The caller owns the reader and closes it when done (``reader.close()``).

        Raises:
            ValueError: the cache does not exist or the dataset is not in it; the message names the cache and the
                dataset and says what to do. An empty dataset opens (consumers that cannot use one say so).
        """
        reader = _open(self.cache_root, f"dataset {self.name!r}")
        try:
            samples = _load(reader, self.cache_root, self.name)
        except BaseException:
            reader.close()
            raise
        return reader, samples

    def load_mix(self, readers: Mapping[str, CacheReader]) -> DatasetMix:
        """The dataset as a one-part :class:`DatasetMix` (what training takes), from the open reader of its cache
        in ``readers`` (cache root → reader, as :func:`open_caches` gives)."""
        return _load_mix(self, readers)


@dataclass(frozen=True)
class CombinedDatasetHandle:
    """Several datasets trained together, each with its repeats and its own cache: a ``STREAM_DATASET`` from
    Combine Datasets. Datasets of several caches are read through one
    :class:`~dataset_cache.multi_reader.MultiCacheReader` (keys are content addresses, so caches never disagree).

    Attributes:
        parts: each dataset (cache, name, repeats), in order; a dataset may appear more than once.
    """

    parts: tuple[DatasetRef, ...]

    @property
    def name(self) -> str:
        """The combination for messages, e.g. ``people×2 + pets``."""
        return " + ".join(p.name if p.repeats == 1 else f"{p.name}×{p.repeats}" for p in self.parts)

    @property
    def cache_roots(self) -> tuple[str, ...]:
        """The caches the datasets are in, each once, in the order of the parts."""
        return tuple(dict.fromkeys(p.cache_root for p in self.parts))

    def where(self) -> str:
        """Where the datasets are, for messages: ``cache at <root>``, or each cache with its datasets."""
        roots = self.cache_roots
        if len(roots) == 1:
            return f"cache at {roots[0]}"
        return "caches at " + "; ".join(
            f"{root} ({', '.join(dict.fromkeys(p.name for p in self.parts if p.cache_root == root))})"
            for root in roots)

    def open(self) -> tuple[CacheReader, list[Sample]]:
        """Refused: a node that works on ONE dataset (Save Streamable Cache) cannot take a combination.

        Raises:
            ValueError: always, naming the datasets and what to connect instead.
        """
        raise ValueError(
            f"this node takes one dataset, but a combination of {len(self.parts)} datasets ({self.name}, from "
            "Combine Datasets) was connected; connect one dataset (Load Lazy Cache or Encode Dataset) directly, "
            "or use the combination with Train LoRA")

    def load_mix(self, readers: Mapping[str, CacheReader]) -> DatasetMix:
        """Every dataset, each from the open reader of its cache in ``readers``, repeats multiplied in
        (:func:`mix_datasets`).

        Raises:
            ValueError: a dataset is missing (naming it and its cache), or the repeats are past the limits.
        """
        return _load_mix(self, readers)


Handle = StreamDatasetHandle | CombinedDatasetHandle


def combine(first: Handle, first_repeats: int, second: Handle | None = None,
            second_repeats: int = 1) -> CombinedDatasetHandle:
    """Combine two handles (either may already be a combination, of any caches), multiplying each one's repeats in.

    Raises:
        ValueError: a dataset's repeats would pass ``MAX_REPEATS``.
    """
    parts: list[DatasetRef] = []
    for handle, repeats in ((first, first_repeats), (second, second_repeats)):
        if handle is None:
            continue
        for part in handle.parts:
            total = part.repeats * int(repeats)
            if total > MAX_REPEATS:
                raise ValueError(
                    f"dataset {part.name!r}: repeats {part.repeats} × {repeats} = {total}, above the limit of "
                    f"{MAX_REPEATS}; lower the repeats of one of the Combine Datasets nodes")
            parts.append(part._replace(repeats=total))
    return CombinedDatasetHandle(tuple(parts))


def cache_roots(*handles: Handle | None) -> tuple[str, ...]:
    """The caches of ``handles`` (``None`` skipped), each once, in order: what a run opens and locks."""
    return tuple(dict.fromkeys(root for h in handles if h is not None for root in h.cache_roots))


def require_caches(**handles: Handle | None) -> None:
    """Refuse a cache without a manifest before anything is locked or created there (a manifest that is there but
    bad, e.g. a link, is left to the open, which names what is wrong with it). ``handles``: input name → handle.

    Raises:
        ValueError: naming the input, its dataset, the folder and what to do.
    """
    for what, handle in handles.items():
        if handle is None:
            continue
        for root in handle.cache_roots:
            if is_remote_url(root):  # a cache in a bucket: its open names what is missing
                continue
            if not os.path.lexists(os.path.join(root, MANIFEST)):
                raise ValueError(f"{what} {handle.name!r}: no StreamCache cache at {root} (no manifest there); encode "
                                 "the dataset first or pick an existing cache")


def open_caches(roots: tuple[str, ...], what: str) -> dict[str, CacheReader]:
    """Open each cache (headers only): cache root → reader. The caller closes them all; on failure none stays open.

    Raises:
        ValueError: a cache does not exist (naming it).
    """
    readers: dict[str, CacheReader] = {}
    try:
        for root in roots:
            readers[root] = _open(root, what)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return readers


def training_reader(readers: Mapping[str, CacheReader]) -> CacheReader | MultiCacheReader:
    """The one reader a run reads through: the cache's own when there is one cache (nothing changes for it), else
    a :class:`MultiCacheReader` over every cache, in the order given (a key is read from the first holding it)."""
    if len(readers) == 1:
        return next(iter(readers.values()))
    return MultiCacheReader(list(readers.values()))


def _open(root: str, what: str) -> CacheReader:
    try:
        if is_remote_url(root):  # a cache in a bucket (Load Lazy Cache's remote: choices)
            from .paths import remote_options

            return open_cache(root, remote=remote_options())
        return open_cache(root)
    except CacheNotFoundError as exc:
        raise ValueError(
            f"{what}: no StreamCache cache at {root} ({exc}); encode the dataset first or pick an existing cache"
        ) from exc


def _load(reader: CacheReader, root: str, name: str) -> list[Sample]:
    try:
        return reader.dataset(name)
    except KeyError as exc:
        there = sorted(reader.datasets()) or "no datasets"
        raise ValueError(
            f"dataset {name!r} is not in the cache at {root}: it holds {there}; pick one of those or encode it"
        ) from exc


def _load_mix(handle: Handle, readers: Mapping[str, CacheReader]) -> DatasetMix:
    loaded: dict[tuple[str, str], list[Sample]] = {}
    parts = []
    for part in handle.parts:
        at = (part.cache_root, part.name)
        if at not in loaded:
            loaded[at] = _load(readers[part.cache_root], part.cache_root, part.name)
        parts.append(DatasetPart(part.name, loaded[at], part.repeats))
    return mix_datasets(parts)
