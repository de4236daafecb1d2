"""End-to-end suite: ONE real ComfyUI server per test session, driven over HTTP and the websocket.

The server (``support.server.ComfyServer``) runs under ``$COMFYUI_PYTHON`` with private input/output/temp/user
folders, an in-memory database, the tiny generated models, and a ``custom_nodes`` folder holding only a
symlink to this pack. Startup fails the whole suite if ComfyUI logs IMPORT FAILED for the pack. Without
ComfyUI every test here is skipped with one line naming the variables to set.

The test process itself needs no ComfyUI: it only speaks HTTP (and imports ``dataset_cache`` to prepare
caches), so it may run under either interpreter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from support.client import SEEN_NODE_ERRORS, ComfyClient  # noqa: E402
from support.collection import (  # noqa: E402
    add_marker_under,
    drop_suite,
    only_dropped,
    report_dropped,
    skip_cuda_tests_without_device,
    skip_pack_root_setup,
)
from support.comfy_env import ComfyInstall, find_comfyui, skip_reason  # noqa: E402
from support.messages import why_bare  # noqa: E402
from support.examples import drop_node_cache  # noqa: E402
from support.server import ComfyServer  # noqa: E402
from support.tiny_models import TinyModels, ensure_tiny_models  # noqa: E402

_HERE = Path(__file__).resolve().parent
_INSTALL = find_comfyui()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _INSTALL is None:
        drop_suite(config, items, _HERE, skip_reason())
    skip_pack_root_setup(items)
    skip_cuda_tests_without_device(items)
    add_marker_under(items, _HERE, "e2e")


def pytest_terminal_summary(terminalreporter: object) -> None:
    report_dropped(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    only_dropped(session, exitstatus)


@pytest.fixture(scope="session")
def comfy_install() -> ComfyInstall:
    assert _INSTALL is not None, "tests/e2e should have been left out"
    return _INSTALL


@pytest.fixture(scope="session")
def tiny_models(comfy_install: ComfyInstall) -> TinyModels:
    return ensure_tiny_models(comfy_install.path, comfy_install.python)


@pytest.fixture(scope="session")
def comfy_server(comfy_install: ComfyInstall, tiny_models: TinyModels,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """The session's ComfyUI server (started once; its log is printed if a test of the session failed)."""
    server = ComfyServer(comfy_install, tmp_path_factory.mktemp("server"), models_dir=tiny_models.root)
    server.start()
    sys.stderr.write(f"\n[e2e] ComfyUI ready at {server.url} in {server.startup_seconds:.1f} s "
                     f"(log: {server.log_path})\n")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(comfy_server: ComfyServer) -> ComfyClient:
    """A fresh client (own websocket client id) for the session's server."""
    return comfy_server.client()


def bare_node_errors() -> list[str]:
    """The errors the pack's nodes reported to this session's clients that are bare Python messages (for
    validation errors, the messages of the nodes' own checks: ComfyUI's built-in checks word theirs)."""
    bad = []
    for seen in SEEN_NODE_ERRORS:
        if seen["kind"] == "validation" and seen["type"] != "custom_validation_failed":
            continue
        why = why_bare(seen["type"] if seen["kind"] == "execution" else "", seen["message"])
        if why:
            bad.append(f"{seen['node_type']} ({seen['kind']}, {seen['type']}): {seen['message'][:200]!r}: {why}")
    return bad


@pytest.fixture(scope="session", autouse=True)
def _every_error_is_written_for_the_user() -> Iterator[None]:
    """After the session: no error that a test provoked from the pack's nodes over HTTP was a bare Python message
    (each names the input, its value and what to do; a bare one means an input reached unchecked code)."""
    yield
    bad = bare_node_errors()
    if bad:
        pytest.fail(f"{len(bad)} error(s) of the pack's nodes are bare Python messages:\n" + "\n".join(bad))


@pytest.fixture(scope="module", autouse=True)
def _drop_node_cache_after_each_module(comfy_server: ComfyServer) -> Iterator[None]:
    """The modules share one server: leave no cached loader outputs to the next module (its tests may check
    which nodes executed), and no models loaded."""
    yield
    drop_node_cache(comfy_server.client())
