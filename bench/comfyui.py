"""ComfyUI set up in-process for the benchmarks run under ComfyUI's python (``scripts/bench-comfy``, its
``encode-memory`` and ``plan-shapes`` commands, ``scripts/bench-gpu``): importable, its folders private to a scratch
folder, the tiny test models registered, and its version read.

Why one module: every one of those benchmarks starts ComfyUI the same way, and this is the one place in ``bench/``
that puts anything on ``sys.path`` (ComfyUI's own tree, as its ``main.py`` runs with it; never the pack root, whose
``nodes/`` would shadow ComfyUI's ``nodes.py``: ``tests/unit/test_bench_package.py`` checks it).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["comfy_setup", "comfy_version", "add_model_folders", "comfy_nodes"]


def comfy_setup(work: Path, cpu: bool = True) -> Any:
    """ComfyUI importable in-process (on the CPU unless ``cpu`` is False: ``scripts/bench-gpu``), its folders private
    to ``work``; returns the install."""
    from support.comfy_env import find_comfyui, skip_reason

    install = find_comfyui()
    if install is None:
        raise SystemExit(skip_reason())
    if str(install.path) not in sys.path:  # ComfyUI's own tree, as its main.py runs with it: never the pack root
        sys.path.insert(0, str(install.path))
    from comfy.cli_args import args

    args.cpu = cpu
    import folder_paths

    for sub in ("output", "input", "temp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    folder_paths.set_output_directory(str(work / "output"))
    folder_paths.set_input_directory(str(work / "input"))
    folder_paths.set_temp_directory(str(work / "temp"))
    return install


def add_model_folders(models: str) -> None:
    """Register the tiny test models' folders (``models``: :func:`support.tiny_models.ensure_tiny_models`'s root)
    as ComfyUI's default checkpoint, diffusion model, text encoder and VAE folders."""
    import folder_paths

    for sub in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(sub, str(Path(models) / sub), is_default=True)


def comfy_nodes() -> Any:
    """ComfyUI's ``nodes`` module (its loaders and ``CLIPTextEncode``), once :func:`comfy_setup` ran.

    Imported by name at run time: to a type checker run from the pack root, ``nodes`` is the pack's own package.
    """
    return importlib.import_module("nodes")


def comfy_version(path: Path) -> str:
    """ComfyUI's version from ``<path>/comfyui_version.py``, read without running the file ("?" if unreadable).

    The file is generated as ``__version__ = "x.y.z"``; it is parsed, never executed.
    """
    try:
        tree = ast.parse((path / "comfyui_version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return "?"
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return node.value.value
    return "?"
