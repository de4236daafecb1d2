"""Reading ComfyUI's built-in training-dataset folders, safely, and converting them into a cache.

ComfyUI's ``SaveTrainingDataset`` node has written two layouts into ``<output>/<folder_name>/``:

* ``comfy-pickle`` (upstream master): ``shard_{k:04d}.pkl`` files, each ``torch.save`` of
  ``{"latents": [latent dict, ...], "conditioning": [conditioning list, ...]}``, plus ``metadata.json``
  ``{"num_samples", "num_shards", "shard_size"}``. We load shards only with ``torch.load(weights_only=True)``,
  which refuses every object but tensors and plain containers.
* ``comfy-lazy`` (KohakuBlueleaf's ``streamabledataset`` branch, ``"format_version": 2`` in ``metadata.json``):
  ``shard_{k:04d}.safetensors`` with every tensor of the shard (keys ``s{i}_lat_{n}`` / ``s{i}_cond_{n}``) plus
  ``shard_{k:04d}.skeleton.pkl``, a plain pickle of one ``(latent_skeleton, cond_skeleton)`` tuple per sample in
  which each tensor is replaced by ``{"__tref__": key}``. ComfyUI reads that pickle with ``pickle.load``, so a
  shared dataset can run any code on load; we read it with :func:`.safe_pickle.load_skeleton_pickle`, which refuses
  every global outside a tiny allowlist before anything is constructed.

Samples are read one shard at a time (:func:`iter_comfy_dataset`), never the whole dataset, and
:func:`convert_comfy_dataset` streams them into a :class:`~dataset_cache.format.writer.CacheWriter`, keyed by
content (:func:`value_key`).
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .constants import DEFAULT_SHARD_BYTES, MAX_SKELETON_DEPTH
from .dataset import Sample
from .errors import CacheCorruptError, CacheFormatError, CacheNotFoundError, UnstorableValueError
from .hashing import tensor_bytes
from .safe_pickle import load_pickle_shard, load_skeleton_pickle

__all__ = [
    "COMFY_PICKLE",
    "COMFY_LAZY",
    "ComfyDatasetInfo",
    "ConvertReport",
    "detect_comfy_dataset",
    "inspect_comfy_dataset",
    "split_batch",
    "iter_comfy_dataset",
    "convert_comfy_dataset",
    "value_key",
]

log = logging.getLogger("dataset_cache.interop")

COMFY_PICKLE = "comfy-pickle"
"""Layout of upstream ``SaveTrainingDataset``: ``shard_*.pkl`` written by ``torch.save``."""
COMFY_LAZY = "comfy-lazy"
"""Layout of the ``streamabledataset`` branch: ``shard_*.safetensors`` + ``shard_*.skeleton.pkl``."""

METADATA_FILE = "metadata.json"
_PICKLE_SHARD = re.compile(r"shard_(\d+)\.pkl")
_LAZY_SHARD = re.compile(r"shard_(\d+)\.safetensors")
_TREF = "__tref__"


@dataclass(frozen=True)
class ComfyDatasetInfo:
    """What a ComfyUI dataset folder holds, read from its file names and ``metadata.json`` only.

    Attributes:
        path: the folder.
        layout: :data:`COMFY_PICKLE` or :data:`COMFY_LAZY`.
        metadata: the parsed ``metadata.json``.
        shards: the shard files in save order (``.pkl`` or ``.safetensors``), as many as the metadata names.
        num_samples: samples the metadata promises.
        bytes: total size of the shard files (and skeleton pickles) on disk.
    """

    path: Path
    layout: str
    metadata: dict[str, Any]
    shards: tuple[Path, ...]
    num_samples: int
    bytes: int


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


# ----------------------------------------------------------------------------------------------- detection


def _shard_files(folder: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """Return ``(pickle shards, safetensors shards)`` of a folder by shard index."""
    pkl: dict[int, Path] = {}
    lazy: dict[int, Path] = {}
    for p in folder.iterdir():
        if m := _PICKLE_SHARD.fullmatch(p.name):
            pkl[int(m.group(1))] = p
        elif m := _LAZY_SHARD.fullmatch(p.name):
            lazy[int(m.group(1))] = p
    return pkl, lazy


def _read_metadata(folder: Path) -> dict[str, Any]:
    """Parse and check ``metadata.json``; raise :class:`CacheFormatError` naming the file and field."""
    path = folder / METADATA_FILE
    if not path.is_file():
        raise CacheFormatError(
            f"{path}: missing. A ComfyUI SaveTrainingDataset folder always has one; it was deleted or the save "
            "was interrupted. Re-run SaveTrainingDataset."
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheFormatError(f"{path}: not valid JSON ({e}). Re-run SaveTrainingDataset.") from e
    if not isinstance(meta, dict):
        raise CacheFormatError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for name in ("num_samples", "num_shards", "shard_size"):
        v = meta.get(name)
        if type(v) is not int or v < 0:
            raise CacheFormatError(f"{path}: field {name!r} must be a non-negative integer, got {v!r}")
    version = meta.get("format_version", 1)
    if version not in (1, 2):
        raise CacheFormatError(f"{path}: format_version {version!r} is unknown; expected 1 (absent) or 2")
    if meta["shard_size"] < 1 or meta["num_shards"] != -(-meta["num_samples"] // meta["shard_size"]):
        raise CacheFormatError(
            f"{path}: num_shards={meta['num_shards']} does not fit num_samples={meta['num_samples']} and "
            f"shard_size={meta['shard_size']}"
        )
    return meta


def detect_comfy_dataset(path: str | Path) -> str | None:
    """Say which ComfyUI layout a folder holds, from file names and ``metadata.json`` alone.

    Returns:
        :data:`COMFY_PICKLE`, :data:`COMFY_LAZY`, or ``None`` when the folder has neither ComfyUI shards nor a
        ComfyUI ``metadata.json`` (including when ``path`` is not a directory). Never raises for bad content:
        :func:`inspect_comfy_dataset` reports what is wrong.
    """
    folder = Path(path)
    if not folder.is_dir():
        return None
    pkl, lazy = _shard_files(folder)
    try:
        version = _read_metadata(folder).get("format_version", 1)
    except CacheFormatError:
        version = None
    if version == 2 or (version is None and lazy and not pkl):
        return COMFY_LAZY
    if version == 1 or pkl:
        return COMFY_PICKLE
    return COMFY_LAZY if lazy else None


def inspect_comfy_dataset(path: str | Path) -> ComfyDatasetInfo:
    """Check a ComfyUI dataset folder without reading any shard.

    The metadata decides the layout (``format_version`` 2 means lazy) and how many shards belong to the dataset:
    ComfyUI never deletes old shards when a folder is saved again, so files beyond ``num_shards`` are stale and
    ignored (with a warning).

    Raises:
        CacheNotFoundError: ``path`` does not exist.
        CacheFormatError: not a ComfyUI dataset folder, ``metadata.json`` missing or invalid, or a shard (or its
            skeleton pickle) missing.
    """
    folder = Path(path)
    if not folder.exists():
        raise CacheNotFoundError(f"{folder}: no such directory")
    if not folder.is_dir():
        raise CacheFormatError(f"{folder}: not a directory; expected a ComfyUI SaveTrainingDataset folder")
    pkl, lazy = _shard_files(folder)
    if not pkl and not lazy and not (folder / METADATA_FILE).is_file():
        raise CacheFormatError(
            f"{folder}: not a ComfyUI dataset folder (no shard_*.pkl, shard_*.safetensors or metadata.json)"
        )
    meta = _read_metadata(folder)
    layout = COMFY_LAZY if meta.get("format_version", 1) == 2 else COMFY_PICKLE
    found = lazy if layout == COMFY_LAZY else pkl
    suffix = ".safetensors" if layout == COMFY_LAZY else ".pkl"
    n = meta["num_shards"]
    missing = [f"shard_{i:04d}{suffix}" for i in range(n) if i not in found]
    if missing:
        raise CacheFormatError(
            f"{folder}: metadata.json names {n} {layout} shard(s) but {', '.join(missing[:5])} "
            f"{'is' if len(missing) == 1 else 'are'} missing. Re-run SaveTrainingDataset."
        )
    stale = sorted(p.name for i, p in {**pkl, **lazy}.items() if i >= n or p.suffix != suffix)
    if stale:
        log.warning("%s: ignoring %d shard file(s) not in metadata.json (left by an earlier save): %s",
                    folder, len(stale), ", ".join(stale[:5]))
    shards = tuple(found[i] for i in range(n))
    total = 0
    for shard in shards:
        total += shard.stat().st_size
        if layout == COMFY_LAZY:
            skel = _skeleton_path(shard)
            if not skel.is_file():
                raise CacheFormatError(f"{skel}: missing; every lazy shard needs its skeleton pickle")
            total += skel.stat().st_size
    return ComfyDatasetInfo(folder, layout, meta, shards, meta["num_samples"], total)


def _skeleton_path(shard: Path) -> Path:
    return shard.with_name(shard.name[: -len(".safetensors")] + ".skeleton.pkl")


# --------------------------------------------------------------------------------------------- iteration


class _TooDeep(Exception):
    pass


def _rejoin(obj: Any, get: Any, depth: int = 0) -> Any:
    """Replace ``{"__tref__": key}`` markers with ``get(key)`` (ComfyUI's own rule: a one-key dict)."""
    if depth > MAX_SKELETON_DEPTH:
        raise _TooDeep
    if isinstance(obj, dict):
        if len(obj) == 1 and _TREF in obj:
            return get(obj[_TREF])
        return {k: _rejoin(v, get, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rejoin(v, get, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rejoin(v, get, depth + 1) for v in obj)
    return obj


def _iter_lazy_shard(shard: Path) -> Iterator[tuple[Any, Any]]:
    """Yield the samples of one safetensors shard, reading each sample's tensors only when it is reached."""
    from safetensors import SafetensorError, safe_open

    skel_path = _skeleton_path(shard)
    skeletons = load_skeleton_pickle(skel_path)
    if not isinstance(skeletons, list) or not all(
        isinstance(s, (tuple, list)) and len(s) == 2 for s in skeletons
    ):
        raise CacheFormatError(f"{skel_path}: expected a list of (latent, conditioning) skeleton pairs")
    try:
        handle = safe_open(str(shard), framework="pt", device="cpu")
    except (SafetensorError, ValueError, OSError) as e:
        raise CacheCorruptError(str(shard), f"not a readable safetensors file ({e})") from e
    with handle as f:
        names = set(f.keys())

        def get(key: Any) -> torch.Tensor:
            if not isinstance(key, str) or key not in names:
                raise CacheCorruptError(str(skel_path), f"references tensor {key!r}, which {shard.name} lacks")
            try:
                return f.get_tensor(key)
            except (SafetensorError, ValueError, RuntimeError) as e:
                raise CacheCorruptError(str(shard), f"tensor {key!r} unreadable ({e})") from e

        for i, (lat, cond) in enumerate(skeletons):
            try:
                yield _rejoin(lat, get), _rejoin(cond, get)
            except _TooDeep:
                raise CacheFormatError(
                    f"{skel_path}: sample {i} is nested deeper than {MAX_SKELETON_DEPTH} levels"
                ) from None


def _counting(samples: Iterator[tuple[Any, Any]], counter: list[int]) -> Iterator[tuple[Any, Any]]:
    for item in samples:
        counter[0] += 1
        yield item


def _iter_shards(info: ComfyDatasetInfo) -> Iterator[tuple[Path, Iterator[tuple[Any, Any]]]]:
    """Yield ``(shard file, its samples)`` one shard at a time; once all are consumed, check the total count."""
    counter = [0]
    for shard in info.shards:
        if info.layout == COMFY_LAZY:
            samples: Iterator[tuple[Any, Any]] = _iter_lazy_shard(shard)
        else:
            samples = zip(*load_pickle_shard(shard))
        yield shard, _counting(samples, counter)
    if counter[0] != info.num_samples:
        raise CacheCorruptError(str(info.path / METADATA_FILE),
                                f"promises {info.num_samples} samples but the shards hold {counter[0]}")


def iter_comfy_dataset(path: str | Path) -> Iterator[tuple[Any, Any]]:
    """Yield ``(latent dict, conditioning list)`` for every sample of a ComfyUI dataset folder, in save order.

    Only one shard is loaded at a time (``.pkl`` shards are memory-mapped; lazy shards read each sample's
    tensors when it is reached), so any dataset size fits in memory.

    Raises:
        CacheNotFoundError, CacheFormatError: see :func:`inspect_comfy_dataset`; also for a shard that holds
            objects that cannot be loaded safely.
        CacheCorruptError: a shard or skeleton is unreadable, or the sample count differs from the metadata.
    """
    for _shard, samples in _iter_shards(inspect_comfy_dataset(path)):
        yield from samples


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
        for shard, shard_samples in _iter_shards(info):
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
