"""Fixed locations of the repository and of the on-disk cache shared by test runs."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PACK_ROOT", "TESTS_DIR", "cache_home"]

TESTS_DIR = Path(__file__).resolve().parents[1]
PACK_ROOT = TESTS_DIR.parent


def cache_home() -> Path:
    """Directory for generated test artefacts that are worth keeping between runs (tiny models).

    ``$STREAMCACHE_TEST_CACHE`` if set, else ``$XDG_CACHE_HOME/comfyui-streamcache`` (``~/.cache/...``).
    Never inside the repository: the files are large (~0.5 GB) and are regenerated on demand.
    """
    explicit = os.environ.get("STREAMCACHE_TEST_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "comfyui-streamcache"
