"""The small handle objects that travel along the pack's custom sockets (``STREAM_DATASET``).

A handle names data; it never holds tensors, open files or threads, so ComfyUI can cache it, compare it and
pass it between nodes for free, and a node that consumes it opens what it needs for the length of its own
``execute`` and closes it again. A socket carries either one dataset (:class:`StreamDatasetHandle`) or several
datasets of one cache with repeats (:class:`CombinedDatasetHandle`, from Combine Datasets); nodes that train take
both (``open_mix``), nodes that work on one dataset take the first and refuse the second by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ..dataset_cache.dataset import MAX_REPEATS, Sample
from ..dataset_cache.errors import CacheNotFoundError
from ..dataset_cache.format.reader import CacheReader, open_cache
from ..dataset_cache.sampler import DatasetMix, DatasetPart, mix_datasets

__all__ = ["CombinedDatasetHandle", "StreamDataset", "StreamDatasetHandle", "combine", "same_cache"]

StreamDataset = io.Custom("STREAM_DATASET")
"""The socket type that carries a :class:`StreamDatasetHandle` between the pack's nodes."""


@dataclass(frozen=True)
class StreamDatasetHandle:
    """One dataset of one cache: the value of a ``STREAM_DATASET`` socket.

    Attributes:
        cache_root: the cache directory (absolute path).
        name: the dataset's name inside the cache.
    """

    cache_root: str
    name: str

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """``(dataset name, repeats)`` of each dataset the handle names: this one, once."""
        return ((self.name, 1),)

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

    def open_mix(self) -> tuple[CacheReader, DatasetMix]:
        """Open the cache and load the dataset as a one-part :class:`DatasetMix` (what training takes)."""
        return _open_mix(self)

    def load_mix(self, reader: CacheReader) -> DatasetMix:
        """The dataset as a one-part :class:`DatasetMix`, from an already open reader of the same cache."""
        return _load_mix(self, reader)


@dataclass(frozen=True)
class CombinedDatasetHandle:
    """Several datasets of ONE cache trained together, each with its repeats: a ``STREAM_DATASET`` from Combine
    Datasets. One cache, because a training run reads every entry through one reader.

    Attributes:
        cache_root: the cache directory (absolute path).
        parts: ``(dataset name, repeats)`` of each dataset, in order; a dataset may appear more than once.
    """

    cache_root: str
    parts: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        """The combination for messages, e.g. ``people×2 + pets``."""
        return " + ".join(n if r == 1 else f"{n}×{r}" for n, r in self.parts)

    def open(self) -> tuple[CacheReader, list[Sample]]:
        """Refused: a node that works on ONE dataset (Save Streamable Cache) cannot take a combination.

        Raises:
            ValueError: always, naming the datasets and what to connect instead.
        """
        raise ValueError(
            f"this node takes one dataset, but a combination of {len(self.parts)} datasets ({self.name}, from "
            "Combine Datasets) was connected; connect one dataset (Load Lazy Cache or Encode Dataset) directly, "
            "or use the combination with Train LoRA")

    def open_mix(self) -> tuple[CacheReader, DatasetMix]:
        """Open the cache and load every dataset, repeats multiplied in (:func:`mix_datasets`).

        Raises:
            ValueError: the cache or a dataset is missing, or the repeats are past the limits (naming the dataset).
        """
        return _open_mix(self)

    def load_mix(self, reader: CacheReader) -> DatasetMix:
        """Every dataset from an already open reader of the same cache (see :meth:`open_mix`)."""
        return _load_mix(self, reader)


def combine(first: StreamDatasetHandle | CombinedDatasetHandle, first_repeats: int,
            second: StreamDatasetHandle | CombinedDatasetHandle | None = None,
            second_repeats: int = 1) -> CombinedDatasetHandle:
    """Combine two handles (either may already be a combination), multiplying each one's repeats in.

    Raises:
        ValueError: the handles are in different caches (naming both), or a dataset's repeats would pass
            ``MAX_REPEATS``.
    """
    parts: list[tuple[str, int]] = []
    for handle, repeats in ((first, first_repeats), (second, second_repeats)):
        if handle is None:
            continue
        same_cache(first, handle, "Combine Datasets")
        for name, r in handle.parts:
            total = r * int(repeats)
            if total > MAX_REPEATS:
                raise ValueError(
                    f"dataset {name!r}: repeats {r} × {repeats} = {total}, above the limit of {MAX_REPEATS}; lower "
                    "the repeats of one of the Combine Datasets nodes")
            parts.append((name, total))
    return CombinedDatasetHandle(first.cache_root, tuple(parts))


def same_cache(a: StreamDatasetHandle | CombinedDatasetHandle, b: StreamDatasetHandle | CombinedDatasetHandle,
               what: str) -> None:
    """Refuse two handles in different caches (a run reads through one reader), naming both and the fix.

    Raises:
        ValueError: naming both datasets and caches, and suggesting Save Streamable Cache to copy one over.
    """
    if a.cache_root != b.cache_root:
        raise ValueError(
            f"{what}: datasets trained together must be in ONE cache, but {a.name!r} is in {a.cache_root} and "
            f"{b.name!r} is in {b.cache_root}; copy one into the other's cache with Save Streamable Cache (same "
            "cache, a new dataset name) and connect that copy")


def _open(root: str, what: str) -> CacheReader:
    try:
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


def _load_mix(handle: StreamDatasetHandle | CombinedDatasetHandle, reader: CacheReader) -> DatasetMix:
    loaded: dict[str, list[Sample]] = {}
    parts = []
    for name, repeats in handle.parts:
        if name not in loaded:
            loaded[name] = _load(reader, handle.cache_root, name)
        parts.append(DatasetPart(name, loaded[name], repeats))
    return mix_datasets(parts)


def _open_mix(handle: StreamDatasetHandle | CombinedDatasetHandle) -> tuple[CacheReader, DatasetMix]:
    reader = _open(handle.cache_root, f"dataset {handle.name!r}")
    try:
        return reader, _load_mix(handle, reader)
    except BaseException:
        reader.close()
        raise
