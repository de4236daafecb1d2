"""Collection helpers shared by the suites' ``conftest.py`` files.

The pack root holds ComfyUI's entry ``__init__.py``, so pytest sees the root as a package and, when it sets up
a test, imports that file (``Package.setup`` looks for ``setup_module``), which needs ComfyUI. The pack's
``__init__`` has no module-level setup, so each suite disables that one call instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from .paths import PACK_ROOT

__all__ = [
    "add_marker_under", "drop_suite", "only_dropped", "report_dropped", "skip_cuda_tests_without_device",
    "skip_pack_root_setup",
]


def _no_setup() -> None:
    return None


def skip_pack_root_setup(items: Iterable[pytest.Item]) -> None:
    """Keep pytest from importing the pack root's ``__init__.py`` while setting up ``items``."""
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and node.path == PACK_ROOT:
                node.setup = _no_setup  # type: ignore[method-assign]


def add_marker_under(items: Iterable[pytest.Item], folder: Path, marker: str) -> list[pytest.Item]:
    """Mark every item whose file lies under ``folder`` (conftest hooks see all items of the session)."""
    chosen = [item for item in items if item.path.is_relative_to(folder)]
    for item in chosen:
        item.add_marker(marker)
    return chosen


_DROPPED: dict[str, int] = {}
"""Reason → number of tests left out by :func:`drop_suite` (shared by every suite's conftest)."""
_PRINTED: set[str] = set()


def drop_suite(config: pytest.Config, items: list[pytest.Item], folder: Path, reason: str) -> None:
    """Leave out every test under ``folder``; :func:`report_dropped` then prints ``reason`` once.

    Used when a suite cannot run here (no ComfyUI): one summary line instead of one skip line per test.
    """
    dropped = [item for item in items if item.path.is_relative_to(folder)]
    if not dropped:
        return
    items[:] = [item for item in items if not item.path.is_relative_to(folder)]
    config.hook.pytest_deselected(items=dropped)
    _DROPPED[reason] = _DROPPED.get(reason, 0) + len(dropped)


def report_dropped(terminalreporter: object) -> None:
    """Print each reason of :func:`drop_suite` once (every suite's ``pytest_terminal_summary`` calls this)."""
    for reason, count in _DROPPED.items():
        if reason not in _PRINTED:
            _PRINTED.add(reason)
            terminalreporter.write_line(f"SKIPPED {count} tests: {reason}", yellow=True, bold=True)


def only_dropped(session: pytest.Session, exitstatus: int) -> None:
    """A run whose every test was left out by :func:`drop_suite` is a clean skip (0), not "no tests" (5)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _DROPPED:
        session.exitstatus = pytest.ExitCode.OK


def skip_cuda_tests_without_device(items: Iterable[pytest.Item]) -> None:
    """Skip items marked ``cuda`` when this process sees no CUDA device (torch imported only if needed)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
