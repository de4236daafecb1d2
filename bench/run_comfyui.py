"""What ``scripts/bench-comfy`` runs with ComfyUI's python: :func:`bench.comfy_command.main`, with the pack off
``sys.path``.

Why a file run by path rather than ``python -m bench.comfy_command``: ``-m`` puts the current folder, the pack root,
first on ``sys.path``, where the pack's ``nodes/`` package shadows ComfyUI's ``nodes.py`` (and the root
``__init__.py`` is not meant to be imported that way). Run by path, Python puts only this file's folder
(``bench/``) on ``sys.path``; the module names there shadow nothing ComfyUI imports (``tests/unit`` checks them
against the standard library and ComfyUI's top-level names). The packages the benchmark needs are then registered
from their folders with importlib, as the test suites do (``tests/support/pack.py``): ``support`` (tests/support:
locating ComfyUI, the tiny models, importing the pack the way ComfyUI does), ``dataset_cache`` and ``bench``.
Nothing of the pack is added to ``sys.path``; ComfyUI's own tree is (:func:`bench.comfyui.comfy_setup`), as when
ComfyUI runs.

    "$COMFYUI_PYTHON" bench/run_comfyui.py [options]      # what scripts/bench-comfy does; --help for options
    "$COMFYUI_PYTHON" bench/run_comfyui.py encode-memory [options]   # bench/encode_memory.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py gpu [options]             # scripts/bench-gpu: bench/gpu.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py step-ops [options]        # scripts/bench-step-ops: bench/step_ops.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py profile-cost [options]    # bench/gpu_profile_cost.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py plan-shapes [options]     # bench/plan_shapes.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py startup [options]         # bench/startup.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py saves [options]           # bench/saves.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py layers [options]          # bench/train_layers.py
    "$COMFYUI_PYTHON" bench/run_comfyui.py dropout [options]         # bench/dropout_cost.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACK_ROOT = Path(__file__).resolve().parents[1]


def _load_package(name: str, folder: Path) -> ModuleType:
    """Import the package in ``folder`` under ``name`` (its submodules found in that folder)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None, f"cannot load {folder}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def main() -> int:
    _load_package("support", PACK_ROOT / "tests" / "support")
    from support.pack import import_bench

    import_bench()  # and dataset_cache, which it imports
    argv = sys.argv[1:]
    if argv[:1] == ["encode-memory"]:
        from bench.encode_memory import main as encode_memory_main

        return encode_memory_main(argv[1:])
    if argv[:1] == ["gpu"]:
        from bench.gpu import main as gpu_main

        return gpu_main(argv[1:])
    if argv[:1] == ["profile-cost"]:
        from bench.gpu_profile_cost import main as profile_cost_main

        return profile_cost_main(argv[1:])
    if argv[:1] == ["plan-shapes"]:
        from bench.plan_shapes import main as plan_shapes_main

        return plan_shapes_main(argv[1:])
    if argv[:1] == ["startup"]:
        from bench.startup import main as startup_main

        return startup_main(argv[1:])
    if argv[:1] == ["saves"]:
        from bench.saves import main as saves_main

        return saves_main(argv[1:])
    if argv[:1] == ["layers"]:
        from bench.train_layers import main as layers_main

        return layers_main(argv[1:])
    if argv[:1] == ["dropout"]:
        from bench.dropout_cost import main as dropout_main

        return dropout_main(argv[1:])
    if argv[:1] == ["step-ops"]:
        from bench.step_ops import main as step_ops_main

        return step_ops_main(argv[1:])
    from bench.comfy_command import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
