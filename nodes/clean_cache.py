"""Node "Clean Cache": preview or reclaim the space of entries no dataset references.

A thin wrapper around :func:`dataset_cache.clean.clean`: a dry run (the default) only reports; a real run
removes unreferenced entries, compacts underfull shards and deletes orphan files, and refuses (with an error
saying why) while an encode or a training run uses the cache.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io, ui

from ..dataset_cache.clean import clean
from ..dataset_cache.format.manifest import MANIFEST
from .load_cache import list_caches
from .paths import resolve_cache

__all__ = ["CleanCache"]


class CleanCache(io.ComfyNode):
    """Reports, and on request removes, what no dataset of a cache references."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        choices = list_caches()
        return io.Schema(
            node_id="StreamCache_CleanCache",
            display_name="Clean Cache",
            category="StreamCache",
            description="Shows how much of a cache no dataset uses (old encodes, removed images, replaced "
                        "captions) and, with dry_run off, removes it and compacts the shards.",
            inputs=[
                io.Combo.Input("name", options=choices or [""], default=choices[0] if choices else "",
                               tooltip="The cache to clean (a folder in models/streamcache)."),
                io.Boolean.Input("dry_run", default=True,
                                 tooltip="On: only report what would be removed. Off: remove it (refused while "
                                 "an encode or a training run uses the cache)."),
                io.Boolean.Input("repair", default=False, optional=True, advanced=True,
                                 tooltip="On (with dry_run off): read every shard and take the damaged ones out "
                                 "of the cache, moving their files to the cache's damaged/ folder; their entries "
                                 "are re-encoded by the next Encode Dataset. Off: damaged shards are only "
                                 "reported. Shards that cannot be read for now (permissions, I/O) are never "
                                 "taken out."),
            ],
            outputs=[io.String.Output(display_name="report",
                                      tooltip="Entries and bytes unreferenced or removed, shards compacted.")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, name: str | None = None) -> bool | str:
        if name is None:
            return True
        try:
            root = resolve_cache(name)
        except ValueError as exc:
            return str(exc)
        if not (root / MANIFEST).is_file():
            return f"unknown cache {name!r} (no cache at {root}); available: {', '.join(list_caches()) or 'none'}"
        return True

    @classmethod
    def fingerprint_inputs(cls, **_: Any) -> float:
        return float("nan")  # the cache changes under the same name, and a clean must act every time it is asked

    @classmethod
    def execute(cls, name: str, dry_run: bool, repair: bool = False) -> io.NodeOutput:
        root = resolve_cache(name)
        if not (root / MANIFEST).is_file():
            raise ValueError(f"unknown cache {name!r} (no cache at {root}); available: "
                             f"{', '.join(list_caches()) or 'none'}")
        report = clean(root, dry_run=dry_run, repair=repair)
        text = report.summary()
        if report.compaction is not None:
            text += (f"\nshards compacted: {report.compaction.shards_rewritten} rewritten, "
                     f"{report.compaction.shards_before} → {report.compaction.shards_after}")
        return io.NodeOutput(text, ui=ui.PreviewText(text))
