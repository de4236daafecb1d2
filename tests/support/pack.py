"""Importing the pack's code in tests without putting the pack root on ``sys.path``.

Putting the root on ``sys.path`` would make its ``nodes/`` package shadow ComfyUI's ``nodes.py`` module in the
suites that import ComfyUI, so instead:

* :func:`import_library` registers ``dataset_cache`` as a top-level package loaded from the pack (no ComfyUI
  needed);
* :func:`import_pack` imports the whole pack the way ComfyUI does (a package whose ``__init__`` is the pack
  root's), under the name ``comfyui_streamcache``, so relative imports inside it work (needs ComfyUI);
* :func:`import_bench` registers the repository's benchmarks (``bench/``) as the top-level package ``bench``
  (``scripts/bench-comfy`` runs them under ComfyUI's python this way, see ``bench/run_comfyui.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .paths import PACK_ROOT

__all__ = ["PACK_MODULE", "import_bench", "import_library", "import_pack"]

PACK_MODULE = "comfyui_streamcache"


def _load_package(name: str, folder: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None, f"cannot load {folder}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_library() -> ModuleType:
    """The pack's ``dataset_cache`` package, importable afterwards as ``import dataset_cache``."""
    return _load_package("dataset_cache", PACK_ROOT / "dataset_cache")


def import_pack() -> ModuleType:
    """The pack imported as ComfyUI imports it (ComfyUI must be importable in this process).

    Its ``nodes`` subpackage is imported too (the root ``__init__`` defers it to ``comfy_entrypoint``), so
    tests can reach ``pack.nodes.<module>``.
    """
    pack = _load_package(PACK_MODULE, PACK_ROOT)
    importlib.import_module(f"{PACK_MODULE}.nodes")
    return pack


def import_bench() -> ModuleType:
    """The repository's ``bench`` package, importable afterwards as ``import bench`` (with ``dataset_cache``, which
    its modules import)."""
    import_library()
    return _load_package("bench", PACK_ROOT / "bench")
