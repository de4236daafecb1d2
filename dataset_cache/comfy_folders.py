"""What a ComfyUI training-dataset folder holds, and its samples read one shard at a time.

ComfyUI's ``SaveTrainingDataset`` node has written two layouts into ``<output>/<folder_name>/``:

* ``comfy-pickle`` (upstream master): ``shard_{k:04d}.pkl`` files, each ``torch.save`` of
  ``{"latents": [latent dict, ...], "conditioning": [conditioning list, ...]}``, plus ``metadata.json``
  ``{"num_samples", "num_shards", "shard_size"}``. We load shards only with ``torch.load(weights_only=True)``,
  which refuses every object but tensors and plain containers.
* ``comfy-lazy`` (KohakuBlueleaf's ``streamabledataset`` branch, ``"format_version": 2`` in ``metadata.json``):
  ``shard_{k:04d}.safetensors`` with every tensor of the shard (keys ``s{i}_lat_{n}`` / ``s{i}_cond_{n}``) plus
  ``shard_{k:04d}.skeleton.pkl``, a plain pickle of one ``(latent_skeleton, cond_skeleton)`` tuple per sample in
  which each tensor is replaced by ``{"__tref__": key}``. ComfyUI reads that pickle with ``pickle.load``, so a
  shared dataset can run any code on load; we read it with :func:`.safe_pickle.load_skeleton_pickle`, which
  refuses every global outside a tiny allowlist before anything is constructed.

A folder is checked from its file names and ``metadata.json`` before any shard is read
(:func:`inspect_comfy_dataset`), and samples are read one shard at a time (:func:`iter_comfy_dataset`), never the
whole dataset, so any dataset size fits in memory. Every pickle goes through :mod:`.safe_pickle`;
:mod:`.interop` converts what is read here into a cache.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .constants import MAX_SKELETON_DEPTH
from .errors import CacheCorruptError, CacheFormatError, CacheNotFoundError
from .safe_pickle import load_pickle_shard, load_skeleton_pickle

__all__ = [
    "COMFY_PICKLE",
    "COMFY_LAZY",
    "ComfyDatasetInfo",
    "detect_comfy_dataset",
    "inspect_comfy_dataset",
    "iter_comfy_shards",
    "iter_comfy_dataset",
]

log = logging.getLogger("dataset_cache.interop")  # reading and converting ComfyUI folders share one logger name

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


def iter_comfy_shards(info: ComfyDatasetInfo) -> Iterator[tuple[Path, Iterator[tuple[Any, Any]]]]:
    """Yield ``(shard file, its samples)`` one shard at a time; once all are consumed, check the total count.

    Conversion iterates shard by shard so it can commit after each one (:func:`.interop.convert_comfy_dataset`).
    """
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
    for _shard, samples in iter_comfy_shards(inspect_comfy_dataset(path)):
        yield from samples

