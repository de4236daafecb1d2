"""Input names shared by the pack's nodes, the names older versions used, and what the pickers offer.

One concept, one name on every node: ``cache`` is the name of a cache (a folder in ``models/streamcache``),
``dataset_name`` the name of a dataset inside a cache, and ``dataset`` the ``STREAM_DATASET`` socket that carries
one between nodes. Version 0.1.0 (and the 0.2.0 development version) spelled some of them differently;
:data:`RENAMED_INPUTS` lists those spellings, and :func:`upgrade_prompt` rewrites them in an API prompt before
ComfyUI validates it (registered as an ``on_prompt`` handler of ComfyUI's server), so a saved API prompt keeps
working. The front-end extension (``web/js/streamcache.js``) renames the same inputs of a saved UI workflow when
it loads; widget values are stored by position there, and the renamed inputs kept their positions.

A cache the node *reads* is picked from a dropdown (:func:`cache_choices`, refreshed with ComfyUI's "refresh node
definitions", key R); a cache the node *creates* is typed, with the existing ones named in the tooltip
(:func:`existing_caches_hint`). Where a list is empty, it shows one entry that says what to do
(:data:`NO_CACHE_YET`), and the node's validation refuses that entry with the same advice.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import folder_paths

from ..dataset_cache.frames import FRAMES_SUFFIX

__all__ = ["NO_CACHE_YET", "NO_FOLDER_YET", "RENAMED_INPUTS", "cache_choices", "existing_caches_hint",
           "input_folders", "no_cache_yet_message", "register_prompt_upgrade", "upgrade_prompt"]

log = logging.getLogger("streamcache.inputs")

RENAMED_INPUTS: dict[str, dict[str, str]] = {
    "StreamCache_EncodeDataset": {"dataset": "dataset_name"},
    "StreamCache_SaveCache": {"name": "cache"},
    "StreamCache_LoadLazyCache": {"name": "cache", "dataset": "dataset_name"},
    "StreamCache_CleanCache": {"name": "cache"},
}
"""``{node id: {old input name: current name}}`` of every input renamed since 0.1.0 (kept forever: saved workflows
are users' data). ``web/js/streamcache.js`` holds the same table for UI workflows."""

NO_CACHE_YET = "(no cache yet: encode one, then press R)"
"""The one entry of a cache dropdown when no cache exists (a fresh install): says what to do instead of being
blank."""
NO_FOLDER_YET = "(no folder in input/ yet: add one, then press R)"
"""The one entry of Encode Dataset's folder dropdown when ComfyUI's input directory has no folder."""

FOLDER_DEPTH = 3
"""Levels of ComfyUI's input directory that the folder dropdown lists (``people/alice/5_alice``); deeper folders can
still be given in an API prompt."""
FOLDER_LIMIT = 2000
"""At most this many folders are listed: the input directory can be large, and the list is rebuilt whenever
ComfyUI asks for the node definitions."""
HINT_LIMIT = 12
"""Existing caches named in a tooltip (then ``and N more``)."""


def upgrade_prompt(prompt: Any) -> list[str]:
    """Rename, in place, the inputs of the pack's nodes that an API prompt gives under an old name.

    An old name is moved to the current one only when the current one is absent (a prompt that names both keeps
    the current value). Anything that is not a well-formed prompt is left alone: ComfyUI's own validation reports
    it. Returns ``"<node id>.<old>-><new>"`` for each rename (for the log).
    """
    done: list[str] = []
    if not isinstance(prompt, dict):
        return done
    for node_id, node in prompt.items():
        if not isinstance(node, dict):
            continue
        renames = RENAMED_INPUTS.get(node.get("class_type"))  # type: ignore[arg-type]
        inputs = node.get("inputs")
        if not renames or not isinstance(inputs, dict):
            continue
        for old, new in renames.items():
            if old in inputs and new not in inputs:
                inputs[new] = inputs.pop(old)
                done.append(f"{node_id}.{old}->{new}")
    return done


def _on_prompt(json_data: Any) -> Any:
    """ComfyUI ``on_prompt`` handler: :func:`upgrade_prompt` on the posted prompt; never raises."""
    try:
        renamed = upgrade_prompt(json_data.get("prompt") if isinstance(json_data, dict) else None)
        if renamed:
            log.info("StreamCache: inputs of a prompt saved by an older version renamed: %s", ", ".join(renamed))
    except Exception:  # a handler must not stop a prompt; validation reports what is wrong with it
        log.debug("could not upgrade the prompt's input names", exc_info=True)
    return json_data


def register_prompt_upgrade() -> bool:
    """Register :func:`upgrade_prompt` with ComfyUI's server (once); False when no server runs (tests in-process)."""
    server_module = sys.modules.get("server")  # never imported by us: no server, nothing to register
    instance = getattr(getattr(server_module, "PromptServer", None), "instance", None)
    add: Callable[[Any], None] | None = getattr(instance, "add_on_prompt_handler", None)
    if add is None:
        return False
    if _on_prompt not in getattr(instance, "on_prompt_handlers", []):
        add(_on_prompt)
    return True


def cache_choices(extra: list[str] | None = None) -> list[str]:
    """The options of a dropdown of existing caches (plus ``extra``), or ``[NO_CACHE_YET]`` when there are none."""
    from .load_cache import list_caches  # load_cache imports this module

    choices = list_caches() + list(extra or [])
    return choices or [NO_CACHE_YET]


def no_cache_yet_message(input_name: str) -> str:
    """What a node says when its cache dropdown still shows :data:`NO_CACHE_YET`."""
    return (f"{input_name}: no cache exists yet in models/streamcache. Encode an image folder with Encode Dataset "
            "(or save one with Save Streamable Cache), then press R to refresh the list and pick it")


def existing_caches_hint() -> str:
    """A tooltip sentence naming the existing caches (or saying there is none yet)."""
    from .load_cache import list_caches  # load_cache imports this module

    caches = list_caches()
    if not caches:
        return "No cache exists yet."
    more = f" and {len(caches) - HINT_LIMIT} more" if len(caches) > HINT_LIMIT else ""
    return "Existing caches (press R to refresh): " + ", ".join(caches[:HINT_LIMIT]) + more + "."


def _is_clip_folder(name: str) -> bool:
    return name.lower().endswith(FRAMES_SUFFIX) and len(name) > len(FRAMES_SUFFIX)


def input_folders() -> list[str]:
    """Folders of ComfyUI's input directory, :data:`FOLDER_DEPTH` levels deep, as ``a/b`` paths, sorted.

    Like the built-in "Load Image (from Folder)" list, plus folders that are symbolic links (the way to offer a
    folder kept elsewhere: a link in ``input/`` is the machine owner's choice, unlike a path in a shared
    workflow); hidden folders are left out and links are not descended into. A ``<name>.frames`` folder is one
    video clip of a dataset, never a dataset: it is not offered (Encode Dataset refuses it by name when typed).
    """
    base = folder_paths.get_input_directory()
    found: list[str] = []

    def walk(rel: str, depth: int) -> None:
        try:
            with os.scandir(os.path.join(base, rel) if rel else base) as it:
                entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if len(found) >= FOLDER_LIMIT:
                return
            try:
                if not entry.is_dir() or _is_clip_folder(entry.name):
                    continue
            except OSError:
                continue
            path = f"{rel}/{entry.name}" if rel else entry.name
            found.append(path)
            if depth > 1 and not entry.is_symlink():
                walk(path, depth - 1)

    walk("", FOLDER_DEPTH)
    return sorted(found)
