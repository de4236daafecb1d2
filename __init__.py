"""ComfyUI-StreamCache: a ComfyUI custom node pack (V3 node API).

ComfyUI imports this folder as a package and calls :func:`comfy_entrypoint`. Everything the nodes do lives in
the ComfyUI-free library ``dataset_cache/``; the adapters live in ``nodes/``. This file only exposes the
entry point and the web folder (no ``NODE_CLASS_MAPPINGS``: a V1 mapping would make ComfyUI ignore the V3
entry point).
"""

from __future__ import annotations

from comfy_api.latest import ComfyExtension

WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]


async def comfy_entrypoint() -> ComfyExtension:
    """Called by ComfyUI's loader; returns the extension that lists the pack's nodes."""
    from .nodes import StreamCacheExtension

    return StreamCacheExtension()
