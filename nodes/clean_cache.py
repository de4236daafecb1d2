"""Node "Clean Cache": preview or reclaim the space of entries no dataset references.

A thin wrapper around :func:`dataset_cache.clean.clean`: a dry run (the default) only reports; a real run
removes unreferenced entries, compacts underfull shards and deletes orphan files, and refuses (with an error
saying why) while an encode or a training run uses the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from comfy_api.latest import io, ui

from ..dataset_cache import clean, is_cache_folder
from .inputs import NO_CACHE_YET, cache_choices, no_cache_yet_message
from .load_cache import list_caches
from .paths import resolve_cache

__all__ = ["CleanCache"]


def _existing_cache(cache: str) -> Path:
    """The folder of an existing cache, or a ValueError naming the input, the value and the caches there are."""
    if cache == NO_CACHE_YET:
        raise ValueError(no_cache_yet_message("cache"))
    root = resolve_cache(cache)
    if not is_cache_folder(root):
        raise ValueError(f"cache {cache!r}: unknown cache (no cache at {root}); available: "
                         f"{', '.join(list_caches()) or 'none'}. Pick one of those (press R to refresh the list)")
    return root


class CleanCache(io.ComfyNode):
    """Reports, and on request removes, what no dataset of a cache references."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        choices = cache_choices()
        return io.Schema(
            node_id="StreamCache_CleanCache",
            display_name="Clean Cache",
            category="StreamCache",
            description="Shows how much of a cache no dataset uses (old encodes, removed images, replaced "
                        "captions) and, with dry_run off, removes it and compacts the shards.",
            inputs=[
                io.Combo.Input("cache", options=choices, default=choices[0],
                               tooltip="The cache to clean (a folder in models/streamcache). Press R to refresh "
                               "the list."),
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
    def validate_inputs(cls, cache: str | None = None) -> bool | str:
        if cache is None:
            return True
        try:
            _existing_cache(cache)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, **_: Any) -> float:
        return float("nan")  # the cache changes under the same name, and a clean must act every time it is asked

    @classmethod
    def execute(cls, cache: str, dry_run: bool, repair: bool = False) -> io.NodeOutput:
        root = _existing_cache(cache)
        report = clean(root, dry_run=dry_run, repair=repair)
        text = report.summary()
        if report.compaction is not None:
            text += (f"\nshards compacted: {report.compaction.shards_rewritten} rewritten, "
                     f"{report.compaction.shards_before} → {report.compaction.shards_after}")
        return io.NodeOutput(text, ui=ui.PreviewText(text))
