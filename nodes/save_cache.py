"""Node "Save Streamable Cache": a dataset, or ComfyUI's own latent + conditioning lists, as a compacted cache.

Two sources, one of them connected:

* ``dataset`` (``STREAM_DATASET``): the dataset's entries are copied into the named cache — latents grouped by
  bucket (latent shape), each followed by its captions — so the new cache is self-contained (it no longer needs
  the source cache) and its shards hold each bucket's rows next to each other;
* ``latents`` + ``conditioning`` lists, as ``MakeTrainingDataset`` (or ``LoadTrainingDataset``) gives them: each
  value is stored under its content key (:func:`dataset_cache.interop.value_key`), so identical captions are
  stored once and saving twice adds nothing; a latent batch of ``B`` rows becomes ``B`` samples, paired with its
  conditioning the way ComfyUI's trainer pairs them.

The dataset is stored last, then the cache is compacted (underfull shards rewritten in dataset order) unless a
training run is reading it at that moment. The cache's write lock keeps a concurrent encode out.

``publish_to`` (optional; old workflows keep their behaviour) then publishes the saved cache to one of the remote
caches of ``remote.json`` (:func:`dataset_cache.remote.publish.push`: content-addressed uploads, never
overwriting, the manifest last), so a team or a rented GPU can train from it with Load Lazy Cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comfy_api.latest import io, ui

from ..dataset_cache import check_dataset_name
from ..dataset_cache.format.compaction import CompactReport
from ..dataset_cache.saving import copy_dataset, save_latent_lists
from .fingerprints import OwnWrites, cache_identity
from .handles import StreamDataset, StreamDatasetHandle
from .inputs import existing_caches_hint
from .paths import explain_disk_full, remote_choices, resolve_cache, resolve_cache_to_write, resolve_remote

__all__ = ["NOT_PUBLISHED", "SaveCache", "save_dataset", "save_lists", "publish"]

NOT_PUBLISHED = "(not published)"
"""``publish_to``'s default: the cache stays on this machine (what the node did before the input existed)."""

log = logging.getLogger("streamcache.save_cache")

_OWN_WRITES = OwnWrites()


def save_dataset(handle: StreamDatasetHandle, root: Path, name: str) -> tuple[int, int, CompactReport | None]:
    """Copy ``handle``'s dataset into the cache at ``root`` as dataset ``name`` (:func:`copy_dataset`).

    Returns ``(samples, entries copied, compaction report)``.
    """
    reader, samples = handle.open()
    try:
        result = copy_dataset(reader, handle.name, root, name, samples=samples, source_label=handle.cache_root)
    finally:
        reader.close()
    return result.samples, result.added, result.compaction


def save_lists(latents: Sequence[Any], conditioning: Sequence[Any], root: Path, name: str
               ) -> tuple[int, int, CompactReport | None]:
    """Store ComfyUI's latent and conditioning lists as dataset ``name`` (:func:`save_latent_lists`).

    Returns ``(samples, new entries, compaction report)``.
    """
    result = save_latent_lists(latents, conditioning, root, name)
    return result.samples, result.added, result.compaction


def publish(root: Path, choice: str) -> str:
    """Publish the cache at ``root`` to the remote cache ``choice`` (``remote:<name>``); the report's line.

    Raises:
        ValueError: ``choice`` names no remote cache. RuntimeError: the upload failed (the local save stands),
            naming the URL and why.
    """
    from ..dataset_cache.errors import CacheError
    from ..dataset_cache.remote.publish import push

    url = resolve_remote(choice)
    try:
        report = push(root, url)
    except CacheError as exc:
        raise RuntimeError(f"the cache was saved into {root}, but publishing it to {url} ({choice}) failed: {exc}"
                           ) from exc
    return report.summary()


def _one(value: Any, name: str) -> Any:
    """Unwrap a widget value that an ``is_input_list`` node receives as a one-item list."""
    if isinstance(value, (list, tuple)):
        distinct = {repr(v) for v in value}
        if len(distinct) > 1:
            raise ValueError(f"{name}: got {len(value)} different values ({', '.join(sorted(distinct)[:3])}); "
                             "connect a single value")
        return value[0] if value else None
    return value


def _check_dataset_name(value: Any) -> None:
    """Refuse an empty or unstorable dataset name, naming the input."""
    name = str(value).strip()
    if not name:
        raise ValueError("dataset_name is empty; give the dataset a name, e.g. `default`")
    try:
        check_dataset_name(name)
    except ValueError as exc:
        raise ValueError(f"dataset_name: {exc}") from exc


def _connected(value: Any) -> list[Any]:
    """The items of an optional list input, or [] when it is not connected (``None`` / ``[None]``)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if v is not None]


class SaveCache(io.ComfyNode):
    """Saves a dataset (or ComfyUI latents + conditioning) as a self-contained, compacted StreamCache cache."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamCache_SaveCache",
            display_name="Save Streamable Cache",
            category="StreamCache",
            description="Writes a dataset into a cache of its own, packed bucket by bucket for sequential reads. "
                        "Connect either a StreamCache dataset, or the latents and conditioning lists of ComfyUI's "
                        "Make Training Dataset.",
            is_input_list=True,
            is_output_node=True,
            inputs=[
                StreamDataset.Input("dataset", optional=True, tooltip="A StreamCache dataset to copy."),
                io.Latent.Input("latents", optional=True,
                                tooltip="ComfyUI latents (list), e.g. from Make Training Dataset."),
                io.Conditioning.Input("conditioning", optional=True,
                                      tooltip="ComfyUI conditionings (list), one per latent or one for all."),
                io.String.Input("cache", default="my_dataset",
                                tooltip="The cache to save into: a folder name inside models/streamcache, created "
                                "if missing (best a new one: the saved cache then holds only this dataset). "
                                + existing_caches_hint()),
                io.String.Input("dataset_name", default="default",
                                tooltip="Name of the dataset inside the cache (replaced if it exists)."),
                io.Combo.Input("publish_to", options=[NOT_PUBLISHED, *remote_choices()], default=NOT_PUBLISHED,
                               optional=True,
                               tooltip="After saving, publish the cache to a remote cache listed in "
                               "models/streamcache/remote.json (replacing what is there; nothing is overwritten "
                               "in the bucket, the new version becomes visible at once). Credentials come from "
                               "the environment or the provider's usual files. Press R to refresh the list."),
            ],
            outputs=[StreamDataset.Output(display_name="dataset", tooltip="The saved dataset.")],
        )

    @classmethod
    def validate_inputs(cls, cache: Any = None) -> bool | str:
        # only `cache`: ComfyUI shows a message returned here on every input this signature names;
        # dataset_name is checked when the node runs, before anything is written
        try:
            cache = _one(cache, "cache")
            if cache is not None:
                resolve_cache_to_write(cache)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, cache: Any, dataset_name: Any, **_: Any) -> str:
        root, ds_name = resolve_cache(_one(cache, "cache")), str(_one(dataset_name, "dataset_name")).strip()
        return _OWN_WRITES.fingerprint((str(root), ds_name), "", cache_identity(root, ds_name))

    @classmethod
    def execute(cls, cache: Any, dataset_name: Any, dataset: Any = None, latents: Any = None,
                conditioning: Any = None, publish_to: Any = None) -> io.NodeOutput:
        root, ds_name = resolve_cache_to_write(_one(cache, "cache")), str(_one(dataset_name, "dataset_name")).strip()
        _check_dataset_name(ds_name)
        target = _one(publish_to, "publish_to") or NOT_PUBLISHED
        if target != NOT_PUBLISHED:
            resolve_remote(target)  # an unknown name fails before anything is written
        with explain_disk_full(root, "saving the cache"):
            handle, text = cls._save(root, ds_name, dataset, latents, conditioning)
        if target != NOT_PUBLISHED:
            text += "\n" + publish(root, target)
        return io.NodeOutput(handle, ui=ui.PreviewText(text))

    @classmethod
    def _save(cls, root: Path, ds_name: str, dataset: Any, latents: Any, conditioning: Any
              ) -> tuple[StreamDatasetHandle, str]:
        handles, lats, conds = _connected(dataset), _connected(latents), _connected(conditioning)
        if handles and (lats or conds):
            raise ValueError("connect either `dataset` or `latents` + `conditioning`, not both")
        if handles:
            handle = _one(handles, "dataset")
            n, written, compaction = save_dataset(handle, root, ds_name)
            what = f"copied {written} entries from {handle.cache_root} (dataset {handle.name!r})"
        elif lats and conds:
            n, written, compaction = save_lists(lats, conds, root, ds_name)
            what = f"stored {written} new entries from {len(lats)} latents"
        else:
            raise ValueError("nothing to save: connect a StreamCache `dataset`, or both `latents` and "
                             "`conditioning` (e.g. from Make Training Dataset)")
        packed = (f"compacted: {compaction.shards_before} → {compaction.shards_after} shards"
                  if compaction else "not compacted (a training run is reading the cache; run Clean Cache later)")
        if compaction is not None and compaction.findings():
            packed += f"\n{compaction.findings()}"
        _OWN_WRITES.remember((str(root), ds_name), "", cache_identity(root, ds_name))
        text = f"saved dataset {ds_name!r} ({n} samples) into {root}\n{what}\n{packed}"
        return StreamDatasetHandle(str(root), ds_name), text
