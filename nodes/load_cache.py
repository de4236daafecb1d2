"""Node "Load Lazy Cache": a cache's dataset as a ``STREAM_DATASET`` handle, reading no tensor bytes.

The ``cache`` list offers every cache under the StreamCache folders and every dataset folder that ComfyUI's
built-in ``SaveTrainingDataset`` wrote into the output directory (``comfy:<folder>``). Picking a ComfyUI
folder converts it, once, into a cache under ``<first StreamCache folder>/from_comfyui/<folder>``
(:func:`dataset_cache.interop.convert_comfy_dataset`, which never unpickles code); it is converted again only
when the ComfyUI folder's files are newer than the converted dataset.

A cache in object storage is offered as ``remote:<name>``, one per entry of ``remote.json`` in a StreamCache
folder (:func:`.paths.remote_config`); it opens the same way, over the network (the library's
``dataset_cache.remote``: ranged GETs, a local fetch cache), and Train LoRA reads it through that reader.

Opening reads the manifest, the journal, shard headers and the dataset's sample list: the info text (samples,
buckets from header shapes, encoder fingerprints) costs no tensor I/O. ``fingerprint_inputs`` follows the cache's
committed state (a remote cache's manifest ETag), so a re-encoded, cleaned or republished cache is noticed
although its name did not change.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import folder_paths
import xxhash
from comfy_api.latest import io

from ..dataset_cache import CacheError, CacheReader, is_cache_folder, read_dataset_info
from ..dataset_cache.comfy_folders import detect_comfy_dataset, inspect_comfy_dataset
from ..dataset_cache.interop import convert_comfy_dataset
from ..dataset_cache.remote import CacheURL
from .fingerprints import cache_identity
from .handles import StreamDataset, StreamDatasetHandle
from .inputs import NO_CACHE_YET, cache_choices, no_cache_yet_message
from .paths import REMOTE_PREFIX, cache_roots, remote_choices, remote_options, resolve_cache, resolve_remote
from .ui_output import TextWithData

__all__ = ["COMFY_PREFIX", "CONVERTED_FOLDER", "LoadLazyCache", "list_caches", "list_comfy_datasets",
           "resolve_source", "dataset_fields", "describe_dataset"]

log = logging.getLogger("streamcache.load_cache")

COMFY_PREFIX = "comfy:"
"""Marks a ``cache`` choice that is a ComfyUI ``SaveTrainingDataset`` folder of the output directory."""
CONVERTED_FOLDER = "from_comfyui"
"""Folder (inside the first StreamCache folder) that receives converted ComfyUI datasets."""
_COMFY_SUBFOLDERS = ("datasets", "training_datasets")
"""Output subfolders searched one level deeper for ComfyUI datasets (others are not descended into: the output
directory can hold many image folders, and this list is rebuilt whenever the node list is)."""


def list_caches() -> list[str]:
    """Names of the caches under the StreamCache folders (``name`` or ``group/name``), sorted."""
    found: set[str] = set()
    for root in cache_roots():
        for rel in _subdirs(root, depth=2):
            if is_cache_folder(root / rel):
                found.add(rel)
    return sorted(found)


def list_comfy_datasets() -> list[str]:
    """``comfy:<folder>`` for every ComfyUI ``SaveTrainingDataset`` folder in the output directory, sorted."""
    out_dir = Path(folder_paths.get_output_directory())
    found = []
    for rel in _subdirs(out_dir, depth=1) + [f"{top}/{sub}" for top in _COMFY_SUBFOLDERS
                                             for sub in _subdirs(out_dir / top, depth=1)]:
        if (out_dir / rel / "metadata.json").is_file() and detect_comfy_dataset(out_dir / rel):
            found.append(COMFY_PREFIX + rel)
    return sorted(found)


def _subdirs(root: Path, depth: int) -> list[str]:
    """Relative POSIX paths of the (non-hidden) folders under ``root``, ``depth`` levels deep at most."""
    out: list[str] = []
    try:
        with os.scandir(root) as it:
            dirs = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return out
    for name in dirs:
        out.append(name)
        if depth > 1 and not is_cache_folder(root / name):  # no caches inside a cache
            out.extend(f"{name}/{sub}" for sub in _subdirs(root / name, depth - 1))
    return out


def _comfy_folder(name: str) -> str:
    """The folder (relative to the output directory) named by a ``comfy:`` choice, checked not to escape it."""
    rel = name[len(COMFY_PREFIX):].strip().replace("\\", "/").strip("/")
    if not rel or ".." in rel.split("/") or os.path.isabs(rel) or "\x00" in rel:
        raise ValueError(f"cache {name!r}: give a folder of ComfyUI's output directory after `{COMFY_PREFIX}`, "
                         "without '..' or an absolute path")
    return rel


def resolve_source(name: str) -> tuple[Path | CacheURL, Path | None]:
    """Return ``(cache root, ComfyUI source folder or None)`` of a ``cache`` choice; the root of a ``remote:`` choice
    is its URL (nothing is fetched here).

    Raises:
        ValueError: the name escapes its folder, or names no cache, no remote cache and no ComfyUI dataset (the
            message lists the available ones).
    """
    if name == NO_CACHE_YET:
        raise ValueError(no_cache_yet_message("cache"))
    if name.startswith(REMOTE_PREFIX):
        return resolve_remote(name), None
    if name.startswith(COMFY_PREFIX):
        rel = _comfy_folder(name)
        src = Path(folder_paths.get_output_directory()) / rel
        if not src.is_dir() or detect_comfy_dataset(src) is None:
            raise ValueError(f"cache {name!r}: {src} is not a ComfyUI SaveTrainingDataset folder; available: "
                             f"{', '.join(list_comfy_datasets()) or 'none'}")
        return cache_roots()[0] / CONVERTED_FOLDER / rel, src
    root = resolve_cache(name)
    if not is_cache_folder(root):
        raise ValueError(f"cache {name!r}: unknown cache (no cache at {root}); available: "
                         f"{', '.join(list_caches() + remote_choices() + list_comfy_datasets()) or 'none'}. Pick one "
                         "of those (press R "
                         "to refresh the list), or encode one with Encode Dataset or save one with Save Streamable "
                         "Cache")
    return root, None


def _source_files(src: Path) -> list[os.stat_result]:
    info = inspect_comfy_dataset(src)
    return [p.stat() for p in (src / "metadata.json", *info.shards)]


def remote_identity(url: CacheURL, dataset: str) -> str:
    """A remote cache's committed state: its manifest's ETag (one HEAD request; ``fingerprint_inputs`` fails, and
    ComfyUI then runs the node, when the store cannot be reached: the run names the problem)."""
    from ..dataset_cache.format.layout import MANIFEST
    from ..dataset_cache.remote.client import ObjectClient

    head = ObjectClient(url, remote_options()).head(MANIFEST)
    return f"{head.etag}:{head.size}:{dataset}"


def _ensure_converted(root: Path, src: Path, dataset: str) -> bool:
    """Convert ``src`` into ``root`` unless the converted dataset is newer than every source file."""
    newest = max(st.st_mtime_ns for st in _source_files(src))
    current = read_dataset_info(root, dataset)
    if (current is not None and current.info.get("source") == str(src.resolve())
            and (root / current.file).stat().st_mtime_ns > newest):
        return False
    report = convert_comfy_dataset(src, root, name=dataset)  # takes the cache's write lock itself
    log.info("converted %s into %s: %d samples, %d new entries", src, root, report.samples, report.new_entries)
    return True


def dataset_fields(reader: CacheReader, name: str) -> dict:
    """Samples, buckets (latent shapes from headers), cache size, encoders and problems of one dataset, as
    JSON-able fields (the node's ``streamcache_info`` UI output); no tensor I/O."""
    samples = reader.dataset(name)
    info = reader.datasets()[name].info
    shapes: Counter[str] = Counter()
    missing = 0
    for s in samples:
        if s.latent not in reader:
            missing += 1
            shapes["?"] += 1
            continue
        latent = reader.tensor_shapes(s.latent)
        shape = latent.get("samples") if isinstance(latent, dict) else None
        shapes["x".join(map(str, shape)) if shape is not None else "?"] += 1
        missing += sum(1 for k in s.keys()[1:] if k not in reader)
    stats = reader.stats()
    problems = [str(p) for p in reader.problems]
    if missing:
        problems.append(f"{missing} sample entries are not in the cache (clean or re-encode the dataset)")
    return {
        "kind": "dataset", "dataset": name, "root": str(reader.root), "samples": len(samples),
        "samples_with_repeats": sum(s.repeats for s in samples),
        "captions": sum(len(s.captions) for s in samples), "buckets": dict(sorted(shapes.items())),
        "entries": stats["entries"], "shards": stats["shards"], "bytes": stats["bytes"],
        "datasets": stats["datasets"], "vae_fingerprint": info.get("vae_fingerprint") or "",
        "text_fingerprint": info.get("text_fingerprint") or "", "folder": info.get("folder") or "",
        "source": info.get("source") or "", "verified": "headers", "problems": problems,
    }


def _describe(fields: dict) -> str:
    lines = [
        f"dataset {fields['dataset']!r} in {fields['root']}",
        f"samples: {fields['samples']} ({fields['samples_with_repeats']} with repeats), "
        f"captions: {fields['captions']}",
        "latent shapes: " + ", ".join(f"{k} ×{n}" for k, n in fields["buckets"].items()),
        f"cache: {fields['entries']} entries in {fields['shards']} shards, {fields['bytes']} bytes, "
        f"datasets: {', '.join(sorted(fields['datasets']))}",
    ]
    for key in ("folder", "source", "vae_fingerprint", "text_fingerprint"):
        if fields.get(key):
            lines.append(f"{key}: {fields[key]}")
    lines += [f"PROBLEM: {p}" for p in fields["problems"]]
    return "\n".join(lines)


def describe_dataset(reader: CacheReader, name: str) -> str:
    """Samples, buckets (latent shapes from headers), entries, size and encoders of one dataset; no tensor I/O."""
    return _describe(dataset_fields(reader, name))


class LoadLazyCache(io.ComfyNode):
    """Opens a cache's dataset for training: headers only, nothing is read into memory."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        choices = cache_choices(remote_choices() + list_comfy_datasets())
        return io.Schema(
            node_id="StreamCache_LoadLazyCache",
            display_name="Load Lazy Cache",
            category="StreamCache",
            description="Opens a dataset of a StreamCache cache for training without reading any tensor "
                        "(training streams them). ComfyUI dataset folders (comfy:...) are converted once.",
            inputs=[
                io.Combo.Input("cache", options=choices, default=choices[0],
                               tooltip="The cache to read: one in models/streamcache, remote:<name> for a cache "
                               "in object storage listed in models/streamcache/remote.json, or comfy:<folder> for a "
                               "folder written by ComfyUI's Save Training Dataset (converted into a cache on first "
                               "use). Press R to refresh the list."),
                io.String.Input("dataset_name", default="default",
                                tooltip="The dataset inside the cache (`default` unless you named it; Cache Info "
                                "lists a cache's datasets)."),
            ],
            outputs=[
                StreamDataset.Output(display_name="dataset", tooltip="The dataset, for training nodes."),
                io.String.Output(display_name="info", tooltip="Samples, latent shapes, encoders, cache size."),
            ],
            has_intermediate_output=True,  # a cached run re-sends the info to the node's panel
        )

    @classmethod
    def validate_inputs(cls, cache: str | None = None) -> bool | str:
        # only `cache`: ComfyUI shows a message returned here on every input this signature names, and a cache
        # problem is not the dataset name's; dataset_name is checked when the node runs
        try:
            if cache is not None:
                resolve_source(cache)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, cache: str, dataset_name: str) -> str:
        root, src = resolve_source(cache)
        dataset = dataset_name
        if isinstance(root, CacheURL):
            state = remote_identity(root, dataset)
        elif src is None:
            state = cache_identity(root, dataset)
        else:  # the converted cache follows its source; our own conversion must not count as a change
            state = ";".join(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}" for st in _source_files(src))
        return xxhash.xxh3_128_hexdigest(f"{root}\0{dataset}\0{state}".encode())

    @classmethod
    def execute(cls, cache: str, dataset_name: str) -> io.NodeOutput:
        dataset = dataset_name
        if not (dataset or "").strip():
            raise ValueError("dataset_name is empty; give the dataset's name (`default` unless you named it; "
                             "Cache Info lists a cache's datasets)")
        root, src = resolve_source(cache)
        converted = src is not None and isinstance(root, Path) and _ensure_converted(root, src, dataset)
        handle = StreamDatasetHandle(str(root), dataset)
        try:
            reader, _samples = handle.open()  # headers + the sample list: checks the dataset exists
        except CacheError:  # a damaged cache: its own message names the file and what to do
            raise
        except ValueError as exc:  # the dataset is not in the cache
            raise ValueError(f"dataset_name: {exc}") from exc
        try:
            fields = dataset_fields(reader, dataset)
        finally:
            reader.close()
        text = _describe(fields)
        if src is not None:
            fields["converted_from"] = str(src)
            text += f"\nconverted from {src}" + (" (just now)" if converted else " (earlier)")
        return io.NodeOutput(handle, text, ui=TextWithData(text, streamcache_info=fields))

