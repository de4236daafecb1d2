"""How the ComfyUI suites find ComfyUI (COMFYUI_PATH / COMFYUI_PYTHON, else /opt/comfyui-dev)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import comfy_env


def _fake_comfyui(root: Path) -> tuple[Path, Path]:
    src, python = root / "ComfyUI", root / "venv" / "bin" / "python"
    src.mkdir(parents=True)
    (src / "main.py").write_text("")
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return src, python


def test_missing_path_skips_without_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFYUI_PATH", "/nonexistent")
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    assert comfy_env.find_comfyui() is None
    reason = comfy_env.skip_reason()
    assert "COMFYUI_PATH=/nonexistent" in reason and "COMFYUI_PYTHON" in reason
    assert "\n" not in reason


def test_path_finds_the_venv_next_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, python = _fake_comfyui(tmp_path)
    monkeypatch.setenv("COMFYUI_PATH", str(src))
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    assert comfy_env.find_comfyui() == comfy_env.ComfyInstall(src.resolve(), python)


def test_explicit_python_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = _fake_comfyui(tmp_path)
    _, other = _fake_comfyui(tmp_path / "other")
    monkeypatch.setenv("COMFYUI_PATH", str(src))
    monkeypatch.setenv("COMFYUI_PYTHON", str(other))
    install = comfy_env.find_comfyui()
    assert install is not None and install.python == other


def test_default_is_the_dev_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.delenv("COMFYUI_PYTHON", raising=False)
    install = comfy_env.find_comfyui()
    if install is None:
        assert str(comfy_env.DEFAULT_COMFYUI_PATH) in comfy_env.skip_reason()
    else:
        assert install.path == comfy_env.DEFAULT_COMFYUI_PATH.resolve()
