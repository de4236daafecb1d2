"""The benchmarks' package (``bench/``): how it is run, and the ComfyUI section rendered from given figures.

``scripts/bench-comfy`` runs ``bench/run_comfyui.py`` by path under ComfyUI's python, which puts ``bench/`` first on
``sys.path``: a module there named like a standard or ComfyUI module would shadow it. The pack's own packages are
loaded by importlib, never by editing ``sys.path`` (only ComfyUI's tree is put there, to import ComfyUI).
The ComfyUI benchmark itself needs ComfyUI and minutes; its report is checked here from fixed figures.
"""

from __future__ import annotations

import ast
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from support.comfy_env import find_comfyui
from support.paths import PACK_ROOT

BENCH = PACK_ROOT / "bench"


def test_module_names_shadow_nothing_when_bench_is_on_sys_path() -> None:
    names = {p.stem for p in BENCH.glob("*.py")} | {p.name for p in BENCH.iterdir() if (p / "__init__.py").exists()}
    assert {"library", "comfyui", "run_comfyui", "common", "report"} <= names
    clash = sorted(names & set(sys.stdlib_module_names))
    assert not clash, f"bench/ modules named like standard modules: {clash}"
    install = find_comfyui()
    if install is not None:  # ComfyUI's top-level modules and packages (nodes.py, comfy/, utils/, ...)
        comfy_names = {p.stem if p.suffix == ".py" else p.name for p in install.path.iterdir()}
        clash = sorted(names & comfy_names)
        assert not clash, f"bench/ modules named like ComfyUI's top-level modules: {clash}"


def _sys_path_edits(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``sys.path.<mutation>(...)`` or ``sys.path[...] = ...`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and is_sys_path(child.func.value)
                    and child.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")):
                found.append((func, child.lineno))
            elif isinstance(child, (ast.Assign, ast.AugAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                if any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets):
                    found.append((func, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_sys_path_edits_but_comfyuis_tree() -> None:
    edits = {str(p.relative_to(PACK_ROOT)): _sys_path_edits(p) for p in sorted(BENCH.glob("*.py"))}
    edits = {k: v for k, v in edits.items() if v}
    assert list(edits) == ["bench/comfyui.py"], edits
    assert [func for func, _ in edits["bench/comfyui.py"]] == ["comfy_setup"], edits


def test_the_detector_sees_an_edit(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("import sys\nsys.path.insert(0, 'a')\ndef f():\n    sys.path[:0] = ['b']\n")
    assert _sys_path_edits(src) == [("<module>", 2), ("f", 4)]


# ------------------------------------------------------------------------------------------------ ComfyUI report
@pytest.fixture
def comfy_run() -> Any:
    """A ComfyRun with two open sizes, two training sizes, the bound, a failed built-in run and C5."""
    from bench.comfy_driver import ComfyRun
    from bench.common import machine_info

    rnd = random.Random(1)

    def series(k: int, base: float) -> list[float]:
        return [base * (1 + 0.1 * rnd.random()) for _ in range(k)]

    opened = {n: {kind: {"open_s": series(5, b * n / 1000), "growth_mib": series(5, g * n / 1000),
                         "rss_mib": series(5, 500)}
                  for kind, b, g in (("builtin", 0.7, 150), ("ours", 0.007, 0.8), ("lazy", 0.012, 0.004))}
              for n in (1000, 5000)}
    train = {("ours", n): {"first_s": 2.1, "steps": 20, "step_s": series(17, 0.69), "wall_s": 15.0,
                           "peak_mib": 1162 + n / 1000, "r0_mib": 900.0, "rss_end_mib": 1000.0} for n in (1000, 5000)}
    train[("bound", 1000)] = {"first_s": 3.1, "steps": 20, "step_s": [0.64] * 17, "wall_s": 15.0, "peak_mib": 1200.0,
                              "r0_mib": 900.0, "rss_end_mib": 1000.0}
    train[("builtin", 1000)] = {"error": "Traceback\n  boom | pipe\nRuntimeError: it failed"}
    reencode = {"first_s": 23.35, "first_vae": 100, "first_clip": 100, "edit_s": 23.75, "edit_vae": 101,
                "edit_clip": 101, "edited": 1, "added": 1, "n": 100}
    return ComfyRun(mode="--quick", runs=5, steps=12, machine=machine_info({"ComfyUI": "0.28.0 (/x)"}),
                    open=opened, save_s={1000: 3.2, 5000: 15.9}, train=train, reencode=reencode, seconds=300.0)


def test_comfy_section_renders_every_table(comfy_run: Any) -> None:
    from bench.comfy_render import render

    text = render(comfy_run, "scripts/bench-comfy --quick", "bench_comfy.png")
    lines = text.splitlines()
    assert lines[0] == "## ComfyUI benchmarks (`scripts/bench-comfy`)"
    assert "Regenerate: `scripts/bench-comfy --quick` (this run: mode --quick, took 5.0 min)." in text
    assert "- Versions: python" in text and "ComfyUI 0.28.0 (/x)" in text
    for title in ("### C1. Open a dataset", "### C2. Training", "### C5. Built-in re-encode"):
        assert sum(line.startswith(title) for line in lines) == 1, title
    c1 = [line for line in lines if line.startswith(("| 1000 | 3.2 |", "| 5000 | 15.9 |"))]
    assert len(c1) == 2 and "memory ≥20×: met" in c1[0]
    assert any(line.startswith("Growth with N (first to last N): built-in time linear") for line in lines)
    assert "| 1000 | ours (StreamCache) | 2.10 |" in text and "within 5%: NOT met" in text
    assert "| 1000 | built-in TrainLoraNode | failed | | | | | RuntimeError: it failed |" in text
    assert "Peak RSS growth with N: ours flat" in text
    assert "| after the edit | 101 | 101 | 101 | 23.75 |" in text
    assert lines[-1] == "![open and training memory vs N](bench_comfy.png)"



def test_comfy_section_renders_a_run_with_too_few_steps(comfy_run: Any) -> None:
    """A child that recorded fewer step ends than the steady window needs: its row says so (it used to crash the
    whole render on an empty median)."""
    import dataclasses

    from bench.comfy_render import render

    train = dict(comfy_run.train)
    train[("ours", 5000)] = {**train[("ours", 5000)], "step_s": []}
    text = render(dataclasses.replace(comfy_run, train=train), "scripts/bench-comfy --quick")
    assert "| 5000 | ours (StreamCache) | 2.10 | — (too few steps) | 0.00 |" in text

def test_comfy_chart_only_with_more_than_one_size_and_c5(comfy_run: Any, tmp_path: Path) -> None:
    from bench.comfy_render import plot_panels, render
    from bench.report import line_plot

    panels = plot_panels(comfy_run)
    assert [p["title"] for p in panels] == ["Open a dataset (SD1.5), ms", "RSS growth after open, MiB",
                                            "Training peak RSS, MiB"]
    line_plot(tmp_path / "c.png", panels)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    comfy_run.reencode = {}  # without C5 the section ends after C2, and no chart is drawn
    assert plot_panels(comfy_run) == []
    text = render(comfy_run, "scripts/bench-comfy")
    assert "### C5" not in text and "![" not in text and text.rstrip().endswith(").")
