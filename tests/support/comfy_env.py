"""Locating the ComfyUI install that the ``tests/comfy`` and ``tests/e2e`` suites run against.

Rules (the same for pytest, ``scripts/test`` and ``scripts/run-example``, which all call :func:`find_comfyui`):

* ``COMFYUI_PATH`` names the ComfyUI source tree (the folder holding ``main.py``). When it is set, it is the
  only place looked at: pointing it at a missing folder skips the ComfyUI suites instead of silently falling
  back to another install.
* ``COMFYUI_PYTHON`` names the interpreter of ComfyUI's environment. When unset, ``venv/bin/python`` next to
  or inside the source tree is used.
* With neither set, the development install ``/opt/comfyui-dev/ComfyUI`` + ``/opt/comfyui-dev/venv/bin/python``
  is used when present.

Run as a script, it prints ``export`` lines for a shell (exit 0) or the one-line skip reason (exit 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ComfyInstall", "DEFAULT_COMFYUI_PATH", "DEFAULT_COMFYUI_PYTHON", "find_comfyui", "skip_reason"]

DEFAULT_COMFYUI_PATH = Path("/opt/comfyui-dev/ComfyUI")
DEFAULT_COMFYUI_PYTHON = Path("/opt/comfyui-dev/venv/bin/python")


@dataclass(frozen=True)
class ComfyInstall:
    """A ComfyUI source tree and the python that runs it."""

    path: Path
    """The ComfyUI source tree (holds ``main.py``, ``comfy/``, ``folder_paths.py``)."""
    python: Path
    """ComfyUI's interpreter (torch + torchvision + ComfyUI's requirements)."""

    def is_current_interpreter(self) -> bool:
        """Whether this process runs under :attr:`python`'s environment (needed to import ComfyUI in-process)."""
        try:
            out = subprocess.run(
                [str(self.python), "-c", "import sys; print(sys.prefix)"],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return False
        return Path(out).resolve() == Path(sys.prefix).resolve()


def _python_for(path: Path) -> Path:
    explicit = os.environ.get("COMFYUI_PYTHON")
    if explicit:
        return Path(explicit)
    for candidate in (path.parent / "venv", path / "venv", path / ".venv", path.parent / ".venv"):
        if (candidate / "bin" / "python").exists():
            return candidate / "bin" / "python"
    return path.parent / "venv" / "bin" / "python"


def _configured() -> tuple[Path, Path]:
    explicit = os.environ.get("COMFYUI_PATH")
    if explicit:
        path = Path(explicit).expanduser()
        return path, _python_for(path)
    python = os.environ.get("COMFYUI_PYTHON")
    return DEFAULT_COMFYUI_PATH, Path(python) if python else DEFAULT_COMFYUI_PYTHON


def find_comfyui() -> ComfyInstall | None:
    """The configured ComfyUI install, or None when it is absent (see the module docstring for the rules)."""
    path, python = _configured()
    if (path / "main.py").is_file() and os.access(python, os.X_OK):
        return ComfyInstall(path.resolve(), python)
    return None


def skip_reason() -> str:
    """One line saying why the ComfyUI suites do not run and which variables to set."""
    path, python = _configured()
    if not (path / "main.py").is_file():
        found = f"no ComfyUI at COMFYUI_PATH={path} (no main.py there)"
    else:
        found = f"ComfyUI at {path} has no python at COMFYUI_PYTHON={python}"
    return (f"ComfyUI suites (tests/comfy, tests/e2e) skipped: {found}. Set COMFYUI_PATH to a ComfyUI source "
            "tree and COMFYUI_PYTHON to its python to run them.")


def _main() -> int:
    install = find_comfyui()
    if install is None:
        print(skip_reason())
        return 1
    print(f"export COMFYUI_PATH='{install.path}'")
    print(f"export COMFYUI_PYTHON='{install.python}'")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
