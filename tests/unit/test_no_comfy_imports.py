"""``dataset_cache/`` must stay a plain library: no module of it may import ComfyUI.

The rule keeps the library testable and usable without ComfyUI (``python -m dataset_cache``); nodes/ is the
only place that adapts between the two. Checked on the source (AST), so it also covers modules no test
imports, lazy imports inside functions, and ``importlib.import_module("comfy...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "dataset_cache"
FORBIDDEN = frozenset({
    "comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "nodes", "execution",
    "latent_preview", "node_helpers",
})


def forbidden_imports(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line: module"`` for every absolute import of a ComfyUI module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{filename}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    return found


def _library_files() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def test_library_has_modules() -> None:
    assert _library_files(), f"no .py files under {LIBRARY}"


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_module_does_not_import_comfyui(path: Path) -> None:
    bad = forbidden_imports(path.read_text(encoding="utf-8"), str(path.relative_to(LIBRARY.parent)))
    assert not bad, "dataset_cache must not import ComfyUI (move the code to nodes/):\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "import comfy.model_management",
    "from comfy_api.latest import io",
    "import os, folder_paths",
    "def f():\n    import server",
    "from nodes import NODE_CLASS_MAPPINGS",
    "import importlib\nimportlib.import_module('comfy_extras.nodes_train')",
    "__import__('execution')",
])
def test_checker_flags_comfyui_imports(source: str) -> None:
    assert forbidden_imports(source)


@pytest.mark.parametrize("source", [
    "from . import nodes",
    "from .format import reader",
    "import comfyish",
    "import torch, safetensors, xxhash",
    "from ..server import x",
])
def test_checker_allows_library_imports(source: str) -> None:
    assert not forbidden_imports(source)
