"""dataset_cache: a content-addressed, streamable training cache for LoRA training.

The library behind ComfyUI-StreamCache, usable without ComfyUI:

* :func:`open_cache` / :class:`CacheWriter` — the on-disk format (docs/FORMAT.md): immutable safetensors shards,
  a manifest and an append-only journal; entries come back as lazy structures (:class:`LazyTensor`) and are
  read in batches with few large reads and checksums verified.
* :func:`plan_encode` / :func:`run_encode` — encode an image+caption folder incrementally: only entries whose
  content key is missing are encoded, each batch committed durably. Video clips (files, or ``<name>.frames``
  folders) are samples too, their frames picked by :class:`FrameSettings`.
* :class:`BucketSampler` / :class:`PrefetchLoader` — deterministic bucketed batch order with resume and rank
  sharding, read ahead on background threads (pinned buffers and side-stream copies on CUDA);
  :class:`MultiCacheReader` trains datasets of several caches together.
* :func:`preview_clean` / :func:`clean` — reclaim entries no dataset references.

It never imports ComfyUI; ``python -m dataset_cache`` is its command line.
"""

from __future__ import annotations

from .clean import CleanPreview, CleanReport, clean, preview_clean
from .dataset import DatasetInfo, Sample
from .errors import (
    CacheCorruptError,
    CacheError,
    CacheFormatError,
    CacheLockedError,
    CacheNotFoundError,
    MaterializeRequired,
    SourceError,
    UnstorableValueError,
)
from .format import CacheReader, CacheWriter, CompactReport, ReadBuffer, open_cache
from .format.layout import is_cache_folder
from .format.dataset_file import check_dataset_name
from .format.manifest import CacheState, read_state
from .frames import FrameSettings
from .encode_jobs import EncodePlan
from .encode_settings import EncodeSettings
from .encode_plan import plan_encode
from .encode_report import EncodeReport
from .encode_run import run_encode
from .latent_buckets import buckets_from_reader
from .loader import Batch, LoaderStats, LoaderWorkerError, PrefetchLoader
from .multi_reader import MultiCacheReader
from .refs import LazyTensor, is_lazy, materialize
from .sampler import BatchPlan, BucketSampler
from .saving import SaveResult, copy_dataset, read_dataset_info, save_latent_lists, update_dataset_info
from .variants import VariantSummary, summarize_variants

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchPlan",
    "buckets_from_reader",
    "BucketSampler",
    "CacheCorruptError",
    "CacheError",
    "CacheFormatError",
    "CacheLockedError",
    "CacheNotFoundError",
    "CacheReader",
    "CacheState",
    "CacheWriter",
    "check_dataset_name",
    "clean",
    "CleanPreview",
    "CleanReport",
    "CompactReport",
    "copy_dataset",
    "DatasetInfo",
    "EncodePlan",
    "EncodeReport",
    "EncodeSettings",
    "FrameSettings",
    "is_cache_folder",
    "is_lazy",
    "LazyTensor",
    "LoaderStats",
    "LoaderWorkerError",
    "materialize",
    "MaterializeRequired",
    "MultiCacheReader",
    "open_cache",
    "plan_encode",
    "PrefetchLoader",
    "preview_clean",
    "read_dataset_info",
    "read_state",
    "ReadBuffer",
    "run_encode",
    "Sample",
    "save_latent_lists",
    "SaveResult",
    "SourceError",
    "UnstorableValueError",
    "summarize_variants",
    "update_dataset_info",
    "VariantSummary",
]
