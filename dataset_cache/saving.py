"""Saving datasets into a cache without encoding: a copy of another cache's dataset, ComfyUI's latent and
conditioning lists, and updates of a dataset's info.

Each takes the cache's write lock (a concurrent encode waits, or this does), stores the dataset last, and compacts
the cache afterwards unless a training run reads it at that moment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .batching import batched
from .dataset import DatasetInfo, Sample
from .encode_run import compact_if_unread
from .errors import CacheNotFoundError
from .format.manifest import read_state
from .format.reader import CacheReader, open_cache
from .format.compaction import CompactReport
from .format.writer import CacheWriter
from .interop import split_batch, value_key
from .lock import WRITE_LOCK, CacheLock

__all__ = ["SaveResult", "copy_dataset", "save_latent_lists", "read_dataset_info", "update_dataset_info",
           "COPY_BATCH", "LOCK_TIMEOUT_S"]

COPY_BATCH = 64
"""Entries read per batch when copying a dataset: one coalesced read each, bounded memory."""
LOCK_TIMEOUT_S = 60.0
"""How long to wait for another writer of the same cache before failing with a clear error."""


@dataclass(frozen=True)
class SaveResult:
    """What a save stored: samples in the dataset, entries newly added, and the compaction that followed."""

    samples: int
    added: int
    compaction: CompactReport | None


def _set_dataset(writer: CacheWriter, root: Path, name: str, samples: list[Sample], info: dict[str, Any]) -> None:
    """Store the dataset unless the cache already holds exactly it (saving again then leaves the cache as is)."""
    current = writer.datasets().get(name)
    if current is not None and current.info == info:
        with open_cache(root, verify=False) as reader:
            if reader.dataset(name) == samples:
                return
    writer.set_dataset(name, samples, info=info)


def copy_dataset(reader: CacheReader, source_name: str, root: str | os.PathLike[str], name: str, *,
                 samples: Sequence[Sample] | None = None, source_label: str | None = None) -> SaveResult:
    """Copy dataset ``source_name`` of ``reader``'s cache into the cache at ``root`` as dataset ``name``.

    ``samples``: the dataset's sample list when the caller has loaded it already (else it is read here). The
    copy's info records where it came from (``source_label``, default the source cache's folder).

    Latents are copied grouped by bucket (latent shape), each followed by its captions, so the new cache is
    self-contained and its shards hold each bucket's rows next to each other.

    Raises:
        KeyError: no such dataset in the source; CacheCorruptError: a damaged source shard (named).
    """
    root = Path(root)
    samples = list(samples) if samples is not None else reader.dataset(source_name)

    def bucket(s: Sample) -> str:
        shapes = reader.tensor_shapes(s.latent)
        shape = shapes.get("samples") if isinstance(shapes, dict) else None
        return "x".join(map(str, shape)) if shape is not None else ""

    order = dict.fromkeys(k for s in sorted(samples, key=bucket) for k in s.keys())
    info = dict(reader.datasets()[source_name].info)
    with CacheLock(root, WRITE_LOCK, timeout=LOCK_TIMEOUT_S, purpose="save"), CacheWriter(root) as writer:
        todo = [k for k in order if not writer.has(k)]
        for batch in batched(todo, COPY_BATCH):
            for key, value in zip(batch, reader.read(batch)):
                writer.add(key, value, kind=reader.kind(key), name=f"entry {key}")
            writer.commit()
        info["copied_from"] = {"cache": source_label or str(reader.root), "dataset": source_name}
        _set_dataset(writer, root, name, samples, info)
        compaction = compact_if_unread(writer, root, purpose="compaction after save")
    return SaveResult(len(samples), len(todo), compaction)


def _pairs(latents: Sequence[Any], conditioning: Sequence[Any]) -> list[tuple[Any, Any]]:
    if len(conditioning) == 1 and len(latents) > 1:
        conditioning = list(conditioning) * len(latents)
    if len(latents) != len(conditioning):
        raise ValueError(f"{len(latents)} latents but {len(conditioning)} conditionings; connect lists of equal "
                         "length (as Make Training Dataset gives) or a single conditioning for all latents")
    if not latents:
        raise ValueError("the latents list is empty: nothing to save")
    return list(zip(latents, conditioning))


def save_latent_lists(latents: Sequence[Any], conditioning: Sequence[Any], root: str | os.PathLike[str],
                      name: str) -> SaveResult:
    """Store ComfyUI latent dicts and conditioning lists (as Make Training Dataset gives them) as dataset ``name``.

    Each value is stored under its content key (:func:`.interop.value_key`), so identical captions are stored once
    and saving twice adds nothing; a latent batch of ``B`` rows becomes ``B`` samples, paired with its conditioning
    the way ComfyUI's trainer pairs them.

    Raises:
        ValueError: the lists do not pair up, or a latent is not a dict with a ``samples`` tensor.
        UnstorableValueError: a value holds something the cache cannot store (e.g. hooks); the message names the
            list index and the path inside the value.
    """
    root = Path(root)
    pairs = _pairs(latents, conditioning)
    samples: list[Sample] = []
    added = 0
    with CacheLock(root, WRITE_LOCK, timeout=LOCK_TIMEOUT_S, purpose="save"), CacheWriter(root) as writer:
        for i, (latent, cond) in enumerate(pairs):
            rows = split_batch(latent, cond, f"latents[{i}]")
            for r, (lat, con) in enumerate(rows):
                where = f"[{i}]" + (f" row {r}" if len(rows) > 1 else "")
                keys = []
                for value, kind, label in ((lat, "latent", "latents"), (con, "conditioning", "conditioning")):
                    key = value_key(value, name=f"{label}{where}")
                    if not writer.has(key):
                        writer.add(key, value, kind=kind, name=f"{label}{where}")
                        added += 1
                    keys.append(key)
                samples.append(Sample(keys[0], (keys[1],), source=f"latents{where}"))
        _set_dataset(writer, root, name, samples, {"source": "ComfyUI latent + conditioning lists",
                                                   "source_samples": len(pairs)})
        compaction = compact_if_unread(writer, root, purpose="compaction after save")
    return SaveResult(len(samples), added, compaction)


def read_dataset_info(root: str | os.PathLike[str], name: str) -> DatasetInfo | None:
    """What the manifest says about dataset ``name`` (``None``: no such cache or dataset); reads no dataset file.

    Raises:
        CacheError: the cache exists but its manifest or journal cannot be read.
    """
    try:
        return read_state(root).datasets.get(name)
    except CacheNotFoundError:
        return None


def update_dataset_info(root: str | os.PathLike[str], name: str, key: str, value: Any) -> bool:
    """Set ``info[key] = value`` of dataset ``name`` under the cache's write lock; ``False`` when there is no such
    dataset or it already holds that value (nothing is written then).

    Raises:
        CacheError: the cache cannot be read or written (the message names the file).
    """
    with CacheLock(root, WRITE_LOCK, purpose=f"update the info of dataset {name!r}"):
        writer = CacheWriter(root, create=False)
        try:
            current = writer.datasets().get(name)
            if current is None or current.info.get(key) == value:
                return False
            with open_cache(root, verify=False) as reader:
                samples = reader.dataset(name)
            writer.set_dataset(name, samples, info={**current.info, key: value})
            return True
        finally:
            writer.close()
