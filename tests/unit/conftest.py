"""Unit suite: the ``dataset_cache`` library alone, under the project venv (no ComfyUI).

``tests/`` goes on ``sys.path`` (for ``import support``), and ``dataset_cache`` is registered as a top-level
package loaded from the pack, so ``import dataset_cache`` works without the pack root on ``sys.path`` (its
``nodes/`` would shadow ComfyUI's ``nodes`` when the suites share a process) and without importing the pack
root's ``__init__.py`` (it needs ComfyUI). The benchmarks' package ``bench`` is registered the same way (the
tests of ``python -m dataset_cache bench`` and of the benchmarks' own code import it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from support.collection import skip_cuda_tests_without_device, skip_pack_root_setup  # noqa: E402
from support.pack import import_bench  # noqa: E402

import_bench()  # and dataset_cache


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_pack_root_setup(items)
    skip_cuda_tests_without_device(items)
