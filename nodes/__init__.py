"""The pack's ComfyUI extension: which nodes it registers and what it sets up when loaded."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .cache_info import CacheInfo
from .clean_cache import CleanCache
from .combine_datasets import CombineDatasets
from .encode_dataset import EncodeDataset
from .load_cache import LoadLazyCache
from .save_cache import SaveCache
from .save_lora import SaveLoRA
from .train_lora import TrainLoRA
from .inputs import register_prompt_upgrade
from .paths import register_cache_folder

__all__ = ["NODES", "StreamCacheExtension"]

NODES: tuple[type[io.ComfyNode], ...] = (EncodeDataset, SaveCache, LoadLazyCache, CombineDatasets, TrainLoRA,
                                         SaveLoRA, CleanCache, CacheInfo)
"""Every node of the pack; ids start with ``StreamCache_`` and the category is ``StreamCache``."""


class StreamCacheExtension(ComfyExtension):
    """Registers the ``streamcache`` model folder and the renaming of old input names in API prompts on load, and
    lists :data:`NODES`."""

    async def on_load(self) -> None:
        register_cache_folder()
        register_prompt_upgrade()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
