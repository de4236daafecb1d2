"""Node "Cache Info": tells the user what a cache holds (format, entries, shards, size, datasets)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from comfy_api.latest import io

from ..dataset_cache.errors import CacheError, CacheNotFoundError
from ..dataset_cache.units import format_bytes
from ..dataset_cache.variants import summarize_datasets
from .inputs import NO_CACHE_YET, cache_choices, no_cache_yet_message
from .paths import resolve_cache
from .ui_output import TextWithData

__all__ = ["CacheInfo", "VERIFY_LIMIT_BYTES", "describe_cache", "inspect_cache"]

_READER = "dataset_cache.format.reader"


def _open_cache_function() -> Any | None:
    """``open_cache`` of the library's reader, or None while this install has no reader module."""
    package = __package__.rsplit(".", 1)[0]  # the pack's package, whatever folder name ComfyUI loaded it under
    try:
        module = importlib.import_module(f"{package}.{_READER}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(_READER):
            return None
        raise
    return module.open_cache


def _dataset_variants(reader: Any) -> tuple[list[str], dict[str, Any]]:
    """Each dataset's variants (entries and bytes per role) as report lines and JSON fields; a dataset file
    that cannot be read is named instead (the check lists it as a problem too)."""
    lines: list[str] = []
    fields: dict[str, Any] = {}
    for name, summary in summarize_datasets(reader).items():
        if isinstance(summary, CacheError):
            lines.append(f"  dataset {name!r}: cannot be read ({summary})")
            fields[name] = {"error": str(summary)}
            continue
        fields[name] = summary.describe()
        lines.append(f"  dataset {name!r}: {summary.samples} samples")
        lines += [f"    {line}" for line in summary.lines()]
    return lines, fields


def _human_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{format_bytes(n)} ({n} bytes)"


def _format(value: Any, key: str = "", indent: int = 0) -> list[str]:
    pad = "  " * indent
    label = f"{pad}{key}: " if key else pad
    if isinstance(value, dict):
        if not value:
            return [f"{label}(none)"]
        lines = [f"{pad}{key}:"] if key else []
        for k, v in value.items():
            lines += _format(v, str(k), indent + (1 if key else 0))
        return lines
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in key:
        return [label + _human_bytes(value)]
    return [label + str(value)]


VERIFY_LIMIT_BYTES = 256 * 1024 * 1024
"""Caches up to this size get a full check (every row's checksum, every dataset's entries) on each run; larger
ones get the header check only, so the node stays instant."""


def inspect_cache(path: Path) -> tuple[str, dict[str, Any]]:
    """A human-readable report of the cache at ``path`` (or ``"no cache at <path>"``) and the same facts as
    JSON-able fields (the node's ``streamcache_info`` UI output, with ``problems`` found by the check)."""
    open_cache = _open_cache_function() if path.is_dir() else None
    missing = (f"no cache at {path}", {"kind": "cache", "root": str(path), "exists": False, "problems": []})
    if open_cache is None:
        return missing
    try:
        reader = open_cache(path, strict=False)  # a damaged shard is reported, not raised
    except CacheNotFoundError:
        return missing
    try:
        stats = reader.stats()
        full = stats["bytes"] <= VERIFY_LIMIT_BYTES
        problems = [str(p) for p in (reader.verify() if full else reader.problems)]
        variant_lines, variants = _dataset_variants(reader)
    finally:
        reader.close()
    verified = "full" if full else "headers"
    fields = {"kind": "cache", "root": str(path), "exists": True, "entries": stats["entries"],
              "shards": stats["shards"], "bytes": stats["bytes"], "datasets": stats["datasets"],
              "samples": sum(stats["datasets"].values()), "kinds": stats["kinds"], "version": stats["version"],
              "verified": verified, "problems": problems, "variants": variants}
    lines = [f"StreamCache cache at {path}", *_format(stats, indent=1), *variant_lines]
    check = "every row and dataset checked" if full else f"headers checked (over {_human_bytes(VERIFY_LIMIT_BYTES)})"
    lines.append(f"  verify: {len(problems)} problem(s), {check}" if problems else f"  verify: ok, {check}")
    lines += [f"  PROBLEM: {p}" for p in problems]
    return "\n".join(lines), fields


def describe_cache(path: Path) -> str:
    """A human-readable report of the cache at ``path``, or ``"no cache at <path>"``."""
    return inspect_cache(path)[0]


class CacheInfo(io.ComfyNode):
    """Reports a cache's contents as text; reads headers only, so it is instant even for large caches."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        choices = cache_choices()
        return io.Schema(
            node_id="StreamCache_CacheInfo",
            display_name="Cache Info",
            category="StreamCache",
            description="Shows what a StreamCache cache holds: format version, entries, shards, bytes and datasets.",
            inputs=[
                io.Combo.Input(
                    "cache",
                    options=choices,
                    default=choices[0],
                    tooltip="The cache to describe: the caches in models/streamcache (and in other folders "
                    "registered as `streamcache` in extra_model_paths.yaml). Press R to refresh the list. An API "
                    "prompt may also give an absolute path inside one of those folders.",
                ),
            ],
            outputs=[io.String.Output(display_name="report", tooltip="The same report as shown on the node.")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, cache: str | None) -> bool | str:
        # naming `cache` here also lets a name the list does not hold yet through (the report then says
        # "no cache at ..."), as a saved workflow or an API prompt may name a cache made after the list was built
        if cache is None:  # linked input: the value is only known at run time
            return True
        if cache == NO_CACHE_YET:
            return no_cache_yet_message("cache")
        try:
            resolve_cache(cache)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, cache: str | None) -> float:
        return float("nan")  # the cache's files can change under the same name: always re-read

    @classmethod
    def execute(cls, cache: str) -> io.NodeOutput:
        report, fields = inspect_cache(resolve_cache(cache))
        return io.NodeOutput(report, ui=TextWithData(report, streamcache_info=fields))
