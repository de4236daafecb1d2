"""The e2e server helper notices when ComfyUI failed to import the pack (read from the server log)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.comfy_env import ComfyInstall
from support.server import PACK_LINK_NAME, ComfyServer


@pytest.fixture
def server(tmp_path: Path) -> ComfyServer:
    return ComfyServer(ComfyInstall(tmp_path, tmp_path / "python"), tmp_path / "work")


def _log(server: ComfyServer, text: str) -> None:
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    server.log_path.write_text(text)


def test_clean_import_has_no_problems(server: ComfyServer) -> None:
    _log(server, f"Import times for custom nodes:\n   0.0 seconds: /x/custom_nodes/{PACK_LINK_NAME}\n")
    assert server.pack_import_problems() == []


def test_import_failed_is_reported(server: ComfyServer) -> None:
    line = f"   0.1 seconds (IMPORT FAILED): /x/custom_nodes/{PACK_LINK_NAME}"
    _log(server, f"Cannot import /x/custom_nodes/{PACK_LINK_NAME} module for custom nodes: boom\n{line}\n")
    assert len(server.pack_import_problems()) == 2


def test_pack_never_loaded_is_reported(server: ComfyServer) -> None:
    _log(server, "Import times for custom nodes:\n   0.0 seconds (IMPORT FAILED): /x/custom_nodes/other\n")
    assert server.pack_import_problems() == [
        f"the log never mentions {PACK_LINK_NAME}: it was not found among the custom nodes"]


def test_command_uses_private_folders(server: ComfyServer) -> None:
    cmd = server.command()
    for flag in ("--cpu", "--disable-api-nodes", "--base-directory", "--user-directory", "--temp-directory",
                 "--input-directory", "--output-directory", "--extra-model-paths-config"):
        assert flag in cmd
    assert cmd[cmd.index("--database-url") + 1] == "sqlite:///:memory:"
    assert (server.custom_nodes / PACK_LINK_NAME).resolve() == Path(__file__).resolve().parents[2]
    assert str(server.custom_nodes) in (server.workdir / "extra_model_paths.yaml").read_text()
