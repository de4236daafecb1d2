"""Converting a ComfyUI training-dataset folder into a cache, keyed by content.

:func:`convert_comfy_dataset` streams the samples :mod:`.comfy_folders` reads (one shard at a time, every pickle
through :mod:`.safe_pickle`) into a :class:`~dataset_cache.format.writer.CacheWriter`, splitting batched latents
into one sample per row (:func:`split_batch`) and storing each value under its content key (:func:`value_key`),
so identical values are stored once and converting twice adds nothing. :mod:`.saving` stores ComfyUI's latent and
conditioning lists with the same two functions.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .comfy_folders import inspect_comfy_dataset, iter_comfy_shards
from .constants import DEFAULT_SHARD_BYTES, MAX_SKELETON_DEPTH
from .dataset import Sample
from .errors import CacheFormatError, UnstorableValueError
from .hashing import tensor_bytes

__all__ = [
    "ConvertReport",
    "split_batch",
    "convert_comfy_dataset",
    "value_key",
]

log = logging.getLogger("dataset_cache.interop")


@dataclass(frozen=True)
class ConvertReport:
    """Result of :func:`convert_comfy_dataset`.

    Attributes:
        source: the ComfyUI dataset folder.
        dest: the cache directory.
        layout: the source layout.
        dataset: name of the dataset written into the cache.
        source_samples: samples in the source (ComfyUI's count; a batched latent counts once).
        samples: samples in the new dataset (batched latents are split into one sample per row).
        new_entries: entries written; the others were already in the cache (same content, same key).
        reused_entries: entries the cache already held.
        seconds: wall time of the conversion.
    """

    source: str
    dest: str
    layout: str
    dataset: str
    source_samples: int
    samples: int
    new_entries: int
    reused_entries: int
    seconds: float = field(default=0.0, compare=False)


# --------------------------------------------------------------------------------------------- content keys


def _feed(h: Any, v: Any, where: str, depth: int) -> None:
    """Feed a canonical, type-tagged serialization of ``v`` into hash ``h``."""
    if depth > MAX_SKELETON_DEPTH:
        raise UnstorableValueError(where, type(v).__name__, f"nested deeper than {MAX_SKELETON_DEPTH} levels")
    t = type(v)
    if v is None:
        h.update(b"N")
    elif t is bool:
        h.update(b"T" if v else b"F")
    elif t is int:
        h.update(b"I%d;" % v)
    elif t is float:
        h.update(b"D" + struct.pack("<d", v))
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        h.update(b"S%d;" % len(b) + b)
    elif t is list or t is tuple:
        h.update(b"%s%d;" % (b"L" if t is list else b"U", len(v)))
        for i, x in enumerate(v):
            _feed(h, x, f"{where}[{i}]", depth + 1)
    elif t is dict:
        h.update(b"M%d;" % len(v))
        for k, x in v.items():  # order kept: it is part of the value that round-trips
            if type(k) is not str:
                raise UnstorableValueError(f"{where}[{k!r}]", f"dict key of type {type(k).__name__}",
                                           "only str keys are storable")
            _feed(h, k, where, depth + 1)
            _feed(h, x, f"{where}[{k!r}]", depth + 1)
    elif isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_meta:
        h.update(b"X%s;%d;%s;" % (str(v.dtype).encode(), v.dim(), ",".join(map(str, v.shape)).encode()))
        h.update(tensor_bytes(v))
    else:
        raise UnstorableValueError(where, t.__name__)


def value_key(value: Any, *, name: str = "value") -> str:
    """Return the content key of a storable value: xxh3-128 (32 hex chars) of a canonical serialization.

    The serialization tags every node with its type (list and tuple differ, ``1``/``1.0``/``True`` differ), keeps
    dict key order, encodes floats by their bits (so ``nan`` payloads and ``-0.0`` count) and tensors by dtype,
    shape and raw bytes, so equal keys mean values that round-trip identically.

    Raises:
        UnstorableValueError: ``value`` holds something the format cannot store, named by its path under ``name``.
    """
    h = xxhash.xxh3_128()
    h.update(b"streamcache-value-v1;")
    _feed(h, value, name, 0)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- conversion


def split_batch(latent: Any, cond: Any, where: str) -> list[tuple[Any, Any]]:
    """Split a latent dict holding ``B > 1`` rows into ``B`` single-row samples, as ComfyUI's trainer does.

    Conditioning pairs the way the trainer's flattening pairs it: ``B`` entries give row ``i`` entry ``i``; a single
    entry is shared by every row. Other tensors with ``B`` leading rows (e.g. ``noise_mask``) and a length-``B``
    ``batch_index`` are split with the rows; everything else is copied.
    """
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise CacheFormatError(f"{where}: latent is not a dict with a 'samples' tensor "
                               f"(got {type(latent).__name__})")
    samples = latent["samples"]
    b = samples.shape[0] if samples.dim() else 1
    if b <= 1:
        return [(latent, cond)]
    if isinstance(cond, list) and len(cond) == b:
        conds = [[c] for c in cond]
    elif isinstance(cond, list) and len(cond) == 1:
        conds = [cond] * b
    else:
        n = len(cond) if isinstance(cond, list) else type(cond).__name__
        raise CacheFormatError(f"{where}: latent batch of {b} rows but conditioning has {n} entries; "
                               f"expected {b} or 1")
    out = []
    for i in range(b):
        row: dict[str, Any] = {}
        for k, v in latent.items():
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b:
                row[k] = v[i : i + 1]
            elif k == "batch_index" and isinstance(v, list) and len(v) == b:
                row[k] = [v[i]]
            else:
                row[k] = v
        out.append((row, conds[i]))
    return out


class _EntrySink:
    """Adds values to a writer under their content keys, counting new and reused entries."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.added = self.reused = 0

    def put(self, value: Any, kind: str, where: str) -> str:
        try:
            key = value_key(value, name=kind)
            if self.writer.has(key):
                self.reused += 1
            else:
                self.writer.add(key, value, kind=kind, name=kind)
                self.added += 1
        except UnstorableValueError as e:  # prefix the source file and sample; keep the writer's hint
            hint = str(e)[len(f"{e.where}: {e.type_name} is not storable"):].strip()[1:-1]
            raise UnstorableValueError(f"{where}: {e.where}", e.type_name, hint) from e
        return key


def convert_comfy_dataset(
    src: str | Path, dst: str | Path, *, name: str = "default", shard_bytes: int = DEFAULT_SHARD_BYTES
) -> ConvertReport:
    """Convert a ComfyUI ``SaveTrainingDataset`` folder into the cache at ``dst`` (created if needed).

    Latent dicts become entries of kind ``"latent"``, conditioning lists entries of kind ``"conditioning"``, each
    keyed by :func:`value_key`, so identical captions are stored once and converting twice adds nothing. Each
    source shard is committed when done (an interrupted conversion keeps its progress); the dataset ``name`` is
    written last, so it exists only when every sample converted.

    Raises:
        CacheNotFoundError, CacheFormatError, CacheCorruptError: the source is missing, not a ComfyUI dataset,
            or damaged (the message names the file).
        UnstorableValueError: a sample holds a value the format cannot store; ``where`` names the shard file,
            the sample and the path inside it.
    """
    from .format.writer import CacheWriter
    from .lock import WRITE_LOCK, CacheLock

    start = time.perf_counter()
    info = inspect_comfy_dataset(src)
    samples: list[Sample] = []
    source_samples = 0
    # Writers take the cache's write lock: a compaction by another writer deletes shard files its state does not
    # name yet, which would include ours before they are committed.
    with CacheLock(dst, WRITE_LOCK, purpose="convert"), CacheWriter(dst, shard_bytes=shard_bytes) as writer:
        sink = _EntrySink(writer)
        for shard, shard_samples in iter_comfy_shards(info):
            for i, (latent, cond) in enumerate(shard_samples):
                source_samples += 1
                rows = split_batch(latent, cond, f"{shard} sample {i}")
                for r, (lat, con) in enumerate(rows):
                    where, src_name = f"{shard} sample {i}", f"{shard.name}#{i}"
                    if len(rows) > 1:
                        where, src_name = f"{where} row {r}", f"{src_name}[{r}]"
                    keys = sink.put(lat, "latent", where), sink.put(con, "conditioning", where)
                    samples.append(Sample(keys[0], (keys[1],), source=src_name))
            writer.commit()
            log.info("converted %s (%d samples so far)", shard.name, len(samples))
        writer.set_dataset(name, samples, info={
            "source": str(info.path.resolve()), "source_format": info.layout, "comfy_metadata": info.metadata,
        })
    return ConvertReport(str(info.path), str(dst), info.layout, name, source_samples, len(samples), sink.added,
                         sink.reused, time.perf_counter() - start)
