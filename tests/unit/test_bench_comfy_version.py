"""bench/comfyui.py (``scripts/bench-comfy``) reads ComfyUI's version by parsing comfyui_version.py, never by
running it.

(``comfy node validate`` flags ``exec``; the registry will refuse it. The module is imported here without ComfyUI:
its top level needs only the ``bench`` package.)
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from support.paths import PACK_ROOT


@pytest.fixture(scope="module")
def bench_comfy() -> ModuleType:
    from bench import comfyui

    return comfyui


def test_version_is_read_without_running_the_file(bench_comfy: ModuleType, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "comfyui_version.py").write_text(
        "# generated\n"
        f"open({str(marker)!r}, 'w').close()\n"
        '__version__ = "0.28.0"\n', encoding="utf-8")
    assert bench_comfy.comfy_version(tmp_path) == "0.28.0"
    assert not marker.exists(), "comfyui_version.py was executed"


@pytest.mark.parametrize("text", ["", "__version__ = compute()\n", "def (:\n", "version = '1.0.0'\n"])
def test_unreadable_version_is_a_question_mark(bench_comfy: ModuleType, tmp_path: Path, text: str) -> None:
    (tmp_path / "comfyui_version.py").write_text(text, encoding="utf-8")
    assert bench_comfy.comfy_version(tmp_path) == "?"
    assert bench_comfy.comfy_version(tmp_path / "missing") == "?"


def test_no_exec_or_eval_in_the_repository() -> None:
    """What ``comfy node validate`` checks (ruff S102 exec, S307 eval), without needing ruff."""
    import ast

    found = []
    for path in PACK_ROOT.rglob("*.py"):
        rel = path.relative_to(PACK_ROOT)
        if rel.parts[0].startswith(".") or "node_modules" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("exec", "eval")):
                found.append(f"{rel}:{node.lineno} {node.func.id}")
    assert not found, found
